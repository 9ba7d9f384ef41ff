//! A feed whose consumer the server dropped without a word, against a real server: the
//! bucket deleted and made again while the reader's link was held (the campaign's seeds
//! 20113 and 20130), and a consumer deleted on its own. A push consumer that is gone sends
//! nothing, so only silence tells; the reader must look the consumer up after one silent
//! heartbeat interval and end the feed on the server's "no such consumer", not wait out
//! the three intervals of missed heartbeats (which end it "missed its heartbeats").
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::TryStreamExt as _;
use tidemark::{Feed as _, FeedItem, FeedStream};
use tidemark_nats::KvBucket;
use tidemark_tests::FaultProxy;

use common::*;

/// Long enough for either rule to end the feed on a loaded machine: the test tells them
/// apart by the error, never by the time.
const WAIT: Duration = Duration::from_secs(30);

/// Reads `feed` until its first entry.
async fn first_entry(feed: &mut impl FeedStream) {
    tokio::time::timeout(WAIT, async {
        loop {
            match feed.next().await {
                Some(Ok(FeedItem::Entry(_))) => return,
                Some(Ok(_)) => {}
                other => panic!("the feed failed before its first entry: {other:?}"),
            }
        }
    })
    .await
    .expect("the first entry arrives");
}

/// Reads `feed` on until it fails, and returns the error's text.
async fn failure(feed: &mut impl FeedStream) -> String {
    tokio::time::timeout(WAIT, async {
        loop {
            match feed.next().await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return e.to_string(),
                None => panic!("the feed ended without an error"),
            }
        }
    })
    .await
    .expect("a feed whose consumer is gone ends")
}

/// The one consumer on `stream` (the feed's).
async fn only_consumer(js: &jetstream::Context, stream: &str) -> String {
    let stream = js.get_stream(stream).await.unwrap();
    let names: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
    assert_eq!(names.len(), 1, "the feed's consumer alone: {names:?}");
    names.into_iter().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_remade_while_the_link_was_held_ends_the_feed_by_asking_for_its_consumer() {
    let server = server().await;
    let admin = client(&server).await;
    let js = jetstream::new(admin.clone());
    let store = create_bucket(&admin, "remade", 1, 1).await;
    store.put("k", Bytes::from_static(b"1")).await.unwrap();
    let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()));
    let proxy = FaultProxy::start(upstream, 20_113).await.unwrap();
    let reader = async_nats::connect(proxy.url()).await.unwrap();
    tidemark_tests::wait_jetstream_ready(&reader).await.unwrap();
    let bucket = KvBucket::new(reader, "remade").unwrap();
    let mut feed = bucket.open(1, None).await.unwrap().stream;
    first_entry(&mut feed).await;
    let consumer = only_consumer(&js, "KV_remade").await;
    // The reader's link forwards nothing (no reset, no reconnect) while the bucket is
    // deleted and made again: its consumer goes with the old stream.
    proxy.half_open();
    js.delete_key_value("remade").await.unwrap();
    let store = create_bucket(&admin, "remade", 1, 1).await;
    store.put("k", Bytes::from_static(b"2")).await.unwrap();
    proxy.heal();
    let failure = failure(&mut feed).await;
    assert!(
        failure.contains(&consumer) && failure.contains("is gone"),
        "the feed must end on the server's word that consumer {consumer} is gone, asked \
         after one silent heartbeat interval, not on three missed heartbeats: {failure}"
    );
    assert_eq!(
        proxy.accepted(),
        1,
        "the link was held, never reset: the reader did not reconnect"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deleted_on_its_own_ends_the_feed_by_asking_for_it() {
    let server = server().await;
    let admin = client(&server).await;
    let js = jetstream::new(admin.clone());
    let store = create_bucket(&admin, "dropped", 1, 1).await;
    store.put("k", Bytes::from_static(b"1")).await.unwrap();
    let bucket = KvBucket::new(client(&server).await, "dropped").unwrap();
    let mut feed = bucket.open(1, None).await.unwrap().stream;
    first_entry(&mut feed).await;
    let consumer = only_consumer(&js, "KV_dropped").await;
    js.delete_consumer_from_stream(&consumer, "KV_dropped")
        .await
        .unwrap();
    let failure = failure(&mut feed).await;
    assert!(
        failure.contains(&consumer) && failure.contains("is gone"),
        "the feed must end on the server's word that consumer {consumer} is gone, not on \
         three missed heartbeats: {failure}"
    );
}
