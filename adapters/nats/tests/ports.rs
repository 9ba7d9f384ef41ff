//! The events stream, cursors, wake, queue, announcing writer, worker and connection
//! options, against real nats-server processes.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::{FollowerConfig, Job, RawBytes, RestartPolicy, Utf8};
use tidemark::{
    AnnouncingRegistry, Cursors, FollowerTask, Queue, Source, Supervisor, Worker, WorkerPhase,
};
use tidemark_nats::{ConnectError, KvBucket, NatsEvents, NatsOptions, NatsQueue, NatsWake};
use tidemark_tests::{NatsServer, NatsServerOptions};

use common::*;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_stream_and_cursors_pass_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let events = NatsEvents::new(client.clone(), "EVENTS", "events").unwrap();
    events.ensure(1).await.unwrap();
    tidemark::conformance::events_deliver_published_in_order(&events).await;
    tidemark::conformance::cursors_are_monotone(&events).await;
    let batched = NatsEvents::new(client.clone(), "BATCHED", "batched").unwrap();
    batched.ensure(1).await.unwrap();
    tidemark::conformance::events_publish_batch_in_order(&batched).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_and_queue_pass_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let wake = NatsWake::new(client.clone(), "wake").unwrap();
    tidemark::conformance::wake_reaches_listeners(&wake).await;
    let q = NatsQueue::open(client.clone(), "JOBS1", 3).await.unwrap();
    tidemark::conformance::queue_round_trip(&q).await;
    let q = NatsQueue::open(client.clone(), "JOBS2", 3).await.unwrap();
    tidemark::conformance::queue_lease_expiry_redelivers(&q, Duration::from_secs(1)).await;
    let q = NatsQueue::open(client.clone(), "JOBS3", 3).await.unwrap();
    tidemark::conformance::queue_dead_letters_after_max_attempts(&q, 3).await;
    let q = NatsQueue::open(client.clone(), "JOBS4", 1).await.unwrap();
    tidemark::conformance::queue_stale_lease_cannot_act_after_requeue(&q, Duration::from_secs(1))
        .await;
}

/// Where the adapters used to disagree: a lease that ran out (nobody else took its job,
/// or it was the last attempt) finishes nothing, and a requeued dead letter coalesces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_lease_end_and_requeue_pass_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "ENDED1", 3).await.unwrap();
    tidemark::conformance::queue_expired_lease_cannot_finish_its_job(&q, Duration::from_secs(1))
        .await;
    let q = NatsQueue::open(client.clone(), "ENDED2", 1).await.unwrap();
    tidemark::conformance::queue_dead_lease_cannot_ack(&q, Duration::from_secs(1)).await;
    let q = NatsQueue::open(client.clone(), "REQUEUED", 3)
        .await
        .unwrap();
    tidemark::conformance::queue_requeued_dead_letter_coalesces(&q).await;
}

