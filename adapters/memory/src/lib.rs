//! tidemark-memory: the in-process reference implementation of every tidemark port.
//!
//! [`Memory`] bundles a source (whose change log is a gapless feed), an events stream with
//! durable cursors, wake channels, a job queue, locks, schedules and an outbox (written by
//! an announced source, drained by relays), all sharing one set of
//! [`Faults`]: fail an announce leg, fail the next N calls of a port, drop, duplicate or
//! reorder announcements, compact the source's history. Every handle is a cheap clone of
//! an `Arc`, so a simulator can keep the state outside a host that crashes.
//!
//! [`MemoryCacheStore`] is a follower's durable cache in memory (its persisted-cache sink
//! is [`MemoryCacheSink`]), with failing, slow and crashing commits.
//!
//! Time (visibility timeouts, lock expiry, schedule clocks) is tokio's, so tests with
//! paused time and simulators drive it.
//!
//! A cache that follows an in-process source:
//!
//! ```
//! use std::time::Duration;
//! use tidemark::{FollowerConfig, Source, Utf8, spawn_cache};
//! use tidemark_memory::MemorySource;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let source = MemorySource::default();
//! source.put("greeting", b"hello".to_vec()).await?;
//! let config = FollowerConfig::builder("demo").build()?;
//! let (cache, handle) = spawn_cache(config, Utf8, source.clone(), source.clone());
//! cache.wait_ready().await?;
//! assert_eq!(cache.get("greeting").as_deref().map(String::as_str), Some("hello"));
//! handle.stop_within(Duration::from_secs(1)).await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache_store;
mod clock;
mod events;
mod faults;
mod lock;
mod outbox;
mod queue;
mod retention;
mod schedule;
mod signal;
mod source;
mod wake;

pub use cache_store::{MemoryCacheSink, MemoryCacheStore};
pub use events::{EventStream, MemoryEvents, Record};
pub use faults::{Faults, Mangle, Port};
pub use lock::MemoryLock;
pub use outbox::{MemoryOutbox, MemoryOutboxBackup, MemoryOutboxWatch};
pub use queue::{DEFAULT_MAX_ATTEMPTS, MemoryQueue};
pub use retention::MemorySweep;
pub use schedule::MemorySchedules;
pub use source::{LogStream, MAX_KEY_BYTES, MAX_VALUE_BYTES, MemoryBackup, MemorySource};
pub use tidemark::CacheOp;
pub use wake::{MemoryListener, MemoryWake};

/// Every memory port, sharing one set of [`Faults`].
#[derive(Clone, Debug)]
pub struct Memory {
    /// The source of truth; also a gapless feed of its own changes.
    pub source: MemorySource,
    /// The durable events stream, with cursors.
    pub events: MemoryEvents,
    /// Wake channels.
    pub wake: MemoryWake,
    /// The job queue.
    pub queue: MemoryQueue,
    /// Named locks.
    pub lock: MemoryLock,
    /// Durable schedules.
    pub schedules: MemorySchedules,
    /// The outbox an [`announced_source`](Self::announced_source) writes and relays drain.
    pub outbox: MemoryOutbox,
    /// The fault switches every port above consults.
    pub faults: Faults,
}

impl Memory {
    /// Fresh, empty ports with no fault armed.
    #[must_use]
    pub fn new() -> Self {
        let faults = Faults::new();
        Memory {
            source: MemorySource::new(faults.clone()),
            events: MemoryEvents::new(faults.clone()),
            wake: MemoryWake::new(faults.clone()),
            queue: MemoryQueue::new(faults.clone()),
            lock: MemoryLock::new(faults.clone()),
            schedules: MemorySchedules::new(faults.clone()),
            outbox: MemoryOutbox::new(faults.clone()),
            faults,
        }
    }

    /// The source as a handle whose every write also appends an outbox row to
    /// [`outbox`](Self::outbox), announcing it on `legs` (SQLite's
    /// `announced_source`, in memory).
    #[must_use]
    pub fn announced_source(&self, legs: tidemark::tidemark_core::Legs) -> MemorySource {
        self.source.announced(legs, self.outbox.clone())
    }
}

impl Default for Memory {
    fn default() -> Self {
        Memory::new()
    }
}
