//! tidemark-sqlite: every tidemark port on one SQLite file, so a user gets durability with
//! no server.
//!
//! Open a [`SqliteDb`] and take the views you need; they share one connection per handle
//! and every call runs on tokio's blocking pool:
//!
//! - [`SqliteSource`]: the registry ([`Source`](tidemark::Source)) with tombstones that
//!   carry their seq, a watermark, compaction with a recorded horizon, and its change log
//!   as a gapless [`Feed`](tidemark::Feed). An *announcing* source also writes an outbox
//!   row in each mutation's own transaction.
//! - [`SqliteOutbox`]: those rows as the runtime's [`Outbox`](tidemark::Outbox) port,
//!   claimed under wall-clock leases, so the runtime's [`Relay`](tidemark::Relay)
//!   ([`SqliteDb::relay`]) drains them into the events stream, the wake channel and the
//!   queue, at least once, and relays in several processes on one file publish each row
//!   once.
//! - [`SqliteEvents`]: the durable events stream ([`Publish`](tidemark::Publish), a sparse
//!   [`Feed`](tidemark::Feed)) and named [`Cursors`](tidemark::Cursors).
//! - [`SqliteWake`]: wake channels across processes. Every commit to the file by any
//!   process is seen through `PRAGMA data_version` on a dedicated watcher connection (which
//!   reads no table); a source write, announced or not, then wakes every listener on the
//!   file (the SPEC §7 backstop), and notified payloads reach their channel in order.
//!   Latency is about the watch interval (2 ms by default; measured p50 ≈ 1 ms).
//! - [`SqliteQueue`], [`SqliteLock`], [`SqliteSchedules`]: jobs with leases, retries and a
//!   dead letter; named locks with owner, TTL and fencing; durable schedules whose ticks
//!   enqueue exactly one job across processes.
//! - [`SqliteSweep`]: retention ([`Sweep`](tidemark::Sweep)): relayed outbox rows,
//!   change-log history and tombstones no durable cursor or persisted follower needs, old
//!   events, within the limits of [`Options::retention`]; run on a schedule under the
//!   lock by [`tidemark::run_retention`].
//! - [`PersistedCache`]: a follower's cache and watermark kept in the file, a sink that
//!   writes each applied batch and its watermark in one transaction, for a warm restart
//!   that catches up only the delta — under any follower, over any source (a NATS bucket
//!   included).
//!
//! The schema is versioned (`PRAGMA user_version`, `PRAGMA application_id`); a file that is
//! not a database, is truncated or corrupt, belongs to another application or has a newer
//! schema is refused with an [`Error`], never a panic. A file that a newer build migrates
//! while this process has it open is neither written nor read any more: every port answers
//! [`tidemark::Error::SchemaChanged`], naming both versions (each write transaction checks
//! the version under the write lock).
//!
//! A registry in a file, and a cache that follows it and keeps its own copy in the same
//! file for a warm restart:
//!
//! ```
//! use std::time::Duration;
//! use tidemark::{FollowerConfig, FollowerTask, RawBytes, Source};
//! use tidemark_sqlite::SqliteDb;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let db = SqliteDb::open(dir.path().join("registry.db")).await?;
//! let source = db.source();
//! let seq = source.put("a", b"1".to_vec()).await?;
//! let config = FollowerConfig::builder("mirror").build()?;
//! let cache = db.follower_cache("mirror");
//! let task = FollowerTask::new(config, RawBytes, source.clone(), source, cache.clone());
//! let handle = task.spawn();
//! let mut status = handle.watch_status();
//! status.wait_for(|s| s.ready).await?;
//! let status = handle.stop_within(Duration::from_secs(1)).await?;
//! assert_eq!(status.watermark, seq, "the cache and its watermark are in the file");
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod db;
mod error;
mod events;
pub mod fuzzing;
mod lock;
mod outbox;
mod queue;
mod read_only;
mod report;
mod retention;
mod schedule;
mod schema;
mod source;
mod wake;

pub use cache::PersistedCache;
pub use db::{Options, SqliteDb, Synchronous};
pub use error::{Error, Result};
pub use events::{EventStream, Record, SqliteEvents};
pub use lock::SqliteLock;
pub use outbox::{SqliteOutbox, SqliteOutboxWatch};
pub use queue::SqliteQueue;
pub use read_only::{Holder, ReadOnlyDb};
pub use report::{
    FollowerReport, LockReport, QueueReport, RegistryReport, Report, ScheduleReport, Start,
    read_report,
};
pub use retention::SqliteSweep;
pub use schedule::SqliteSchedules;
pub use schema::{APPLICATION_ID, SCHEMA_VERSION};
pub use source::{
    ChangeLogStream, Compaction, MAX_KEY_BYTES, MAX_VALUE_BYTES, SqliteSource, Write,
};
pub use tidemark::CacheOp;
pub use wake::{SqliteListener, SqliteWake};

impl SqliteDb {
    /// The registry as a source and a gapless change-log feed; its writes announce nothing.
    #[must_use]
    pub fn source(&self) -> SqliteSource {
        SqliteSource::new(self.clone(), None)
    }

    /// The registry as a source whose every mutation also writes an outbox row, in the
    /// same transaction, announcing it on the given legs. A [`relay`](Self::relay) drains
    /// the outbox.
    #[must_use]
    pub fn announced_source(&self, legs: tidemark::tidemark_core::Legs) -> SqliteSource {
        SqliteSource::new(self.clone(), Some(legs))
    }
}

impl SqliteDb {
    /// The durable events stream and its named cursors.
    #[must_use]
    pub fn events(&self) -> SqliteEvents {
        SqliteEvents::new(self.clone())
    }

    /// Wake channels on this file, seen by every process that opens it.
    #[must_use]
    pub fn wake(&self) -> SqliteWake {
        SqliteWake::new(self.clone())
    }
}

impl SqliteDb {
    /// The durable job queue.
    #[must_use]
    pub fn queue(&self) -> SqliteQueue {
        SqliteQueue::new(self.clone())
    }

    /// Named locks with owner, TTL and fencing.
    #[must_use]
    pub fn lock(&self) -> SqliteLock {
        SqliteLock::new(self.clone())
    }

    /// Durable schedules.
    #[must_use]
    pub fn schedules(&self) -> SqliteSchedules {
        SqliteSchedules::new(self.clone())
    }
}

impl SqliteDb {
    /// The persisted cache of the follower called `name`.
    #[must_use]
    pub fn follower_cache(&self, name: impl Into<String>) -> PersistedCache {
        PersistedCache::new(self.clone(), name.into())
    }
}
