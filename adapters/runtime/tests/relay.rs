//! The outbox relay driver over the memory adapter: the same legs as the registry, a
//! jittered, seeded backoff on tokio's clock, and a task that relays until stopped.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::until;
use tidemark::tidemark_core::Legs;
use tidemark::{Announcer, AnnouncingRegistry, Outbox, Publish, Relay, Source};
use tidemark_memory::{Memory, MemoryEvents, MemoryOutbox, MemoryQueue, MemoryWake, Port};
use tokio::time::Instant;

type MemoryRelay<P> = Relay<MemoryOutbox, P, MemoryWake, MemoryQueue>;

fn relay(m: &Memory, owner: &str) -> MemoryRelay<MemoryEvents> {
    relay_with(m, m.events.clone(), owner)
}

fn relay_with<P: Publish>(m: &Memory, events: P, owner: &str) -> MemoryRelay<P> {
    Relay::new(
        m.outbox.clone(),
        Announcer::new(events, m.wake.clone(), m.queue.clone(), "changes"),
        owner,
    )
}

/// The seqs on the events stream, in stream order.
fn published_seqs(m: &Memory) -> Vec<u64> {
    m.events
        .records()
        .iter()
        .map(|r| {
            tidemark::tidemark_core::Event::decode(&r.payload)
                .unwrap()
                .seq()
        })
        .collect()
}

fn fail_legs(m: &Memory, mask: u8) {
    m.faults.set_failing(Port::Publish, mask & 1 != 0);
    m.faults.set_failing(Port::Notify, mask & 2 != 0);
    m.faults.set_failing(Port::Queue, mask & 4 != 0);
}

#[tokio::test(start_paused = true)]
async fn the_registry_and_the_relay_report_the_same_legs_for_the_same_faults() {
    for mask in 0u8..8 {
        let direct = Memory::new();
        fail_legs(&direct, mask);
        let written = AnnouncingRegistry::new(
            direct.source.clone(),
            direct.events.clone(),
            direct.wake.clone(),
            direct.queue.clone(),
            "changes",
        )
        .put("k", b"v".to_vec())
        .await
        .unwrap();

        let outboxed = Memory::new();
        outboxed
            .announced_source(Legs::default())
            .put("k", b"v".to_vec())
            .await
            .unwrap();
        fail_legs(&outboxed, mask);
        let report = relay(&outboxed, "relay").drain().await.unwrap();
        let (row, done) = outboxed.outbox.rows().remove(0);
        assert_eq!(
            row.landed, written.report,
            "failing legs {mask:03b}: the relay must land exactly the legs the registry \
             lands, under the same faults (one rule, one function)"
        );
        assert_eq!(done, written.report.is_complete(&row.plan));
        assert_eq!(
            report.failures,
            u64::from(mask.count_ones()),
            "failing legs {mask:03b}: each failing leg, and only it, is a failure"
        );
    }
}

/// The events stream, noting when each publish was tried.
#[derive(Clone, Debug)]
struct Attempts {
    inner: MemoryEvents,
    at: Arc<Mutex<Vec<Instant>>>,
}

impl Publish for Attempts {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        self.at.lock().unwrap().push(Instant::now());
        self.inner.publish(key, payload).await
    }
}

/// Runs a relay named `owner` for a minute against a publish leg that keeps failing, then
/// heals it; returns the gaps between publish attempts while it failed.
async fn gaps_while_publish_fails(owner: &str) -> Vec<Duration> {
    let m = Memory::new();
    let at = Arc::new(Mutex::new(Vec::new()));
    let events = Attempts {
        inner: m.events.clone(),
        at: Arc::clone(&at),
    };
    m.faults.set_failing(Port::Publish, true);
    m.announced_source(Legs::default())
        .put("k", b"v".to_vec())
        .await
        .unwrap();
    let handle = relay_with(&m, events, owner).spawn();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let attempts: Vec<Instant> = at.lock().unwrap().clone();
    assert_eq!(
        m.queue.jobs().len(),
        1,
        "the enqueue leg landed once and is not retried with the failing publish"
    );
    assert!(m.outbox.rows()[0].0.landed.notified);

    m.faults.heal();
    until("the healed publish lands", || m.events.records().len() == 1).await;
    until("the row is done", || m.outbox.rows()[0].1).await;
    let report = handle.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        (
            report.published,
            report.notified,
            report.enqueued,
            report.done
        ),
        (1, 1, 1, 1)
    );
    assert!(report.failures >= attempts.len() as u64);
    attempts.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(start_paused = true)]
