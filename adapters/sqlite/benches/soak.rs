//! Soak: announced writes over a fixed key set on one SQLite file, with the relay and a
//! job consumer running, and retention either on (the default sweep schedule under the
//! lock, default limits) or off (what a deployment without it does). Prints the file's
//! size every tenth of the run beside the live data's size. No assertions: figures.
//!
//! `cargo bench -p tidemark-sqlite --bench soak` runs 1,000,000 writes over 10,000 keys
//! per mode (`-- --writes N --keys K --rate R --mode on|off|both --tail-secs S`; the tail
//! keeps sampling S seconds after the last write, while the relay and runner work off
//! their backlog and sweeps go on; `ready` is that backlog of jobs, `pending` the relay's). Retention's limits are
//! times (history is kept a minute for unknown readers, sweeps run every minute), so the
//! retention run writes at a steady `--rate` (default 2,500 writes/s: 400 s for 1M) while
//! the run without retention writes as fast as it can (its growth is per write, not per
//! second). Without `--bench` (as under `cargo test --benches`) it is a tiny smoke run.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::{Duration, Instant};

use tidemark::tidemark_core::Legs;
use tidemark::{
    DEFAULT_SWEEP_EVERY, Job, JobHandlers, JobRetention, JobRunner, Retention, Shutdown,
    SweepWithJobs, run_scheduler, with_sweep_job,
};
use tidemark_sqlite::{Options, SqliteDb, Synchronous, Write};

/// Writes per transaction: each write still gets its own seq and outbox row.
const BATCH: u64 = 100;
const VALUE: usize = 100;

struct Args {
    writes: u64,
    keys: u64,
    rate: u64,
    retention: Vec<bool>,
    every: Option<Duration>,
    sync: Synchronous,
    job_done: Duration,
    tail: Duration,
    tail_every: Duration,
    samples: u64,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let full = argv.iter().any(|a| a == "--bench");
    let get = |name: &str| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .cloned()
    };
    let num = |name: &str, default: u64| get(name).map_or(default, |v| v.parse().unwrap());
    let retention = match get("--mode").as_deref() {
        Some("on") => vec![true],
        Some("off") => vec![false],
        _ => vec![false, true],
    };
    if !full {
        println!("smoke run (pass --bench, as `cargo bench` does, for the real figures)");
        return Args {
            writes: 2_000,
            keys: 100,
            rate: 20_000,
            retention,
            every: Some(Duration::from_millis(20)),
            sync: Synchronous::Normal,
            job_done: Duration::ZERO,
            tail: Duration::ZERO,
            tail_every: Duration::from_secs(1),
            samples: 10,
        };
    }
    Args {
        writes: num("--writes", 1_000_000),
        keys: num("--keys", 10_000),
        rate: num("--rate", 2_500),
        retention,
        every: get("--every-ms").map(|v| Duration::from_millis(v.parse().unwrap())),
        sync: match get("--sync").as_deref() {
            Some("full") => Synchronous::Full,
            _ => Synchronous::Normal,
        },
        tail: Duration::from_secs(num("--tail-secs", 0)),
        tail_every: Duration::from_secs(num("--tail-every-secs", 15)),
        samples: num("--samples", 10).max(1),
        job_done: get("--job-done-secs").map_or(JobRetention::default().done, |v| {
            Duration::from_secs(v.parse().unwrap())
        }),
    }
}

