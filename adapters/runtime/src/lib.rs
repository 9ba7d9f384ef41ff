//! tidemark: the async ports and the tokio drivers that run [`tidemark_core`] against them.
//!
//! - **Ports** ([`ports`]): small async traits an adapter implements: [`Source`], [`Feed`],
//!   [`Cursors`], [`Publish`], [`Wake`], [`Queue`], [`Lock`], [`ScheduleStore`],
//!   [`Outbox`]. The
//!   `conformance` feature exposes generic test bodies every adapter runs.
//! - **Drivers**, written once for every adapter and the simulator: the [`FollowerTask`]
//!   (one core follower against a source and a feed, into a [`Cache`] or a [`Worker`]),
//!   the wake runner ([`spawn_wake_cache`]: no feed, catches up on each wake, never
//!   polls), the durable stream consumer ([`FollowerTask::with_cursor`]), reconcile
//!   ([`FollowerHandle::reconcile`]), the [`AnnouncingRegistry`] and the outbox [`Relay`]
//!   (both run the announce legs through one [`Announcer`]), the [`Supervisor`], and the
//!   schedule runner ([`run_scheduler`]), the [`JobRunner`] (leases, renews, acks,
//!   retries and dead-letters the jobs of a [`Queue`] with the user's [`JobHandlers`]),
//!   and retention ([`run_retention`]: a durable schedule that runs each adapter's
//!   [`Sweep`] under the sweeper lock).
//!
//! Drivers read tokio's clock only (so paused time and turmoil drive them), use biased
//! `select!`, and iterate no `HashMap` into outputs.
//!
//! ```
//! use tidemark::{FollowerConfig, Source, Utf8, spawn_cache};
//! use tidemark_memory::Memory;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let m = Memory::new();
//! m.source.put("pkg/a", b"1.0.0".to_vec()).await?;
//! let config = FollowerConfig::new("mirror")?;
//! let (cache, follower) = spawn_cache(config, Utf8, m.source.clone(), m.source.clone());
//! let watermark = cache.wait_ready().await?;
//! assert_eq!(cache.get("pkg/a").as_deref().map(String::as_str), Some("1.0.0"));
//! println!("ready at {watermark} with {} keys", cache.len());
//! follower.stop();
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod announce;
mod cache;
mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
mod follower;
mod jobs;
mod json;
mod noop;
pub mod ports;
mod probe;
mod reconnect;
mod relay;
mod retention;
mod running;
mod scheduler;
mod settle;
mod shutdown;
mod sink;
mod supervisor;
pub mod telemetry;
mod worker;

pub use announce::{Announcer, AnnouncingRegistry, Written};
pub use cache::{Cache, CacheWriter, Change, cache};
pub use clock::{Clock, instant_after};
pub use error::{Error, Result, check_key, check_key_within, check_value, key_prefix};
pub use follower::handle::{FollowerHandle, spawn_cache, spawn_wake_cache};
pub use follower::{DEFAULT_SNAPSHOT_PART_LEN, FollowerTask, Reconciled};
pub use jobs::{
    DEFAULT_JOB_CONCURRENCY, DEFAULT_JOB_IDLE_POLL, DEFAULT_JOB_VISIBILITY, JobContext,
    JobCounters, JobHandlers, JobRunner, JobRunnerHandle,
};
pub use json::{PutJson, to_json};
pub use noop::{NoCursors, NoFeed, NoStream, NoWake};
pub use ports::*;
pub use reconnect::{RECONNECT_GAP, RECONNECT_SETTLE};
pub use relay::{DEFAULT_BATCH, DEFAULT_LEASE, Relay, RelayHandle, RelayReport};
pub use retention::{
    DEFAULT_SWEEP_EVERY, DEFAULT_SWEEP_LEASE, Retention, SWEEP_LOCK, SWEEP_SCHEDULE, SweepWithJobs,
    run_retention, sweep_under_lock, with_sweep_job,
};
pub use scheduler::{Fired, fire_due, run_scheduler};
pub use shutdown::{Shutdown, StopSignal};
pub use sink::{CacheOp, Held, Sink};
pub use supervisor::{Supervisor, WorkerFailure, WorkerInfo, WorkerPhase};
pub use telemetry::{DEFAULT_STALL_AFTER, FollowerHealth, Health};
pub use tidemark_core;
// The core types every user needs, so one `use tidemark::…` is enough.
pub use tidemark_core::{
    Ahead, AnnounceReport, BackoffPolicy, ConfigError, Continuity, Counters, CustomJob, Decode,
    DecodeFn, Entry, Event, FeedInfo, Follow, FollowerConfig, FollowerConfigBuilder, Job, JobError,
    JobId, Json, Legs, Lineage, Mark, Op, Phase, RawBytes, RestartPolicy, RetentionPolicy,
    Schedule, ScheduleClock, Status, UNDECODABLE_KIND, Utf8, decode_fn,
};
pub use worker::{ValueOf, Worker, WorkerSink};
