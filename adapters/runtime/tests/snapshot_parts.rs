//! The follower task reads a resync's snapshot part by part: each part goes to the core as
//! it comes, an error midway has the whole read done again, and a stop midway stops.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{config, until};
use futures::StreamExt;
use tidemark::tidemark_core::{Phase, Utf8};
use tidemark::{
    Changes, Error, FollowerTask, Result, Snapshot, SnapshotParts, Source, Versioned, cache,
};
use tidemark_memory::{MemorySource, Port};
use tokio::sync::Notify;

/// A memory source whose snapshot parts are counted, and which can fail after the first
/// part of the next read or hold a read before its second part.
#[derive(Clone)]
struct Parts {
    inner: MemorySource,
    parts: Arc<AtomicUsize>,
    reads: Arc<AtomicUsize>,
    /// Reads left that fail after their first part.
    fail_midway: Arc<AtomicUsize>,
    /// Set: reads wait on it after their first `hold_after` parts.
    hold: Option<Arc<Notify>>,
    hold_after: usize,
}

impl Parts {
    fn new(inner: MemorySource) -> Self {
        Parts {
            inner,
            parts: Arc::default(),
            reads: Arc::default(),
            fail_midway: Arc::default(),
            hold: None,
            hold_after: 1,
        }
    }
}

impl Source for Parts {
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        self.inner.put(key, value).await
    }
    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        self.inner.update(key, value, expected).await
    }
    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        self.inner.remove(key).await
    }
    async fn watermark(&self) -> Result<u64> {
        self.inner.watermark().await
    }
    async fn changes_since(&self, since: u64) -> Result<Changes> {
        self.inner.changes_since(since).await
    }
    async fn snapshot(&self) -> Result<Snapshot> {
        panic!("the follower task reads a snapshot in parts")
    }
    async fn snapshot_parts(&self, part_len: usize) -> Result<SnapshotParts<'_>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let read = self.inner.snapshot_parts(part_len).await?;
        let fail = self
            .fail_midway
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let counted = Arc::clone(&self.parts);
        let hold = self.hold.clone();
        let hold_after = self.hold_after;
        let parts = read.parts.enumerate().then(move |(i, part)| {
            let counted = Arc::clone(&counted);
            let hold = hold.clone();
            async move {
                if i == hold_after
                    && let Some(hold) = hold
                {
                    hold.notified().await;
                }
                if i == 1 && fail {
                    return Err(Error::unavailable("source", "connection lost midway"));
                }
                counted.fetch_add(1, Ordering::SeqCst);
                part
            }
        });
        Ok(SnapshotParts {
            watermark: read.watermark,
            lineage: read.lineage,
            parts: parts.boxed(),
        })
    }
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        self.inner.get(key).await
    }
    async fn first_available(&self) -> Result<u64> {
        self.inner.first_available().await
    }
}

/// Ten keys, a follower over them reading parts of `part_len`, then a compaction past
/// it after one key changed and one went: the next read of the source is a resync.
async fn resync_setup(
    source: &Parts,
    part_len: usize,
) -> (tidemark::Cache<String>, tidemark::FollowerHandle) {
    for i in 0..10 {
        source
            .inner
            .put(&format!("k{i}"), b"old".to_vec())
            .await
            .unwrap();
    }
    let (writer, reader) = cache();
    let handle = FollowerTask::new(
        config("parts"),
        Utf8,
        source.clone(),
        source.inner.clone(),
        writer,
    )
    .snapshot_part_len(part_len)
    .spawn();
    reader.wait_ready().await.unwrap();
    source.inner.faults().set_failing(Port::Feed, true);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    source.inner.put("k3", b"new".to_vec()).await.unwrap();
    source.inner.remove("k7").await.unwrap();
    source
        .inner
        .compact_below(source.inner.current_watermark() + 1);
    (reader, handle)
}

