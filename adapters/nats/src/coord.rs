//! What the lock and the schedule store share: a KV bucket opened or created for them, the
//! encoding of names as KV keys, and the server's clock.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use tidemark::Result;

use crate::error::{check_name, unavailable};

/// The key whose writes read the server's clock.
const CLOCK_KEY: &str = "clock";

/// Opens the bucket `name` (history 1, file storage), creating it if absent.
pub(crate) async fn bucket(
    client: async_nats::Client,
    name: &str,
    replicas: usize,
    port: &'static str,
) -> Result<kv::Store> {
    check_name(name)?;
    let context = jetstream::new(client);
    match context.get_key_value(name).await {
        Ok(store) => Ok(store),
        Err(_) => context
            .create_key_value(kv::Config {
                bucket: name.to_owned(),
                history: 1,
                num_replicas: replicas.max(1),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(port, e)),
    }
}

/// A name of any characters as a KV key under `prefix` (base64url: only characters NATS
/// allows in a key).
pub(crate) fn key(prefix: &str, name: &str) -> String {
    format!("{prefix}.{}", URL_SAFE_NO_PAD.encode(name))
}

/// Now, by the server's clock, as time since the unix epoch: the timestamp the server
/// gives a write to the bucket's clock key. Every process asking the same server gets one
/// clock, whatever its own says.
pub(crate) async fn server_now(store: &kv::Store, port: &'static str) -> Result<Duration> {
    store
        .put(CLOCK_KEY, Bytes::new())
        .await
        .map_err(|e| unavailable(port, e))?;
    let entry = store
        .entry(CLOCK_KEY)
        .await
        .map_err(|e| unavailable(port, e))?
        .ok_or_else(|| unavailable(port, "the clock key vanished"))?;
    Ok(since_epoch(&entry))
}

/// When the server stored `entry`, as time since the unix epoch.
pub(crate) fn since_epoch(entry: &kv::Entry) -> Duration {
    let nanos = entry.created.unix_timestamp_nanos();
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
}

/// The live entry under `key` (a delete or purge marker reads as absent).
pub(crate) async fn live(
    store: &kv::Store,
    key: &str,
    port: &'static str,
) -> Result<Option<kv::Entry>> {
    Ok(store
        .entry(key)
        .await
        .map_err(|e| unavailable(port, e))?
        .filter(|e| e.operation == kv::Operation::Put))
}
