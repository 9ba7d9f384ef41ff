//! The follower task applying 1,000,000 entries from the memory feed into a cache, and the
//! core alone on the same entries; prints both rates (best of 3) and their ratio.
//!
//! Beside them it times the same task over a sink that keeps no map (each value wrapped
//! and queued as the cache does, then set aside in a list at the commit): the bound of
//! any cache that queues a batch's values and files them at the commit, even one whose
//! map is the follower's own index, since there the cache's map costs nothing at all. (A
//! cache that wrote each value into the index's slot at once, with no queue, could pass
//! it by what the queue costs.)
//!
//! Everything runs on this one thread (a current-thread runtime), so beside the wall clock
//! each part is also timed by the thread's own time on a CPU (Linux's
//! `/proc/thread-self/schedstat`): on a shared machine, time spent waiting for a core
//! then counts in neither part, and the ratio stops moving with other people's load.
//!
//! `cargo bench -p tidemark-memory --bench follower_task`
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use tidemark::tidemark_core::{
    Apply, Entry, FeedInfo, Follower, FollowerConfig, Input, Output, RawBytes, Request, Time,
};
use tidemark::{Source, spawn_cache};
use tidemark_memory::MemorySource;

const N: u64 = 1_000_000;

/// This thread's time on a CPU so far, in seconds; `None` where the kernel does not say.
fn cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

/// Wall and on-CPU seconds of one measured stretch.
#[derive(Clone, Copy)]
struct Took {
    wall: f64,
    cpu: Option<f64>,
}

/// A started clock of both kinds.
struct Clock(Instant, Option<f64>);

impl Clock {
    fn start() -> Self {
        Clock(Instant::now(), cpu_secs())
    }

    fn took(&self) -> Took {
        let wall = self.0.elapsed().as_secs_f64();
        let cpu = self.1.zip(cpu_secs()).map(|(a, b)| b - a);
        Took { wall, cpu }
    }
}

/// The best of several measurements, each kind on its own.
#[derive(Clone, Copy)]
struct Best {
    wall: f64,
    cpu: Option<f64>,
}

impl Best {
    const NONE: Best = Best {
        wall: f64::MAX,
        cpu: None,
    };

