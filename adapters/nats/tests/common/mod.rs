//! Shared helpers of the NATS tests: servers, buckets, a recording sink, waiting.
#![allow(dead_code, clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use tidemark::tidemark_core::{BackoffPolicy, FollowerConfig, RawBytes};
use tidemark::{FollowerHandle, FollowerTask, Result, Sink, Source};
use tidemark_nats::KvBucket;
use tidemark_tests::{NatsServer, wait_jetstream_ready};

/// A server for one test; fails (never skips) with the provisioning hint when none is found.
pub async fn server() -> NatsServer {
    match NatsServer::start().await {
        Ok(s) => s,
        Err(e) => panic!("a real nats-server is required for these tests: {e}"),
    }
}

/// A connected, JetStream-ready client.
pub async fn client(server: &NatsServer) -> async_nats::Client {
    let client = server.connect().await.expect("connect");
    wait_jetstream_ready(&client)
        .await
        .expect("jetstream ready");
    client
}

/// Creates bucket `name` with `history` revisions per key and `replicas`.
pub async fn create_bucket(
    client: &async_nats::Client,
    name: &str,
    history: i64,
    replicas: usize,
) -> kv::Store {
    let js = jetstream::new(client.clone());
    retry(Duration::from_secs(30), || {
        js.create_key_value(kv::Config {
            bucket: name.to_owned(),
            history,
            num_replicas: replicas,
            ..Default::default()
        })
    })
    .await
}

/// Puts `k0`..`k{n-1}` with the values `v0`..`v{n-1}`, `depth` puts in flight at a
/// time; panics on a failed put.
pub async fn put_keys(store: &kv::Store, n: u32, depth: usize) {
    put_keys_with(store, n, depth, |i| bytes::Bytes::from(format!("v{i}"))).await;
}

/// Puts `k0`..`k{n-1}` with the values `value(0)`..`value(n-1)`, `depth` puts in flight
/// at a time; panics on a failed put.
pub async fn put_keys_with(
    store: &kv::Store,
    n: u32,
    depth: usize,
    value: impl Fn(u32) -> bytes::Bytes,
) {
    use futures::StreamExt as _;
    let mut acks = futures::stream::iter(0..n)
        .map(|i| {
            let (store, value) = (store.clone(), value(i));
            async move { store.put(format!("k{i}"), value).await }
        })
        .buffer_unordered(depth);
    while let Some(ack) = acks.next().await {
        ack.unwrap();
    }
}

/// Retries `f` with backoff until it succeeds or `limit` passes.
pub async fn retry<T, E: std::fmt::Display, F, Fut>(limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut delay = Duration::from_millis(20);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if started.elapsed() < limit => {
                let _ = e;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(500));
            }
            Err(e) => panic!("gave up after {limit:?}: {e}"),
        }
    }
}

/// Waits until `cond` holds, polling, or panics with `what` after `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A follower configuration with quick backoff, for tests.
pub fn config(name: &str) -> FollowerConfig {
    let fast = BackoffPolicy::new(
        Duration::from_millis(20),
        2.0,
        Duration::from_millis(500),
        Duration::from_secs(5),
        0.5,
    )
    .expect("backoff");
    FollowerConfig::builder(name)
        .lookup_backoff(fast)
        .failure_backoff(fast)
        .end_backoff(fast)
        .build()
        .expect("config")
}

/// Everything a recording sink saw, shared across follower restarts.
#[derive(Clone, Debug, Default)]
pub struct Record {
    inner: Arc<Mutex<RecordInner>>,
}

#[derive(Debug, Default)]
struct RecordInner {
    map: BTreeMap<String, (u64, Vec<u8>)>,
    applied: Vec<(String, u64)>,
    watermark: u64,
    ready: Option<u64>,
    /// The keys held when the follower said ready.
    held_at_ready: Option<usize>,
}

