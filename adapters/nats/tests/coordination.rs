//! The lock and the schedule store on NATS KV pass the conformance bodies memory and
//! SQLite pass, against a real nats-server, and hold across separate connections (as
//! separate processes would).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::{Job, Schedule};
use tidemark::{Lock, ScheduleStore};
use tidemark_nats::{NatsLock, NatsQueue, NatsSchedules};

use common::*;

/// Leases on the server's clock: long enough that a loaded machine makes the checks
/// inside one.
const REAL_LEASE: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_passes_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let lock = NatsLock::open(client.clone(), "locks", 1).await.unwrap();
    tidemark::conformance::lock_is_exclusive_and_expires(&lock, REAL_LEASE).await;
    let lock = NatsLock::open(client.clone(), "locks2", 1).await.unwrap();
    tidemark::conformance::lock_taken_again_by_its_owner_is_a_new_lease(&lock).await;
    let lock = NatsLock::open(client, "locks3", 1).await.unwrap();
    tidemark::conformance::lock_for_ever_is_held(&lock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_pass_the_conformance_suite() {
    let server = server().await;
    let client = client(&server).await;
    let s = NatsSchedules::open(client.clone(), "sched1", 1)
        .await
        .unwrap();
    tidemark::conformance::schedule_mark_fired_is_compare_and_set(&s).await;
    let s = NatsSchedules::open(client.clone(), "sched2", 1)
        .await
        .unwrap();
    tidemark::conformance::schedule_replace_and_remove(&s).await;
    let s = NatsSchedules::open(client.clone(), "sched4", 1)
        .await
        .unwrap();
    tidemark::conformance::schedule_mark_fired_refuses_a_replaced_schedule(&s).await;
    let s = NatsSchedules::open(client.clone(), "sched3", 1)
        .await
        .unwrap();
    let q = NatsQueue::open(client.clone(), "CRONJOBS", 3)
        .await
        .unwrap();
    tidemark::conformance::schedule_cron_fires_each_tick_once(&s, &q).await;
    let s = NatsSchedules::open(client.clone(), "sched5", 1)
        .await
        .unwrap();
    let q = NatsQueue::open(client, "TICKJOBS", 3).await.unwrap();
    tidemark::conformance::schedule_claimed_tick_fires_once_across_crashes(&s, &q).await;
}

/// Processes on separate connections race for one lock: exactly one holds it at a time,
/// and each new holder's fencing token is higher than every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_connections_take_the_lock_one_at_a_time() {
    let server = server().await;
    let mut locks = Vec::new();
    for _ in 0..4 {
        let c = client(&server).await;
        locks.push(NatsLock::open(c, "locks", 1).await.unwrap());
    }
    let mut last_fencing = 0;
    for round in 0..5 {
        let tries = locks.iter().enumerate().map(|(i, l)| async move {
            l.try_lock("sweeper", &format!("p{i}"), Duration::from_secs(30))
                .await
                .unwrap()
        });
        let won: Vec<_> = futures::future::join_all(tries)
            .await
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(
            won.len(),
            1,
            "round {round}: exactly one winner, got {won:?}"
        );
        assert!(won[0].fencing > last_fencing, "fencing tokens grow");
        last_fencing = won[0].fencing;
        locks[0].release(&won[0]).await.unwrap();
    }
}

/// Several connections run the scheduler against one store: each due tick enqueues one
/// job in total, and a schedule stored through one connection is seen by all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_schedulers_fire_each_interval_tick_once() {
    let server = server().await;
    let c = client(&server).await;
    let queue = NatsQueue::open(c.clone(), "TICKJOBS", 3).await.unwrap();
    let mut stores = Vec::new();
    for _ in 0..3 {
        let c = client(&server).await;
        stores.push(NatsSchedules::open(c, "sched", 1).await.unwrap());
    }
    let every = Duration::from_millis(500);
    stores[0]
        .put_schedule(Schedule::new("sweep", every, Job::Sweep).unwrap())
        .await
        .unwrap();
    let mut ticks = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(every + every / 5).await;
        let passes = stores.iter().map(|s| tidemark::fire_due(s, &queue));
        for pass in futures::future::join_all(passes).await {
            ticks.extend(pass.unwrap().0.into_iter().map(|f| f.tick));
        }
    }
    let mut distinct = ticks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        ticks.len(),
        "no tick fired twice: {ticks:?}"
    );
    assert!(ticks.len() >= 3, "due ticks fired: {ticks:?}");
}

/// The sweeper lock's fencing token goes with the sweep: a NATS sweep fenced by the lock
/// refuses a stalled sweeper's lease once another has taken the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_refuses_a_stale_fence() {
    let server = server().await;
    let client = client(&server).await;
    let events = tidemark_nats::NatsEvents::new(client.clone(), "FENCED", "fenced").unwrap();
    events.ensure(1).await.unwrap();
    let lock = NatsLock::open(client.clone(), "sweeplocks", 1)
        .await
        .unwrap();
    let sweep = tidemark_nats::NatsSweep::new(client)
        .events("FENCED", tidemark_nats::StreamLimits::EVENTS)
        .fenced_by(lock.clone());
    tidemark::conformance::sweep_refuses_a_stale_fence(&lock, &sweep, REAL_LEASE).await;
}

/// A scheduler that dies between publishing a tick's job and recording the tick, and
/// passes again after the stream's duplicate window, publishes the tick's job a second
/// time: the message id no longer dedups it. The runner settles it by the schedule's tick
/// record: the first job leased claims the tick, the second is finished without running.
/// (A one-second window here stands for the default two minutes.) On the code before the
/// runner's check, both jobs were leased to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticks_job_published_again_after_the_duplicate_window_runs_once() {
    use async_nats::jetstream;
    use tidemark::{Queue, TickKey};
    let server = server().await;
    let client = client(&server).await;
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "SHORTDUP".into(),
        subjects: vec!["tidemark.jobs.SHORTDUP".into()],
        retention: jetstream::stream::RetentionPolicy::WorkQueue,
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .unwrap();
    let q = NatsQueue::open(client.clone(), "SHORTDUP", 3)
        .await
        .unwrap();
    let tick = TickKey {
        schedule: "sweep".into(),
        anchor: Duration::from_millis(1_000),
        tick: 7,
    };
    let first = q.enqueue_tick(&tick, Job::Sweep).await.unwrap();
    assert!(first.is_some(), "the tick's job is enqueued");
    // The scheduler died before its record: the record is gone as if never written.
    let state = js.get_key_value("SHORTDUP_state").await.unwrap();
    state.purge("tick.7377656570").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let second = q.enqueue_tick(&tick, Job::Sweep).await.unwrap();
    assert!(
        second.is_some() && second != first,
        "past the duplicate window the publish makes a second message: {first:?} {second:?}"
    );
    let mut ran = Vec::new();
    while let Some(lease) = q.lease(Duration::from_secs(5)).await.unwrap() {
        ran.push(lease.id);
        q.ack(&lease).await.unwrap();
    }
    assert_eq!(ran.len(), 1, "one job of the tick runs: {ran:?}");
    let other = if ran[0] == first.unwrap() {
        second
    } else {
        first
    };
    let record = q.get(other.unwrap()).await.unwrap().unwrap();
    assert!(
        record
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("not run")),
        "the second is finished, saying why: {record:?}"
    );
}
