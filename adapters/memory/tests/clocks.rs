//! A queue, a lock, schedules and a sweep given their own clock measure time on it, not on
//! tokio's: their state outlives the runtime that made it (a simulated host that restarts
//! runs on a new runtime, whose `Instant`s start from a new base).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{Job, RetentionPolicy, Schedule};
use tidemark::{JobState, Lock, Queue, ScheduleStore, Source, Sweep};
use tidemark_memory::{Faults, Memory, MemoryLock, MemoryQueue, MemorySchedules};
use tokio::time::Instant;

/// The fence of a sweep run by hand, outside the sweeper lock (never taken here).
fn fence() -> tidemark::LockLease {
    tidemark::LockLease {
        name: tidemark::SWEEP_LOCK.into(),
        owner: "test".into(),
        fencing: 0,
    }
}

/// A clock that moves only when told to.
fn manual_clock() -> (Arc<AtomicU64>, impl Fn() -> Instant + Send + Sync + 'static) {
    let base = Instant::now();
    let millis = Arc::new(AtomicU64::new(0));
    let at = Arc::clone(&millis);
    (millis, move || {
        base + Duration::from_millis(at.load(Ordering::SeqCst))
    })
}

#[tokio::test(start_paused = true)]
async fn a_queue_given_a_clock_expires_leases_on_it_and_not_on_tokios() {
    let (millis, clock) = manual_clock();
    let queue = MemoryQueue::with_clock(Faults::new(), clock);
    let id = queue.enqueue(Job::Sweep).await.unwrap();
    let first = queue.lease(Duration::from_secs(1)).await.unwrap().unwrap();
    assert_eq!((first.id, first.attempt), (id, 1));

    // tokio's clock moves past the lease: the queue's clock did not, so it is still held.
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(queue.lease(Duration::from_secs(1)).await.unwrap().is_none());
    queue.renew(&first, Duration::from_secs(1)).await.unwrap();

    // The queue's clock moves past it: delivered again, and the old lease is lost.
    millis.store(1_500, Ordering::SeqCst);
    let second = queue.lease(Duration::from_secs(1)).await.unwrap().unwrap();
    assert_eq!((second.id, second.attempt), (id, 2));
    assert!(matches!(
        queue.ack(&first).await,
        Err(tidemark::Error::LeaseLost(_))
    ));
    queue.ack(&second).await.unwrap();
    assert_eq!(queue.jobs()[0].state, JobState::Done);
}

#[tokio::test(start_paused = true)]
async fn a_queue_given_a_clock_delays_retries_on_it() {
    let (millis, clock) = manual_clock();
    let queue = MemoryQueue::with_clock(Faults::new(), clock);
    queue.enqueue(Job::Sweep).await.unwrap();
    let lease = queue.lease(Duration::from_secs(10)).await.unwrap().unwrap();
    let state = queue
        .fail(&lease, "not yet", Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(state, JobState::Ready);
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(
        queue
            .lease(Duration::from_secs(10))
            .await
            .unwrap()
            .is_none()
    );
    millis.store(2_000, Ordering::SeqCst);
    let again = queue.lease(Duration::from_secs(10)).await.unwrap().unwrap();
    assert_eq!(again.attempt, 2);
}

#[tokio::test(start_paused = true)]
async fn a_lock_given_a_clock_expires_on_it_and_not_on_tokios() {
    let (millis, clock) = manual_clock();
    let lock = MemoryLock::with_clock(Faults::new(), clock);
    let ttl = Duration::from_secs(2);
    assert!(lock.try_lock("sweep", "a", ttl).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        lock.try_lock("sweep", "b", ttl).await.unwrap().is_none(),
        "tokio's time moved, the lock's clock did not: a's lease is live"
    );
    millis.store(2_000, Ordering::SeqCst);
    assert!(
        lock.try_lock("sweep", "b", ttl).await.unwrap().is_some(),
        "two seconds on the lock's clock: a's lease ran out"
    );
}

#[tokio::test(start_paused = true)]
async fn schedules_given_a_clock_fall_due_on_it_and_not_on_tokios() {
    let (millis, clock) = manual_clock();
    let store = MemorySchedules::with_clock(Faults::new(), Duration::from_secs(1_000), clock);
    let every = Duration::from_secs(1);
    store
        .put_schedule(Schedule::new("s", every, Job::Sweep).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let due = store.schedules().await.unwrap().remove(0);
    assert_eq!(
        due.schedule.tick_to_fire(due.last_fired, due.clock),
        None,
        "tokio's time moved, the store's clock did not"
    );
    millis.store(1_000, Ordering::SeqCst);
    let due = store.schedules().await.unwrap().remove(0);
    assert_eq!(due.clock.now, Duration::from_secs(1_001), "on its calendar");
    assert_eq!(
        due.schedule.tick_to_fire(due.last_fired, due.clock),
        Some(1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_sweep_given_a_clock_ages_history_on_it_and_not_on_tokios() {
    let (millis, clock) = manual_clock();
    let m = Memory::new();
    for i in 0..5 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let policy = RetentionPolicy::new(Duration::from_secs(1), None).unwrap();
    let sweep = m.sweeper_with_clock(policy, clock);
    sweep.sweep(&fence()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        (swept.log_rows, swept.first_available),
        (0, 1),
        "tokio's time moved, the sweep's clock did not: nothing is a second old"
    );
    millis.store(1_000, Ordering::SeqCst);
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        (swept.log_rows, m.source.first_available().await.unwrap()),
        (5, 6),
        "a second on the sweep's clock: the five writes before the first sweep went"
    );
}
