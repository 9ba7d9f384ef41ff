//! The outbox: an announcement commits with its write, and a relay drains it into the
//! events stream, the wake channel and the queue, at least once, leg by leg.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::{Event, Job, Legs};
use tidemark::{Cursors, Queue, Received, Source, Wake, WakeListener};
use tidemark_memory::{Memory, Port};
use tidemark_sqlite::{Relay, SqliteDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announced_write_commits_its_outbox_row_and_the_relay_delivers_every_leg() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    let plain = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    plain.put("quiet", b"x".to_vec()).await.unwrap();
    src.remove("a").await.unwrap();
    let relay = Relay::new(db.clone(), db.events(), db.wake(), db.queue(), "reg");
    assert_eq!(
        relay.pending().await.unwrap(),
        2,
        "an announcing source writes one row per mutation; a plain one writes none"
    );
    let mut listener = db.wake().listen("reg").await.unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(
        (
            report.done,
            report.published,
            report.notified,
            report.enqueued
        ),
        (2, 2, 2, 2)
    );
    assert_eq!(relay.pending().await.unwrap(), 0);
    let records = db.events().records(0, 10).await.unwrap();
    let events: Vec<Event> = records
        .iter()
        .map(|r| Event::decode(&r.payload).unwrap())
        .collect();
    assert_eq!(
        events,
        vec![
            Event::Put {
                seq: 1,
                key: "a".into(),
                value: b"1".to_vec()
            },
            Event::Removed {
                seq: 3,
                key: "a".into()
            },
        ],
        "the stream carries each announced mutation, in seq order"
    );
    assert_eq!(
        listener.recv_timeout(Duration::from_secs(5)).await.unwrap(),
        Received::Wake(records[0].payload.clone()),
        "wake payloads reach the channel in order"
    );
    assert_eq!(
        listener.recv_timeout(Duration::from_secs(5)).await.unwrap(),
        Received::Wake(records[1].payload.clone())
    );
    let job = db
        .queue()
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.job, Job::PackHousekeeping { key: "a".into() });
    assert_eq!(
        relay.drain().await.unwrap().done,
        0,
        "a second drain finds nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_leg_is_retried_alone_and_does_not_block_the_others() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    for key in ["a", "b", "c"] {
        src.put(key, b"v".to_vec()).await.unwrap();
    }
    let mem = Memory::new();
    let relay = Relay::new(
        db.clone(),
        mem.events.clone(),
        mem.wake.clone(),
        mem.queue.clone(),
        "reg",
    );
    mem.faults.set_failing(Port::Notify, true);
    let first = relay.drain().await.unwrap();
    assert_eq!(
        (first.published, first.enqueued, first.done),
        (3, 3, 0),
        "a failing wake leg must not stop publishing or enqueueing"
    );
    assert_eq!(
        relay.pending().await.unwrap(),
        3,
        "rows stay pending until every leg is done"
    );
    mem.faults.heal();
    let second = relay.drain().await.unwrap();
    assert_eq!(
        (
            second.published,
            second.notified,
            second.enqueued,
            second.done
        ),
        (0, 3, 0, 3),
        "the retry redoes only the failed leg"
    );
    assert_eq!(mem.events.records().len(), 3, "nothing was published twice");

    src.put("d", b"v".to_vec()).await.unwrap();
    src.put("e", b"v".to_vec()).await.unwrap();
    mem.faults.fail_next(Port::Publish, 1);
    let blocked = relay.drain().await.unwrap();
    assert_eq!(
        blocked.published, 0,
        "a failed publish stops the pass so the stream keeps seq order"
    );
    relay.drain().await.unwrap();
    let seqs: Vec<u64> = mem
        .events
        .records()
        .iter()
        .map(|r| Event::decode(&r.payload).unwrap().seq())
        .collect();
    assert_eq!(seqs, vec![1, 2, 3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_drains_writes_made_by_another_handle() {
    let (_dir, path, db) = common::fresh().await;
    let relay = Relay::new(db.clone(), db.events(), db.wake(), db.queue(), "reg");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run(async {
                let _ = rx.await;
            })
            .await
    });
    let other = SqliteDb::open(&path).await.unwrap();
    let seq = other
        .announced_source(Legs::default())
        .put("k", b"v".to_vec())
        .await
        .unwrap();
    let events = db.events();
    common::eventually("a commit by another connection wakes the relay", || async {
        !events.records(0, 10).await.unwrap().is_empty()
    })
    .await;
    assert_eq!(
        Event::decode(&events.records(0, 1).await.unwrap()[0].payload)
            .unwrap()
            .seq(),
        seq
    );
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(events.save("consumer", 1).await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_are_shared_by_every_handle_on_the_file() {
    let (_dir, path, db) = common::fresh().await;
    let other = SqliteDb::open(&path).await.unwrap();
    db.events().save("c", 10).await.unwrap();
    assert_eq!(
        other.events().save("c", 4).await.unwrap(),
        10,
        "saves stay monotone"
    );
    assert_eq!(other.events().load("c").await.unwrap(), Some(10));
    let _ = db.wake().notify("x", vec![]).await;
    assert_eq!(db.source().watermark().await.unwrap(), 0);
}
