//! An initial sync into a durable sink commits in big batches, and safely: a turn of the
//! follower task is its batch, so the sink is asked what it holds only between commits
//! and a rewind goes back to a commit every earlier turn made.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::config;
use tidemark::tidemark_core::RawBytes;
use tidemark::{Error, FollowerTask, Held, Result, Shutdown, Sink, Source};
use tidemark_memory::{Memory, MemoryCacheSink, MemoryCacheStore};

/// What a [`Checked`] sink saw.
#[derive(Debug, Default)]
struct Seen {
    /// Every committed watermark, in order.
    commits: Vec<u64>,
    /// The most changes one commit carried.
    largest_commit: usize,
    /// Everything the sink was asked or told that it should not have been.
    violations: Vec<String>,
    /// The room it was asked to make, each time, with the keys it held then.
    reserved: Vec<(usize, usize)>,
    /// How many times it was asked for every key it holds.
    listings: usize,
}

/// A durable sink (the memory store) that checks the driver's side of the contract: it
/// is never asked what it holds while it has uncommitted changes, and a watermark it
/// committed never goes down. Optionally fails once, for good (a worker's handler
/// error), at its `fail_at`-th put.
struct Checked {
    inner: MemoryCacheSink,
    uncommitted: usize,
    puts: usize,
    fail_at: Option<usize>,
    /// Whether that failure is transient (a busy database) rather than a handler's.
    transient: bool,
    seen: Arc<Mutex<Seen>>,
}

impl Checked {
    fn new(store: &MemoryCacheStore, fail_at: Option<usize>) -> (Self, Arc<Mutex<Seen>>) {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = Checked {
            inner: store.sink(),
            uncommitted: 0,
            puts: 0,
            fail_at,
            transient: false,
            seen: Arc::clone(&seen),
        };
        (sink, seen)
    }

    fn asked(&self, what: &str) {
        if self.uncommitted > 0 {
            self.seen.lock().unwrap().violations.push(format!(
                "{what} asked with {} changes not committed",
                self.uncommitted
            ));
        }
    }
}

impl Sink<Vec<u8>> for Checked {
    async fn put(&mut self, key: std::sync::Arc<str>, seq: u64, value: Vec<u8>) -> Result<()> {
        self.puts += 1;
        if self.fail_at == Some(self.puts) {
            self.fail_at = None;
            if self.transient {
                return Err(Error::unavailable("sink", "database is locked"));
            }
            return Err(Error::Worker {
                worker: "checked".into(),
                reason: "handler failed".into(),
            });
        }
        self.uncommitted += 1;
        Sink::<Vec<u8>>::put(&mut self.inner, key, seq, value).await
    }

    async fn remove(&mut self, key: std::sync::Arc<str>, seq: u64) -> Result<()> {
        self.uncommitted += 1;
        Sink::<Vec<u8>>::remove(&mut self.inner, key, seq).await
    }

    async fn commit(&mut self, watermark: u64, lineage: tidemark::Lineage) -> Result<()> {
        Sink::<Vec<u8>>::commit(&mut self.inner, watermark, lineage).await?;
        let mut seen = self.seen.lock().unwrap();
        if let Some(&last) = seen.commits.last()
            && watermark < last
        {
            seen.violations
                .push(format!("committed {watermark} after {last}"));
        }
        seen.commits.push(watermark);
        seen.largest_commit = seen.largest_commit.max(self.uncommitted);
        self.uncommitted = 0;
        Ok(())
    }

    fn reserve(&mut self, keys: usize) {
        let held = self.inner.store().entries().len();
        self.seen.lock().unwrap().reserved.push((keys, held));
    }

    async fn rollback(&mut self) {
        Sink::<Vec<u8>>::rollback(&mut self.inner).await;
        self.uncommitted = 0;
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        Sink::<Vec<u8>>::resume(&mut self.inner).await
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        self.asked("seqs_of");
        Sink::<Vec<u8>>::seqs_of(&mut self.inner, keys).await
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        self.asked("all_seqs");
        self.seen.lock().unwrap().listings += 1;
        Sink::<Vec<u8>>::all_seqs(&mut self.inner).await
    }
}

/// The source's current state, as the store holds it.
fn source_state(m: &Memory) -> std::collections::BTreeMap<String, (u64, Vec<u8>)> {
    m.source
        .contents()
        .into_iter()
        .map(|(k, v)| (k, (v.seq, v.value)))
        .collect()
}