    fn with(self, t: Took) -> Best {
        Best {
            wall: self.wall.min(t.wall),
            cpu: match (self.cpu, t.cpu) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

fn core_alone(entries: Vec<Entry>) -> Took {
    // The core alone: the same entries through a Follower, outputs drained and dropped.
    let started = Clock::start();
    let mut core = Follower::new(FollowerConfig::builder("bench").build().unwrap(), RawBytes);
    let mut token = None;
    while let Some(out) = core.poll_output() {
        if let Output::Request(Request::LookupSource { token }) = out {
            core.handle_input(Input::SourceFound { token }, Time::ZERO);
        } else if let Output::Request(Request::OpenFeed { token: t, .. }) = out {
            token = Some(t);
        }
    }
    let token = token.unwrap();
    let info = FeedInfo::change_log(1, N);
    core.handle_input(Input::FeedOpened { token, info }, Time::ZERO);
    let mut applied = 0u64;
    for e in entries {
        core.handle_input(Input::Entry { token, entry: e }, Time::ZERO);
        while let Some(out) = core.poll_output() {
            if matches!(out, Output::Apply(Apply::Put { .. })) {
                applied += 1;
            }
        }
    }
    assert_eq!(applied, N);
    let took = started.took();
    drop(core);
    took
}

fn follower_task(rt: &tokio::runtime::Runtime, source: &MemorySource) -> Took {
    // The follower task: memory feed → core → cache, until ready. Like the core alone
    // (whose follower is dropped after its clock stops), the teardown is not timed: the
    // task is stopped and awaited, and the cache dropped, outside the measurement.
    rt.block_on(async {
        let started = Clock::start();
        let config = FollowerConfig::builder("bench").build().unwrap();
        let (cache, handle) = spawn_cache(config, RawBytes, source.clone(), source.clone());
        let wm = cache.wait_ready().await.unwrap();
        let took = started.took();
        assert_eq!((wm, cache.len() as u64), (N, N));
        handle
            .stop_within(std::time::Duration::from_secs(60))
            .await
            .unwrap();
        drop(cache);
        took
    })
}

/// A sink that keeps no map: it wraps and queues each value as the cache does (an `Arc`
/// per value, a pending list per batch) and at the commit sets the batch aside in a list,
/// so that, as in the cache, nothing is freed while the clock runs.
struct NoMap {
    pending: Vec<(Arc<str>, u64, Arc<Vec<u8>>)>,
    kept: Vec<(Arc<str>, Arc<Vec<u8>>)>,
    ready: Option<tokio::sync::oneshot::Sender<u64>>,
}

impl NoMap {
    fn keep(&mut self) {
        self.kept
            .extend(self.pending.drain(..).map(|(key, _, value)| (key, value)));
    }
}

impl tidemark::Sink<Vec<u8>> for NoMap {
    const FALLIBLE: bool = false;

    async fn put(&mut self, key: Arc<str>, seq: u64, value: Vec<u8>) -> tidemark::Result<()> {
        self.pending.push((key, seq, Arc::new(value)));
        Ok(())
    }

    async fn remove(&mut self, _key: Arc<str>, _seq: u64) -> tidemark::Result<()> {
        Ok(())
    }

    fn reserve(&mut self, keys: usize) {
        // A turn of the initial sync, as the cache reserves its pending list.
        self.pending.reserve(keys.min(16_384));
    }

    async fn commit(&mut self, _watermark: u64, _: tidemark::Lineage) -> tidemark::Result<()> {
        self.keep();
        Ok(())
    }

    fn ready(&mut self, watermark: u64) {
        self.keep();
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(watermark);
        }
    }
}

/// The follower task over a sink that keeps no map: what the task costs beside the core
/// when the cache's map costs nothing (teardown untimed, as for the task).
fn task_without_map(rt: &tokio::runtime::Runtime, source: &MemorySource) -> Took {
    rt.block_on(async {
        let started = Clock::start();
        let config = FollowerConfig::builder("bench").build().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sink = NoMap {
            pending: Vec::new(),
            kept: Vec::new(),
            ready: Some(tx),
        };
        let handle =
            tidemark::FollowerTask::new(config, RawBytes, source.clone(), source.clone(), sink)
                .spawn();
        let wm = rx.await.unwrap();
        let took = started.took();
        assert_eq!(wm, N);
        handle
            .stop_within(std::time::Duration::from_secs(60))
            .await
            .unwrap();
        took
    })
}

/// The memory feed alone: the same entries read off the log, nothing applied.
fn feed_alone(rt: &tokio::runtime::Runtime, source: &MemorySource) -> Took {
    rt.block_on(async {
        let started = Clock::start();
        let mut stream = tidemark::Feed::open(source, 1, None).await.unwrap().stream;
        let mut read = 0u64;
        while read < N {
            match tidemark::FeedStream::next(&mut stream).await {
                Some(Ok(_)) => read += 1,
                other => panic!("the feed ended early: {other:?}"),
            }
        }
        started.took()
    })
}

/// The cache alone: the same puts into a cache writer, no follower.
fn cache_alone(rt: &tokio::runtime::Runtime, entries: Vec<Entry>) -> Took {
    rt.block_on(async {
        let (mut writer, reader) = tidemark::cache::<Vec<u8>>();
        let started = Clock::start();
        // In batches of 256 with a commit each, as the follower task applies them.
        for (i, e) in entries.into_iter().enumerate() {
            let seq = e.seq;
            tidemark::Sink::put(&mut writer, e.key, seq, e.value)
                .await
                .unwrap();
            if i % 256 == 255 {
                tidemark::Sink::commit(&mut writer, seq, tidemark::Lineage::default())
                    .await
                    .unwrap();
            }
        }
        tidemark::Sink::commit(&mut writer, N, tidemark::Lineage::default())
            .await
            .unwrap();
        let took = started.took();
        assert_eq!(reader.len() as u64, N);
        drop((writer, reader));
        took
    })
}

type Value = (u64, Arc<Vec<u8>>);

/// Secs to insert `keys` into a map built by `insert`, best of 3 (the map is dropped
/// outside the clock).
fn time_map<M>(
    keys: &[String],
    mut new: impl FnMut() -> M,
    insert: impl Fn(&mut M, String, Value),
) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let mut map = new();
        let started = Instant::now();
        for (i, k) in keys.iter().enumerate() {
            insert(&mut map, k.clone(), (i as u64, Arc::new(vec![b'x'; 32])));
        }
        best = best.min(started.elapsed().as_secs_f64());
        drop(map);
    }
    best
}