fn expected() -> Vec<String> {
    (0..10)
        .filter(|i| *i != 7)
        .map(|i| format!("k{i}"))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_resync_reads_the_snapshot_in_parts_and_applies_what_changed() {
    let source = Parts::new(MemorySource::default());
    let (cache, h) = resync_setup(&source, 3).await;
    source.inner.faults().set_failing(Port::Feed, false);
    until("the follower resyncs", || {
        h.status().counters.resyncs >= 1 && cache.watermark() == 12
    })
    .await;
    assert_eq!(cache.keys(), expected());
    assert_eq!(cache.get("k3").as_deref(), Some(&"new".to_owned()));
    assert_eq!(source.reads.load(Ordering::SeqCst), 1);
    // Nine keys in parts of three.
    assert_eq!(source.parts.load(Ordering::SeqCst), 3);
    assert_eq!(h.status().counters.ignored, 0);
}

#[tokio::test(start_paused = true)]
async fn an_error_midway_through_the_parts_has_the_snapshot_read_again() {
    let source = Parts::new(MemorySource::default());
    source.fail_midway.store(1, Ordering::SeqCst);
    let (cache, h) = resync_setup(&source, 2).await;
    source.inner.faults().set_failing(Port::Feed, false);
    until("the follower resyncs", || cache.watermark() == 12).await;
    assert_eq!(cache.keys(), expected());
    assert_eq!(cache.get("k3").as_deref(), Some(&"new".to_owned()));
    assert_eq!(
        source.reads.load(Ordering::SeqCst),
        2,
        "read again after the failure"
    );
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn a_stop_midway_through_the_parts_stops() {
    let mut source = Parts::new(MemorySource::default());
    source.hold = Some(Arc::new(Notify::new()));
    let (cache, h) = resync_setup(&source, 2).await;
    source.inner.faults().set_failing(Port::Feed, false);
    until("the read is under way", || {
        source.parts.load(Ordering::SeqCst) >= 1
    })
    .await;
    assert_eq!(h.status().phase, Phase::Resyncing);
    h.stop_within(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        source.parts.load(Ordering::SeqCst),
        1,
        "no part after the stop"
    );
    assert!(
        cache.get("k7").is_some(),
        "nothing of the unfinished read was applied"
    );
}

/// Ten keys written "old" (the backup is taken there), then k0 written again with the
/// same value (a new seq) and k1 with another, and k10 added: a follower reading parts of
/// `part_len` loads that. The restore that follows is a new history: k0..k9 "old" at
/// seqs 1..=10.
async fn restore_setup(
    source: &Parts,
    part_len: usize,
) -> (
    tidemark::Cache<String>,
    tidemark::FollowerHandle,
    tidemark_memory::MemoryBackup,
) {
    for i in 0..10 {
        let key = format!("k{i}");
        source.inner.put(&key, b"old".to_vec()).await.unwrap();
    }
    let backup = source.inner.backup();
    source.inner.put("k0", b"old".to_vec()).await.unwrap();
    source.inner.put("k1", b"new".to_vec()).await.unwrap();
    source.inner.put("k10", b"new".to_vec()).await.unwrap();
    let (writer, reader) = cache();
    let handle = FollowerTask::new(
        config("restore"),
        Utf8,
        source.clone(),
        source.inner.clone(),
        writer,
    )
    .snapshot_part_len(part_len)
    .spawn();
    assert_eq!(reader.wait_ready().await.unwrap(), 13);
    (reader, handle, backup)
}

/// The cache as the backup's history holds it: k0..k9 "old" at seqs 1..=10.
fn restored() -> Vec<(String, u64, Arc<String>)> {
    let mut all: Vec<_> = (0..10)
        .map(|i| (format!("k{i}"), i + 1, Arc::new("old".to_owned())))
        .collect();
    all.sort();
    all
}

#[tokio::test(start_paused = true)]
async fn a_new_history_keeps_each_equal_value_at_its_new_seq_and_puts_each_other() {
    let source = Parts::new(MemorySource::default());
    let (cache, h, backup) = restore_setup(&source, 3).await;
    let before = cache.snapshot();
    source.inner.restore(&backup);
    until("the follower takes the restored history", || {
        h.status().counters.resets == 1 && cache.watermark() == 10
    })
    .await;
    assert!(source.parts.load(Ordering::SeqCst) >= 4, "read in parts");
    assert_eq!(
        cache.snapshot(),
        restored(),
        "every key, value and seq is the new history's (k0 at 1, not 11; k1 back to old; k10 gone)"
    );
    let held = |key: &str| before.iter().find(|(k, ..)| k == key).unwrap().2.clone();
    for key in ["k0", "k2", "k9"] {
        assert!(
            Arc::ptr_eq(&held(key), &cache.get(key).unwrap()),
            "{key}: an equal value is kept, not copied again"
        );
    }
    assert!(!Arc::ptr_eq(&held("k1"), &cache.get("k1").unwrap()));
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn readers_see_no_mix_of_histories_while_a_new_one_is_read_in_parts() {
    let mut source = Parts::new(MemorySource::default());
    let hold = Arc::new(Notify::new());
    source.hold = Some(Arc::clone(&hold));
    // Parts of two: the core has the first two (k0, k1, k10, k2: restamps and a put)
    // when the read waits before the fourth.
    source.hold_after = 3;
    let (cache, h, backup) = restore_setup(&source, 2).await;
    let before = cache.snapshot();
    let mut changes = cache.subscribe();
    source.inner.restore(&backup);
    until("the read is under way", || {
        source.parts.load(Ordering::SeqCst) >= 3
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(h.status().phase, Phase::Resyncing);
    assert_eq!(
        cache.snapshot(),
        before,
        "until the last part, readers see the old history whole"
    );
    assert!(changes.try_recv().is_err(), "and no change of the new one");
    hold.notify_one();
    until("the follower takes the restored history", || {
        h.status().counters.resets == 1 && cache.watermark() == 10
    })
    .await;
    assert_eq!(cache.snapshot(), restored(), "then the new history whole");
}
