//! A queue given its own clock measures leases and retry delays on it, not on tokio's: jobs
//! outlive the runtime that leased them (a simulated host that restarts runs on a new
//! runtime, whose `Instant`s start from a new base).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::Job;
use tidemark::{JobState, Queue};
use tidemark_memory::{Faults, MemoryQueue};
use tokio::time::Instant;

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
