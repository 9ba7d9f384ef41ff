//! Figures for the SQLite adapter, one run each, printed with their ratios:
//! single-write transactions/s, batched rows/s, reconcile of 100 changes in a
//! 1,000,000-row registry vs a full snapshot scan, warm restart of a persisted follower
//! (1,000,000 cached keys, 1,000 missed changes) vs a cold start, and cross-process wake
//! latency.
//!
//! `cargo bench -p tidemark-sqlite` runs it at full size. Without `--bench` (as under
//! `cargo test --benches`) it runs a tiny smoke version, so test runs stay quick.
//! `TIDEMARK_BENCH_PERF_CTL`/`TIDEMARK_BENCH_PERF_WHAT` ([`tidemark_tests::bench::perf`])
//! profile the cold start (`cold`) or the in-memory cache's sync (`memory`).
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use tidemark::tidemark_core::FollowerConfig;
use tidemark::{Changes, Received, Source, Wake, WakeListener};
use tidemark_sqlite::{Options, SqliteDb, Synchronous, Write};
use tidemark_tests::bench::{cpu_secs, load, perf};

struct Size {
    single: u64,
    batch: u64,
    batches: u64,
    registry: u64,
    missed: u64,
    wakes: u32,
}

fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

async fn open(path: &std::path::Path, sync: Synchronous) -> SqliteDb {
    SqliteDb::open_with(
        path,
        Options {
            synchronous: sync,
            ..Options::default()
        },
    )
    .await
    .unwrap()
}

async fn fill(db: &SqliteDb, prefix: &str, n: u64, chunk: u64) {
    let src = db.source();
    let mut i = 0;
    while i < n {
        let end = (i + chunk).min(n);
        src.write_batch(
            (i..end)
                .map(|k| Write::Put(format!("{prefix}{k:08}"), vec![(k % 251) as u8; 32]))
                .collect(),
        )
        .await
        .unwrap();
        i = end;
    }
}

async fn writes(size: &Size) {
    for sync in [Synchronous::Full, Synchronous::Normal] {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir.path().join("w.db"), sync).await;
        let src = db.source();
        let t = Instant::now();
        for i in 0..size.single {
            src.put(&format!("k{i}"), vec![1; 32]).await.unwrap();
        }
        let single = t.elapsed();
        let t = Instant::now();
        fill(&db, "b", size.batch * size.batches, size.batch).await;
        let batched = t.elapsed();
        let (s, b) = (
            per_sec(size.single, single),
            per_sec(size.batch * size.batches, batched),
        );
        println!(
            "writes ({sync:?}): single-write transactions {s:>10.0}/s | batched ({} rows/tx) {b:>10.0} rows/s | ratio {:.0}x",
            size.batch,
            b / s
        );
    }
}

async fn reconcile_vs_snapshot(size: &Size) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.db");
    let db = open(&path, Synchronous::Normal).await;
    let t = Instant::now();
    fill(&db, "k", size.registry, 50_000).await;
    println!(
        "setup: {} rows written in {:.2?}",
        size.registry,
        t.elapsed()
    );
    let src = db.source();
    let before = src.watermark().await.unwrap();
    for i in 0..100 {
        src.put(
            &format!("k{:08}", i * 7919 % size.registry),
            b"changed".to_vec(),
        )
        .await
        .unwrap();
    }
    // Warm both paths once, then time them.
    let _ = src.changes_since(before).await.unwrap();
    let t = Instant::now();
    let changes = src.changes_since(before).await.unwrap();
    let reconcile = t.elapsed();
    let Changes::Since { entries, .. } = changes else {
        panic!("not compacted")
    };
    assert_eq!(entries.len(), 100);
    let t = Instant::now();
    let snap = src.snapshot().await.unwrap();
    let scan = t.elapsed();
    assert_eq!(snap.entries.len() as u64, size.registry);
    println!(
        "reconcile of 100 changes in {} rows: {reconcile:.2?} | full snapshot scan: {scan:.2?} | ratio {:.0}x (target >= 1000x)",
        size.registry,
        scan.as_secs_f64() / reconcile.as_secs_f64()
    );

    // Warm restart vs cold start of a persisted follower over the same registry. Each
    // start opens the file anew, as a restarted process does (the last connection to close
    // checkpoints the write-ahead log: a handle kept open across both runs would make the
    // warm start pay for checkpointing the cold start's million rows, 40-300 ms of noise).
    drop((src, db));
    // The in-memory cache's initial sync of the same registry: what the cold start is
    // measured against, in CPU seconds of the process as well as wall time.
    let db = open(&path, Synchronous::Normal).await;
    let (cpu, t) = (cpu_secs("self"), Instant::now());
    perf("memory", true);
    let (cache, h) = tidemark::spawn_cache(
        FollowerConfig::builder("memory").seed(1).build().unwrap(),
        tidemark::RawBytes,
        db.source(),
        tidemark::NoFeed,
    );
    cache.wait_ready().await.unwrap();
    perf("memory", false);
    let (memory_time, memory_cpu, memory_load) = (t.elapsed(), cpu_secs("self") - cpu, load());
    assert_eq!(cache.len() as u64, size.registry);
    h.stop();
    drop((cache, db));
    let db = open(&path, Synchronous::Normal).await;
    perf("cold", true);
    let (c, cold_time, cold_cpu) = persisted_catch_up(&db, "bench").await;
    perf("cold", false);
    let cold_load = load();
    assert_eq!(c.counters.applied, size.registry);
    drop(db);
    let per_key = |secs: f64| secs * 1e6 / size.registry as f64;
    println!(
        "persisted follower cold start vs memory, {} keys: cold {cold_time:.2?} {:.2} µs CPU/key (load {cold_load}) | memory {memory_time:.2?} {:.2} µs CPU/key (load {memory_load}) | {:.0}% of memory's rate, {:.0}% of its CPU rate (goal >= 80%)",
        size.registry,
        per_key(cold_cpu),
        per_key(memory_cpu),
        100.0 * memory_time.as_secs_f64() / cold_time.as_secs_f64(),
        100.0 * memory_cpu / cold_cpu,
    );
    let db = open(&path, Synchronous::Normal).await;
    let src = db.source();
    for i in 0..size.missed {
        // Missed while the follower was down: puts and some removals.
        let key = format!("k{:08}", i * 104_729 % size.registry);
        if i % 10 == 0 {
            src.remove(&key).await.unwrap();
        } else {
            src.put(&key, b"missed".to_vec()).await.unwrap();
        }
    }
    drop((src, db));
    let db = open(&path, Synchronous::Normal).await;
    let (w, warm_time, _) = persisted_catch_up(&db, "bench").await;
    let delta = w.counters.applied + w.counters.removed;
    assert!(delta <= size.missed, "a warm restart reads only the delta");
    println!(
        "persisted follower, {} cached keys, {} missed changes: warm restart {warm_time:.2?} (applied {delta}) | cold start {cold_time:.2?} (applied {}) | ratio {:.0}x (target >= 50x)",
        size.registry,
        size.missed,
        c.counters.applied,
        cold_time.as_secs_f64() / warm_time.as_secs_f64()
    );
}

