//! Named durable cursors: where a stream consumer got to.

use std::future::Future;

use crate::error::Result;

/// Durable, named positions on a feed. Saves are monotone: saving a position below the
/// stored one keeps the stored one.
pub trait Cursors: Send + Sync {
    /// The position saved under `name`, or `None` for a fresh name.
    fn load(&self, name: &str) -> impl Future<Output = Result<Option<u64>>> + Send;

    /// Saves `position` under `name` if it is above the stored one; returns the stored
    /// position afterwards.
    fn save(&self, name: &str, position: u64) -> impl Future<Output = Result<u64>> + Send;
}
