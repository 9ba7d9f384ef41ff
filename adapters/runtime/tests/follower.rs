//! The follower task and the cache: sync, ready, resume, resync, decode failures.
#![allow(clippy::unwrap_used)]

mod common;

use common::{config, until};
use tidemark::tidemark_core::{Phase, Utf8};
use tidemark::{Change, Source, spawn_cache};
use tidemark_memory::{Memory, Port};

#[tokio::test(start_paused = true)]
async fn wait_ready_on_an_empty_source_resolves() {
    let m = Memory::new();
    let (cache, handle) = spawn_cache(config("empty"), Utf8, m.source.clone(), m.source.clone());
    let wm = tokio::time::timeout(std::time::Duration::from_secs(5), cache.wait_ready())
        .await
        .expect("an empty source must still become ready, or readers of empty sources hang")
        .unwrap();
    assert_eq!((wm, cache.len()), (0, 0));
    handle.stop();
}

#[tokio::test(start_paused = true)]
async fn initial_sync_loads_every_entry_before_ready() {
    let m = Memory::new();
    for i in 0..100 {
        m.source
            .put(&format!("k{i:03}"), format!("v{i}").into_bytes())
            .await
            .unwrap();
    }
    m.source.remove("k050").await.unwrap();
    let (cache, _h) = spawn_cache(config("sync"), Utf8, m.source.clone(), m.source.clone());
    let wm = cache.wait_ready().await.unwrap();
    assert_eq!(
        (cache.len(), wm),
        (99, 101),
        "ready must mean every current entry is loaded (the watch-from-empty defect)"
    );
    assert_eq!(cache.get("k007").as_deref().map(String::as_str), Some("v7"));
    assert!(
        cache.get("k050").is_none(),
        "a removed key is not in the cache"
    );
}

