//! The `Queue` port where the adapters used to disagree: what a lease that has ended can
//! still do (nothing), and what a requeued dead letter is to coalescing (its key's pending
//! job). One meaning on every adapter; SPEC §9 says which.

use super::common::*;

/// Leases `visibility` and returns the lease; the job must be the only one ready.
async fn take<Q: Queue>(q: &Q, visibility: Duration) -> crate::ports::Leased {
    q.lease(visibility)
        .await
        .unwrap()
        .expect("a ready job is leased")
}

/// Asserts that `result` is [`Error::LeaseLost`](crate::Error::LeaseLost).
fn refused(what: &str, result: crate::Result<()>) {
    assert!(
        matches!(result, Err(crate::Error::LeaseLost(_))),
        "{what}: {result:?}"
    );
}

/// Leases until a job comes back (a server may take a moment to redeliver one whose
/// lease lapsed), or panics after `within`.
async fn lease_again<Q: Queue>(
    q: &Q,
    visibility: Duration,
    within: Duration,
) -> crate::ports::Leased {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(lease) = q.lease(visibility).await.unwrap() {
            return lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a job whose lease lapsed is delivered again within {within:?}"
        );
        tokio::time::sleep(visibility / 20).await;
    }
}

/// A lease that ran out is over even when nobody else has taken its job yet: its ack,
/// fail and dead letter are [`Error::LeaseLost`](crate::Error::LeaseLost), and the job is
/// delivered again (attempt 2, its last error saying the lease expired). Why: whether
/// somebody else has taken the job is a race the holder cannot see; an ack that lands
/// only when the job was not yet redelivered makes "done" depend on that race, and a
/// runner that kept working past its lease would sometimes complete a job another runner
/// is running. The lease's end, on the queue's clock, is the one line.
///
/// `q` must allow at least two attempts; `visibility` is the lease the test takes (short
/// under paused time; on a real clock long enough to take it and let it lapse).
pub async fn queue_expired_lease_cannot_finish_its_job<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let lapsed = take(q, visibility).await;
    assert_eq!((lapsed.id, lapsed.attempt), (id, 1));
    tokio::time::sleep(visibility * 3 / 2).await;
    // Nobody has leased the job since: only the lapsed lease's own end stands in its way.
    refused(
        "an expired lease must not ack, though nobody took its job",
        q.ack(&lapsed).await,
    );
    refused(
        "an expired lease must not fail its job",
        q.fail(&lapsed, "late", Duration::ZERO).await.map(drop),
    );
    refused(
        "an expired lease must not dead-letter its job",
        q.dead_letter(&lapsed, "late").await,
    );
    refused(
        "an expired lease must not renew",
        q.renew(&lapsed, visibility).await,
    );
    let again = lease_again(q, visibility, visibility * 50).await;
    assert_eq!(
        (again.id, again.attempt),
        (id, 2),
        "the job the refused ack would have finished runs again: at least once"
    );
    let rec = q.get(id).await.unwrap().unwrap();
    assert!(
        rec.last_error
            .as_deref()
            .is_some_and(|e| e.contains("lease expired")),
        "the attempt that lapsed is recorded as such: {:?}",
        rec.last_error
    );
    q.ack(&again).await.expect("the live lease acks");
    assert_eq!(q.get(id).await.unwrap().unwrap().state, JobState::Done);
}