async fn a_relay_backs_off_with_seeded_jitter_while_a_leg_keeps_failing() {
    let gaps = gaps_while_publish_fails("relay-a").await;
    assert!(
        (8..=40).contains(&gaps.len()),
        "a minute of a failing leg must be retried, without a tight loop: {} attempts",
        gaps.len() + 1
    );
    let cap = Duration::from_secs(5);
    assert!(
        gaps.iter().all(|g| *g <= cap),
        "delays are capped: {gaps:?}"
    );
    assert!(
        gaps[0] < Duration::from_millis(100) && *gaps.last().unwrap() > cap / 2,
        "delays grow from the first to the cap: {gaps:?}"
    );
    assert!(
        gaps.iter().rev().take(5).collect::<BTreeSet<_>>().len() > 1,
        "delays at the cap are jittered, not all equal: {gaps:?}"
    );
    assert_eq!(
        gaps_while_publish_fails("relay-a").await,
        gaps,
        "the same owner (seed) replays the same delays"
    );
    assert_ne!(
        gaps_while_publish_fails("relay-b").await,
        gaps,
        "another owner's relay does not back off in step"
    );
}

#[tokio::test(start_paused = true)]
async fn a_spawned_relay_relays_every_write_until_stopped() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for key in ["a", "b", "c"] {
        src.put(key, b"v".to_vec()).await.unwrap();
    }
    let handle = relay(&m, "relay").spawn();
    until("the rows written before it started", || {
        m.events.records().len() == 3
    })
    .await;
    src.put("d", b"v".to_vec()).await.unwrap();
    src.remove("a").await.unwrap();
    until("the rows written while it waits", || {
        m.events.records().len() == 5
    })
    .await;
    assert!(!handle.is_finished());
    let report = handle.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        (
            report.published,
            report.notified,
            report.enqueued,
            report.done
        ),
        (5, 5, 5, 5)
    );
    assert_eq!((report.failures, report.lost), (0, 0));
    assert_eq!(m.outbox.pending().await.unwrap(), 0);
}

/// The events stream, where each publish takes a second.
#[derive(Clone, Debug)]
struct Slow(MemoryEvents);

impl Publish for Slow {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.0.publish(key, payload).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_slower_than_the_lease_is_not_taken_over_midway() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..6 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    // Six one-second publishes under a three-second lease: one relay alone would still be
    // publishing when its first claim ran out, and the other would take the rest over.
    let lease = Duration::from_secs(3);
    let a = relay_with(&m, Slow(m.events.clone()), "a")
        .with_lease(lease)
        .spawn();
    let b = relay_with(&m, Slow(m.events.clone()), "b")
        .with_lease(lease)
        .spawn();
    until("every row is done", || {
        m.outbox.rows().iter().all(|(_, done)| *done)
    })
    .await;
    let ra = a.stop_within(Duration::from_secs(5)).await.unwrap();
    let rb = b.stop_within(Duration::from_secs(5)).await.unwrap();
    let mut seqs = published_seqs(&m);
    seqs.sort_unstable();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 4, 5, 6],
        "a relay releases the rows it cannot reach within its lease instead of letting \
         another relay take them while it is still working: each row is published once"
    );
    assert_eq!((ra.lost, rb.lost), (0, 0), "no claim was taken over");
    assert_eq!(ra.published + rb.published, 6);
}

/// The events stream of a relay that dies in the middle of a batch: its publishes land,
/// then it never returns (the process is gone before it completes the rows).
#[derive(Clone, Debug)]
struct DiesAfterPublishing {
    inner: MemoryEvents,
    died: Arc<tokio::sync::Notify>,
}

impl Publish for DiesAfterPublishing {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        self.inner.publish(key, payload).await
    }

    async fn publish_batch(&self, items: Vec<(String, Vec<u8>)>) -> Vec<tidemark::Result<u64>> {
        let _landed = self.inner.publish_batch(items).await;
        self.died.notify_one();
        std::future::pending().await
    }
}

