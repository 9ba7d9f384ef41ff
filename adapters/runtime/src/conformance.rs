//! The port conformance suite: async test bodies generic over the ports, so every adapter
//! proves the same semantics with the same code. An adapter's tests instantiate each body
//! with a fresh port:
//!
//! ```
//! # use tidemark_memory::MemorySource;
//! #[tokio::test(start_paused = true)]
//! async fn source_changes_cover_removals() {
//!     tidemark::conformance::source_changes_cover_removals(&MemorySource::default()).await;
//! }
//! # fn main() {}
//! ```
//!
//! Bodies panic (with a message saying why the behaviour matters) on a violation. Bodies
//! that wait use tokio time and short durations, so they run under paused time and stay
//! quick against a real clock. Enabled by the `conformance` feature.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod feed;
mod history;
mod lease_end;
mod lock;
mod outbox;
mod prefix;
mod queue;
mod runner;
mod schedule;
mod source;

pub use feed::*;
pub use history::*;
pub use lease_end::*;
pub use lock::*;
pub use outbox::*;
pub use prefix::{prefix_follower_holds_exactly_its_keys, prefix_view_carries_only_its_keys};
pub use queue::*;
pub use runner::*;
pub use schedule::*;
pub use source::*;

use std::time::Duration;

use tidemark_core::{
    AnnounceReport, Entry, Event, Job, JobId, MAX_KEY_BYTES, MAX_VALUE_BYTES, Op, Schedule,
};

use crate::jobs::{JobHandlers, JobRunner};
use crate::ports::{
    Changes, Cursors, Feed, FeedItem, FeedStream, JobCounts, JobRetention, JobState, Lock, Outbox,
    OutboxRow, OutboxUpdate, OutboxWatch, Publish, Queue, Received, ScheduleStore, Source, Wake,
    WakeListener,
};

/// The next entry or undecodable item (a raised head only tells the follower how far its
/// initial sync reads, and is passed over).
async fn next_item<S: FeedStream>(stream: &mut S) -> FeedItem {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Ok(FeedItem::Head(_)))) => {}
            Ok(Some(Ok(item))) => return item,
            Ok(other) => panic!("feed should deliver an item, got {other:?}"),
            Err(_) => panic!("feed delivered nothing within 5s"),
        }
    }
}

fn entry(item: FeedItem) -> Entry {
    match item {
        FeedItem::Entry(e) => e,
        other => panic!("expected an entry, got {other:?}"),
    }
}

/// Waits until job `id` is in `state`, or panics after `within`.
async fn wait_for_state<Q: Queue>(q: &Q, id: JobId, state: JobState, within: Duration) -> u32 {
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

fn ids(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.id).collect()
}

fn seqs(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.seq).collect()
}
