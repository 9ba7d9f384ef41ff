//! Recovery after kill -9: how fast followers over a KV bucket catch up once the server is
//! back, and how often they try while it is away.
//!
//! One real nats-server, one writer that keeps writing (skewed: some keys written once and
//! never again) and retries through every outage, and two followers of the same bucket:
//! one on a client from `NatsOptions::connect` (it hears the client's reconnects), one on
//! a client with the same options but no reconnect hook (the baseline). Then 20 times:
//! kill -9 the server, wait 1–3 s, restart it on the same port with the same storage, and
//! once JetStream answers, write a marker; a follower has caught up when its cache holds
//! the marker and every key as the writer last had it acknowledged before the marker. The
//! server stays up 5 s from its return, so a follower slower than that is still away when
//! the next kill comes (the flapping case: its backoff never gets a healthy period).
//!
//! Printed: catch-up p50/p99/max per follower, its attempts per second while the server
//! was down (feed reopens and resyncs from its status), and the consumers left on the
//! server at the end. `cargo bench -p tidemark-nats --bench recovery` runs it; without
//! `--bench` it only checks that it builds.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use tidemark::tidemark_core::{FollowerConfig, Utf8};
use tidemark::{Cache, FollowerHandle, spawn_cache};
use tidemark_nats::{KvBucket, NatsOptions};
use tidemark_tests::{NatsServer, NatsServerBin, wait_jetstream_ready};

const RESTARTS: usize = 20;
const BUCKET: &str = "recovery";
/// How long the server stays up after it is back: one catch-up window.
const UP: Duration = Duration::from_secs(5);
/// How often the bench looks at a cache.
const POLL: Duration = Duration::from_millis(1);

fn main() {
    common::run_bench(
        "recovery",
        "cargo bench -p tidemark-nats --bench recovery",
        run(),
    );
}

/// What the writer had acknowledged: key → the number of the write that set it.
type Model = Arc<Mutex<BTreeMap<String, u64>>>;