/// Runs a wake-only follower named `name` over `db`'s registry into its persisted cache
/// until it is ready; its status, how long that took and the CPU seconds it cost (to
/// ready, as the in-memory cache's are counted: not its stop, which frees its index).
async fn persisted_catch_up(db: &SqliteDb, name: &str) -> (tidemark::Status, Duration, f64) {
    let (t, cpu) = (Instant::now(), cpu_secs("self"));
    let h = tidemark::FollowerTask::new(
        FollowerConfig::builder(name).seed(1).build().unwrap(),
        tidemark::RawBytes,
        db.source(),
        tidemark::NoFeed,
        db.follower_cache(name),
    )
    .spawn();
    let mut status = h.watch_status();
    status.wait_for(|s| s.ready).await.unwrap();
    let (took, cpu) = (t.elapsed(), cpu_secs("self") - cpu);
    let s = h.stop_within(Duration::from_secs(60)).await.unwrap();
    (s, took, cpu)
}

async fn wake_latency(size: &Size) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wake.db");
    let writer = open(&path, Synchronous::Normal).await;
    // Another handle has its own connection and watcher: what another process sees.
    let reader = open(&path, Synchronous::Normal).await;
    let interval = reader.options().watch_interval;
    let mut listener = reader.wake().listen("ch").await.unwrap();
    let src = writer.source();
    let mut samples = Vec::new();
    for i in 0..size.wakes {
        src.put("k", i.to_le_bytes().to_vec()).await.unwrap();
        let t = Instant::now();
        let got = listener.recv_timeout(Duration::from_secs(5)).await.unwrap();
        samples.push(t.elapsed());
        assert!(matches!(got, Received::Wake(_)), "{got:?}");
        tokio::time::sleep(Duration::from_micros(700 * u64::from(i % 5))).await;
    }
    samples.sort();
    let pct = |p: usize| samples[(samples.len() - 1) * p / 100];
    println!(
        "cross-connection wake latency (watch interval {interval:?}, {} samples, commit returned -> listener woke): p50 {:.2?} | p90 {:.2?} | p99 {:.2?} | max {:.2?}",
        samples.len(),
        pct(50),
        pct(90),
        pct(99),
        pct(100)
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    // `-- persisted`: only the registry and its followers (the figures a change to the
    // persisted cache moves).
    let only_persisted = std::env::args().any(|a| a == "persisted");
    let size = if full {
        Size {
            single: 2_000,
            batch: 10_000,
            batches: 20,
            registry: 1_000_000,
            missed: 1_000,
            wakes: 200,
        }
    } else {
        println!("smoke run (pass --bench, as `cargo bench` does, for the real figures)");
        Size {
            single: 20,
            batch: 100,
            batches: 2,
            registry: 2_000,
            missed: 10,
            wakes: 5,
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if !only_persisted {
            writes(&size).await;
        }
        reconcile_vs_snapshot(&size).await;
        if !only_persisted {
            wake_latency(&size).await;
        }
    });
}