#[tokio::test(start_paused = true)]
async fn a_relay_that_dies_mid_batch_has_its_rows_relayed_again_after_its_lease() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..10 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let lease = Duration::from_secs(2);
    let died = Arc::new(tokio::sync::Notify::new());
    let events = DiesAfterPublishing {
        inner: m.events.clone(),
        died: Arc::clone(&died),
    };
    let dying = relay_with(&m, events, "dying").with_lease(lease).spawn();
    died.notified().await;
    let died_at = Instant::now();
    let published_before = m.events.records().len();
    assert!(
        published_before > 0,
        "the dying relay's batch landed on the stream"
    );
    dying.stop_within(Duration::from_millis(1)).await.ok();

    let other = relay(&m, "other").with_lease(lease).spawn();
    until("every row is done", || {
        m.outbox.rows().iter().all(|(_, done)| *done)
    })
    .await;
    assert!(
        died_at.elapsed() >= lease - Duration::from_millis(10),
        "the rows were held until the dead relay's lease ran out"
    );
    let report = other.stop_within(Duration::from_secs(5)).await.unwrap();
    let seqs = published_seqs(&m);
    let distinct: BTreeSet<u64> = seqs.iter().copied().collect();
    assert_eq!(
        distinct,
        (1..=10).collect(),
        "no row is lost: every write is on the stream"
    );
    assert_eq!(
        seqs.len(),
        10 + published_before,
        "the rows the dead relay published but never completed go out again (at least \
         once), and only those"
    );
    assert_eq!(report.done, 10, "the survivor finished every row");
    assert_eq!(report.lost, 0);
}

/// An events stream whose first publish batch lands, then makes the next `fails` outbox
/// calls fail: the relay's `complete` of a batch whose legs all landed (a SQLite busy
/// past its timeout, say).
#[derive(Clone, Debug)]
struct ThenOutboxFails {
    inner: MemoryEvents,
    faults: tidemark_memory::Faults,
    fails: Arc<Mutex<Option<u32>>>,
}

impl ThenOutboxFails {
    fn new(m: &Memory, fails: u32) -> Self {
        ThenOutboxFails {
            inner: m.events.clone(),
            faults: m.faults.clone(),
            fails: Arc::new(Mutex::new(Some(fails))),
        }
    }
}

impl Publish for ThenOutboxFails {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        self.inner.publish(key, payload).await
    }

    async fn publish_batch(&self, items: Vec<(String, Vec<u8>)>) -> Vec<tidemark::Result<u64>> {
        let landed = self.inner.publish_batch(items).await;
        if let Some(n) = self.fails.lock().unwrap().take() {
            self.faults.fail_next(Port::Outbox, n);
        }
        landed
    }
}

#[tokio::test(start_paused = true)]
async fn a_complete_that_fails_once_does_not_publish_its_rows_again() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..3 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let relay = relay_with(&m, ThenOutboxFails::new(&m, 1), "only-relay").with_batch(3);
    let first = relay.drain().await;
    let again = relay.drain().await;
    assert_eq!(
        published_seqs(&m),
        vec![1, 2, 3],
        "one relay, no crash, no lease expiry: a complete that failed once is tried again \
         with what landed, so each row is published once (first pass {first:?}, second \
         {again:?})"
    );
    let first = first.unwrap();
    assert_eq!(first.done, 3, "the first pass finished every row");
    assert_eq!(first.failures, 1, "the failed complete is counted");
    assert_eq!(relay.pending().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_relay_retries_a_failing_complete_until_its_lease_is_gone() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..3 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let lease = Duration::from_secs(4);
    let relay = relay_with(&m, ThenOutboxFails::new(&m, u32::MAX), "only-relay")
        .with_batch(3)
        .with_lease(lease);
    let started = Instant::now();
    let pass = relay.drain().await;
    let took = started.elapsed();
    assert!(
        pass.is_err(),
        "an outbox that never answers ends the pass with its error: {pass:?}"
    );
    assert_eq!(
        took, lease,
        "the complete is retried while the lease lasts (the relay would take its own rows \
         back at once and run their legs again), and given up when the lease is gone, \
         when another relay may take them over"
    );
}
