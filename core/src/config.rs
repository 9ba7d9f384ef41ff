//! A follower's configuration, validated when built.

use crate::backoff::BackoffPolicy;
use crate::error::ConfigError;

/// How a follower learns about changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// Replay a change feed from watermark+1 and keep following it (a KV watch, a source's
    /// change log, an events stream). Ready once the replay reaches the feed's head.
    Feed,
    /// No feed: read the source's changes since the watermark on start and on every wake
    /// (the wake runner). Ready after the first reconcile. Never polls.
    WakeOnly,
    /// Follow a stream of announcements that may miss changes (a writer can crash between
    /// commit and announce): reconcile from the source first — ready after that — then
    /// apply announcements as they come, and reconcile again on every wake.
    Announcements,
}

impl Sync {
    /// Whether the follower keeps a feed open.
    #[must_use]
    pub fn uses_feed(self) -> bool {
        matches!(self, Sync::Feed | Sync::Announcements)
    }

    /// Whether the initial sync reads the source rather than replaying the feed.
    #[must_use]
    pub fn syncs_by_reconcile(self) -> bool {
        matches!(self, Sync::WakeOnly | Sync::Announcements)
    }
}

/// What a follower is allowed to do and how it backs off. Build with
/// [`FollowerConfig::builder`].
#[derive(Clone, Debug, PartialEq)]
pub struct FollowerConfig {
    pub(crate) name: String,
    pub(crate) seed: u64,
    pub(crate) sync: Sync,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_value_bytes: usize,
    pub(crate) lookup_backoff: BackoffPolicy,
    pub(crate) failure_backoff: BackoffPolicy,
    pub(crate) end_backoff: BackoffPolicy,
}

impl FollowerConfig {
    /// Starts a configuration for the follower called `name` (shown to operators).
    #[must_use]
    pub fn builder(name: impl Into<String>) -> FollowerConfigBuilder {
        FollowerConfigBuilder {
            config: FollowerConfig {
                name: name.into(),
                seed: 0,
                sync: Sync::Feed,
                max_key_bytes: crate::limits::MAX_KEY_BYTES,
                max_value_bytes: crate::limits::MAX_VALUE_BYTES,
                lookup_backoff: BackoffPolicy::default(),
                failure_backoff: BackoffPolicy::default(),
                end_backoff: BackoffPolicy::fast_reopen(),
            },
        }
    }

    /// The follower's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The seed of the follower's jitter generator.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// How the follower learns about changes.
    #[must_use]
    pub fn sync(&self) -> Sync {
        self.sync
    }

    /// The same configuration with another sync mode (a driver that only makes sense in one
    /// mode, like a wake runner, sets it rather than trusting the caller's).
    #[must_use]
    pub fn with_sync(mut self, sync: Sync) -> Self {
        self.sync = sync;
        self
    }

    /// The backoff after a failed feed or request (for drivers that retry on their own).
    #[must_use]
    pub fn failure_backoff(&self) -> &BackoffPolicy {
        &self.failure_backoff
    }

    /// Keys longer than this many bytes are counted and skipped.
    #[must_use]
    pub fn max_key_bytes(&self) -> usize {
        self.max_key_bytes
    }

    /// Values larger than this many bytes are counted and skipped.
    #[must_use]
    pub fn max_value_bytes(&self) -> usize {
        self.max_value_bytes
    }
}

/// Builds a [`FollowerConfig`]; [`build`](Self::build) validates it.
#[derive(Clone, Debug)]
pub struct FollowerConfigBuilder {
    config: FollowerConfig,
}

impl FollowerConfigBuilder {
    /// Seeds the jitter generator (default 0). Give each follower its own seed so that
    /// many of them do not retry in step; give a simulation the run's seed.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = seed;
        self
    }

    /// How the follower learns about changes (default [`Sync::Feed`]).
    #[must_use]
    pub fn sync(mut self, sync: Sync) -> Self {
        self.config.sync = sync;
        self
    }

    /// The largest key accepted, in bytes (default 1024).
    #[must_use]
    pub fn max_key_bytes(mut self, n: usize) -> Self {
        self.config.max_key_bytes = n;
        self
    }

    /// The largest value accepted, in bytes (default 8 MiB).
    #[must_use]
    pub fn max_value_bytes(mut self, n: usize) -> Self {
        self.config.max_value_bytes = n;
        self
    }

    /// Backoff while the source (bucket) cannot be looked up.
    #[must_use]
    pub fn lookup_backoff(mut self, p: BackoffPolicy) -> Self {
        self.config.lookup_backoff = p;
        self
    }

    /// Backoff after a feed fails to open or fails mid-stream, or a request fails.
    #[must_use]
    pub fn failure_backoff(mut self, p: BackoffPolicy) -> Self {
        self.config.failure_backoff = p;
        self
    }

    /// Backoff after a feed ends cleanly (default [`BackoffPolicy::fast_reopen`]).
    #[must_use]
    pub fn end_backoff(mut self, p: BackoffPolicy) -> Self {
        self.config.end_backoff = p;
        self
    }

    /// Validates and returns the configuration.
    pub fn build(self) -> Result<FollowerConfig, ConfigError> {
        let c = self.config;
        if c.name.trim().is_empty() {
            return Err(ConfigError::EmptyName {
                field: "follower name",
            });
        }
        if c.max_key_bytes == 0 {
            return Err(ConfigError::ZeroLimit {
                field: "max_key_bytes",
            });
        }
        if c.max_value_bytes == 0 {
            return Err(ConfigError::ZeroLimit {
                field: "max_value_bytes",
            });
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_validates_names_and_limits() {
        assert!(matches!(
            FollowerConfig::builder("  ").build(),
            Err(ConfigError::EmptyName { .. })
        ));
        assert!(matches!(
            FollowerConfig::builder("f").max_value_bytes(0).build(),
            Err(ConfigError::ZeroLimit { .. })
        ));
        assert!(matches!(
            FollowerConfig::builder("f").max_key_bytes(0).build(),
            Err(ConfigError::ZeroLimit { .. })
        ));
        let c = FollowerConfig::builder("f")
            .seed(9)
            .sync(Sync::WakeOnly)
            .build()
            .unwrap();
        assert_eq!((c.name(), c.seed(), c.sync()), ("f", 9, Sync::WakeOnly));
    }
}