/// A follower task started on its own tokio task, and whether it became ready within a
/// minute.
struct Started {
    ready: bool,
    shutdown: Shutdown,
    run: tokio::task::JoinHandle<Result<tidemark::Status>>,
}

/// Starts a follower task of `m`'s source over `feed` into `sink`, and waits for ready.
async fn start<F>(m: &Memory, name: &str, feed: F, sink: Checked) -> Started
where
    F: tidemark::Feed + Send + Sync + 'static,
{
    let mut task = FollowerTask::new(config(name), RawBytes, m.source.clone(), feed, sink);
    let mut watch = task.status();
    let shutdown = Shutdown::new();
    let signal = shutdown.signal();
    let run = tokio::spawn(async move { task.run(signal).await });
    let ready = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        watch.wait_for(|s| s.ready),
    )
    .await
    // The borrow the wait returns holds the status's lock: drop it before the stop.
    .is_ok_and(|r| r.is_ok());
    Started {
        ready,
        shutdown,
        run,
    }
}

/// Runs a follower task into `sink` until it is ready; returns its result.
/// A memory source holding `n` keys (`k00000`, `k00001`, ...), each with `value`.
async fn with_keys(n: u32, value: Vec<u8>) -> Memory {
    let m = Memory::new();
    for i in 0..n {
        m.source
            .put(&format!("k{i:05}"), value.clone())
            .await
            .unwrap();
    }
    m
}

async fn sync_once(m: &Memory, name: &str, sink: Checked) -> Result<u64> {
    let started = start(m, name, m.source.clone(), sink).await;
    started.shutdown.trigger();
    let ended = started.run.await.unwrap();
    assert!(
        started.ready,
        "the follower did not become ready: {ended:?}"
    );
    ended.map(|s| s.watermark)
}

#[tokio::test]
async fn an_initial_sync_into_a_durable_sink_commits_in_big_batches() {
    let m = with_keys(40_000, vec![1; 8]).await;
    let store = MemoryCacheStore::new();
    let (sink, seen) = Checked::new(&store, None);
    let watermark = sync_once(&m, "big", sink).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(watermark, 40_000);
    assert!(
        seen.largest_commit > 256,
        "an initial sync must not commit one transaction per 256-entry turn (a 1M-key cold \
         start into SQLite took 77 s that way); largest commit: {}",
        seen.largest_commit
    );
    assert!(
        seen.commits.len() < 40_000 / 256,
        "fewer commits than one per 256 entries: {}",
        seen.commits.len()
    );
    assert_eq!(
        store.entries(),
        source_state(&m),
        "the store holds the source"
    );
    assert!(seen.violations.is_empty(), "{:?}", seen.violations);
}

/// Simulator seed 192's kind: a lazily resumed core asks the sink the seqs of the keys a
/// batch names; if changes applied before were not yet committed, it learns a stale seq
/// (a removed key looks held again: a wrong key count, a key put twice by a resync).
#[tokio::test]
async fn a_warm_started_sync_asks_the_sink_only_between_commits() {
    let m = with_keys(2_000, vec![1]).await;
    let store = MemoryCacheStore::new();
    let (sink, _) = Checked::new(&store, None);
    sync_once(&m, "warm", sink).await.unwrap();
    // While it was down: 40k changes over the held keys and new ones, removals among
    // them, then some removed keys written again, spread across several turns.
    for round in 0..10u32 {
        for i in 0..2_000u32 {
            let key = format!("k{:05}", (i * 7 + round * 13) % 4_000);
            if (i + round) % 5 == 0 {
                m.source.remove(&key).await.unwrap();
            } else {
                m.source.put(&key, vec![2; 4]).await.unwrap();
            }
        }
    }
    let (sink, seen) = Checked::new(&store, None);
    let watermark = sync_once(&m, "warm", sink).await.unwrap();
    let seen = seen.lock().unwrap();
    assert!(seen.violations.is_empty(), "{:?}", seen.violations);
    assert!(
        seen.commits.len() > 1,
        "the delta spans several turns: {:?}",
        seen.commits
    );
    assert_eq!(watermark, m.source.current_watermark());
    assert_eq!(
        store.entries(),
        source_state(&m),
        "the warm-started store converges on the source"
    );
    assert_eq!(store.held().unwrap().keys, m.source.contents().len());
}

