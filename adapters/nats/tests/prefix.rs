//! A bucket view over a key prefix, against a real nats-server: the server filters, and a
//! follower holds exactly the prefix's keys through writes, deletes and a resync.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use futures::StreamExt as _;
use tidemark::conformance as c;
use tidemark::tidemark_core::Utf8;
use tidemark::{Error, Source, spawn_cache};
use tidemark_nats::KvBucket;

use common::*;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_view_passes_the_prefix_conformance_bodies() {
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "view", 1, 1).await;
    let whole = KvBucket::new(client.clone(), "view").unwrap();
    c::prefix_view_carries_only_its_keys(&whole, &whole.with_prefix("orders").unwrap()).await;

    let store = create_bucket(&client, "follow", 1, 1).await;
    let whole = KvBucket::new(client.clone(), "follow").unwrap();
    let view = whole.with_prefix("orders.").unwrap();
    // Compaction on NATS: the stream's messages below `seq` purged (the removal of
    // orders.3 among them), so a follower whose watermark + 1 is below it must resync.
    let purge = |seq: u64| async move {
        store.stream.purge().sequence(seq).await.unwrap();
    };
    c::prefix_follower_holds_exactly_its_keys(whole, view, purge).await;
}

/// Only the prefix's messages cross the wire: the view's consumers are filtered on the
/// server, not in the client (which would read the whole bucket to keep a tenth of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_reads_only_its_prefix_from_the_server() {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "wide", 1, 1).await;
    let mut acks = futures::stream::iter(0..1000u32)
        .map(|i| {
            let store = store.clone();
            async move {
                let key = if i % 100 == 0 {
                    format!("orders.{i}")
                } else {
                    format!("users.{i}")
                };
                store.put(key, format!("v{i}").into()).await
            }
        })
        .buffer_unordered(128);
    while let Some(ack) = acks.next().await {
        ack.unwrap();
    }
    let view = KvBucket::new(client.clone(), "wide")
        .unwrap()
        .with_prefix("orders")
        .unwrap();
    let config = tidemark::FollowerConfig::builder("orders")
        .seed(3)
        .build()
        .unwrap();
    let (cache, handle) = spawn_cache(config, Utf8, view.clone(), view.clone());
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cache.len(), 10, "the prefix's ten keys");
    assert!(cache.keys().iter().all(|k| k.starts_with("orders.")));
    assert_eq!(
        view.entries_read(),
        10,
        "the initial sync read the prefix's 10 messages, not the bucket's 1000"
    );

    let writer = KvBucket::new(client.clone(), "wide").unwrap();
    writer.put("users.x", b"1".to_vec()).await.unwrap();
    writer.remove("users.1").await.unwrap();
    let seq = writer.put("orders.x", b"2".to_vec()).await.unwrap();
    wait_until(WAIT, "the prefix's live write", || {
        cache.get_versioned("orders.x").map(|(s, _)| s) == Some(seq)
    })
    .await;
    assert_eq!(
        view.entries_read(),
        11,
        "live writes of other keys are not sent to the view's consumer"
    );
    assert_eq!(cache.len(), 11);
    let status = handle.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(status.counters.outside, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_the_server_cannot_filter_on_are_typed_errors() {
    let server = server().await;
    let client = client(&server).await;
    let bucket = KvBucket::new(client, "any").unwrap();
    for bad in [
        "",
        ".",
        "orders..eu",
        ".orders",
        "orders.*",
        "orders.>",
        ">",
        "a b",
    ] {
        assert!(
            matches!(bucket.with_prefix(bad), Err(Error::InvalidKey { .. })),
            "{bad:?} must be refused before any consumer is made"
        );
    }
    let view = bucket.with_prefix("orders.eu").unwrap();
    assert_eq!(
        view.key_prefix().map(|p| p.as_str()),
        Some("orders.eu."),
        "whole tokens: orders.eu.1, not orders.europe"
    );
}
