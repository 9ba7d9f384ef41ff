//! A follower's configuration, validated when built.

use crate::backoff::BackoffPolicy;
use crate::error::ConfigError;

/// What a follower is allowed to do and how it backs off. Build with
/// [`FollowerConfig::builder`].
#[derive(Clone, Debug, PartialEq)]
pub struct FollowerConfig {
    pub(crate) name: String,
    pub(crate) seed: Option<u64>,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_value_bytes: usize,
    pub(crate) max_ahead: u64,
    pub(crate) presence_check: Option<std::time::Duration>,
    pub(crate) confirm_after: std::time::Duration,
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
                seed: None,
                max_key_bytes: crate::limits::MAX_KEY_BYTES,
                max_value_bytes: crate::limits::MAX_VALUE_BYTES,
                max_ahead: 1 << 20,
                presence_check: None,
                confirm_after: std::time::Duration::from_millis(200),
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

    /// The defaults for the follower called `name`: the same as
    /// `FollowerConfig::builder(name).build()`.
    pub fn new(name: impl Into<String>) -> Result<FollowerConfig, ConfigError> {
        Self::builder(name).build()
    }

    /// The seed of the follower's jitter generator, if one was given. Drivers draw one
    /// when none was (so that a fleet does not retry in lockstep) and show it in the
    /// status; the core itself uses 0 then, to stay deterministic.
    #[must_use]
    pub fn seed(&self) -> Option<u64> {
        self.seed
    }

    /// The seed the core uses: the given one, or 0.
    #[must_use]
    pub(crate) fn seed_or_zero(&self) -> u64 {
        self.seed.unwrap_or(0)
    }

    /// The same configuration with `seed`, if it has none yet (a driver drawing one for a
    /// follower the user gave no seed).
    #[must_use]
    pub fn with_seed_if_unset(mut self, seed: u64) -> Self {
        self.seed.get_or_insert(seed);
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

    /// How far past the source's last known watermark an announcement's seq may be.
    #[must_use]
    pub fn max_ahead(&self) -> u64 {
        self.max_ahead
    }

    /// How often a live follower lists the keys the source holds, if at all.
    #[must_use]
    pub fn presence_check(&self) -> Option<std::time::Duration> {
        self.presence_check
    }

    /// How long an announcement applied to the cache may wait for a read of the source
    /// that confirms it.
    #[must_use]
    pub fn confirm_after(&self) -> std::time::Duration {
        self.confirm_after
    }
}

/// Builds a [`FollowerConfig`]; [`build`](Self::build) validates it.
#[derive(Clone, Debug)]
pub struct FollowerConfigBuilder {
    config: FollowerConfig,
}

impl FollowerConfigBuilder {
    /// Seeds the jitter generator. Without one, the runtime draws a seed per follower (so
    /// that many of them do not retry in step) and shows it in the status; give a
    /// simulation or a replay the run's seed.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = Some(seed);
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

    /// How far past the source's last known watermark an announcement's seq may be
    /// (default 2^20). Further is a foreign or corrupt announcement: counted and skipped,
    /// since a seq that high would pin its key (every real write of it would look older).
    /// Skipping a real one costs only latency: the next reconcile brings it.
    #[must_use]
    pub fn max_ahead(mut self, n: u64) -> Self {
        self.config.max_ahead = n;
        self
    }

    /// Every `interval`, a live follower lists the keys the source holds (a cheap call
    /// for a NATS bucket: the stream's subjects) and removes cached keys the source no
    /// longer has: what no message announces (a delete marker purged while older messages
    /// keep the stream's first sequence low). Off by default; the source must support
    /// listing (`Source::present_keys`).
    #[must_use]
    pub fn presence_check(mut self, interval: std::time::Duration) -> Self {
        self.config.presence_check = Some(interval);
        self
    }

    /// How long an announcement applied to the cache may wait for a read of the source
    /// that confirms it (default 200 ms). An announcement is trusted only to say that its
    /// key may have changed: its seq and value are held unconfirmed until a reconcile or
    /// snapshot shows the same change, and replaced by the source's answer otherwise. A
    /// wake reads the source sooner; without one (a quiet source, a foreign producer) the
    /// follower reads it this long after the first unconfirmed announcement, once for
    /// every announcement applied meanwhile. Only announcement streams wait for this; a
    /// feed that is the source's own history is trusted.
    #[must_use]
    pub fn confirm_after(mut self, wait: std::time::Duration) -> Self {
        self.config.confirm_after = wait;
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
        if c.presence_check.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::ZeroDuration {
                field: "presence check interval",
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
        let c = FollowerConfig::builder("f").seed(9).build().unwrap();
        assert_eq!((c.name(), c.seed()), ("f", Some(9)));
        let d = FollowerConfig::new("f").unwrap();
        assert_eq!(d.seed(), None, "no seed given: the driver draws one");
        assert_eq!(d.with_seed_if_unset(5).seed(), Some(5));
        assert_eq!(
            c.with_seed_if_unset(5).seed(),
            Some(9),
            "a given seed is kept"
        );
    }
}