/// A lease that ran out on the job's last attempt is dead, and stays so: its ack is
/// [`Error::LeaseLost`](crate::Error::LeaseLost) before and after the queue has noticed,
/// and the job ends dead-lettered with "lease expired" — never done by a holder that did
/// not hold it when it finished.
///
/// `q` must dead-letter after one attempt (`max_attempts` 1); `visibility` as for
/// [`queue_expired_lease_cannot_finish_its_job`].
pub async fn queue_dead_lease_cannot_ack<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let dead = take(q, visibility).await;
    tokio::time::sleep(visibility * 3 / 2).await;
    refused(
        "a lease that lapsed on its last attempt must not ack",
        q.ack(&dead).await,
    );
    // The job is dead-lettered (at once on some adapters, by the next lease on others; a
    // server may take a moment to redeliver it so that it can be).
    let deadline = tokio::time::Instant::now() + visibility * 50;
    loop {
        let rec = q.get(id).await.unwrap().expect("the job is kept");
        assert_ne!(
            rec.state,
            JobState::Done,
            "a dead lease's ack must not have completed the job"
        );
        if rec.state == JobState::DeadLettered {
            assert!(
                rec.last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("lease expired")),
                "dead-lettered because its last lease lapsed: {:?}",
                rec.last_error
            );
            break;
        }
        assert!(
            q.lease(visibility).await.unwrap().is_none(),
            "with one attempt allowed, a lapsed lease's job is not delivered again"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "a lapsed last attempt is dead-lettered (now {:?})",
            rec.state
        );
        tokio::time::sleep(visibility / 20).await;
    }
    refused(
        "a dead-lettered job's lease must not ack",
        q.ack(&dead).await,
    );
    assert_eq!(
        q.get(id).await.unwrap().unwrap().state,
        JobState::DeadLettered,
        "the refused ack changed nothing"
    );
}

/// A requeued dead letter has not run since it was requeued, so it is its key's pending
/// job: a later enqueue for the key is absorbed by it (pending housekeeping stays one job
/// per key). When the key already has a pending job, that job stays the one that absorbs.
pub async fn queue_requeued_dead_letter_coalesces<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    let pack = || Job::PackHousekeeping { key: "k".into() };
    let first = q.enqueue(pack()).await.unwrap();
    let lease = take(q, visibility).await;
    q.dead_letter(&lease, "no hope").await.unwrap();
    let requeued = q.requeue(first).await.expect("a dead letter requeues");
    assert_eq!(
        q.enqueue(pack()).await.unwrap(),
        requeued,
        "a requeued job absorbs the next enqueue for its key, as any job that has not run"
    );
    assert_eq!(
        q.counts().await.unwrap().ready,
        1,
        "one pending job for the key"
    );

    // Dead again; meanwhile a new job becomes the key's pending one.
    let lease = take(q, visibility).await;
    assert_eq!(lease.id, requeued);
    q.dead_letter(&lease, "no hope again").await.unwrap();
    let pending = q.enqueue(pack()).await.unwrap();
    assert_ne!(pending, requeued, "a dead job absorbs nothing");
    q.requeue(requeued).await.expect("a dead letter requeues");
    assert_eq!(
        q.enqueue(pack()).await.unwrap(),
        pending,
        "the key's pending job keeps absorbing: one job per key absorbs"
    );
    // Whatever ran, every job leased afterwards is the key's, and the queue drains.
    let mut ran = Vec::new();
    while let Some(lease) = q.lease(visibility).await.unwrap() {
        assert_eq!(lease.job, pack());
        ran.push(lease.id);
        q.ack(&lease).await.unwrap();
    }
    assert!(ran.contains(&pending), "the pending job ran: {ran:?}");
    assert!(
        ran.len() <= 2,
        "at most the pending and the requeued: {ran:?}"
    );

    // Dead while a later job for its key ran and finished: requeued, it is the pending
    // one again.
    let dead = q.enqueue(pack()).await.unwrap();
    let lease = take(q, visibility).await;
    q.dead_letter(&lease, "no hope").await.unwrap();
    let later = q.enqueue(pack()).await.unwrap();
    let lease = take(q, visibility).await;
    assert_eq!(lease.id, later);
    q.ack(&lease).await.unwrap();
    let requeued = q.requeue(dead).await.expect("a dead letter requeues");
    assert_eq!(
        q.enqueue(pack()).await.unwrap(),
        requeued,
        "a requeued job absorbs for its key once the key's other jobs have run"
    );
}
