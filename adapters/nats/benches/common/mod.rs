//! What every NATS bench shares: run only under `cargo bench` (a plain `cargo test`
//! builds and runs bench targets too, and must not start a server), on a two-worker
//! runtime like the machines the figures are measured on.

use std::future::Future;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::StreamExt as _;
use tidemark_tests::NatsServer;

/// Runs `bench` on a two-worker tokio runtime when the process was started by `cargo
/// bench` (`--bench`); otherwise prints that `name` was skipped and how to run it.
pub fn run_bench<F: Future<Output = ()>>(name: &str, how: &str, bench: F) {
    if !std::env::args().any(|a| a == "--bench") {
        println!("tidemark-nats {name} bench: skipped (run `{how}`)");
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(bench);
}

/// A real nats-server and, on it, a bucket `name` keeping one revision per key that holds
/// `n` keys (`key(i)` → `value(i)`), put 512 at a time: the start of every bench that
/// reads a filled bucket. The server stops when the returned handle drops.
#[allow(dead_code)] // not every bench reads a filled bucket
pub async fn filled_bucket(
    name: &str,
    n: u32,
    key: impl Fn(u32) -> String,
    value: impl Fn(u32) -> Bytes,
) -> (NatsServer, async_nats::Client) {
    let server = NatsServer::start()
        .await
        .unwrap_or_else(|e| panic!("a real nats-server is required: {e}"));
    let client = server.connect().await.expect("connect");
    tidemark_tests::wait_jetstream_ready(&client)
        .await
        .expect("ready");
    let store = jetstream::new(client.clone())
        .create_key_value(kv::Config {
            bucket: name.into(),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("bucket");
    let mut acks = futures::stream::iter(0..n)
        .map(|i| {
            let (store, key, value) = (store.clone(), key(i), value(i));
            async move { store.put(key, value).await }
        })
        .buffer_unordered(512);
    while let Some(r) = acks.next().await {
        r.expect("put");
    }
    (server, client)
}
