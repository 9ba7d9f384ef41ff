//! Publishing announcements to the durable events stream.

use std::future::Future;

use crate::error::Result;

/// The write side of the durable events stream: payloads keyed by entity key.
pub trait Publish: Send + Sync {
    /// Appends `payload` under `key`; returns its position on the stream.
    fn publish(&self, key: &str, payload: Vec<u8>) -> impl Future<Output = Result<u64>> + Send;
}
