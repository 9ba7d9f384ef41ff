//! An events stream deleted and made again under its name, against a real nats-server:
//! its sequences start at 1 again and its cursors' consumers are gone. Saves must be
//! stored on the new stream, and a feed opened after a position of the old one must
//! deliver the new stream's first events.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::Event;
use tidemark::{Cursors, Feed, FeedItem, FeedStream, Publish};
use tidemark_nats::NatsEvents;

use common::*;

const STREAM: &str = "EV";
const PREFIX: &str = "ev";

/// A handle on a fresh events stream holding `n` events.
async fn events_with(client: &async_nats::Client, n: u64) -> NatsEvents {
    let events = NatsEvents::new(client.clone(), STREAM, PREFIX).unwrap();
    events.ensure(1).await.unwrap();
    publish(&events, n).await;
    events
}

async fn publish(events: &NatsEvents, n: u64) {
    for seq in 1..=n {
        let key = format!("k{seq}");
        let event = Event::of_write(seq, &key, Some(b"v")).encode().unwrap();
        events.publish(&key, event).await.unwrap();
    }
}

/// Deletes the stream and makes it again with `n` events (positions 1..=n again).
async fn remake(client: &async_nats::Client, events: &NatsEvents, n: u64) {
    async_nats::jetstream::new(client.clone())
        .delete_stream(STREAM)
        .await
        .unwrap();
    events.ensure(1).await.unwrap();
    publish(events, n).await;
}

/// The positions of the next `n` items of a feed opened on `events` after `after`.
async fn first_positions(events: &NatsEvents, after: Option<u64>, n: usize) -> Vec<u64> {
    let mut opened = events.open(1, after).await.unwrap();
    let mut positions = Vec::new();
    while positions.len() < n {
        let item = tokio::time::timeout(Duration::from_secs(5), opened.stream.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "opened after {after:?}: nothing delivered within 5 s after {positions:?} \
                     (the new stream's events were skipped)"
                )
            })
            .expect("the feed ended")
            .unwrap();
        match item {
            FeedItem::Entry(e) => positions.push(e.position),
            FeedItem::Undecodable { position, .. } => positions.push(position),
            FeedItem::Head(_) => {}
        }
    }
    positions
}

/// A handle saved a cursor on the old stream (its floor remembered at 8); on the stream
/// made again, a save below that floor was answered "done at 8" and never stored: the
/// cursor's consumer went with the old stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_save_on_a_stream_made_again_is_stored() {
    let server = server().await;
    let client = client(&server).await;
    let events = events_with(&client, 10).await;
    assert_eq!(events.save("c", 8).await.unwrap(), 8);

    remake(&client, &events, 5).await;
    assert_eq!(
        events.save("c", 3).await.unwrap(),
        3,
        "a save on the new stream is answered with what was stored on it, not the old floor"
    );
    let fresh = NatsEvents::new(client.clone(), STREAM, PREFIX).unwrap();
    assert_eq!(
        fresh.load("c").await.unwrap(),
        Some(3),
        "the save reported done is stored on the server"
    );
    assert_eq!(events.save("c", 4).await.unwrap(), 4, "and saves go on");
    assert_eq!(fresh.load("c").await.unwrap(), Some(4));
}

/// The follower hands back its position on the old stream (8) at every open; the new
/// stream holds 5 events, so "after 8" is past its end and delivered nothing until its
/// ninth event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_past_the_end_of_a_stream_made_again_delivers_its_first_events() {
    let server = server().await;
    let client = client(&server).await;
    let events = events_with(&client, 10).await;
    assert_eq!(first_positions(&events, Some(7), 1).await, [8]);

    remake(&client, &events, 5).await;
    assert_eq!(
        first_positions(&events, Some(8), 3).await,
        [1, 2, 3],
        "the handle that read the old stream starts the new one at its first event"
    );
    // A process started after the stream was made again, with a position persisted from
    // the old one: no identity to compare, but no message of this stream had position 8.
    let fresh = NatsEvents::new(client.clone(), STREAM, PREFIX).unwrap();
    assert_eq!(
        first_positions(&fresh, Some(8), 3).await,
        [1, 2, 3],
        "a fresh handle starts at the first event when the position is past the end"
    );
}