/// Writes until stopped, retrying each write until acknowledged: one write in four goes to
/// a key written only then, the rest to 64 hot keys.
async fn writer(store: kv::Store, model: Model, stop: Arc<std::sync::atomic::AtomicBool>) {
    let mut i = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        i += 1;
        let key = if i % 4 == 0 {
            format!("once.{i}")
        } else {
            format!("hot.{}", i % 64)
        };
        while store.put(&key, Bytes::from(i.to_string())).await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        model.lock().unwrap().insert(key, i);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Whether `cache` holds at least what `expected` says for every key (a later write of a
/// hot key may already be there), and the marker.
fn holds(cache: &Cache<String>, expected: &BTreeMap<String, u64>, marker: &str) -> bool {
    cache.get(marker).is_some()
        && expected.iter().all(|(k, want)| {
            cache
                .get(k)
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|got| got >= *want)
        })
}

struct Follower {
    name: &'static str,
    cache: Cache<String>,
    handle: FollowerHandle,
    /// Catch-up per restart; `None` when not caught up before the next kill.
    catch_up: Vec<Option<Duration>>,
    attempts: u64,
    down: Duration,
}

impl Follower {
    fn attempts(&self) -> u64 {
        let c = self.handle.status().counters;
        c.reopens + c.resyncs
    }
}

async fn follower(name: &'static str, client: async_nats::Client) -> Follower {
    let bucket = KvBucket::new(client, BUCKET).expect("bucket");
    let config = FollowerConfig::builder(name).build().expect("config");
    let (cache, handle) = spawn_cache(config, Utf8, bucket.clone(), bucket);
    tokio::time::timeout(Duration::from_secs(30), cache.wait_ready())
        .await
        .expect("ready in time")
        .expect("ready");
    Follower {
        name,
        cache,
        handle,
        catch_up: Vec::new(),
        attempts: 0,
        down: Duration::ZERO,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

async fn run() {
    let mut server = NatsServer::start()
        .await
        .unwrap_or_else(|e| panic!("a real nats-server is required: {e}"));
    let url = server.url();
    println!(
        "nats-server {} on {url}; {RESTARTS} kill -9 restarts, 1-3 s down, {UP:?} up",
        NatsServerBin::find().expect("found above").version
    );
    let options = NatsOptions::new([url.clone()]);
    let admin = options.connect().await.expect("connect");
    wait_jetstream_ready(&admin).await.expect("JetStream");
    let store = jetstream::new(admin.clone())
        .create_key_value(kv::Config {
            bucket: BUCKET.into(),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("bucket");

    let model: Model = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writing = tokio::spawn(writer(store.clone(), model.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;

    let hooked = options.connect().await.expect("connect");
    let plain = options
        .to_connect_options()
        .await
        .expect("options")
        .connect(url.as_str())
        .await
        .expect("connect");
    let mut followers = [
        follower("reconnect-hook", hooked).await,
        follower("no-hook", plain).await,
    ];

    // Outages of 1–3 s, the same in every run.
    let mut lcg = 0x2545_f491_4f6c_dd1du64;
    for n in 0..RESTARTS {
        lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let down = Duration::from_millis(1000 + (lcg >> 33) % 2000);
        let before: Vec<u64> = followers.iter().map(Follower::attempts).collect();
        server.kill9().await.expect("kill -9");
        let killed = Instant::now();
        tokio::time::sleep(down).await;
        server.restart().await.expect("restart");
        // Back: the client port accepts and JetStream answers.
        let probe = async_nats::connect(url.as_str()).await.expect("connect");
        wait_jetstream_ready(&probe).await.expect("JetStream back");
        let back = Instant::now();
        for (f, before) in followers.iter_mut().zip(&before) {
            f.attempts += f.attempts().saturating_sub(*before);
            f.down += back - killed;
        }
        let marker = format!("marker.{n}");
        let store = jetstream::new(probe.clone())
            .get_key_value(BUCKET)
            .await
            .expect("bucket after restart");
        store.put(&marker, Bytes::from("0")).await.expect("marker");
        let expected = model.lock().unwrap().clone();
        let mut waiting: Vec<usize> = (0..followers.len()).collect();
        while !waiting.is_empty() && back.elapsed() < UP {
            waiting.retain(|&i| {
                let f = &mut followers[i];
                if holds(&f.cache, &expected, &marker) {
                    f.catch_up.push(Some(back.elapsed()));
                    false
                } else {
                    true
                }
            });
            tokio::time::sleep(POLL).await;
        }
        for i in waiting {
            followers[i].catch_up.push(None);
        }
        let shown: Vec<String> = followers
            .iter()
            .map(|f| match f.catch_up.last().copied().flatten() {
                Some(d) => format!("{}={}ms", f.name, d.as_millis()),
                None => format!("{}=>{UP:?}", f.name),
            })
            .collect();
        println!(
            "restart {:2}: down {down:.1?}; caught up {}",
            n + 1,
            shown.join(" ")
        );
        drop(probe);
        if let Some(rest) = UP.checked_sub(back.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writing.await.expect("writer");
    // At the end every follower must hold exactly what the writer wrote.
    let mut stream = jetstream::new(admin.clone())
        .get_stream(format!("KV_{BUCKET}"))
        .await
        .expect("stream");
    let head = stream.info().await.expect("info").state.last_sequence;
    let model = model.lock().unwrap().clone();
    for f in &followers {
        let started = Instant::now();
        while f.cache.watermark() < head && started.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let got: BTreeMap<String, u64> = f
            .cache
            .snapshot()
            .into_iter()
            .filter(|(k, _, _)| !k.starts_with("marker."))
            .map(|(k, _, v)| (k, v.parse().expect("a number")))
            .collect();
        assert_eq!(
            f.cache.watermark(),
            head,
            "{}: watermark at the bucket's head",
            f.name
        );
        assert!(
            got == model,
            "{}: the cache must equal what the writer wrote",
            f.name
        );
    }
    let consumers = stream.info().await.expect("info").state.consumer_count;

    println!("\nkeys written: {}; bucket head: {head}", model.len());
    for f in &followers {
        let mut caught: Vec<Duration> = f.catch_up.iter().flatten().copied().collect();
        caught.sort();
        let caught: Vec<Duration> = caught
            .into_iter()
            .map(|d| Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
            .collect();
        let late = f.catch_up.len() - caught.len();
        let rate = f.attempts as f64 / f.down.as_secs_f64();
        if late > 0 {
            println!(
                "{}: not caught up within {UP:?} after {late} of {RESTARTS} restarts; p50 of the rest {:?}; attempts while down {rate:.2}/s",
                f.name,
                caught.get(caught.len() / 2)
            );
        } else {
            println!(
                "{}: catch-up p50 {:?} p99 {:?} max {:?} over {RESTARTS} restarts; attempts while down {rate:.2}/s ({} in {:.1?})",
                f.name,
                percentile(&caught, 0.50),
                percentile(&caught, 0.99),
                caught.last().expect("some"),
                f.attempts,
                f.down
            );
        }
    }
    println!("consumers on the server at the end: {consumers} (one per follower)");
    for f in followers {
        f.handle.stop();
        let _ = f.handle.join().await;
    }
    drop(server);
}
