//! A view of a whole bucket, against a real nats-server: its consumers take no subject
//! filter (nats-server then answers their pending count and first message from its totals,
//! not by walking every subject), a prefix view keeps its filter, and the read that
//! confirms the end of an initial sync finds the last message present also when the
//! stream's last seq names one that is gone.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use futures::StreamExt as _;
use tidemark::tidemark_core::Utf8;
use tidemark::{Feed, spawn_cache};
use tidemark_nats::KvBucket;

use common::*;

const WAIT: Duration = Duration::from_secs(30);

/// The subject filters of the consumers on `stream` now.
async fn filters(js: &async_nats::jetstream::Context, stream: &str) -> Vec<String> {
    let stream = js.get_stream(stream).await.unwrap();
    let mut infos = stream.consumers();
    let mut out = Vec::new();
    while let Some(info) = infos.next().await {
        out.push(info.unwrap().config.filter_subject);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_bucket_is_read_unfiltered_and_a_prefix_view_keeps_its_filter() {
    let server = server().await;
    let client = client(&server).await;
    let js = async_nats::jetstream::new(client.clone());
    let store = create_bucket(&client, "whole", 1, 1).await;
    put_keys(&store, 100, 16).await;
    store.put("orders.1", "o1".into()).await.unwrap();
    let bucket = KvBucket::new(client.clone(), "whole").unwrap();

    let opened = bucket.open(1, None).await.unwrap();
    assert_eq!(
        filters(&js, "KV_whole").await,
        vec![String::new()],
        "the bucket's stream holds only the bucket's subjects: a filter only costs the server a walk of every subject"
    );
    drop(opened);
    retry(WAIT, || async {
        if filters(&js, "KV_whole").await.is_empty() {
            Ok(())
        } else {
            Err("the dropped feed's consumer is still there")
        }
    })
    .await;

    let view = bucket.with_prefix("orders").unwrap();
    let _opened = view.open(1, None).await.unwrap();
    assert_eq!(
        filters(&js, "KV_whole").await,
        vec!["$KV.whole.orders.>".to_owned()],
        "a prefix view must keep its filter, or it would deliver every key"
    );
    let kept = create_bucket(&client, "kept", 5, 1).await;
    put_keys(&kept, 10, 4).await;
    let history = KvBucket::new(client.clone(), "kept").unwrap();
    let _history_feed = history.open(1, None).await.unwrap();
    assert_eq!(
        filters(&js, "KV_kept").await,
        vec!["$KV.kept.>".to_owned()],
        "a bucket with a history keeps its filter: unfiltered, the first sync would read every revision"
    );
    let (cache, handle) = spawn_cache(config("orders"), Utf8, view.clone(), view);
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cache.len(), 1, "the view holds only its keys");
    handle.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initial_sync_is_ready_when_the_stream_s_last_seq_names_a_message_gone() {
    let server = server().await;
    let client = client(&server).await;
    let js = async_nats::jetstream::new(client.clone());
    let store = create_bucket(&client, "gone", 1, 1).await;
    put_keys(&store, 100, 16).await;
    let bucket = KvBucket::new(client.clone(), "gone").unwrap();
    let erased = store.put("z", "z".into()).await.unwrap();
    assert_eq!(erased, 101);
    // The last message purged from the stream: its last seq stays 101, which no replay
    // delivers, so only a read of the last message present can end the sync.
    let stream = js.get_stream("KV_gone").await.unwrap();
    stream.purge().filter("$KV.gone.z").await.unwrap();
    let info = stream.get_info().await.unwrap();
    assert_eq!(
        info.state.last_sequence, erased,
        "the stream still names it"
    );
    assert_eq!(info.state.messages, 100);
    let last = erased - 1;

    let (cache, handle) = spawn_cache(config("gone"), Utf8, bucket.clone(), bucket);
    let ready_at = tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .expect("an initial sync must not wait for a message that is gone")
        .unwrap();
    assert_eq!(
        ready_at, last,
        "ready at the last message present, the one before the erased one"
    );
    assert_eq!(cache.len(), 100, "every key present is loaded before ready");

    // Written after it: the live feed carries on past the erased seq.
    let seq = store.put("late", "l".into()).await.unwrap();
    wait_until(WAIT, "the late key", || cache.get("late").is_some()).await;
    assert_eq!(seq, erased + 1);
    handle.stop();
}
