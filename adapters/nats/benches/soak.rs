//! Soak: announced writes over a fixed key set through NATS (a KV bucket as the source,
//! the events stream, wake, the work-queue), with the job runner consuming the
//! housekeeping jobs, and retention on (the events stream with its default limits, the
//! sweep job under the lock removing finished jobs' state) or off (a stream without limits,
//! no sweep). Prints every stream's bytes every tenth of the run beside the live data's
//! size. No assertions: figures.
//!
//! `cargo bench -p tidemark-nats --bench soak -- --writes N --keys K --mode on|off|both
//! --events-mib M --rate R --tail-secs S --samples N --concurrency C` (default 1,000,000
//! over 10,000 keys, both modes, the default 256 MiB cap on the events stream, unpaced, no
//! tail, the runner's default concurrency). `queued` is the work queue's backlog (jobs not
//! yet acked). Needs nats-server (the test harness finds it).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv, stream};
use futures::StreamExt as _;
use tidemark::{
    AnnouncingRegistry, DEFAULT_SWEEP_EVERY, Job, JobHandlers, JobRetention, JobRunner, Retention,
    Shutdown, SweepWithJobs, run_scheduler, with_sweep_job,
};
use tidemark_nats::{
    KvBucket, NatsEvents, NatsLock, NatsQueue, NatsSchedules, NatsSweep, NatsWake, StreamLimits,
};
use tidemark_tests::{NatsServer, wait_jetstream_ready};

const VALUE: usize = 100;

struct Args {
    writes: u64,
    keys: u64,
    modes: Vec<bool>,
    events_cap: i64,
    job_done: Duration,
    rate: u64,
    tail: Duration,
    samples: u64,
    concurrency: Option<usize>,
}

fn args() -> Option<Args> {
    let argv: Vec<String> = std::env::args().collect();
    if !argv.iter().any(|a| a == "--bench") {
        println!("tidemark-nats soak: skipped (run `cargo bench -p tidemark-nats --bench soak`)");
        return None;
    }
    let get = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .cloned()
    };
    let num = |name: &str, default: u64| get(name).map_or(default, |v| v.parse().unwrap());
    Some(Args {
        writes: num("--writes", 1_000_000),
        keys: num("--keys", 10_000),
        modes: match get("--mode").as_deref() {
            Some("on") => vec![true],
            Some("off") => vec![false],
            _ => vec![false, true],
        },
        events_cap: get("--events-mib").map_or(StreamLimits::EVENTS.max_bytes, |m| {
            m.parse::<i64>().unwrap() * 1024 * 1024
        }),
        job_done: get("--job-done-secs").map_or(JobRetention::default().done, |v| {
            Duration::from_secs(v.parse().unwrap())
        }),
        rate: num("--rate", 0),
        tail: Duration::from_secs(num("--tail-secs", 0)),
        samples: num("--samples", 10).max(1),
        concurrency: get("--concurrency").map(|v| v.parse().unwrap()),
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

async fn bytes(js: &jetstream::Context, name: &str) -> u64 {
    match js.get_stream(name).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.bytes),
        Err(_) => 0,
    }
}

