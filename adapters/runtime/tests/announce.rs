//! The announcing registry, reconcile, the wake runner and the durable stream consumer.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, registry, until};
use tidemark::tidemark_core::{AnnounceReport, Event, FollowerConfig, Job, Status, Utf8};
use tidemark::{
    Cursors, FollowerTask, JobState, Publish, Queue, Received, Source, Wake, WakeListener, cache,
    spawn_wake_cache,
};
use tidemark_memory::{Mangle, Memory, MemoryEvents, Port};

/// A durable consumer of `m`'s events stream (its cursor saved under `cursor`), applying
/// into `writer`.
fn durable(
    m: &Memory,
    config: FollowerConfig,
    cursor: &str,
    writer: tidemark::CacheWriter<String>,
) -> tidemark::FollowerHandle {
    FollowerTask::new(config, Utf8, m.source.clone(), m.events.clone(), writer)
        .with_cursor(m.events.clone(), cursor)
        .spawn()
}

fn wake_config(name: &str) -> FollowerConfig {
    FollowerConfig::builder(name).seed(2).build().unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_announced_write_lands_all_three_legs() {
    let m = Memory::new();
    let r = registry(&m);
    let mut listener = m.wake.listen("changes").await.unwrap();
    let w = r.put("pkg", b"v1".to_vec()).await.unwrap();
    assert!(
        w.report.published && w.report.notified,
        "publish and notify must land: {w:?}"
    );
    let id = w
        .report
        .enqueued
        .expect("a housekeeping job must be enqueued");
    let job = m.queue.get(id).await.unwrap().unwrap();
    assert_eq!(job.job, Job::PackHousekeeping { key: "pkg".into() });
    let records = m.events.records();
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].key, "pkg",
        "the events stream is keyed by entity key"
    );
    assert!(matches!(listener.recv().await.unwrap(), Received::Wake(p) if p == records[0].payload));
}

#[tokio::test(start_paused = true)]
async fn a_keys_writes_share_its_pending_housekeeping_job_and_each_report_names_it() {
    let m = Memory::new();
    let r = registry(&m);
    let first = r.put("pkg", b"v1".to_vec()).await.unwrap().report.enqueued;
    let second = r.put("pkg", b"v2".to_vec()).await.unwrap().report.enqueued;
    let removed = r.remove("pkg").await.unwrap().unwrap().report.enqueued;
    assert!(first.is_some());
    assert_eq!(
        (second, removed),
        (first, first),
        "later writes to a key whose job still waits are announced with that job's id"
    );
    let other = r.put("other", b"v".to_vec()).await.unwrap().report.enqueued;
    assert_ne!(other, first, "another key gets its own job");
    assert_eq!(
        m.queue.counts().await.unwrap().ready,
        2,
        "one pending job per key, not per write"
    );
}

#[tokio::test(start_paused = true)]
async fn an_event_that_cannot_be_serialised_yields_an_empty_report_and_runs_no_leg() {
    let m = Memory::new();
    let r = registry(&m);
    let mut listener = m.wake.listen("changes").await.unwrap();
    // No reader could decode these (seq 0, empty key): the writer refuses to send them.
    for event in [
        Event::Put {
            seq: 0,
            key: "k".into(),
            value: b"v".to_vec(),
        },
        Event::Removed {
            seq: 5,
            key: String::new(),
        },
    ] {
        let report = r.announce(&event).await;
        assert_eq!(report, AnnounceReport::default(), "{event:?}");
    }
    assert!(m.events.records().is_empty(), "nothing published");
    assert!(m.queue.jobs().is_empty(), "nothing enqueued");
    assert!(
        matches!(
            listener
                .recv_timeout(Duration::from_millis(100))
                .await
                .unwrap(),
            Received::TimedOut
        ),
        "nobody notified"
    );
}

