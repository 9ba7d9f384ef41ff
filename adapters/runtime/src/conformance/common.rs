//! What the conformance bodies share: the ports and core types they use, and a few
//! helpers (reading a feed's next item, waiting for a job's state, a claim's ids and
//! seqs).

#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

pub(super) use std::time::Duration;

pub(super) use tidemark_core::{
    AnnounceReport, Entry, Event, Job, JobId, MAX_KEY_BYTES, MAX_VALUE_BYTES, Op, Schedule,
};

pub(super) use crate::jobs::{JobHandlers, JobRunner};
pub(super) use crate::ports::{
    Changes, Cursors, Feed, FeedItem, FeedStream, JobCounts, JobRetention, JobState, Lock, Outbox,
    OutboxRow, OutboxUpdate, OutboxWatch, Publish, Queue, Received, ScheduleStore, Source, Wake,
    WakeListener,
};

/// The next entry or undecodable item (a raised head only tells the follower how far its
/// initial sync reads, and is passed over).
pub(super) async fn next_item<S: FeedStream>(stream: &mut S) -> FeedItem {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Ok(FeedItem::Head(_)))) => {}
            Ok(Some(Ok(item))) => return item,
            Ok(other) => panic!("feed should deliver an item, got {other:?}"),
            Err(_) => panic!("feed delivered nothing within 5s"),
        }
    }
}

pub(super) fn entry(item: FeedItem) -> Entry {
    match item {
        FeedItem::Entry(e) => e,
        other => panic!("expected an entry, got {other:?}"),
    }
}

/// Waits until job `id` is in `state`, or panics after `within`.
pub(super) async fn wait_for_state<Q: Queue>(
    q: &Q,
    id: JobId,
    state: JobState,
    within: Duration,
) -> u32 {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(rec) = q.get(id).await.unwrap()
            && rec.state == state
        {
            return rec.attempts;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} did not reach {state:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(super) fn ids(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.id).collect()
}

pub(super) fn seqs(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.seq).collect()
}