/// Messages on a stream: the work queue's backlog of jobs not yet acked.
async fn messages(js: &jetstream::Context, name: &str) -> u64 {
    match js.get_stream(name).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

async fn run(server: &NatsServer, args: &Args, on: bool, round: usize) {
    let client = server.connect().await.unwrap();
    wait_jetstream_ready(&client).await.unwrap();
    let js = jetstream::new(client.clone());
    let bucket_name = format!("soak{round}");
    js.create_key_value(kv::Config {
        bucket: bucket_name.clone(),
        history: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let (events_name, queue_name) = (format!("EVENTS{round}"), format!("JOBS{round}"));
    let prefix = format!("events{round}");
    let events = NatsEvents::new(client.clone(), events_name.clone(), prefix.clone()).unwrap();
    if on {
        let limits = StreamLimits {
            max_bytes: args.events_cap,
            ..StreamLimits::EVENTS
        };
        events.ensure_with(1, limits).await.unwrap();
    } else {
        // What an events stream was before limits: none.
        js.create_stream(stream::Config {
            name: events_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let queue = NatsQueue::open(client.clone(), &queue_name, 5)
        .await
        .unwrap();
    let registry = AnnouncingRegistry::new(
        KvBucket::new(client.clone(), bucket_name.clone()).unwrap(),
        events,
        NatsWake::new(client.clone(), format!("wake{round}")).unwrap(),
        queue.clone(),
        "soak",
    );

    let shutdown = Shutdown::new();
    let retention = Retention::new("soak").unwrap();
    let mut handlers = JobHandlers::new().on(["pack_housekeeping"], |_: Job, _| async {
        Ok::<(), std::io::Error>(())
    });
    let mut scheduler = None;
    if on {
        let sweep = SweepWithJobs::new(
            NatsSweep::new(client.clone())
                .events(events_name.clone(), StreamLimits::EVENTS)
                .jobs(queue_name.clone(), StreamLimits::JOBS),
            queue.clone(),
            JobRetention {
                done: args.job_done,
                ..JobRetention::default()
            },
        );
        let lock = NatsLock::open(client.clone(), &format!("locks{round}"), 1)
            .await
            .unwrap();
        handlers = with_sweep_job(
            handlers,
            lock,
            sweep,
            retention.owner(),
            retention.lease_time(),
        );
        let schedules = NatsSchedules::open(client.clone(), &format!("sched{round}"), 1)
            .await
            .unwrap();
        retention.install(&schedules).await.unwrap();
        let (q, stop) = (queue.clone(), shutdown.signal());
        scheduler = Some(tokio::spawn(async move {
            run_scheduler(&schedules, &q, DEFAULT_SWEEP_EVERY, stop).await;
        }));
    }
    let mut runner = JobRunner::new("soak", queue.clone(), handlers);
    if let Some(n) = args.concurrency {
        runner = runner.concurrency(n);
    }
    let runner = runner.spawn();

    println!(
        "\nretention {}: {} announced writes over {} keys, {VALUE}-byte values, {}",
        if on { "ON" } else { "OFF" },
        args.writes,
        args.keys,
        if args.rate == 0 {
            "unpaced".to_owned()
        } else {
            format!("paced at {} writes/s", args.rate)
        }
    );
    println!(
        "{:>9} {:>7} {:>10} {:>11} {:>10} {:>11} {:>8} {:>9}",
        "writes",
        "secs",
        "bucket MiB",
        "events MiB",
        "queue MiB",
        "jobs state",
        "queued",
        "live MiB"
    );
    let started = Instant::now();
    let step = (args.writes / args.samples).max(1);
    let live = args.keys.min(args.writes) * (VALUE as u64 + 10);
    let sample = |done: u64| {
        let js = &js;
        let (bucket_name, events_name, queue_name) = (&bucket_name, &events_name, &queue_name);
        async move {
            println!(
                "{:>9} {:>7.1} {:>10.1} {:>11.1} {:>10.1} {:>11.1} {:>8} {:>9.2}",
                done,
                started.elapsed().as_secs_f64(),
                mib(bytes(js, &format!("KV_{bucket_name}")).await),
                mib(bytes(js, events_name).await),
                mib(bytes(js, queue_name).await),
                mib(bytes(js, &format!("KV_{queue_name}_state")).await),
                messages(js, queue_name).await,
                mib(live)
            );
        }
    };
    let mut done = 0u64;
    while done < args.writes {
        let upto = (done + step).min(args.writes);
        let mut puts = futures::stream::iter(done..upto)
            .map(|i| {
                let registry = &registry;
                async move {
                    if args.rate > 0 {
                        // Paced: write i is due at i / rate seconds into the run.
                        let due = Duration::from_secs_f64(i as f64 / args.rate as f64);
                        tokio::time::sleep_until((started + due).into()).await;
                    }
                    registry
                        .put(&format!("key.{:05}", i % args.keys), vec![b'x'; VALUE])
                        .await
                }
            })
            .buffer_unordered(64);
        while let Some(r) = puts.next().await {
            r.unwrap();
        }
        done = upto;
        sample(done).await;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{done} writes in {secs:.1} s: {:.0} writes/s",
        done as f64 / secs
    );
    // Then no writes: the runner works off its backlog, and sweeps go on.
    let tail_started = Instant::now();
    while tail_started.elapsed() < args.tail {
        tokio::time::sleep(Duration::from_secs(15)).await;
        sample(done).await;
    }
    shutdown.trigger();
    if let Some(s) = scheduler {
        s.await.unwrap();
    }
    runner.stop_within(Duration::from_secs(30)).await.unwrap();
}

fn main() {
    let Some(args) = args() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = NatsServer::start()
            .await
            .expect("a nats-server for the soak");
        for (round, &on) in args.modes.iter().enumerate() {
            run(&server, &args, on, round).await;
        }
    });
}
