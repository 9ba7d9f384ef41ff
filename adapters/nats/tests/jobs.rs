//! The job queue's additions and the job runner against a real nats-server: the same
//! conformance bodies the memory and SQLite queues pass, and the state bucket staying
//! bounded under retention.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use tidemark::conformance as c;
use tidemark::tidemark_core::{Job, JobId};
use tidemark::{JobRetention, JobState, Queue, UNDECODABLE_KIND};
use tidemark_nats::NatsQueue;

use common::*;

/// On NATS a lease is the consumer's ack wait: every body here uses this one.
const VISIBILITY: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_additions_pass_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "RENEW", 3).await.unwrap();
    c::queue_renew_extends_a_lease(&q, VISIBILITY).await;
    let q = NatsQueue::open(client.clone(), "DEAD", 3).await.unwrap();
    c::queue_dead_letters_list_and_requeue(&q).await;
    let q = NatsQueue::open(client.clone(), "COUNTS", 3).await.unwrap();
    c::queue_counts_by_state(&q).await;
    let q = NatsQueue::open(client.clone(), "COALESCE", 3)
        .await
        .unwrap();
    c::queue_coalesces_pending_jobs_per_key(&q).await;
    let q = NatsQueue::open(client.clone(), "RETAIN", 3).await.unwrap();
    c::queue_removes_finished_jobs_past_retention(&q, Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runner_passes_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "SLOW", 3).await.unwrap();
    c::runner_renews_a_slow_jobs_lease(&q, VISIBILITY).await;
    let q = NatsQueue::open(client.clone(), "CRASH", 3).await.unwrap();
    c::runner_crash_redelivers_its_job(&q, VISIBILITY).await;
    let q = NatsQueue::open(client.clone(), "BAD", 3).await.unwrap();
    c::runner_dead_letters_what_it_cannot_run(&q).await;
}

/// Retention purges a finished job's state key with its history and leaves no delete
/// marker: the state bucket's stream holds a message per job still kept, and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_leaves_no_state_behind_on_the_stream() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "BOUNDED", 3).await.unwrap();
    for i in 0..20 {
        q.enqueue(Job::PackHousekeeping {
            key: format!("k{i}"),
        })
        .await
        .unwrap();
    }
    for _ in 0..19 {
        let lease = q.lease(Duration::from_secs(30)).await.unwrap().unwrap();
        q.ack(&lease).await.unwrap();
    }
    let messages = || async {
        let js = jetstream::new(client.clone());
        let mut stream = js.get_stream("KV_BOUNDED_state").await.unwrap();
        stream.info().await.unwrap().state.messages
    };
    assert_eq!(
        messages().await,
        21,
        "one state message per job, and one pending key for the job not yet leased \
         (a leased job's pending key is purged, leaving no marker)"
    );
    let removed = q
        .remove_finished(JobRetention {
            done: Duration::ZERO,
            dead: None,
        })
        .await
        .unwrap();
    assert_eq!(removed, 19);
    assert_eq!(
        messages().await,
        2,
        "only the job still to run keeps state (and its pending key); purged keys leave \
         no marker"
    );
    let counts = q.counts().await.unwrap();
    assert_eq!((counts.ready, counts.done), (1, 0));
}

/// A message on the job stream that is no job (a foreign publisher's) is dead-lettered at
/// its first lease and listed with why, instead of vanishing; jobs after it still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_is_no_job_is_listed_as_a_dead_letter() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "FOREIGN", 3).await.unwrap();
    let js = jetstream::new(client.clone());
    js.publish("tidemark.jobs.FOREIGN", "\u{1} not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let sweep = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q.lease(Duration::from_secs(30)).await.unwrap().unwrap();
    assert_eq!(
        lease.id, sweep,
        "the foreign message is passed over, the job after it runs"
    );
    q.ack(&lease).await.unwrap();
    let dead = q.dead_letters(None, 10).await.unwrap();
    assert_eq!(
        dead.len(),
        1,
        "kept as a dead letter, not dropped: {dead:?}"
    );
    assert_eq!(dead[0].job.kind(), UNDECODABLE_KIND);
    let why = dead[0].last_error.as_deref().unwrap_or_default();
    assert!(why.contains("not a job"), "the dead letter says why: {why}");
}

/// A runner that leases and acks every job until `stop`, recording each leased id (in
/// lease order) before its "handler" (the ack) runs.
fn spawn_acking_runner(
    q: NatsQueue,
    stop: Arc<AtomicBool>,
    started: Arc<Mutex<Vec<JobId>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            if let Some(lease) = q.lease(Duration::from_secs(30)).await.unwrap() {
                started.lock().unwrap().push(lease.id);
                q.ack(&lease).await.unwrap();
            }
        }
    })
}

/// A housekeeping enqueue is absorbed only by a job whose handler has not started yet: a
/// runner that leases the job between its publish and its `pending` key must not leave
/// the key naming it, or every later enqueue for the key returns that finished job and
/// the writes it stands for are never housekept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn housekeeping_enqueued_while_a_runner_works_is_never_absorbed_by_a_started_job() {
    let server = server().await;
    let client = client(&server).await;
    let q = NatsQueue::open(client.clone(), "COALESCE_RACE", 3)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(Mutex::new(Vec::new()));
    let runner = spawn_acking_runner(q.clone(), stop.clone(), started.clone());
    let pack = || Job::PackHousekeeping { key: "a".into() };
    let mut absorbed_by_started = Vec::new();
    for i in 0..300 {
        let before: BTreeSet<JobId> = started.lock().unwrap().iter().copied().collect();
        let id = q.enqueue(pack()).await.unwrap();
        if before.contains(&id) {
            absorbed_by_started.push((i, id));
        }
    }
    stop.store(true, Ordering::SeqCst);
    runner.await.unwrap();
    assert!(
        absorbed_by_started.is_empty(),
        "{} of 300 enqueues were absorbed by a job whose handler had started before the \
         enqueue began, so it may have read the key before the write; the first (iteration, \
         id): {:?}",
        absorbed_by_started.len(),
        &absorbed_by_started[..absorbed_by_started.len().min(5)]
    );
    let id = q.enqueue(pack()).await.unwrap();
    let state = q.get(id).await.unwrap().map(|r| r.state);
    assert_eq!(
        state,
        Some(JobState::Ready),
        "with the runner stopped, an enqueue names a job still to run, not {id} finished"
    );
}