impl Record {
    pub fn sink(&self) -> Recorder {
        Recorder(self.clone())
    }
    /// Spawns a follower of `bucket` (config named `name`) recording into this record.
    pub fn follow(&self, name: &str, bucket: &KvBucket) -> FollowerHandle {
        FollowerTask::new(
            config(name),
            RawBytes,
            bucket.clone(),
            bucket.clone(),
            self.sink(),
        )
        .spawn()
    }
    pub fn map(&self) -> BTreeMap<String, (u64, Vec<u8>)> {
        self.inner.lock().unwrap().map.clone()
    }
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().map.len()
    }
    pub fn watermark(&self) -> u64 {
        self.inner.lock().unwrap().watermark
    }
    pub fn ready(&self) -> Option<u64> {
        self.inner.lock().unwrap().ready
    }
    /// How many keys the sink held when the follower said ready.
    pub fn held_at_ready(&self) -> Option<usize> {
        self.inner.lock().unwrap().held_at_ready
    }
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.inner
            .lock()
            .unwrap()
            .map
            .get(key)
            .map(|(_, v)| v.clone())
    }
    /// The keys and seqs held, for a warm restart.
    pub fn keys(&self) -> Vec<(String, u64)> {
        let inner = self.inner.lock().unwrap();
        inner
            .map
            .iter()
            .map(|(k, (s, _))| (k.clone(), *s))
            .collect()
    }
    /// Panics if any (key, seq) was applied twice or a key went back in seq.
    pub fn assert_applied_once(&self) {
        let inner = self.inner.lock().unwrap();
        let mut last: BTreeMap<&str, u64> = BTreeMap::new();
        for (key, seq) in &inner.applied {
            if let Some(prev) = last.insert(key, *seq) {
                assert!(
                    *seq > prev,
                    "{key} was applied at {seq} after {prev}: an update applied twice or out of order"
                );
            }
        }
    }
    pub fn applied_count(&self) -> usize {
        self.inner.lock().unwrap().applied.len()
    }
}

/// A sink that records every change; the map doubles as the cache.
#[derive(Debug)]
pub struct Recorder(Record);

impl Sink<Vec<u8>> for Recorder {
    const FALLIBLE: bool = false;

    async fn put(&mut self, key: std::sync::Arc<str>, seq: u64, value: Vec<u8>) -> Result<()> {
        let key = key.to_string();
        let mut inner = self.0.inner.lock().unwrap();
        inner.applied.push((key.clone(), seq));
        inner.map.insert(key, (seq, value));
        Ok(())
    }
    async fn remove(&mut self, key: std::sync::Arc<str>, seq: u64) -> Result<()> {
        let key = key.to_string();
        let mut inner = self.0.inner.lock().unwrap();
        inner.applied.push((key.clone(), seq));
        inner.map.remove(&key);
        Ok(())
    }
    fn ready(&mut self, watermark: u64) {
        let mut inner = self.0.inner.lock().unwrap();
        inner.ready = Some(watermark);
        inner.held_at_ready = Some(inner.map.len());
    }
    async fn commit(&mut self, watermark: u64, _: tidemark::Lineage) -> Result<()> {
        self.0.inner.lock().unwrap().watermark = watermark;
        Ok(())
    }
}

/// The bucket's current contents read independently of the adapter (async-nats'
/// `keys()` + `get`; slow, so for small buckets).
pub async fn contents(store: &kv::Store) -> BTreeMap<String, Vec<u8>> {
    use futures::TryStreamExt as _;
    let keys: Vec<String> = store.keys().await.unwrap().try_collect().await.unwrap();
    let mut out = BTreeMap::new();
    for k in keys {
        if let Some(v) = store.get(k.clone()).await.unwrap() {
            out.insert(k, v.to_vec());
        }
    }
    out
}

/// Puts `key`, retrying with backoff through restarts (503, no responders, timeouts).
pub async fn put_retry(bucket: &KvBucket, key: &str, value: Vec<u8>) -> u64 {
    let started = Instant::now();
    let mut delay = Duration::from_millis(10);
    loop {
        match bucket.put(key, value.clone()).await {
            Ok(seq) => return seq,
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(60),
                "writer gave up: {e}"
            ),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}