/// A warm start on an announcements stream must find the keys held past the watermark
/// (announcements no read confirmed): it listed every key the sink held, a cost in the
/// cache's size. A sink that says what it committed ahead is not listed at all.
#[tokio::test]
async fn a_warm_start_on_announcements_lists_no_key_when_the_sink_says_what_it_holds_ahead() {
    let m = with_keys(2_000, vec![1]).await;
    let store = MemoryCacheStore::new();
    let (sink, _) = Checked::new(&store, None);
    sync_once(&m, "events", sink).await.unwrap();
    m.source.put("k00001", vec![2]).await.unwrap();
    let (sink, seen) = Checked::new(&store, None);
    let started = start(&m, "events", m.events.clone(), sink).await;
    started.shutdown.trigger();
    let ended = started.run.await.unwrap().unwrap();
    assert!(started.ready);
    assert_eq!(ended.watermark, m.source.current_watermark());
    assert_eq!(store.entries(), source_state(&m));
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.listings, 0,
        "the warm start costs the delta, not the cache"
    );
    assert!(seen.violations.is_empty(), "{:?}", seen.violations);
}

/// Campaign seed 37769916's kind: a worker fails for good in the middle of a sync; its
/// supervisor runs the same task again. It goes back to its last commit and must never
/// commit a watermark below one it committed.
#[tokio::test]
async fn a_worker_failing_mid_sync_never_commits_a_lower_watermark() {
    let m = with_keys(40_000, vec![3; 8]).await;
    let store = MemoryCacheStore::new();
    let (sink, seen) = Checked::new(&store, Some(30_000));
    let mut task = FollowerTask::new(
        config("worker"),
        RawBytes,
        m.source.clone(),
        m.source.clone(),
        sink,
    );
    let first = task.run(tidemark::StopSignal::never()).await;
    assert!(
        matches!(first, Err(Error::Worker { .. })),
        "a handler error ends the run: {first:?}"
    );
    let committed = store.watermark().unwrap_or(0);
    assert!(
        committed > 0 && committed < 40_000,
        "it failed part of the way, after a commit: {committed}"
    );
    // The supervisor's restart: the same task runs again, until ready.
    let status = task.status();
    let shutdown = Shutdown::new();
    let signal = shutdown.signal();
    let run = tokio::spawn(async move { task.run(signal).await });
    let mut watch = status;
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        watch.wait_for(|s| s.ready),
    )
    .await
    .expect("the restarted worker becomes ready")
    .unwrap();
    shutdown.trigger();
    run.await.unwrap().unwrap();
    let seen = seen.lock().unwrap();
    assert!(seen.violations.is_empty(), "{:?}", seen.violations);
    assert_eq!(store.watermark(), Some(40_000));
    assert_eq!(store.entries(), source_state(&m));
}

/// The memory feed with the pending count a KV bucket's feed reports: how many entries
/// follow each one, up to the head the feed opened at (`Some(n)`: the first entry says
/// only `n`, a count that understates).
struct Counted(tidemark_memory::MemorySource, Option<u64>);

struct CountedStream {
    inner: <tidemark_memory::MemorySource as tidemark::Feed>::Stream,
    head: u64,
    first: Option<u64>,
}

impl tidemark::Feed for Counted {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Replay;
    type Stream = CountedStream;

    async fn open(&self, from: u64, after: Option<u64>) -> Result<tidemark::Opened<CountedStream>> {
        let opened = tidemark::Feed::open(&self.0, from, after).await?;
        Ok(tidemark::Opened {
            info: opened.info,
            stream: CountedStream {
                inner: opened.stream,
                head: opened.info.head,
                first: self.1,
            },
        })
    }
}

impl tidemark::FeedStream for CountedStream {
    async fn next(&mut self) -> Option<Result<tidemark::FeedItem>> {
        match self.inner.next().await {
            Some(Ok(tidemark::FeedItem::Entry(e))) => {
                let pending = match self.first.take() {
                    Some(first) => first,
                    None => self.head.saturating_sub(e.seq),
                };
                Some(Ok(tidemark::FeedItem::Entry(e.with_pending(pending))))
            }
            other => other,
        }
    }
}