#[tokio::test(start_paused = true)]
async fn each_leg_fails_soft_and_alone() {
    for port in [Port::Publish, Port::Notify, Port::Queue] {
        let m = Memory::new();
        let r = registry(&m);
        m.faults.set_failing(port, true);
        let w = r
            .put("k", b"v".to_vec())
            .await
            .expect("a failing leg must never fail the write");
        assert_eq!(w.seq, 1, "the write's durable seq is returned");
        let rep = w.report;
        assert_eq!(
            rep.published,
            port != Port::Publish,
            "{port:?}: publish independent"
        );
        assert_eq!(
            rep.notified,
            port != Port::Notify,
            "{port:?}: notify independent"
        );
        assert_eq!(
            rep.enqueued.is_some(),
            port != Port::Queue,
            "{port:?}: enqueue independent"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_write_with_a_lost_announcement_returns_its_seq_and_one_reconcile_closes_the_window() {
    let m = Memory::new();
    let r = registry(&m);
    let (writer, cache) = cache();
    let h = FollowerTask::new(
        wake_config("rec"),
        Utf8,
        m.source.clone(),
        tidemark::NoFeed,
        writer,
    )
    .with_wake(m.wake.listen("changes").await.unwrap())
    .spawn();
    cache.wait_ready().await.unwrap();
    r.put("a", b"1".to_vec()).await.unwrap();
    until("the announced write arrives", || cache.watermark() == 1).await;
    // Crash window: committed, every leg lost.
    m.faults.set_failing(Port::Publish, true);
    m.faults.set_failing(Port::Notify, true);
    m.faults.set_failing(Port::Queue, true);
    let w = r.put("b", b"2".to_vec()).await.unwrap();
    let gone = r.remove("a").await.unwrap().unwrap();
    assert_eq!(
        (w.seq, gone.seq),
        (2, 3),
        "the exact durable seqs come back"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        cache.watermark(),
        1,
        "nothing announced, so nothing arrived yet"
    );
    let caught = h.reconcile().await.unwrap();
    assert_eq!(
        (caught.applied, caught.removed, caught.watermark),
        (1, 1, 3),
        "one reconcile closes the window, removals included"
    );
    assert_eq!(cache.keys(), ["b"]);
    let again = h.reconcile().await.unwrap();
    assert_eq!(
        (again.applied, again.removed),
        (0, 0),
        "a second reconcile finds nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn the_wake_runner_refreshes_on_wakes_and_never_polls() {
    let m = Memory::new();
    let r = registry(&m);
    let (cache, h) = spawn_wake_cache(
        wake_config("wr"),
        Utf8,
        m.source.clone(),
        m.wake.listen("changes").await.unwrap(),
    );
    cache.wait_ready().await.unwrap();
    let before = h.status().counters.reconciles;
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(
        h.status().counters.reconciles,
        before,
        "a quiet hour must cause no refresh: the runner never polls"
    );
    // A commit nobody announced is not seen until a wake: proof that it does not poll.
    m.source.put("silent", b"x".to_vec()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(cache.get("silent").is_none());
    r.put("loud", b"y".to_vec()).await.unwrap();
    until("the wake triggers a catch-up", || cache.len() == 2).await;
    assert_eq!(
        h.status().counters.reconciles,
        before + 1,
        "one wake, one refresh"
    );
}

#[tokio::test(start_paused = true)]
async fn the_wake_runner_stops_within_a_grace_and_ends_cleanly_when_the_wake_source_closes() {
    let m = Memory::new();
    let (_c, h) = spawn_wake_cache(
        wake_config("a"),
        Utf8,
        m.source.clone(),
        m.wake.listen("ch").await.unwrap(),
    );
    let started = tokio::time::Instant::now();
    h.stop_within(Duration::from_millis(100))
        .await
        .expect("stop must be honoured within the grace");
    assert!(started.elapsed() < Duration::from_millis(100));
    let (_c, h) = spawn_wake_cache(
        wake_config("b"),
        Utf8,
        m.source.clone(),
        m.wake.listen("ch").await.unwrap(),
    );
    m.wake.close();
    let status = tokio::time::timeout(Duration::from_secs(1), h.join())
        .await
        .expect("ends when the wake source closes");
    assert!(
        status.is_ok(),
        "a closed wake source is a clean end, not a failure: {status:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fresh_consumer_replays_the_stream_and_checkpoints_every_entry() {
    let m = Memory::new();
    let r = registry(&m);
    for i in 0..5 {
        r.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    m.events
        .publish("junk", b"not json".to_vec())
        .await
        .unwrap();
    let (writer, cache) = cache();
    let h = durable(&m, config("c1"), "c1", writer);
    cache.wait_ready().await.unwrap();
    until("the poison record is checkpointed past", || {
        h.status().counters.invalid == 1
    })
    .await;
    assert_eq!(
        cache.len(),
        5,
        "a fresh name replays the stream from its head"
    );
    assert_eq!(
        m.events.load("c1").await.unwrap(),
        Some(6),
        "every entry, poison included, is checkpointed"
    );
}

/// Cursors that note the follower's published status at the moment of each save.
struct Observing {
    inner: MemoryEvents,
    status: tokio::sync::watch::Receiver<Status>,
    seen: Arc<Mutex<Vec<(u64, Status)>>>,
}

impl Cursors for Observing {
    async fn load(&self, name: &str) -> tidemark::Result<Option<u64>> {
        self.inner.load(name).await
    }

    async fn save(&self, name: &str, position: u64) -> tidemark::Result<u64> {
        let status = self.status.borrow().clone();
        self.seen.lock().unwrap().push((position, status));
        self.inner.save(name, position).await
    }
}

#[tokio::test(start_paused = true)]
async fn the_status_is_published_before_the_cursor_and_readiness_it_covers() {
    let m = Memory::new();
    let r = registry(&m);
    r.put("a", b"1".to_vec()).await.unwrap();
    r.put("b", b"2".to_vec()).await.unwrap();
    m.events
        .publish("junk", b"not json".to_vec())
        .await
        .unwrap();
    let (writer, cache) = cache();
    let task = FollowerTask::new(
        config("observed"),
        Utf8,
        m.source.clone(),
        m.events.clone(),
        writer,
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let observing = Observing {
        inner: m.events.clone(),
        status: task.status(),
        seen: seen.clone(),
    };
    let h = task.with_cursor(observing, "observed").spawn();
    cache.wait_ready().await.unwrap();
    assert!(
        h.status().ready,
        "whoever saw readiness sees a ready status"
    );
    until("every entry is checkpointed", || {
        seen.lock().unwrap().last().is_some_and(|(p, _)| *p == 3)
    })
    .await;
    let seen = seen.lock().unwrap().clone();
    let (_, at_junk) = seen.iter().find(|(p, _)| *p == 3).unwrap();
    assert_eq!(
        at_junk.counters.invalid, 1,
        "a reader of the saved cursor sees the skip counted: {seen:?}"
    );
    assert!(
        seen.windows(2)
            .all(|w| w[0].1.counters.applied <= w[1].1.counters.applied),
        "the status only moves forward: {seen:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_restarted_consumer_resumes_after_its_cursor() {
    let m = Memory::new();
    let r = registry(&m);
    r.put("a", b"1".to_vec()).await.unwrap();
    r.put("b", b"2".to_vec()).await.unwrap();
    let (w1, c1) = cache();
    let h = durable(&m, config("c"), "durable", w1);
    c1.wait_ready().await.unwrap();
    until("both are checkpointed", || c1.len() == 2).await;
    h.stop_within(Duration::from_secs(1)).await.unwrap();
    r.put("c", b"3".to_vec()).await.unwrap();
    let (w2, c2) = cache();
    let _h2 = durable(&m, config("c"), "durable", w2);
    c2.wait_ready().await.unwrap();
    // A fresh cache reads the source first (an announcements stream may have lost
    // entries), then the stream from after the saved cursor: only c comes again.
    until("the stream's last entry arrives", || {
        _h2.status().counters.stale >= 1
    })
    .await;
    assert_eq!(c2.keys(), ["a", "b", "c"], "a cache holds every key");
    assert_eq!(
        _h2.status().counters.stale,
        1,
        "a restart resumes after the saved cursor, not from the head"
    );
    assert_eq!(
        m.events.load("durable").await.unwrap(),
        Some(3),
        "the resumed consumer checkpoints on"
    );
}

/// A cursor save that failed is not dropped on the promise of a later checkpoint: the
/// stream may stay quiet (or the consumer catch up only through resyncs) for good, and a
/// restart would then replay what was observed. Simulator seed 3118: the save failed
/// while the source host was down and the consumer never saved a cursor. (Here the read
/// confirming the announcement commits too; reconnect.rs's
/// `a_cursor_save_that_failed_is_made_again_though_no_event_follows` has nothing commit.)
#[tokio::test(start_paused = true)]
async fn a_checkpoint_that_failed_to_save_is_saved_once_the_store_answers() {
    let m = Memory::new();
    let r = registry(&m);
    r.put("a", b"1".to_vec()).await.unwrap();
    let (writer, cache) = cache();
    let _h = durable(&m, config("retry"), "retry", writer);
    cache.wait_ready().await.unwrap();
    until("the first entry is checkpointed", || {
        poll_saved(&m.events, "retry") == Some(1)
    })
    .await;
    m.faults.set_failing(Port::Cursor, true);
    r.put("b", b"2".to_vec()).await.unwrap();
    until("the second entry is applied", || cache.len() == 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    m.faults.set_failing(Port::Cursor, false);
    assert_eq!(
        m.events.load("retry").await.unwrap(),
        Some(1),
        "the save of position 2 failed"
    );
    // Nothing more comes on the stream, and nothing commits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        m.events.load("retry").await.unwrap(),
        Some(2),
        "the observed position is saved again once the cursor store answers, with nothing \
         more observed"
    );
}

/// The cursor saved under `name`, read without waiting.
fn poll_saved(events: &MemoryEvents, name: &str) -> Option<u64> {
    futures::FutureExt::now_or_never(events.load(name))
        .and_then(Result::ok)
        .flatten()
}

#[tokio::test(start_paused = true)]
async fn duplicated_announcements_apply_once_and_the_next_reconcile_is_empty() {
    let m = Memory::new();
    let r = registry(&m);
    let (writer, cache) = cache();
    let h = durable(&m, config("c2"), "c2", writer);
    cache.wait_ready().await.unwrap();
    m.faults.mangle_next(Mangle::Duplicate);
    r.put("k", b"1".to_vec()).await.unwrap();
    m.faults.mangle_next(Mangle::Duplicate);
    r.put("k", b"2".to_vec()).await.unwrap();
    r.put("other", b"3".to_vec()).await.unwrap();
    until("the consumer converges through the feed", || {
        cache.get("other").as_deref().map(String::as_str) == Some("3")
    })
    .await;
    assert_eq!(cache.get("k").as_deref().map(String::as_str), Some("2"));
    let s = h.status().counters;
    assert_eq!(
        s.applied, 3,
        "a duplicate is applied once (idempotent consumer): {s:?}"
    );
    assert_eq!(s.stale, 2, "each duplicate is counted stale: {s:?}");
    let rec = h.reconcile().await.unwrap();
    assert_eq!(
        (rec.applied, rec.removed),
        (0, 0),
        "converged through the feed: reconcile is empty"
    );
    assert_eq!(
        m.events.load("c2").await.unwrap(),
        Some(5),
        "stale duplicates are still checkpointed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reordered_announcement_still_converges() {
    let m = Memory::new();
    let r = registry(&m);
    let (writer, cache) = cache();
    // Announcements can be reordered and lost: the events feed says it must be followed
    // as announcements, where per-key seqs, not the watermark, decide what is stale. The
    // config says nothing of it.
    let announcements = FollowerConfig::new("c3").unwrap();
    let h = durable(&m, announcements, "c3", writer);
    cache.wait_ready().await.unwrap();
    r.put("k", b"1".to_vec()).await.unwrap();
    m.faults.mangle_next(Mangle::Reorder);
    r.put("k", b"2".to_vec()).await.unwrap();
    r.put("other", b"3".to_vec()).await.unwrap();
    until("the consumer sees the last position", || {
        h.status().counters.stale + h.status().counters.applied >= 3
    })
    .await;
    h.reconcile().await.unwrap();
    assert_eq!(
        cache.get("k").as_deref().map(String::as_str),
        Some("2"),
        "a late older-seq announcement that is newer for its key must not be lost"
    );
}

#[tokio::test(start_paused = true)]
async fn jobs_from_announcements_round_trip_through_the_queue() {
    let m = Memory::new();
    let r = registry(&m);
    let id = r
        .put("k", b"v".to_vec())
        .await
        .unwrap()
        .report
        .enqueued
        .unwrap();
    let lease = m
        .queue
        .lease(Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.id, id);
    m.queue.ack(&lease).await.unwrap();
    assert_eq!(
        m.queue.get(id).await.unwrap().unwrap().state,
        JobState::Done,
        "acked jobs are done"
    );
}

#[tokio::test(start_paused = true)]
async fn a_wake_runner_given_a_feed_config_still_runs_as_a_wake_runner() {
    let m = Memory::new();
    let r = registry(&m);
    m.source.put("a", b"1".to_vec()).await.unwrap();
    // A wake runner has no feed: it follows by reconciling, whatever the config.
    let (cache, h) = spawn_wake_cache(
        config("feedy"),
        Utf8,
        m.source.clone(),
        m.wake.listen("changes").await.unwrap(),
    );
    tokio::time::timeout(Duration::from_secs(5), cache.wait_ready())
        .await
        .expect("ready from its first reconcile, not stuck opening a feed it lacks")
        .unwrap();
    assert_eq!(cache.get("a").as_deref().map(String::as_str), Some("1"));
    r.put("b", b"2".to_vec()).await.unwrap();
    until("the wake triggers a catch-up", || cache.len() == 2).await;
    h.stop();
}

/// A value the source takes but whose event no stream would carry (over NATS' default
/// 1 MiB payload): the report says it went out as a marker, and a follower of the stream
/// fetches the value and converges.
#[tokio::test(start_paused = true)]
async fn a_value_too_large_for_its_event_is_announced_as_a_marker_and_still_converges() {
    let m = Memory::new();
    let r = registry(&m);
    let (writer, cache) = cache();
    let h = FollowerTask::new(
        FollowerConfig::new("big").unwrap(),
        tidemark::RawBytes,
        m.source.clone(),
        m.events.clone(),
        writer,
    )
    .spawn();
    cache.wait_ready().await.unwrap();
    let big = vec![b'x'; 2 << 20];
    let written = r.put("big", big.clone()).await.unwrap();
    assert!(
        written.report.as_marker && written.report.published && written.report.notified,
        "the report says the event went out as a marker: {:?}",
        written.report
    );
    until("the follower fetched the value", || cache.len() == 1).await;
    assert_eq!(
        cache.get("big").as_deref().map(Vec::as_slice),
        Some(big.as_slice())
    );
    assert_eq!(h.status().counters.fetches, 1);
    h.stop();
}

/// SPEC §5: the durable write comes first and only a committed write is announced. A
/// write the source refuses (unreachable, an invalid key) fails with its error and runs no
/// leg: no event, no wake, no job.
#[tokio::test(start_paused = true)]
async fn a_write_the_source_refuses_is_not_announced() {
    let m = Memory::new();
    let r = registry(&m);
    let mut listener = m.wake.listen("changes").await.unwrap();
    m.faults.fail_next(Port::Source, 1);
    let refused = r.put("a", b"1".to_vec()).await;
    assert!(
        matches!(refused, Err(tidemark::Error::Unavailable { .. })),
        "{refused:?}"
    );
    let invalid = r.put("", b"1".to_vec()).await;
    assert!(
        matches!(invalid, Err(tidemark::Error::InvalidKey { .. })),
        "{invalid:?}"
    );
    m.faults.fail_next(Port::Source, 1);
    assert!(r.update("a", b"1".to_vec(), 0).await.is_err());
    assert!(
        m.events.records().is_empty(),
        "nothing was committed, so nothing may be published"
    );
    assert_eq!(
        listener
            .recv_timeout(Duration::from_millis(100))
            .await
            .unwrap(),
        Received::TimedOut,
        "nor notified"
    );
    assert_eq!(
        m.queue.lease(Duration::from_secs(1)).await.unwrap(),
        None,
        "nor enqueued"
    );
    assert_eq!(m.source.watermark().await.unwrap(), 0);
    let w = r.put("a", b"1".to_vec()).await.unwrap();
    assert_eq!(w.seq, 1, "the first committed write is the first announced");
    assert_eq!(m.events.records().len(), 1);
}

/// SPEC §8: every consumer that converged through the feed (a second, fresh one on the
/// same stream included: it replays from the stream's head) finds its next reconcile empty.
#[tokio::test(start_paused = true)]
async fn a_second_consumer_that_converged_through_the_feed_finds_reconcile_empty() {
    let m = Memory::new();
    let r = registry(&m);
    let consumer = |name: &'static str| {
        let (writer, cache) = cache::<String>();
        let h = durable(&m, config(name), name, writer);
        (cache, h)
    };
    let (first, h1) = consumer("first");
    first.wait_ready().await.unwrap();
    r.put("a", b"1".to_vec()).await.unwrap();
    r.put("b", b"2".to_vec()).await.unwrap();
    r.remove("a").await.unwrap();
    let last = r.put("c", b"3".to_vec()).await.unwrap().seq;
    let (second, h2) = consumer("second");
    for (cache, h) in [(&first, &h1), (&second, &h2)] {
        until("the consumer converges through the feed", || {
            cache.get_versioned("c").map(|(s, _)| s) == Some(last)
        })
        .await;
        assert_eq!(cache.keys(), ["b", "c"]);
        let rec = h.reconcile().await.unwrap();
        assert_eq!(
            (rec.applied, rec.removed, rec.watermark),
            (0, 0, last),
            "{}: converged through the feed, so reconcile finds nothing",
            h.name()
        );
    }
    assert_eq!(
        m.events.load("second").await.unwrap(),
        m.events.load("first").await.unwrap(),
        "both cursors reached the stream's end"
    );
}
