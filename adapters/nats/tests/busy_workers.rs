//! A feed whose runtime's workers are busy, against a real nats-server: the client drops
//! what overflows a subscription's channel, and a pump that waited for a free worker let
//! it overflow (a consumer sequence gap, a failed feed, a backoff, a reopen); whatever
//! the pump does, the follower ends with every key exactly once.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use tidemark::FollowerTask;
use tidemark::tidemark_core::RawBytes;
use tidemark_nats::KvBucket;

use common::*;

/// A sink whose first commits hold their worker thread (a long synchronous turn: a big
/// batch applied, a map resized), the way a follower's turn of 16k entries does.
struct BlockingCommits {
    inner: Recorder,
    hold: Duration,
    commits: u32,
}

impl tidemark::Sink<Vec<u8>> for BlockingCommits {
    const FALLIBLE: bool = false;

    async fn put(&mut self, key: Arc<str>, seq: u64, value: Vec<u8>) -> tidemark::Result<()> {
        self.inner.put(key, seq, value).await
    }
    async fn remove(&mut self, key: Arc<str>, seq: u64) -> tidemark::Result<()> {
        self.inner.remove(key, seq).await
    }
    fn ready(&mut self, watermark: u64) {
        self.inner.ready(watermark);
    }
    async fn commit(&mut self, watermark: u64, lineage: tidemark::Lineage) -> tidemark::Result<()> {
        if self.commits > 0 {
            self.commits -= 1;
            std::thread::sleep(self.hold);
        }
        self.inner.commit(watermark, lineage).await
    }
}

/// With one worker held by the follower's turn, the client's connection task on the other
/// moves a whole burst into the subscription's channel in one poll; a pump that was a task
/// on the same runtime could not take messages out meanwhile, and the channel (8,192
/// messages on this client) overflowed: a gap, a failed feed, a backoff, a reopen, in
/// every run tried. The pump now has a thread of its own. Whether it keeps up is a matter
/// of scheduling (a loaded machine can still starve a thread: a reopen was seen once in a
/// debug build under CI's load), so this asserts what must hold whatever the scheduler
/// does — every key applied exactly once, ready at the head — and prints the reopens;
/// their count is the `nats` bench's business, not a test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_holding_a_worker_gets_every_key_exactly_once() {
    const KEYS: u32 = 60_000;
    let server = server().await;
    let client = async_nats::ConnectOptions::new()
        .subscription_capacity(8_192)
        .connect(server.url())
        .await
        .unwrap();
    tidemark_tests::wait_jetstream_ready(&client).await.unwrap();
    let store = create_bucket(&client, "busy", 1, 1).await;
    put_keys(&store, KEYS, 256).await;
    let bucket = KvBucket::new(client.clone(), "busy").unwrap();
    let record = Record::default();
    let sink = BlockingCommits {
        inner: record.sink(),
        hold: Duration::from_millis(150),
        commits: 8,
    };
    let handle = FollowerTask::new(config("busy"), RawBytes, bucket.clone(), bucket, sink).spawn();
    let mut status = handle.watch_status();
    let ready = tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.ready))
        .await
        .map(|r| r.map(|s| s.watermark));
    let Ok(Ok(ready_at)) = ready else {
        panic!("not ready in 60 s: {:?}", handle.status());
    };
    assert_eq!(ready_at, u64::from(KEYS));
    let stopped = handle.stop_within(Duration::from_secs(30)).await.unwrap();
    println!(
        "feed reopens while a worker was held: {}",
        stopped.counters.reopens
    );
    assert_eq!(record.len(), KEYS as usize);
    record.assert_applied_once();
}