fn file_bytes(path: &Path) -> (u64, u64) {
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    (len(path), len(Path::new(&wal)))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Row counts and the live data's size (keys and values of present keys), read on a
/// connection of its own.
fn census(path: &Path) -> (Vec<(&'static str, i64)>, u64) {
    let c = rusqlite::Connection::open(path).unwrap();
    let rows = [
        ("changelog", "changelog"),
        ("outbox", "outbox"),
        ("pending", "outbox WHERE done = 0"),
        ("events", "events"),
        ("jobs", "jobs"),
        ("ready", "jobs WHERE state = 0"),
    ]
    .into_iter()
    .map(|(name, from)| {
        let n: i64 = c
            .query_row(&format!("SELECT count(*) FROM {from}"), [], |r| r.get(0))
            .unwrap();
        (name, n)
    })
    .collect();
    let live: i64 = c
        .query_row(
            "SELECT COALESCE(SUM(length(key) + length(value)), 0) FROM registry
             WHERE deleted = 0",
            [],
            |r| r.get(0),
        )
        .unwrap();
    (rows, u64::try_from(live).unwrap_or(0))
}

/// One line of the table: sizes and row counts now.
fn sample(path: &Path, written: u64, started: Instant) {
    let (file, wal) = file_bytes(path);
    let (rows, live) = census(path);
    let n = |t: &str| rows.iter().find(|(name, _)| *name == t).map_or(0, |r| r.1);
    println!(
        "{:>9} {:>7.1} {:>9.1} {:>8.1} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9.2} {:>8.0}x",
        written,
        started.elapsed().as_secs_f64(),
        mib(file),
        mib(wal),
        n("changelog"),
        n("outbox"),
        n("pending"),
        n("events"),
        n("jobs"),
        n("ready"),
        mib(live),
        (file + wal) as f64 / live.max(1) as f64
    );
}

async fn run(args: &Args, retention_on: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("soak.db");
    let options = Options {
        synchronous: args.sync,
        ..Options::default()
    };
    let db = SqliteDb::open_with(&path, options).await.unwrap();
    let shutdown = Shutdown::new();
    let src = db.announced_source(Legs::default());

    // The default runner: the relay drains the outbox into events, wake and the queue...
    let relay = db.relay(db.events(), db.wake(), db.queue(), "soak");
    let relay_task = {
        let stop = shutdown.signal();
        tokio::spawn(async move { relay.run(stop).await })
    };
    // ...the job runner runs the housekeeping jobs the announcements enqueue (and, with
    // retention on, the scheduled sweeps under the lock, which also remove finished jobs)...
    let retention = {
        let mut r = Retention::new("soak").unwrap();
        if let Some(every) = args.every {
            r = r.every(every).unwrap();
        }
        r
    };
    let mut handlers = JobHandlers::new().on(["pack_housekeeping"], |_: Job, _| async {
        Ok::<(), std::io::Error>(())
    });
    if retention_on {
        let sweep = SweepWithJobs::new(
            db.sweeper(),
            db.queue(),
            JobRetention {
                done: args.job_done,
                ..JobRetention::default()
            },
        );
        handlers = with_sweep_job(
            handlers,
            db.lock(),
            sweep,
            retention.owner(),
            retention.lease_time(),
        );
    }
    let runner = JobRunner::new("soak", db.queue(), handlers).spawn();
    // ...and the scheduler fires the default sweep schedule into the queue.
    let scheduler = retention_on.then(|| {
        let (db, stop) = (db.clone(), shutdown.signal());
        let retention = retention.clone();
        tokio::spawn(async move {
            retention.install(&db.schedules()).await.unwrap();
            run_scheduler(&db.schedules(), &db.queue(), DEFAULT_SWEEP_EVERY, stop).await;
        })
    });

    println!(
        "\nretention {}: {} announced writes over {} keys, {VALUE}-byte values{}",
        if retention_on { "ON (defaults)" } else { "OFF" },
        args.writes,
        args.keys,
        if retention_on {
            format!(", paced at {} writes/s", args.rate)
        } else {
            ", unpaced".into()
        }
    );
    println!(
        "{:>9} {:>7} {:>9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
        "writes",
        "secs",
        "file MiB",
        "wal MiB",
        "changelog",
        "outbox",
        "pending",
        "events",
        "jobs",
        "ready",
        "live MiB",
        "file/live"
    );
    let started = Instant::now();
    let step = (args.writes / args.samples / BATCH * BATCH).max(BATCH);
    let value = vec![b'x'; VALUE];
    let mut written = 0u64;
    while written < args.writes {
        let writes: Vec<Write> = (written..written + BATCH)
            .map(|i| Write::Put(format!("key/{:05}", i % args.keys), value.clone()))
            .collect();
        src.write_batch(writes).await.unwrap();
        written += BATCH;
        if retention_on {
            let due = Duration::from_secs_f64(written as f64 / args.rate as f64);
            if let Some(ahead) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(ahead).await;
            }
        }
        if written % step == 0 {
            sample(&path, written, started);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{written} writes in {secs:.1} s: {:.0} writes/s",
        written as f64 / secs
    );
    // Then no writes: the relay and runner work off any backlog, and sweeps go on.
    let tail_started = Instant::now();
    while tail_started.elapsed() < args.tail {
        tokio::time::sleep(args.tail_every).await;
        sample(&path, written, started);
    }
    shutdown.trigger();
    relay_task.await.unwrap().unwrap();
    runner.stop_within(Duration::from_secs(30)).await.unwrap();
    if let Some(s) = scheduler {
        s.await.unwrap();
    }
}

fn main() {
    let args = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for &on in &args.retention {
            run(&args, on).await;
        }
    });
}
