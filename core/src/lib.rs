//! tidemark-core: the deterministic, sans-IO decisions that keep a local cache converged
//! with a durable, keyed source of truth through a change feed.
//!
//! This crate decides; it never does. It performs no I/O, reads no clock and no OS
//! randomness, spawns nothing and holds no global state: time comes in as a [`Time`] value
//! and jitter from a generator seeded by configuration. The same inputs therefore give
//! the same outputs, which is what lets a simulator, property tests and fuzzers replay any
//! run exactly. Adapters (tokio drivers, NATS, SQLite, the simulator) carry the decisions
//! out.
//!
//! # The follower
//!
//! [`Follower`] is the state machine of one cache. It is driven like quinn-proto or str0m:
//!
//! 1. report a fact with [`Follower::handle_input`] (a feed entry, a feed failure, a
//!    reconcile's rows…) or [`Follower::handle_timeout`];
//! 2. drain [`Follower::poll_output`] until it returns `None`, carrying out each
//!    [`Output`] in order: a [`Request`] to a port (open the feed from watermark+1,
//!    reconcile, …), an [`Apply`] to the cache, a [`Notice`] to whoever waits (ready, a
//!    reconcile's result), a [`Diagnostic`] to the log;
//! 3. sleep until [`Follower::poll_timeout`], then go to 1.
//!
//! ```
//! use tidemark_core::*;
//!
//! let config = FollowerConfig::builder("mirror").seed(7).build()?;
//! let mut f = Follower::new(config, Utf8);
//! let now = Time::ZERO;
//! let Some(Output::Request(Request::LookupSource { token })) = f.poll_output() else {
//!     unreachable!()
//! };
//! f.handle_input(Input::SourceFound { token }, now);
//! let Some(Output::Request(Request::OpenFeed { token, from: 1, .. })) = f.poll_output() else {
//!     unreachable!()
//! };
//! let info = FeedInfo::change_log(1, 1); // gapless, first available seq 1, head 1
//! f.handle_input(Input::FeedOpened { token, info }, now);
//! f.handle_input(Input::Entry { token, entry: Entry::put(1, "a", "hello") }, now);
//! let put = Apply::Put { key: "a".into(), seq: 1, value: "hello".into() };
//! assert_eq!(f.poll_output(), Some(Output::Apply(put)));
//! assert_eq!(f.poll_output(), Some(Output::Notice(Notice::Ready { watermark: 1 })));
//! assert_eq!(f.watermark(), 1);
//! # Ok::<(), ConfigError>(())
//! ```
//!
//! What it guarantees: the watermark only grows; an entry at or below it is not applied
//! again (but is still checkpointed); per key a newer value is never replaced by an older
//! one; a gap on a gapless feed, or a feed that can no longer serve watermark+1, leads to a
//! reconcile or a full resync instead of a silent skip; readiness comes only after the
//! initial sync; bad entries and undecodable values are counted skips, never panics.
//!
//! # Also here
//!
//! How a follower follows is the feed's to say ([`Follow`], carried by [`FeedInfo`]): a
//! source's own history is replayed, an announcements stream is reconciled first and then
//! applied never-older, and with no feed the follower reconciles on wakes. A driver whose
//! sink commits in batches (a persisted cache, a worker) marks each commit
//! ([`Follower::commit`]); a failed batch ([`Input::SinkFailed`]) takes the follower back to
//! the last mark, so nothing the sink lost is skipped.
//!
//! - [`Event`]: the announcement wire format; [`Entry`] and [`Op`]: what feeds deliver.
//! - [`Decode`]: the user's value decoder, with an error type of their choosing.
//! - [`BackoffPolicy`] and [`Backoff`]: exponential, jittered, capped, reset when healthy.
//! - [`Probes`]: when a follower that backs off asks whether its source answers again,
//!   and when an answer means a stalled path is back ([`Input::Resumed`]).
//! - [`AnnouncePlan`] and [`AnnounceReport`]: the writer's three fail-soft legs.
//! - [`Job`], [`Schedule`] and [`RestartPolicy`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod announce;
mod backoff;
mod config;
mod decode;
mod entry;
mod error;
mod event;
mod follower;
pub mod fuzzing;
mod job;
mod limits;
mod lineage;
mod prefix;
mod probe;
mod restart;
mod retention;
mod rng;
mod schedule;
mod time;

pub use announce::{AnnouncePlan, AnnounceReport, Legs, MAX_EVENT_BYTES};
pub use backoff::{Backoff, BackoffPolicy};
pub use config::{FollowerConfig, FollowerConfigBuilder};
pub use decode::{Decode, DecodeFn, Json, RawBytes, Utf8, decode_fn};
pub use entry::{CacheChange, Entry, Op};
pub use error::ConfigError;
pub use event::{EncodeError, Event, NotAnEvent};
pub use follower::{
    Ahead, Apply, Cached, CaughtUp, Cause, Continuity, Counters, Diagnostic, FeedInfo, Follow,
    Follower, Input, InvalidReason, Notice, Output, Phase, Request, Status, Token,
};
pub use job::{BUILT_IN_KINDS, CustomJob, Job, JobError, JobId, UNDECODABLE_KIND};
pub use limits::{
    KeyProblem, MAX_KEY_BYTES, MAX_VALUE_BYTES, check_key, presize_for, presize_more, shorten,
};
pub use lineage::Lineage;
pub use prefix::KeyPrefix;
pub use probe::{Asking, ProbePolicy, Probed, Probes, SINGLE_ANSWERS};
pub use restart::RestartPolicy;
pub use retention::{Mark, RetentionPolicy};
pub use rng::Rng;
pub use schedule::{Cadence, CronExpr, Schedule, ScheduleClock};
pub use time::Time;
