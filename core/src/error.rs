//! The core's one error type: invalid configuration. Data problems on a feed are counted
//! events, never errors.

use std::time::Duration;

/// A configuration value a constructor refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration that must be positive was zero.
    #[error("{field} must be greater than zero")]
    ZeroDuration {
        /// Which setting.
        field: &'static str,
    },
    /// The backoff growth factor was below 1 (or not a number).
    #[error("backoff factor must be at least 1, got {factor}")]
    FactorBelowOne {
        /// The factor given.
        factor: f64,
    },
    /// The backoff cap was below the first delay.
    #[error("backoff cap {cap:?} is below the first delay {first:?}")]
    CapBelowFirst {
        /// The first delay given.
        first: Duration,
        /// The cap given.
        cap: Duration,
    },
    /// The jitter fraction was outside `[0, 1]`.
    #[error("jitter must be between 0 and 1, got {jitter}")]
    JitterOutOfRange {
        /// The jitter given.
        jitter: f64,
    },
    /// A name that identifies something to an operator was empty.
    #[error("{field} must not be empty")]
    EmptyName {
        /// Which name.
        field: &'static str,
    },
    /// A size limit was zero.
    #[error("{field} must be greater than zero")]
    ZeroLimit {
        /// Which limit.
        field: &'static str,
    },
    /// A cron expression that does not parse.
    #[error("invalid cron expression {expr:?}: {reason}")]
    InvalidCron {
        /// The expression given.
        expr: String,
        /// Why it was refused.
        reason: String,
    },
}
