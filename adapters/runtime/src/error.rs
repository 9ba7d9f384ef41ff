//! The runtime's one error type. Data problems on a feed (undecodable payloads, poison
//! values, invalid keys) are counted events, never errors: only misuse and I/O failures
//! are `Err`.

use std::time::Duration;

/// What a port or driver could not do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend could not be reached or failed to answer (I/O, a network partition, a
    /// busy database, an injected fault). Retryable: drivers back off and try again.
    #[error("{port} unavailable: {reason}")]
    Unavailable {
        /// Which port failed (`"source"`, `"feed"`, `"wake"`, `"queue"`, …).
        port: &'static str,
        /// The backend's explanation.
        reason: String,
    },
    /// A compare-and-set write found another seq than the one it expected.
    #[error("conflict on {key:?}: expected seq {expected}, found {current:?}")]
    Conflict {
        /// The key written.
        key: String,
        /// The seq the caller expected the key to hold.
        expected: u64,
        /// The seq it holds (`None`: the key is absent).
        current: Option<u64>,
    },
    /// A key the source refuses (empty, too long, control characters).
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key, possibly shortened.
        key: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A value larger than the backend accepts.
    #[error("value of {len} bytes exceeds the limit of {max}")]
    ValueTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A typed value that could not be encoded for a write (see [`to_json`](crate::to_json)).
    #[error("value for {key:?} cannot be encoded: {reason}")]
    Encode {
        /// The key written, possibly shortened.
        key: String,
        /// The encoder's explanation.
        reason: String,
    },
    /// A queue lease or a lock lease is no longer held (it expired and was handed to
    /// someone else, or was already completed).
    #[error("lease lost: {0}")]
    LeaseLost(String),
    /// Something named does not exist (a job id, a schedule).
    #[error("not found: {0}")]
    NotFound(String),
    /// The port was closed (the process-local backend was shut down).
    #[error("{0} closed")]
    Closed(&'static str),
    /// A driver did not finish within its budget.
    #[error("{what} did not finish within {budget:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The budget.
        budget: Duration,
    },
    /// A user worker's handler failed; the worker exits and its restart policy decides.
    #[error("worker {worker} failed: {reason}")]
    Worker {
        /// The worker's name.
        worker: String,
        /// The handler's error, displayed.
        reason: String,
    },
    /// The store's schema is no longer the one this process opened it at: a newer build,
    /// in another process sharing the store, migrated it since. This build's statements
    /// may no longer mean what they did, so it writes (and reads) nothing through them.
    /// Not retryable: restart the process on a build that knows version `found`.
    #[error(
        "{store}: schema version {found} is not version {opened}, which this process opened it at (a newer build migrated it); restart this process on a build that knows version {found}"
    )]
    SchemaChanged {
        /// The store (a file's path).
        store: String,
        /// The schema version this process opened the store at and writes.
        opened: i64,
        /// The version the store carries now.
        found: i64,
    },
    /// A value that cannot be a user job (not tagged by `"kind"`, or a built-in kind).
    #[error(transparent)]
    Job(#[from] tidemark_core::JobError),
    /// A configuration the core refused.
    #[error(transparent)]
    Config(#[from] tidemark_core::ConfigError),
}

impl Error {
    /// An [`Error::Unavailable`] for `port`.
    pub fn unavailable(port: &'static str, reason: impl Into<String>) -> Self {
        Error::Unavailable {
            port,
            reason: reason.into(),
        }
    }

    /// One failure for each of `n` items of a batch that failed as a whole: this error
    /// first, then its description under the same port (every item failed alike).
    #[must_use]
    pub fn for_each_of<T>(self, n: usize) -> Vec<std::result::Result<T, Error>> {
        let port = match &self {
            Error::Unavailable { port, .. } => *port,
            _ => "batch",
        };
        let reason = self.to_string();
        let mut out = Vec::with_capacity(n);
        if n > 0 {
            out.push(Err(self));
        }
        out.extend((1..n).map(|_| Err(Error::unavailable(port, reason.clone()))));
        out
    }

    /// Whether trying again later may succeed.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Timeout { .. })
    }
}

/// Refuses a key no tidemark source stores (empty, longer than
/// [`MAX_KEY_BYTES`](tidemark_core::MAX_KEY_BYTES), control characters) with
/// [`Error::InvalidKey`]: the one rule every adapter applies.
pub fn check_key(key: &str) -> Result<()> {
    tidemark_core::check_key(key, tidemark_core::MAX_KEY_BYTES).map_err(|p| Error::InvalidKey {
        key: tidemark_core::shorten(key, 64),
        reason: p.describe(),
    })
}

/// `prefix` as a [`KeyPrefix`](tidemark_core::KeyPrefix) for a source view over part of
/// its keys; [`Error::InvalidKey`] for one no key could begin with (empty, too long,
/// control characters).
pub fn key_prefix(prefix: &str) -> Result<tidemark_core::KeyPrefix> {
    tidemark_core::KeyPrefix::new(prefix).map_err(|p| Error::InvalidKey {
        key: tidemark_core::shorten(prefix, 64),
        reason: p.describe(),
    })
}

/// [`check_key`], and for a source view over `prefix`, [`Error::InvalidKey`] for a key
/// outside it: what a view refuses to write.
pub fn check_key_within(key: &str, prefix: Option<&tidemark_core::KeyPrefix>) -> Result<()> {
    check_key(key)?;
    match prefix {
        Some(p) if !p.matches(key) => Err(Error::InvalidKey {
            key: tidemark_core::shorten(key, 64),
            reason: "outside the source's key prefix",
        }),
        _ => Ok(()),
    }
}

/// Refuses a value larger than [`MAX_VALUE_BYTES`](tidemark_core::MAX_VALUE_BYTES) with
/// [`Error::ValueTooLarge`].
pub fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > tidemark_core::MAX_VALUE_BYTES {
        return Err(Error::ValueTooLarge {
            len: value.len(),
            max: tidemark_core::MAX_VALUE_BYTES,
        });
    }
    Ok(())
}

/// The runtime's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