/// The cache's map chosen by measurement: 1M inserts into a `BTreeMap` and a foldhash
/// `HashMap`, in key order (the bench's feed) and in a scrambled order (a KV bucket
/// replays in revision order, not key order).
fn maps_compared(entries: &[Entry]) {
    let ordered: Vec<String> = entries.iter().map(|e| e.key.to_string()).collect();
    let mut scrambled = ordered.clone();
    // A fixed multiplicative permutation: the same order on every run.
    let n = scrambled.len();
    for i in 0..n {
        let j = (i.wrapping_mul(2_654_435_761) ^ (i >> 7)) % n;
        scrambled.swap(i, j);
    }
    for (name, keys) in [("key order", &ordered), ("scrambled", &scrambled)] {
        let btree = time_map(keys, std::collections::BTreeMap::new, |m, k, v| {
            m.insert(k, v);
        });
        let hash = time_map(
            keys,
            std::collections::HashMap::<String, Value, foldhash::fast::RandomState>::default,
            |m, k, v| {
                m.insert(k, v);
            },
        );
        println!("  map, {name}: BTreeMap {btree:.3}s, foldhash HashMap {hash:.3}s");
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let source = MemorySource::default();
    rt.block_on(async {
        for i in 1..=N {
            let key = format!("key-{i:07}");
            source.put(&key, vec![b'x'; 32]).await.unwrap();
        }
    });
    // The core alone and the cache alone take the very entries the feed delivers (keys,
    // values, pending counts), so that every part works on the same input.
    let entries: Vec<Entry> = rt.block_on(async {
        let mut stream = tidemark::Feed::open(&source, 1, None).await.unwrap().stream;
        let mut entries = Vec::with_capacity(N as usize);
        while (entries.len() as u64) < N {
            match tidemark::FeedStream::next(&mut stream).await {
                Some(Ok(tidemark::FeedItem::Entry(e))) => entries.push(e),
                other => panic!("the feed ended early: {other:?}"),
            }
        }
        entries
    });

    // `-- task`: the follower task alone, ten times, for a profiler (`perf record`).
    if std::env::args().any(|a| a == "task") {
        for _ in 0..10 {
            println!("follower task: {:.3}s", follower_task(&rt, &source).wall);
        }
        return;
    }
    // Best of 3 each, alternating, so a busy moment on the machine skews neither.
    let (mut core, mut task, mut feed, mut cache, mut bare) =
        (Best::NONE, Best::NONE, Best::NONE, Best::NONE, Best::NONE);
    for _ in 0..3 {
        core = core.with(core_alone(entries.clone()));
        task = task.with(follower_task(&rt, &source));
        bare = bare.with(task_without_map(&rt, &source));
        feed = feed.with(feed_alone(&rt, &source));
        cache = cache.with(cache_alone(&rt, entries.clone()));
    }
    maps_compared(&entries);
    let rate = |secs: f64| N as f64 / secs;
    println!(
        "core alone:    {N} entries in {:.3}s = {:.0} entries/s (wall)",
        core.wall,
        rate(core.wall)
    );
    println!(
        "follower task: {N} entries in {:.3}s = {:.0} entries/s (wall)",
        task.wall,
        rate(task.wall)
    );
    // Where the task's time goes besides the core: reading the feed and filling the cache.
    println!(
        "  parts (wall): feed alone {:.3}s, cache alone {:.3}s, core alone {:.3}s = {:.3}s of the task's {:.3}s",
        feed.wall,
        cache.wall,
        core.wall,
        feed.wall + cache.wall + core.wall,
        task.wall
    );
    let wall_ratio = 100.0 * core.wall / task.wall;
    match (core.cpu, task.cpu, feed.cpu, cache.cpu, bare.cpu) {
        (Some(core_cpu), Some(task_cpu), Some(feed_cpu), Some(cache_cpu), Some(bare_cpu)) => {
            println!(
                "  on CPU: core alone {core_cpu:.3}s, follower task {task_cpu:.3}s; parts: feed {feed_cpu:.3}s, cache {cache_cpu:.3}s"
            );
            println!(
                "  the task over a sink keeping no map: {bare_cpu:.3}s on CPU = {:.1}% of the core alone's rate (the bound of a cache that queues its batch)",
                100.0 * core_cpu / bare_cpu
            );
            println!(
                "ratio task/core: {:.1}% on CPU time, {wall_ratio:.1}% wall (goal >= 70%)",
                100.0 * core_cpu / task_cpu
            );
        }
        _ => {
            println!(
                "  the task over a sink keeping no map: {:.3}s wall = {:.1}% of the core alone's rate",
                bare.wall,
                100.0 * core.wall / bare.wall
            );
            println!("ratio task/core: {wall_ratio:.1}% wall (goal >= 70%)");
        }
    }
}