/// The new stream already passed the old position when the handle opens it: only the
/// stream's identity tells. And the follower keeps handing back 8 at later opens (its
/// checkpoint only grows): the handle trusts it only up to what it delivered itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_made_again_past_the_old_position_is_read_from_its_first_event() {
    let server = server().await;
    let client = client(&server).await;
    let events = events_with(&client, 10).await;
    assert_eq!(first_positions(&events, Some(7), 1).await, [8]);

    remake(&client, &events, 12).await;
    assert_eq!(
        first_positions(&events, Some(8), 3).await,
        [1, 2, 3],
        "events 1..=8 of the new stream are not skipped"
    );
    assert_eq!(
        first_positions(&events, Some(8), 2).await,
        [4, 5],
        "a reopen after 3 were delivered resumes at 4, not after the old position"
    );
    assert_eq!(
        first_positions(&events, Some(8), 6).await,
        [6, 7, 8, 9, 10, 11],
        "and again after 5"
    );
    assert_eq!(
        first_positions(&events, Some(10), 1).await,
        [11],
        "a position delivered on the new stream is trusted"
    );
}

/// A follower with a durable cursor runs on while the stream is made again: it must
/// apply the new stream's announcements (it hands back its old position at every reopen)
/// and, once it is past the old position, store its cursor on the new stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_with_a_cursor_reads_a_stream_made_again() {
    use tidemark::tidemark_core::RawBytes;
    use tidemark::{FollowerTask, Source};
    use tidemark_nats::KvBucket;

    const WAIT: Duration = Duration::from_secs(30);
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "registry", 1, 1).await;
    let bucket = KvBucket::new(client.clone(), "registry").unwrap();
    let events = NatsEvents::new(client.clone(), STREAM, PREFIX).unwrap();
    events.ensure(1).await.unwrap();
    // A writer: the bucket is the source, each write announced on the stream.
    let write = |key: String| {
        let (bucket, events) = (bucket.clone(), events.clone());
        async move {
            let seq = bucket.put(&key, b"v".to_vec()).await.unwrap();
            let event = Event::of_write(seq, &key, Some(b"v")).encode().unwrap();
            events.publish(&key, event).await.unwrap();
        }
    };
    for i in 0..10 {
        write(format!("a{i}")).await;
    }
    let record = Record::default();
    let handle = FollowerTask::new(
        config("remade"),
        RawBytes,
        bucket.clone(),
        events.clone(),
        record.sink(),
    )
    .with_cursor(events.clone(), "mirror")
    .spawn();
    let fresh = NatsEvents::new(client.clone(), STREAM, PREFIX).unwrap();
    wait_until(WAIT, "the follower checkpoints the old stream", || {
        futures::executor::block_on(fresh.load("mirror"))
            .ok()
            .flatten()
            == Some(10)
    })
    .await;

    async_nats::jetstream::new(client.clone())
        .delete_stream(STREAM)
        .await
        .unwrap();
    events.ensure(1).await.unwrap();
    for i in 0..5 {
        write(format!("b{i}")).await;
    }
    wait_until(
        WAIT,
        "the new stream's announcements reach the follower",
        || (0..5).all(|i| record.value(&format!("b{i}")).is_some()),
    )
    .await;
    for i in 5..12 {
        write(format!("b{i}")).await;
    }
    wait_until(
        WAIT,
        "the cursor is stored on the new stream once past the old position",
        || {
            futures::executor::block_on(fresh.load("mirror"))
                .ok()
                .flatten()
                == Some(12)
        },
    )
    .await;
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
}