/// The writer announces on all three legs; a durable stream consumer converges through
/// the events and resumes after its cursor; the jobs can be leased and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcing_writer_and_durable_stream_consumer_round_trip() {
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "registry", 1, 1).await;
    let bucket = KvBucket::new(client.clone(), "registry").unwrap();
    let events = NatsEvents::new(client.clone(), "REGISTRY_EVENTS", "registry.events").unwrap();
    events.ensure(1).await.unwrap();
    let wake = NatsWake::new(client.clone(), "registry.wake").unwrap();
    let queue = NatsQueue::open(client.clone(), "REGISTRY_JOBS", 5)
        .await
        .unwrap();
    let registry = AnnouncingRegistry::new(
        bucket.clone(),
        events.clone(),
        wake.clone(),
        queue.clone(),
        "changes",
    );

    let mut listener = tidemark::Wake::listen(&wake, "changes").await.unwrap();
    let a = registry.put("pkg/a", b"1".to_vec()).await.unwrap();
    assert!(a.report.published && a.report.notified && a.report.enqueued.is_some());
    assert!(matches!(
        tidemark::WakeListener::recv_timeout(&mut listener, Duration::from_secs(5))
            .await
            .unwrap(),
        tidemark::Received::Wake(_)
    ));
    registry.put("pkg/b", b"2".to_vec()).await.unwrap();
    registry.remove("pkg/a").await.unwrap().unwrap();
    // A foreign payload on the stream: counted, never an error.
    tidemark::Publish::publish(&events, "foreign", b"{\"hello\":1}".to_vec())
        .await
        .unwrap();

    let config = FollowerConfig::new("stream-mirror").unwrap();
    let record = Record::default();
    let handle = FollowerTask::new(
        config.clone(),
        RawBytes,
        bucket.clone(),
        events.clone(),
        record.sink(),
    )
    .with_cursor(events.clone(), "mirror")
    .spawn();
    wait_until(WAIT, "the stream consumer converges", || {
        record.keys() == [("pkg/b".to_owned(), 2)]
    })
    .await;
    wait_until(
        WAIT,
        "every entry is checkpointed, the foreign one too",
        || {
            futures::executor::block_on(events.load("mirror"))
                .ok()
                .flatten()
                == Some(4)
        },
    )
    .await;
    assert_eq!(
        handle.status().counters.invalid,
        1,
        "the foreign payload is counted"
    );
    handle.stop_within(Duration::from_secs(5)).await.unwrap();

    registry.put("pkg/c", b"3".to_vec()).await.unwrap();
    let fresh = Record::default();
    let handle = FollowerTask::new(
        config,
        RawBytes,
        bucket.clone(),
        events.clone(),
        fresh.sink(),
    )
    .with_cursor(events.clone(), "mirror")
    .spawn();
    // A fresh cache reads the source first (announcements may have been lost), then the
    // stream from after the saved cursor: only pkg/c's announcement comes again.
    wait_until(WAIT, "the restart resumes after its cursor", || {
        handle.status().counters.stale >= 1
    })
    .await;
    assert_eq!(
        fresh.keys(),
        [("pkg/b".to_owned(), 2), ("pkg/c".to_owned(), 4)],
        "a cache holds every key"
    );
    assert_eq!(
        handle.status().counters.stale,
        1,
        "only what came after the saved cursor is replayed"
    );
    handle.stop_within(Duration::from_secs(5)).await.unwrap();

    // One pending housekeeping job per key written: pkg/a's put and removal coalesce into
    // one job, as nothing leased it in between. A busy server may hand them out slowly, so
    // lease until three came or the wait is over, then check that no fourth is there.
    let mut jobs = Vec::new();
    let started = std::time::Instant::now();
    while jobs.len() < 3 && started.elapsed() < WAIT {
        if let Some(lease) = queue.lease(Duration::from_secs(30)).await.unwrap() {
            jobs.push(lease.job.clone());
            queue.ack(&lease).await.unwrap();
        }
    }
    assert!(
        queue
            .lease(Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "no job beyond one per key written"
    );
    jobs.sort_by_key(|j| format!("{j:?}"));
    assert_eq!(
        jobs,
        ["pkg/a", "pkg/b", "pkg/c"].map(|key| Job::PackHousekeeping { key: key.into() }),
        "one housekeeping job per key: a key's writes coalesce while its job waits"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_refused_clearly_and_the_right_one_accepted() {
    let server = NatsServer::start_with(NatsServerOptions::new().user_password("mirror", "s3cret"))
        .await
        .unwrap_or_else(|e| panic!("a real nats-server is required for these tests: {e}"));
    let wrong = NatsOptions::new([server.url()])
        .user_password("mirror", "guess")
        .name("tidemark-test")
        .connect()
        .await;
    match wrong {
        Err(e @ ConnectError::Unauthorized { .. }) => {
            assert!(e.to_string().contains("rejected the credentials"), "{e}");
        }
        other => panic!("a wrong password must be refused as unauthorized, got {other:?}"),
    }
    let client = NatsOptions::new([server.url()])
        .user_password("mirror", "s3cret")
        .name("tidemark-test")
        .connect()
        .await
        .unwrap();
    tidemark_tests::wait_jetstream_ready(&client).await.unwrap();
    create_bucket(&client, "auth", 1, 1).await;
    let bucket = KvBucket::new(client, "auth").unwrap();
    assert!(bucket.put("k", b"v".to_vec()).await.unwrap() > 0);
    let debug = format!(
        "{:?}",
        NatsOptions::new(["x"])
            .user_password("u", "s3cret")
            .token("tok")
    );
    assert!(
        !debug.contains("s3cret") && !debug.contains("tok\""),
        "secrets never print: {debug}"
    );
}

struct Counter {
    puts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    deletes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Worker for Counter {
    type Decoder = Utf8;
    type Error = std::convert::Infallible;
    fn name(&self) -> &str {
        "counter"
    }
    fn description(&self) -> &str {
        "counts packages"
    }
    fn source(&self) -> &str {
        "packages"
    }
    fn decoder(&self) -> Utf8 {
        Utf8
    }
    async fn on_put(&mut self, _key: &str, _seq: u64, _value: String) -> Result<(), Self::Error> {
        self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    async fn on_delete(&mut self, _key: &str, _seq: u64) -> Result<(), Self::Error> {
        self.deletes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_worker_runs_under_the_supervisor_on_a_bucket() {
    use std::sync::atomic::Ordering::Relaxed;
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "packages", 1, 1).await;
    let bucket = KvBucket::new(client, "packages").unwrap();
    bucket.put("a", b"1".to_vec()).await.unwrap();
    bucket.put("bad", vec![0xff]).await.unwrap();
    let worker = Counter {
        puts: Default::default(),
        deletes: Default::default(),
    };
    let (puts, deletes) = (worker.puts.clone(), worker.deletes.clone());
    let supervisor = Supervisor::new(7);
    supervisor
        .spawn(worker, bucket.clone(), bucket.clone(), RestartPolicy::Never)
        .unwrap();
    wait_until(WAIT, "the initial sync reaches the worker", || {
        puts.load(Relaxed) == 1
    })
    .await;
    bucket.put("b", b"2".to_vec()).await.unwrap();
    let last = bucket.remove("a").await.unwrap().unwrap();
    // The listing reads the live status, which covers everything up to its watermark.
    wait_until(WAIT, "the worker reaches the last change", || {
        supervisor
            .get("counter")
            .is_some_and(|i| i.watermark == last)
    })
    .await;
    assert_eq!(
        (puts.load(Relaxed), deletes.load(Relaxed)),
        (2, 1),
        "the worker saw every live change"
    );
    let info = supervisor.get("counter").unwrap();
    assert_eq!(
        info.counters.poison, 1,
        "the undecodable value is skipped and counted"
    );
    assert_eq!(
        (info.description.as_str(), info.source.as_str()),
        ("counts packages", "packages")
    );
    assert!(matches!(info.phase, WorkerPhase::Running(_)));
    supervisor.shutdown(Duration::from_secs(5)).await.unwrap();
    let _ = bucket.watermark().await;
}

/// A cursor's durable consumer deleted on the server (by an operator, or expired): the
/// save that finds it gone fails, and the next one makes it again, instead of every save
/// failing for the life of the handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_whose_consumer_was_deleted_is_made_again() {
    let server = server().await;
    // A short request timeout: the server does not answer a reset of a missing consumer.
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_millis(500)))
        .connect(server.url())
        .await
        .unwrap();
    tidemark_tests::wait_jetstream_ready(&client).await.unwrap();
    let events = NatsEvents::new(client.clone(), "EV", "ev").unwrap();
    events.ensure(1).await.unwrap();
    for i in 0..10 {
        tidemark::Publish::publish(&events, &format!("k{i}"), b"x".to_vec())
            .await
            .unwrap();
    }
    assert_eq!(events.save("c1", 3).await.unwrap(), 3);
    async_nats::jetstream::new(client.clone())
        .delete_consumer_from_stream("c1", "EV")
        .await
        .unwrap();
    let mut saved = None;
    for position in 4..8 {
        if let Ok(p) = events.save("c1", position).await {
            saved = Some(p);
            break;
        }
    }
    assert!(
        saved.is_some(),
        "a save after the failure recreates the cursor"
    );
    assert_eq!(events.load("c1").await.unwrap(), saved);
}

/// A value a SQLite registry takes (1.5 MiB) whose event no NATS stream or subject carries
/// (over the server's 1 MiB `max_payload`): before, the publish and the notify both failed
/// and an announcements follower never saw the write. It goes out as a marker now, the
/// report says so, and the follower fetches the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_too_large_for_a_nats_event_still_reaches_an_announcements_follower() {
    let server = server().await;
    let client = client(&server).await;
    let events = NatsEvents::new(client.clone(), "BIG_EVENTS", "big.events").unwrap();
    events.ensure(1).await.unwrap();
    let wake = NatsWake::new(client.clone(), "big.wake").unwrap();
    let queue = NatsQueue::open(client.clone(), "BIG_JOBS", 5)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = tidemark_sqlite::SqliteDb::open(dir.path().join("registry.db"))
        .await
        .unwrap();
    let registry = AnnouncingRegistry::new(db.source(), events.clone(), wake, queue, "big");
    let record = Record::default();
    let handle = FollowerTask::new(
        FollowerConfig::new("big").unwrap(),
        RawBytes,
        db.source(),
        events.clone(),
        record.sink(),
    )
    .spawn();
    wait_until(WAIT, "the follower is ready", || record.ready().is_some()).await;
    let big = vec![b'v'; 1_500_000];
    let written = registry.put("big", big.clone()).await.unwrap();
    assert!(
        written.report.as_marker && written.report.published && written.report.notified,
        "announced as a marker, on every leg: {:?}",
        written.report
    );
    wait_until(WAIT, "the follower fetched the value", || {
        record.value("big").is_some()
    })
    .await;
    assert_eq!(record.value("big"), Some(big));
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
}
