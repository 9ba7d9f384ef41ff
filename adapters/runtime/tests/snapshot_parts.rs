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
    /// Set: reads wait on it after their first part.
    hold: Option<Arc<Notify>>,
}

impl Parts {
    fn new(inner: MemorySource) -> Self {
        Parts {
            inner,
            parts: Arc::default(),
            reads: Arc::default(),
            fail_midway: Arc::default(),
            hold: None,
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
        let parts = read.parts.enumerate().then(move |(i, part)| {
            let counted = Arc::clone(&counted);
            let hold = hold.clone();
            async move {
                if i == 1 {
                    if let Some(hold) = hold {
                        hold.notified().await;
                    }
                    if fail {
                        return Err(Error::unavailable("source", "connection lost midway"));
                    }
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
