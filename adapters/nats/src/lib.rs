//! tidemark-nats: tidemark on NATS JetStream.
//!
//! - [`KvBucket`]: a KV bucket as both [`Source`](tidemark::Source) and
//!   [`Feed`](tidemark::Feed) (revision = seq). Followers replay it from their
//!   watermark + 1 over an ephemeral push consumer they control, detect compaction from
//!   the stream's first sequence, and become ready once the replay reaches the stream's
//!   last message.
//! - [`NatsEvents`]: the durable events stream (`Event` JSON on `<prefix>.<key>`):
//!   [`Publish`](tidemark::Publish), [`Feed`](tidemark::Feed) and
//!   [`Cursors`](tidemark::Cursors) kept as durable consumers' ack floors.
//! - [`NatsWake`]: wake channels over core NATS subjects.
//! - [`NatsQueue`]: maintenance jobs on a work-queue stream (lease = ack wait, nak with
//!   delay, dead letter after the maximum attempts, keeping the last error).
//! - [`NatsLock`], [`NatsSchedules`]: named locks (owner, TTL, fencing) and durable
//!   schedules on KV buckets, each change a revision compare-and-set, time by the
//!   server's clock, so a NATS-only deployment runs one sweeper and fires each tick once.
//! - [`NatsSweep`], [`StreamLimits`]: retention on the server: the events and work-queue
//!   streams carry age, size and count limits (documented defaults) that the server
//!   enforces; a sweep puts them on streams created without them.
//! - [`NatsOptions`]: server URLs, credentials file, nkey, user/password, token, TLS (CA,
//!   client certificate) and connection name, passed through to async-nats.
//!
//! ```no_run
//! use tidemark::tidemark_core::{FollowerConfig, Utf8};
//! use tidemark::spawn_cache;
//! use tidemark_nats::{KvBucket, NatsOptions};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let client = NatsOptions::new(["nats://127.0.0.1:4222"]).name("mirror").connect().await?;
//! let bucket = KvBucket::new(client, "packages")?;
//! let config = FollowerConfig::builder("mirror").build()?;
//! let (cache, follower) = spawn_cache(config, Utf8, bucket.clone(), bucket);
//! cache.wait_ready().await?;
//! println!("{} packages", cache.len());
//! follower.stop();
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod clock;
mod consumer;
mod coord;
mod error;
mod events;
pub mod fuzzing;
mod kv;
mod lock;
mod options;
mod queue;
mod reconnects;
mod retention;
mod schedule;
mod wake;

pub use events::{EventStream, NatsEvents};
pub use kv::{KvBucket, KvStream};
pub use lock::{DEFAULT_LOCK_BUCKET, NatsLock};
pub use options::{ConnectError, DEFAULT_MAX_RECONNECT_DELAY, NatsOptions};
pub use queue::NatsQueue;
pub use retention::{NatsSweep, StreamLimits};
pub use schedule::{DEFAULT_SCHEDULE_BUCKET, NatsSchedules};
pub use wake::{NatsWake, NatsWakeListener};