#[tokio::test(start_paused = true)]
async fn live_writes_reach_the_cache_and_subscribers() {
    let m = Memory::new();
    let (cache, _h) = spawn_cache(config("live"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    let mut changes = cache.subscribe();
    let put = m.source.put("a", b"1".to_vec()).await.unwrap();
    let removed = m.source.remove("a").await.unwrap().unwrap();
    assert_eq!(
        changes.recv().await.unwrap(),
        Change::Put {
            key: "a".into(),
            seq: put
        }
    );
    assert_eq!(
        changes.recv().await.unwrap(),
        Change::Removed {
            key: "a".into(),
            seq: removed
        },
        "subscribers must see removals, not only puts"
    );
    until("the watermark reaches the removal", || {
        cache.watermark() == removed
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_feed_failing_mid_stream_resumes_from_watermark_and_loses_nothing() {
    let m = Memory::new();
    let (cache, h) = spawn_cache(config("resume"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    for i in 0..10 {
        m.source.put(&format!("a{i}"), b"x".to_vec()).await.unwrap();
    }
    until("the first writes are applied", || cache.watermark() == 10).await;
    // The feed fails for a while; writes go on meanwhile.
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    for i in 0..10 {
        m.source.put(&format!("b{i}"), b"y".to_vec()).await.unwrap();
    }
    m.faults.set_failing(Port::Feed, false);
    let wm = m.source.current_watermark();
    until("the follower catches up after the feed heals", || {
        cache.watermark() == wm
    })
    .await;
    assert_eq!(
        cache.len(),
        21,
        "every write made while the feed was down must arrive"
    );
    assert!(cache.get("during").is_some());
    assert!(
        h.status().counters.reopens >= 1,
        "the feed was reopened from watermark+1"
    );
}

#[tokio::test(start_paused = true)]
async fn compaction_forces_a_resync_that_removes_vanished_keys() {
    let m = Memory::new();
    m.source.put("stays", b"1".to_vec()).await.unwrap();
    m.source.put("vanishes", b"2".to_vec()).await.unwrap();
    let (cache, h) = spawn_cache(config("resync"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    m.source.remove("vanishes").await.unwrap();
    m.source.put("new", b"3".to_vec()).await.unwrap();
    m.source.compact_below(m.source.current_watermark() + 1);
    m.faults.set_failing(Port::Feed, false);
    until("the follower resyncs", || h.status().counters.resyncs >= 1).await;
    until("the watermark converges", || cache.watermark() == 4).await;
    assert_eq!(
        cache.keys(),
        ["new", "stays"],
        "a resync must remove keys whose tombstones were compacted away"
    );
}

/// A database restored from an older backup: its seqs go back below the follower's
/// watermark, and its next writes reuse them with other changes. The follower must see
/// the head below its watermark, replace its cache with the restored history (keys the
/// backup never had are removed, keys it had come back) and follow it from there.
#[tokio::test(start_paused = true)]
async fn a_source_restored_from_an_older_backup_replaces_the_cache() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    m.source.put("b", b"2".to_vec()).await.unwrap();
    let backup = m.source.backup();
    assert_eq!(backup.watermark(), 2);
    m.source.put("c", b"3".to_vec()).await.unwrap();
    m.source.remove("a").await.unwrap();
    m.source.put("b", b"5".to_vec()).await.unwrap();
    let (cache, h) = spawn_cache(config("restored"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    until("the follower reaches 5", || cache.watermark() == 5).await;
    m.source.restore(&backup);
    // The new history reuses seq 3 for another change; the head is still below 5.
    assert_eq!(m.source.put("d", b"new".to_vec()).await.unwrap(), 3);
    until("the follower takes the restored history", || {
        cache.watermark() == 3
    })
    .await;
    assert_eq!(
        cache.keys(),
        ["a", "b", "d"],
        "the restored keys, and only them"
    );
    assert_eq!(
        cache.get("b").as_deref().map(String::as_str),
        Some("2"),
        "b as backed up"
    );
    assert_eq!(h.status().counters.resets, 1, "a new history is counted");
    m.source.put("e", b"live".to_vec()).await.unwrap();
    until("it follows the restored history live", || {
        cache.watermark() == 4
    })
    .await;
    assert_eq!(cache.keys(), ["a", "b", "d", "e"]);
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_value_is_skipped_and_the_watermark_moves_past_it() {
    let m = Memory::new();
    let (cache, h) = spawn_cache(config("poison"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    m.source.put("bad", vec![0xff, 0xfe]).await.unwrap();
    let good = m.source.put("good", b"ok".to_vec()).await.unwrap();
    until("the entry after the poison applies", || {
        cache.watermark() == good
    })
    .await;
    assert!(
        cache.get("bad").is_none(),
        "a value that fails to decode is not applied"
    );
    assert_eq!(
        h.status().counters.poison,
        1,
        "a poison entry is counted, not retried forever"
    );
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn reconcile_through_a_live_follower_is_empty_once_converged() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (cache, h) = spawn_cache(config("rec"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    let r = h.reconcile().await.unwrap();
    assert_eq!(
        (r.applied, r.removed, r.watermark),
        (0, 0, 1),
        "a converged follower's reconcile must find nothing"
    );
    let status = h
        .stop_within(std::time::Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(
        status.phase,
        Phase::Stopped,
        "stop ends the task within its budget"
    );
}

/// A source that never answers: every read waits forever, as one behind a dead server.
struct Unanswering;

impl Source for Unanswering {
    async fn put(&self, _: &str, _: Vec<u8>) -> tidemark::Result<u64> {
        std::future::pending().await
    }
    async fn update(&self, _: &str, _: Vec<u8>, _: u64) -> tidemark::Result<u64> {
        std::future::pending().await
    }
    async fn remove(&self, _: &str) -> tidemark::Result<Option<u64>> {
        std::future::pending().await
    }
    async fn watermark(&self) -> tidemark::Result<u64> {
        std::future::pending().await
    }
    async fn changes_since(&self, _: u64) -> tidemark::Result<tidemark::Changes> {
        std::future::pending().await
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        std::future::pending().await
    }
    async fn get(&self, _: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        std::future::pending().await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        std::future::pending().await
    }
}

#[tokio::test(start_paused = true)]
async fn a_stop_abandons_a_request_the_source_never_answers() {
    let m = Memory::new();
    let (cache, h) = spawn_cache(config("hung"), Utf8, Unanswering, m.source.clone());
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    assert!(!cache.is_ready(), "nothing answered, nothing is ready");
    let status = h
        .stop_within(std::time::Duration::from_millis(100))
        .await
        .expect("a stop asked while a request waits must end the task within its budget");
    assert_eq!(status.phase, Phase::Stopped);
}

#[tokio::test(start_paused = true)]
async fn a_status_watcher_wakes_for_a_counter_only_change() {
    let m = Memory::new();
    let (cache, h) = spawn_cache(config("watched"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    let mut status = h.watch_status();
    status.borrow_and_update();
    // A poison entry moves the counters and the watermark, not the phase.
    m.source.put("bad", vec![0xff]).await.unwrap();
    let seen = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        status.wait_for(|s| s.counters.poison == 1),
    )
    .await
    .expect("a watcher waiting on a counter is woken when it moves")
    .unwrap()
    .clone();
    assert_eq!(seen.phase, Phase::Live, "the phase did not change");
}

/// A sink that is slow to commit its watermark (as one that persists it is).
struct SlowWatermark(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl tidemark::Sink<String> for SlowWatermark {
    async fn put(&mut self, _: std::sync::Arc<str>, _: u64, _: String) -> tidemark::Result<()> {
        Ok(())
    }
    async fn remove(&mut self, _: std::sync::Arc<str>, _: u64) -> tidemark::Result<()> {
        Ok(())
    }
    async fn commit(&mut self, watermark: u64, _: tidemark::Lineage) -> tidemark::Result<()> {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        self.0.store(watermark, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_answer_comes_after_the_status_and_watermark_it_reports() {
    let m = Memory::new();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let h = tidemark::FollowerTask::new(
        config("answer"),
        Utf8,
        m.source.clone(),
        m.source.clone(),
        SlowWatermark(seen.clone()),
    )
    .spawn();
    for i in 0..5 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
        let r = h.reconcile().await.unwrap();
        assert!(
            h.status().watermark >= r.watermark,
            "the status covers the answer: {:?} vs {r:?}",
            h.status()
        );
        assert!(
            seen.load(std::sync::atomic::Ordering::SeqCst) >= r.watermark,
            "the sink's watermark covers the answer: {r:?}"
        );
    }
    h.stop_within(std::time::Duration::from_secs(5))
        .await
        .unwrap();
}

/// A wake listener whose first receive fails with a transient error.
struct FlakyListener<L> {
    inner: L,
    fail_first: bool,
}

impl<L: tidemark::WakeListener> tidemark::WakeListener for FlakyListener<L> {
    async fn recv(&mut self) -> tidemark::Result<tidemark::Received> {
        if std::mem::take(&mut self.fail_first) {
            return Err(tidemark::Error::unavailable("wake", "database is locked"));
        }
        self.inner.recv().await
    }
}

/// A transient error from a wake listener (a busy SQLite file) used to end the wake
/// runner for good, leaving its cache silently stale. It catches up and listens again.
#[tokio::test(start_paused = true)]
async fn a_wake_runner_outlives_a_transient_listener_error() {
    let m = Memory::new();
    let listener = FlakyListener {
        inner: tidemark::Wake::listen(&m.wake, "changes").await.unwrap(),
        fail_first: true,
    };
    let (cache, h) = tidemark::spawn_wake_cache(config("flaky"), Utf8, m.source.clone(), listener);
    cache.wait_ready().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert!(
        !h.is_finished(),
        "a transient listener error does not end the runner"
    );
    m.source.put("a", b"1".to_vec()).await.unwrap();
    tidemark::Wake::notify(&m.wake, "changes", Vec::new())
        .await
        .unwrap();
    until("a later wake still catches up", || cache.len() == 1).await;
    h.stop();
}

/// SPEC §15: followers with default settings draw their own seeds, so a fleet does not
/// retry in lockstep; the seed is in the status, so a run can be replayed.
#[tokio::test(start_paused = true)]
async fn two_default_followers_draw_different_seeds_and_show_them() {
    let m = Memory::new();
    let config = tidemark::FollowerConfig::new("fleet").unwrap();
    assert_eq!(config.seed(), None);
    let (_, a) = spawn_cache(config.clone(), Utf8, m.source.clone(), m.source.clone());
    let (_, b) = spawn_cache(config, Utf8, m.source.clone(), m.source.clone());
    assert_ne!(
        a.status().seed,
        b.status().seed,
        "two processes with default configs must not jitter in lockstep"
    );
    let (_, c) = spawn_cache(
        tidemark::FollowerConfig::builder("replay")
            .seed(42)
            .build()
            .unwrap(),
        Utf8,
        m.source.clone(),
        m.source.clone(),
    );
    assert_eq!(c.status().seed, 42, "a given seed is kept, for replays");
    for h in [a, b, c] {
        h.stop();
    }
}

/// What a woken subscriber reads: the watermark and the value, at the moment the cache's
/// broadcast wakes it (inside the writer's commit, on the writer's thread).
struct Look {
    cache: tidemark::Cache<String>,
    seen: std::sync::Mutex<Vec<(u64, Option<String>)>>,
}

impl std::task::Wake for Look {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        let value = self.cache.get("k").map(|v| v.as_str().to_owned());
        let watermark = self.cache.watermark();
        self.seen.lock().unwrap().push((watermark, value));
    }
}

/// A subscriber told of a change must find the cache's watermark (and value) already
/// covering it: the batch's map, value and watermark move together, and changes go out
/// after. The subscriber's waker runs inside the broadcast's send, so it sees exactly
/// what a reader on another thread could see at that instant; when the watermark was
/// stored after the send (before 37374a7), it read the previous batch's watermark.
#[test]
fn a_subscriber_woken_by_a_change_reads_a_watermark_that_covers_it() {
    use std::future::Future as _;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    use tidemark::Sink as _;

    let (mut writer, reader) = tidemark::cache::<String>();
    let look = Arc::new(Look {
        cache: reader.clone(),
        seen: std::sync::Mutex::default(),
    });
    let waker = Waker::from(Arc::clone(&look));
    let mut cx = Context::from_waker(&waker);
    let mut changes = reader.subscribe();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for seq in 1..=3u64 {
        let mut recv = std::pin::pin!(changes.recv());
        assert!(recv.as_mut().poll(&mut cx).is_pending(), "nothing sent yet");
        rt.block_on(async {
            writer
                .put("k".into(), seq, format!("v{seq}"))
                .await
                .unwrap();
            writer
                .commit(seq, tidemark::Lineage::default())
                .await
                .unwrap();
        });
        let Poll::Ready(Ok(Change::Put { key, seq: told })) = recv.poll(&mut cx) else {
            panic!("the commit must announce its put");
        };
        assert_eq!((key.as_str(), told), ("k", seq));
    }
    let seen = look.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        (1..=3u64)
            .map(|s| (s, Some(format!("v{s}"))))
            .collect::<Vec<_>>(),
        "each subscriber, when woken, must read a watermark and value that cover the change"
    );
}
