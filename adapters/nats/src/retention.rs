//! Retention on JetStream: limits on the streams tidemark writes, enforced by the server,
//! and a sweep that puts them on streams created before them.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tidemark::{LockLease, Result, Sweep, Swept};

use crate::NatsLock;

use crate::error::unavailable;

const PORT: &str = "sweep";

/// Limits on a stream, enforced by the server (the oldest messages go first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    /// Messages older than this go. Zero: no age limit.
    pub max_age: Duration,
    /// The stream's size in bytes at most. -1: no limit.
    pub max_bytes: i64,
    /// The stream's messages at most. -1: no limit.
    pub max_messages: i64,
}

impl StreamLimits {
    /// The events stream's defaults: a day, 256 MiB, any number of messages. Followers
    /// that fall further behind find what they missed by reconcile (or resync), so
    /// announcements need not be kept long.
    pub const EVENTS: StreamLimits = StreamLimits {
        max_age: Duration::from_secs(24 * 3600),
        max_bytes: 256 * 1024 * 1024,
        max_messages: -1,
    };

    /// The work-queue stream's defaults: a week, 256 MiB, a million jobs waiting. An
    /// acknowledged job leaves the stream at once; these bound a queue nobody consumes.
    pub const JOBS: StreamLimits = StreamLimits {
        max_age: Duration::from_secs(7 * 24 * 3600),
        max_bytes: 256 * 1024 * 1024,
        max_messages: 1_000_000,
    };

    /// `config` with these limits.
    #[must_use]
    pub fn apply(&self, mut config: stream::Config) -> stream::Config {
        config.max_age = self.max_age;
        config.max_bytes = self.max_bytes;
        config.max_messages = self.max_messages;
        config
    }

    fn holds(&self, config: &stream::Config) -> bool {
        config.max_age == self.max_age
            && config.max_bytes == self.max_bytes
            && config.max_messages == self.max_messages
    }
}

/// NATS retention ([`Sweep`]): the server enforces stream limits itself, so a sweep
/// makes sure the events and work-queue streams carry theirs (a stream created before
/// limits were configured, or with other ones, is updated), and reports what that
/// removed. KV buckets keep one revision per key (history 1) and need nothing.
#[derive(Clone, Debug)]
pub struct NatsSweep {
    context: jetstream::Context,
    streams: Vec<(String, StreamLimits)>,
    lock: Option<NatsLock>,
}

impl NatsSweep {
    /// A sweep of no stream yet; add them with [`events`](Self::events) and
    /// [`jobs`](Self::jobs).
    #[must_use]
    pub fn new(client: async_nats::Client) -> Self {
        NatsSweep {
            context: jetstream::new(client),
            streams: Vec::new(),
            lock: None,
        }
    }

    /// Checks each sweep's fence against `lock` (the lock the sweeps run under) before it
    /// changes each stream: a sweeper whose lock was taken since changes nothing more.
    /// Without it the fence is not checked (putting limits the server enforces is safe
    /// to repeat).
    #[must_use]
    pub fn fenced_by(mut self, lock: NatsLock) -> Self {
        self.lock = Some(lock);
        self
    }

    /// Keeps the events stream `stream` within `limits` ([`StreamLimits::EVENTS`] by
    /// default).
    #[must_use]
    pub fn events(mut self, stream: impl Into<String>, limits: StreamLimits) -> Self {
        self.streams.push((stream.into(), limits));
        self
    }

    /// Keeps the work-queue stream `stream` (a [`NatsQueue`](crate::NatsQueue)'s name)
    /// within `limits` ([`StreamLimits::JOBS`] by default).
    #[must_use]
    pub fn jobs(mut self, stream: impl Into<String>, limits: StreamLimits) -> Self {
        self.streams.push((stream.into(), limits));
        self
    }
}

impl Sweep for NatsSweep {
    async fn sweep(&self, fence: &LockLease) -> Result<Swept> {
        let mut swept = Swept::default();
        for (name, limits) in &self.streams {
            if let Some(lock) = &self.lock {
                fence.check_fence(lock.fencing(&fence.name).await?)?;
            }
            let mut s = self
                .context
                .get_stream(name)
                .await
                .map_err(|e| unavailable(PORT, format!("stream {name}: {e}")))?;
            let info = s.info().await.map_err(|e| unavailable(PORT, e))?.clone();
            if limits.holds(&info.config) {
                continue;
            }
            let before = info.state.messages;
            let after = self
                .context
                .update_stream(limits.apply(info.config.clone()))
                .await
                .map_err(|e| unavailable(PORT, format!("stream {name}: {e}")))?;
            let removed = before.saturating_sub(after.state.messages);
            tracing::info!(stream = %name, ?limits, removed, "stream limits applied");
            swept.events += removed;
        }
        Ok(swept)
    }
}
