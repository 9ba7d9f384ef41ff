//! Schedules, locks and jobs driven by the runtime.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tidemark::tidemark_core::{Job, Schedule};
use tidemark::{Lock, Queue, ScheduleStore, Shutdown, fire_due, run_scheduler};
use tidemark_memory::Memory;

fn sweep_every_minute() -> Schedule {
    Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap()
}

#[tokio::test(start_paused = true)]
async fn each_due_tick_enqueues_exactly_one_job_with_two_runners() {
    let m = Memory::new();
    m.schedules
        .put_schedule(sweep_every_minute())
        .await
        .unwrap();
    let stop = Shutdown::new();
    let (s1, s2, q1, q2) = (
        m.schedules.clone(),
        m.schedules.clone(),
        m.queue.clone(),
        m.queue.clone(),
    );
    let (sig1, sig2) = (stop.signal(), stop.signal());
    let r1 =
        tokio::spawn(async move { run_scheduler(&s1, &q1, Duration::from_secs(5), sig1).await });
    let r2 =
        tokio::spawn(async move { run_scheduler(&s2, &q2, Duration::from_secs(5), sig2).await });
    tokio::time::sleep(Duration::from_secs(60 * 5 + 30)).await;
    stop.trigger();
    r1.await.unwrap();
    r2.await.unwrap();
    assert_eq!(
        m.queue.jobs().len(),
        5,
        "five due ticks, two runners: each tick must enqueue exactly one sweep"
    );
}

#[tokio::test(start_paused = true)]
async fn a_tick_missed_while_no_runner_ran_fires_once() {
    let m = Memory::new();
    m.schedules
        .put_schedule(sweep_every_minute())
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(60 * 100 + 1)).await;
    let (fired, next) = fire_due(&m.schedules, &m.queue).await.unwrap();
    assert_eq!(
        fired.len(),
        1,
        "a long gap fires once, not once per missed interval"
    );
    assert_eq!(fired[0].tick, 100);
    assert_eq!(
        next,
        Some(Duration::from_secs(59)),
        "the next tick is due at 101 minutes"
    );
    let (again, _) = fire_due(&m.schedules, &m.queue).await.unwrap();
    assert!(again.is_empty(), "the same tick never fires twice");
}

/// A tick this runner claimed whose enqueue fails for a moment still enqueues its job:
/// no other runner will fire that tick again, so a blip of the queue must not lose it.
#[tokio::test(start_paused = true)]
async fn a_claimed_tick_whose_enqueue_fails_once_still_enqueues_its_job() {
    use tidemark_memory::Port;
    let m = Memory::new();
    m.schedules
        .put_schedule(sweep_every_minute())
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(61)).await;
    m.faults.fail_next(Port::Queue, 2);
    let (fired, _) = fire_due(&m.schedules, &m.queue).await.unwrap();
    assert_eq!(
        fired.iter().map(|f| f.tick).collect::<Vec<_>>(),
        [1],
        "the claimed tick fired once its enqueue went through"
    );
    assert_eq!(m.queue.jobs().len(), 1, "one job for the tick");
    let (again, _) = fire_due(&m.schedules, &m.queue).await.unwrap();
    assert!(again.is_empty(), "the same tick never fires twice");
}

#[tokio::test(start_paused = true)]
async fn a_lock_lets_one_sweeper_run_at_a_time() {
    let m = Memory::new();
    let ttl = Duration::from_secs(10);
    let a = m
        .lock
        .try_lock("sweeper", "host-a", ttl)
        .await
        .unwrap()
        .unwrap();
    assert!(
        m.lock
            .try_lock("sweeper", "host-b", ttl)
            .await
            .unwrap()
            .is_none(),
        "exclusive"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    let b = m.lock.try_lock("sweeper", "host-b", ttl).await.unwrap();
    assert!(
        b.is_some(),
        "a crashed holder's lock expires so the sweeper is not stuck forever"
    );
    assert!(m.lock.renew(&a, ttl).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn a_job_whose_lease_expires_is_delivered_again_then_dead_lettered() {
    let m = Memory::new();
    let q = m.queue.clone().with_max_attempts(2);
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let _lost = q.lease(Duration::from_secs(1)).await.unwrap().unwrap();
    tokio::time::advance(Duration::from_secs(2)).await;
    let second = q
        .lease(Duration::from_secs(1))
        .await
        .unwrap()
        .expect("expired lease redelivers");
    assert_eq!(second.attempt, 2);
    q.fail(&second, "disk full", Duration::ZERO).await.unwrap();
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        tidemark::JobState::DeadLettered,
        "max attempts reached"
    );
    assert_eq!(
        rec.last_error.as_deref(),
        Some("disk full"),
        "the last error is kept for an operator"
    );
}
