//! A bucket's `max_value_size` changed by an operator after the handle looked the bucket
//! up, against a real nats-server: the handle must write by the limit the bucket has now,
//! not the one it read first.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use tidemark::{Error, Source};
use tidemark_nats::KvBucket;

use common::*;

/// Creates bucket `name` with values of at most `max` bytes.
async fn bucket_with_limit(client: &async_nats::Client, name: &str, max: i32) -> KvBucket {
    jetstream::new(client.clone())
        .create_key_value(kv::Config {
            bucket: name.to_owned(),
            max_value_size: max,
            ..Default::default()
        })
        .await
        .unwrap();
    KvBucket::new(client.clone(), name).unwrap()
}

/// What an operator does: sets the bucket's stream's `max_msg_size` through the
/// JetStream API (`nats kv edit --max-value-size`, or a stream update).
async fn set_max_value_size(client: &async_nats::Client, bucket: &str, max: i32) {
    let js = jetstream::new(client.clone());
    let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_message_size = max;
    js.update_stream(config).await.unwrap();
}

/// Lowered from 4096 to 256 after the handle's first write: a 1000-byte value is the
/// caller's error to act on ([`Error::ValueTooLarge`] with the new limit), not a server
/// failure that looks like an outage and is retried as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_max_value_size_refuses_a_larger_value_as_too_large() {
    let server = server().await;
    let client = client(&server).await;
    let bucket = bucket_with_limit(&client, "lowered", 4096).await;
    let first = bucket.put("a", vec![b'x'; 1000]).await.unwrap();

    set_max_value_size(&client, "lowered", 256).await;
    match bucket.put("b", vec![b'x'; 1000]).await {
        Err(Error::ValueTooLarge {
            len: 1000,
            max: 256,
        }) => {}
        other => panic!(
            "a put above the lowered limit must be ValueTooLarge {{ len: 1000, max: 256 }}, got {other:?}"
        ),
    }
    match bucket.update("a", vec![b'x'; 1000], first).await {
        Err(Error::ValueTooLarge {
            len: 1000,
            max: 256,
        }) => {}
        other => panic!(
            "an update above the lowered limit must be ValueTooLarge {{ len: 1000, max: 256 }}, got {other:?}"
        ),
    }
    bucket
        .put("c", vec![b'x'; 200])
        .await
        .expect("a value within the lowered limit is written");
}

/// Raised from 256 to 4096 after the handle's first write: a 1000-byte value the bucket
/// now takes is written (within a few seconds: the handle may refuse on a limit it read a
/// moment ago), not refused for the life of the handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_max_value_size_takes_a_larger_value() {
    let server = server().await;
    let client = client(&server).await;
    let bucket = bucket_with_limit(&client, "raised", 256).await;
    bucket.put("a", vec![b'x'; 200]).await.unwrap();
    assert!(
        matches!(
            bucket.put("b", vec![b'x'; 1000]).await,
            Err(Error::ValueTooLarge {
                len: 1000,
                max: 256
            })
        ),
        "above the limit before the raise"
    );

    set_max_value_size(&client, "raised", 4096).await;
    let started = Instant::now();
    loop {
        match bucket.put("b", vec![b'x'; 1000]).await {
            Ok(_) => break,
            Err(Error::ValueTooLarge { .. }) if started.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "a value within the raised limit (4096) must be written within 5 s; {:?} after the raise: {e}",
                started.elapsed()
            ),
        }
    }
}