/// A sink that keeps its keys in a table is told, once, before an initial sync, how many
/// are coming (the feed's pending count, bounded), so it makes room at once rather than
/// growing its table a dozen times on the way (the follower_task bench's profile).
#[tokio::test]
async fn an_initial_sync_tells_the_sink_once_how_many_keys_are_coming() {
    let m = with_keys(3_000, vec![1; 4]).await;
    let store = MemoryCacheStore::new();
    let (sink, seen) = Checked::new(&store, None);
    let started = start(&m, "presize", Counted(m.source.clone(), None), sink).await;
    // Live writes after ready: no more hints.
    for i in 0..300u32 {
        m.source.put(&format!("n{i:05}"), vec![2; 4]).await.unwrap();
    }
    common::until("the live writes", || store.entries().len() == 3_300).await;
    started.shutdown.trigger();
    started.run.await.unwrap().unwrap();
    assert!(started.ready, "the follower did not become ready");
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.reserved,
        vec![(tidemark::tidemark_core::presize_for(2_999), 0)],
        "one hint, before the first key, of the keys the first entry said follow it \
         (and itself)"
    );
    assert_eq!(tidemark::tidemark_core::presize_for(2_999), 3_000);
    assert!(
        tidemark::tidemark_core::presize_for(u64::MAX) <= (1 << 17) + 1,
        "a stream's long history is only a hint: bounded"
    );
}

/// A first count that understates (or a table that fills for any reason during the
/// initial sync) makes the follower grow its index by the counts that follow, and the
/// sink is told again, before the changes that need the room reach it: once more, not
/// key by key.
#[tokio::test]
async fn the_sink_is_told_again_when_the_followers_room_fills_during_the_sync() {
    let m = with_keys(3_000, vec![1; 4]).await;
    let store = MemoryCacheStore::new();
    let (sink, seen) = Checked::new(&store, None);
    let started = start(&m, "regrow", Counted(m.source.clone(), Some(9)), sink).await;
    started.shutdown.trigger();
    started.run.await.unwrap().unwrap();
    assert!(started.ready, "the follower did not become ready");
    assert_eq!(store.entries().len(), 3_000);
    let seen = seen.lock().unwrap();
    let [first, (keys, held)] = seen.reserved[..] else {
        panic!("two hints expected: {:?}", seen.reserved);
    };
    assert_eq!(first, (tidemark::tidemark_core::presize_for(9), 0));
    assert!(
        held < 3_000,
        "told before the last change reached the sink: {held}"
    );
    assert!(
        held + keys >= 3_000,
        "the second hint covers every key still to come: {:?}",
        seen.reserved
    );
}

/// The follower task hands each entry's change to the sink as the core decides it,
/// within a turn; a transient sink failure in the middle of a turn drops the rest of the
/// turn with the feed, goes back to the last commit, and the sync still converges.
#[tokio::test]
async fn a_transient_sink_failure_mid_turn_goes_back_to_the_last_commit_and_converges() {
    let m = with_keys(40_000, vec![4; 8]).await;
    let store = MemoryCacheStore::new();
    let (mut sink, seen) = Checked::new(&store, Some(20_000));
    sink.transient = true;
    let watermark = sync_once(&m, "transient", sink).await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(watermark, 40_000);
    assert!(seen.violations.is_empty(), "{:?}", seen.violations);
    assert_eq!(
        store.entries(),
        source_state(&m),
        "the store holds the source, nothing lost or doubled by the rewind"
    );
    assert!(
        seen.commits.windows(2).all(|w| w[0] <= w[1]),
        "{:?}",
        seen.commits
    );
}

/// A reconcile that finds nothing (an idle wake) changes nothing the sink holds, so it
/// costs the sink no commit (a SQLite transaction each); one that finds a change commits
/// it once.
#[tokio::test]
async fn a_reconcile_that_finds_nothing_commits_nothing_to_the_sink() {
    let m = with_keys(100, vec![1]).await;
    let store = MemoryCacheStore::new();
    let (sink, seen) = Checked::new(&store, None);
    let handle = FollowerTask::new(
        config("idle"),
        RawBytes,
        m.source.clone(),
        tidemark::NoFeed,
        sink,
    )
    .spawn();
    assert_eq!(handle.reconcile().await.unwrap().watermark, 100);
    let synced = seen.lock().unwrap().commits.len();
    for _ in 0..20 {
        let idle = handle.reconcile().await.unwrap();
        assert_eq!((idle.applied, idle.removed, idle.watermark), (0, 0, 100));
    }
    assert_eq!(
        seen.lock().unwrap().commits.len(),
        synced,
        "twenty reconciles that found nothing committed nothing"
    );
    m.source.put("k000", vec![2]).await.unwrap();
    let found = handle.reconcile().await.unwrap();
    assert_eq!((found.applied, found.watermark), (1, 101));
    assert_eq!(
        seen.lock().unwrap().commits.len(),
        synced + 1,
        "a reconcile that finds a change commits it, once"
    );
    handle
        .stop_within(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(store.entries(), source_state(&m));
    assert!(seen.lock().unwrap().violations.is_empty());
}
