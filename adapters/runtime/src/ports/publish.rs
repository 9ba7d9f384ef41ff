//! Publishing announcements to the durable events stream.

use std::future::Future;

use crate::error::Result;

/// The write side of the durable events stream: payloads keyed by entity key.
pub trait Publish: Send + Sync {
    /// Appends `payload` under `key`; returns its position on the stream.
    fn publish(&self, key: &str, payload: Vec<u8>) -> impl Future<Output = Result<u64>> + Send;

    /// Appends every `(key, payload)` in order; one result per item, in the same order (an
    /// item that failed was not appended, or its append is unknown, as for
    /// [`publish`](Self::publish)). The relay publishes a claimed batch with it. The
    /// default publishes one at a time; a backend overrides it to pay one round trip or
    /// one commit for the batch (SQLite: one transaction; NATS: acks awaited together).
    fn publish_batch(
        &self,
        items: Vec<(String, Vec<u8>)>,
    ) -> impl Future<Output = Vec<Result<u64>>> + Send {
        async move {
            let mut out = Vec::with_capacity(items.len());
            for (key, payload) in items {
                out.push(self.publish(&key, payload).await);
            }
            out
        }
    }
}
