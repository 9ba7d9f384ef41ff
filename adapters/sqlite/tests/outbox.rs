//! The outbox: an announcement commits with its write, and a relay drains it into the
//! events stream, the wake channel and the queue, at least once, leg by leg; relays on
//! one file (in one process or many) publish each row once.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{Event, Job, Legs};
use tidemark::{Cursors, Outbox, Publish, Queue, Received, Source, Wake, WakeListener};
use tidemark_memory::{Memory, Port};
use tidemark_sqlite::{SqliteDb, SqliteEvents};
use tokio::sync::Barrier;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announced_write_commits_its_outbox_row_and_the_relay_delivers_every_leg() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    let plain = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    plain.put("quiet", b"x".to_vec()).await.unwrap();
    src.remove("a").await.unwrap();
    let relay = db.relay(db.events(), db.wake(), db.queue(), "reg");
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
    let relay = db.relay(
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
    assert_eq!(mem.queue.jobs().len(), 3, "nothing was enqueued twice");
}

fn seqs_of(records: &[tidemark_memory::Record]) -> Vec<u64> {
    records
        .iter()
        .map(|r| Event::decode(&r.payload).unwrap().seq())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_publish_does_not_stop_the_batch_and_only_it_is_retried() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    for key in ["a", "b", "c"] {
        src.put(key, b"v".to_vec()).await.unwrap();
    }
    let mem = Memory::new();
    let relay = db.relay(
        mem.events.clone(),
        mem.wake.clone(),
        mem.queue.clone(),
        "reg",
    );
    let mut listener = mem.wake.listen("reg").await.unwrap();
    mem.faults.fail_next(Port::Publish, 1);
    let first = relay.drain().await.unwrap();
    assert_eq!(
        (
            first.published,
            first.notified,
            first.enqueued,
            first.failures,
            first.done
        ),
        (2, 3, 3, 1, 2),
        "a failing publish of the first row must not stop its notify and enqueue, nor any \
         leg of the rows after it"
    );
    assert_eq!(seqs_of(&mem.events.records()), vec![2, 3]);
    for _ in 0..3 {
        assert!(matches!(
            listener.recv_timeout(Duration::from_secs(5)).await.unwrap(),
            Received::Wake(_)
        ));
    }
    assert_eq!(relay.pending().await.unwrap(), 1, "the failed row waits");

    let second = relay.drain().await.unwrap();
    assert_eq!(
        (
            second.published,
            second.notified,
            second.enqueued,
            second.failures,
            second.done
        ),
        (1, 0, 0, 0, 1),
        "the retry redoes only the failed publish"
    );
    assert_eq!(
        seqs_of(&mem.events.records()),
        vec![2, 3, 1],
        "every row is published once; the retried one after the rest"
    );
    assert_eq!(mem.queue.jobs().len(), 3, "nothing was enqueued twice");
    assert_eq!(
        listener
            .recv_timeout(Duration::from_millis(100))
            .await
            .unwrap(),
        Received::TimedOut,
        "nothing was notified twice"
    );
    assert_eq!(relay.pending().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_drains_writes_made_by_another_handle() {
    let (_dir, path, db) = common::fresh().await;
    let relay = db.relay(db.events(), db.wake(), db.queue(), "reg").spawn();
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
    let report = relay.stop_within(Duration::from_secs(10)).await.unwrap();
    assert_eq!((report.published, report.done), (1, 1));
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

/// The events stream of one handle, whose publish waits (up to a bound) until another
/// relay is inside publish too: both relays have then read their rows before either
/// records anything, the worst case for claims.
#[derive(Clone, Debug)]
struct MeetInPublish {
    inner: SqliteEvents,
    barrier: Arc<Barrier>,
    met: Arc<AtomicU64>,
}

impl Publish for MeetInPublish {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        if tokio::time::timeout(Duration::from_secs(5), self.barrier.wait())
            .await
            .is_ok()
        {
            self.met.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.publish(key, payload).await
    }
}

/// Two "processes" (two handles on one file) relaying with one row per claim and a
/// barrier inside publish. Returns (rows, publishes that met the other relay).
async fn race_two_relays(path: &Path, db: &SqliteDb, owners: [&str; 2], rows: u64) -> u64 {
    let src = db.announced_source(Legs::default());
    for i in 0..rows {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let other = SqliteDb::open(path).await.unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let met = Arc::new(AtomicU64::new(0));
    let relay = |handle: &SqliteDb, owner: &str| {
        let events = MeetInPublish {
            inner: handle.events(),
            barrier: Arc::clone(&barrier),
            met: Arc::clone(&met),
        };
        tidemark::Relay::new(
            handle.outbox(),
            tidemark::Announcer::new(events, handle.wake(), handle.queue(), "reg"),
            owner,
        )
        .with_batch(1)
    };
    let (a, b) = (relay(db, owners[0]), relay(&other, owners[1]));
    let (ra, rb) = tokio::join!(a.drain(), b.drain());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.failures + rb.failures, 0);
    assert_eq!(db.outbox().pending().await.unwrap(), 0);
    met.load(Ordering::SeqCst)
}

/// (events, distinct seqs among them, jobs, distinct jobs) in the file.
fn published_and_enqueued(path: &Path) -> (i64, i64, i64, i64) {
    let conn = rusqlite::Connection::open(path).unwrap();
    let (events, seqs) = conn
        .query_row(
            "SELECT count(*), count(DISTINCT seq) FROM events",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    let (jobs, distinct) = conn
        .query_row("SELECT count(*), count(DISTINCT job) FROM jobs", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    (events, seqs, jobs, distinct)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_file_publish_and_enqueue_each_row_exactly_once() {
    let (_dir, path, db) = common::fresh().await;
    let met = race_two_relays(&path, &db, ["relay-a", "relay-b"], 8).await;
    assert_eq!(
        published_and_enqueued(&path),
        (8, 8, 8, 8),
        "each row is published once and enqueued once although both relays ran at once"
    );
    assert_eq!(
        met, 8,
        "every publish must happen while the other relay is inside publish too, or the \
         race proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_separate_claims_the_same_race_publishes_rows_twice() {
    // The control for the test above: relays under one owner name do not exclude each
    // other, so the barrier makes both read and publish the same row. If this stopped
    // publishing twice, the race above would no longer be testing the claims.
    let (_dir, path, db) = common::fresh().await;
    let met = race_two_relays(&path, &db, ["twin", "twin"], 4).await;
    assert!(met >= 2, "the relays met inside publish: {met}");
    let (events, seqs, jobs, _) = published_and_enqueued(&path);
    assert_eq!(seqs, 4, "every row still went out");
    assert!(
        events > 4,
        "without claims both relays publish the rows they both read: {events} events for 4 rows"
    );
    assert_eq!(
        jobs, 4,
        "both enqueue them too, but a key's second housekeeping job coalesces into its \
         pending first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_relays_rows_are_taken_over_when_its_lease_runs_out() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    for key in ["a", "b", "c"] {
        src.put(key, b"v".to_vec()).await.unwrap();
    }
    // A relay in this process claims every row and dies before running any leg.
    let lease = Duration::from_millis(800);
    let crashed = db.outbox().claim("crashed", 0, 100, lease).await.unwrap();
    let claimed_at = std::time::Instant::now();
    assert_eq!(crashed.rows.len(), 3);

    let other = SqliteDb::open(&path).await.unwrap();
    let relay = other.relay(other.events(), other.wake(), other.queue(), "reg");
    assert_eq!(
        relay.drain().await.unwrap().done,
        0,
        "a live claim keeps the rows from another relay"
    );
    let handle = relay.spawn();
    let events = other.events();
    // Only reads from here on: no commit wakes the relay, its lease timer must.
    common::eventually("the crashed relay's rows are published", || async {
        events.records(0, 10).await.unwrap().len() == 3
    })
    .await;
    assert!(
        claimed_at.elapsed() >= lease - Duration::from_millis(50),
        "rows were taken over before the lease ran out ({:?})",
        claimed_at.elapsed()
    );
    let report = handle.stop_within(Duration::from_secs(10)).await.unwrap();
    assert_eq!((report.published, report.enqueued, report.done), (3, 3, 3));
    let seqs: BTreeSet<u64> = events
        .records(0, 10)
        .await
        .unwrap()
        .iter()
        .map(|r| Event::decode(&r.payload).unwrap().seq())
        .collect();
    assert_eq!(seqs, BTreeSet::from([1, 2, 3]));
    assert_eq!(other.outbox().pending().await.unwrap(), 0);
}
