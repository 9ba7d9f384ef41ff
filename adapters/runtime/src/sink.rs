//! Where a follower's decisions land: a cache, or a user's worker.

use std::future::Future;

use crate::error::Result;

/// Receives the changes a follower decided, in order. A failure ends the follower task
/// (its supervisor's restart policy decides what next).
pub trait Sink<V>: Send {
    /// Upsert `key` to `value` as of `seq`.
    fn put(&mut self, key: String, seq: u64, value: V) -> impl Future<Output = Result<()>> + Send;

    /// Remove `key` as of `seq`.
    fn remove(&mut self, key: String, seq: u64) -> impl Future<Output = Result<()>> + Send;

    /// The initial sync completed at `watermark`.
    fn ready(&mut self, watermark: u64) {
        let _ = watermark;
    }

    /// The applied watermark moved to `watermark` (called after each batch of decisions).
    fn watermark(&mut self, watermark: u64) {
        let _ = watermark;
    }

    /// The follower is stopping: finish in-flight work (within the shutdown budget).
    fn drain(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}
