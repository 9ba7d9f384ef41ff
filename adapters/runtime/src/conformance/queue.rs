//! The `Queue` port: leases, expiry, dead letters, receipts, counts, retention and
//! coalescing.

use super::common::*;

/// Enqueue → get → lease → ack: a job is readable by id and done once acked.
pub async fn queue_round_trip<Q: Queue>(q: &Q) {
    let job = Job::PackHousekeeping { key: "k".into() };
    let id = q.enqueue(job.clone()).await.unwrap();
    let rec = q.get(id).await.unwrap().expect("a job reads back by id");
    assert_eq!((rec.job.clone(), rec.state), (job.clone(), JobState::Ready));
    let lease = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a ready job");
    assert_eq!((lease.id, lease.job.clone(), lease.attempt), (id, job, 1));
    assert!(
        q.lease(Duration::from_secs(30)).await.unwrap().is_none(),
        "leased jobs are hidden"
    );
    q.ack(&lease).await.unwrap();
    assert_eq!(q.get(id).await.unwrap().unwrap().state, JobState::Done);
}

/// A job whose lease expires is delivered again, and the old lease can no longer ack:
/// a crashed worker loses no job and cannot complete one it no longer holds.
///
/// `visibility` is the lease length the test uses: short under paused time, long enough
/// on a real clock that a loaded machine acks the second lease before it runs out.
pub async fn queue_lease_expiry_redelivers<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let first = q.lease(visibility).await.unwrap().unwrap();
    tokio::time::sleep(visibility * 3 / 2).await;
    // Redelivery is due now; a busy server may take a moment to make it.
    let deadline = tokio::time::Instant::now() + visibility * 50;
    let second = loop {
        if let Some(lease) = q.lease(visibility).await.unwrap() {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an expired lease's job is redelivered"
        );
        tokio::time::sleep(visibility / 20).await;
    };
    assert_eq!((second.id, second.attempt), (id, 2));
    assert!(
        q.ack(&first).await.is_err(),
        "an expired lease must not ack"
    );
    q.ack(&second).await.unwrap();
}

/// After `max_attempts` failures a job is dead-lettered with its last error kept.
pub async fn queue_dead_letters_after_max_attempts<Q: Queue>(q: &Q, max_attempts: u32) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    for attempt in 1..=max_attempts {
        let lease = q
            .lease(Duration::from_secs(30))
            .await
            .unwrap()
            .expect("ready again");
        assert_eq!(lease.attempt, attempt);
        let state = q
            .fail(&lease, &format!("boom {attempt}"), Duration::ZERO)
            .await
            .unwrap();
        let want = if attempt == max_attempts {
            JobState::DeadLettered
        } else {
            JobState::Ready
        };
        assert_eq!(state, want);
    }
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(rec.state, JobState::DeadLettered, "attempts are used up");
    assert_eq!(
        rec.last_error.as_deref(),
        Some(&*format!("boom {max_attempts}"))
    );
    assert!(
        q.lease(Duration::from_secs(30)).await.unwrap().is_none(),
        "dead letters stay out"
    );
}

/// A renewed lease outlives its first visibility timeout: a slow job is not delivered
/// again while its holder renews it, and a finished job's lease cannot be renewed.
///
/// `visibility` is the lease the test takes (on NATS: the queue's ack wait).
pub async fn queue_renew_extends_a_lease<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q.lease(visibility).await.unwrap().expect("a ready job");
    let start = tokio::time::Instant::now();
    while start.elapsed() < visibility * 2 {
        tokio::time::sleep(visibility / 4).await;
        q.renew(&lease, visibility)
            .await
            .expect("a held lease renews");
        assert!(
            q.lease(visibility).await.unwrap().is_none(),
            "a renewed lease keeps its job from being delivered again"
        );
    }
    q.ack(&lease).await.expect("a renewed lease still acks");
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempts),
        (JobState::Done, 1),
        "one attempt, done"
    );
    assert!(
        matches!(
            q.renew(&lease, visibility).await,
            Err(crate::Error::LeaseLost(_))
        ),
        "a finished job's lease cannot be renewed"
    );
    q.enqueue(Job::Sweep).await.unwrap();
    let lapsed = q.lease(visibility).await.unwrap().expect("a ready job");
    tokio::time::sleep(visibility * 3 / 2).await;
    assert!(
        matches!(
            q.renew(&lapsed, visibility).await,
            Err(crate::Error::LeaseLost(_))
        ),
        "an expired lease cannot be renewed: its job may be someone else's"
    );
}

/// Dead letters are listed in id order with their last error, page by page, and a
/// requeued one runs again with fresh attempts; only a dead letter can be requeued.
pub async fn queue_dead_letters_list_and_requeue<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    let jobs = [
        Job::PackHousekeeping { key: "a".into() },
        Job::PackHousekeeping { key: "b".into() },
        Job::PackHousekeeping { key: "c".into() },
    ];
    let mut ids = Vec::new();
    for job in &jobs {
        ids.push(q.enqueue(job.clone()).await.unwrap());
    }
    for (i, id) in ids.iter().enumerate() {
        let lease = q.lease(visibility).await.unwrap().expect("a ready job");
        assert_eq!(lease.id, *id, "oldest first");
        if i == 1 {
            q.ack(&lease).await.unwrap();
        } else {
            q.dead_letter(&lease, &format!("no hope for {i}"))
                .await
                .unwrap();
        }
    }
    let dead = q.dead_letters(None, 10).await.unwrap();
    let listed: Vec<_> = dead
        .iter()
        .map(|r| {
            (
                r.id,
                r.job.clone(),
                r.state,
                r.attempts,
                r.last_error.clone(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            (
                ids[0],
                jobs[0].clone(),
                JobState::DeadLettered,
                1,
                Some("no hope for 0".into())
            ),
            (
                ids[2],
                jobs[2].clone(),
                JobState::DeadLettered,
                1,
                Some("no hope for 2".into())
            ),
        ],
        "dead letters are listed with their job and last error, and only dead letters"
    );
    let page: Vec<_> = q
        .dead_letters(Some(ids[0]), 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(page, vec![ids[2]], "listing resumes after the id given");
    let first: Vec<_> = q
        .dead_letters(None, 1)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(first, vec![ids[0]], "listing stops at the limit");
    assert!(
        matches!(q.requeue(ids[1]).await, Err(crate::Error::NotFound(_))),
        "a done job is not a dead letter"
    );
    let again = q.requeue(ids[0]).await.expect("a dead letter requeues");
    let lease = q
        .lease(visibility)
        .await
        .unwrap()
        .expect("the requeued job is ready");
    assert_eq!(
        (lease.id, lease.job.clone(), lease.attempt),
        (again, jobs[0].clone(), 1),
        "a requeued job runs again with fresh attempts"
    );
    q.ack(&lease).await.unwrap();
    let left: Vec<_> = q
        .dead_letters(None, 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(left, vec![ids[2]], "a requeued job leaves the dead letters");
}

/// A lease that expired before its job was dead-lettered and requeued can do nothing to
/// the job's next lease: its renew, ack, fail and dead letter are all
/// [`Error::LeaseLost`](crate::Error::LeaseLost), and the new holder acks. Why: a runner
/// that stalls past its visibility (a pause, a partition) wakes holding a receipt for a
/// job someone else now runs; if that receipt still matched, its fail would put the job
/// back while it runs and its ack would mark it done under the new holder, whose own ack
/// would then be refused. A receipt must name one lease for ever, however often the job
/// is requeued and its attempts start over.
///
/// `q` must dead-letter after one attempt (`max_attempts` 1), so that the lapsed lease's
/// job is dead-lettered rather than delivered again. `visibility` is the first lease's
/// length: short under paused time, long enough on a real clock to be taken and let lapse.
pub async fn queue_stale_lease_cannot_act_after_requeue<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let stale = q.lease(visibility).await.unwrap().expect("a ready job");
    assert_eq!((stale.id, stale.attempt), (id, 1));
    tokio::time::sleep(visibility * 3 / 2).await;
    // The lease has lapsed with the only attempt used: the job is dead-lettered (at once
    // on some adapters, by the next lease on others; a busy server may take a moment).
    let deadline = tokio::time::Instant::now() + visibility * 50;
    loop {
        let state = q.get(id).await.unwrap().map(|r| r.state);
        if state == Some(JobState::DeadLettered) {
            break;
        }
        assert!(
            q.lease(visibility).await.unwrap().is_none(),
            "with one attempt allowed, a lapsed lease's job is dead-lettered, not redelivered"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "a lapsed lease's job with its attempts used up is dead-lettered (now {state:?})"
        );
        tokio::time::sleep(visibility / 20).await;
    }
    let again = q.requeue(id).await.expect("a dead letter requeues");
    let fresh = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the requeued job is ready");
    assert_eq!(
        (fresh.id, fresh.attempt),
        (again, 1),
        "a requeued job runs again with fresh attempts"
    );
    let lost = |what: &str, result: crate::Result<()>| {
        assert!(
            matches!(result, Err(crate::Error::LeaseLost(_))),
            "a lease from before the requeue must not {what} the job's new lease: {result:?}"
        );
    };
    lost("renew", q.renew(&stale, Duration::from_secs(30)).await);
    lost("ack", q.ack(&stale).await);
    lost(
        "fail",
        q.fail(&stale, "stale", Duration::ZERO).await.map(|_| ()),
    );
    lost("dead-letter", q.dead_letter(&stale, "stale").await);
    let rec = q.get(again).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempts),
        (JobState::Leased, 1),
        "the stale lease changed nothing"
    );
    q.ack(&fresh).await.expect("the new lease still acks");
    assert_eq!(q.get(again).await.unwrap().unwrap().state, JobState::Done);
}

/// Counts by state: what a status command and the queue-depth gauge read.
pub async fn queue_counts_by_state<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    assert_eq!(
        q.counts().await.unwrap(),
        JobCounts::default(),
        "an empty queue"
    );
    for key in ["a", "b", "c", "d"] {
        q.enqueue(Job::PackHousekeeping { key: key.into() })
            .await
            .unwrap();
    }
    let done = q.lease(visibility).await.unwrap().unwrap();
    q.ack(&done).await.unwrap();
    let dead = q.lease(visibility).await.unwrap().unwrap();
    q.dead_letter(&dead, "bad").await.unwrap();
    let _held = q.lease(visibility).await.unwrap().unwrap();
    assert_eq!(
        q.counts().await.unwrap(),
        JobCounts {
            ready: 1,
            leased: 1,
            done: 1,
            dead: 1
        },
        "each job is counted in the state it is in"
    );
}

/// Retention removes done jobs and dead letters once they are older than their limits, and
/// never a ready or leased job; `dead: None` keeps dead letters.
///
/// `age` is the retention the test uses: long enough that a call made right after the jobs
/// finished finds them younger than it.
pub async fn queue_removes_finished_jobs_past_retention<Q: Queue>(q: &Q, age: Duration) {
    let visibility = Duration::from_secs(30);
    let done = q
        .enqueue(Job::PackHousekeeping { key: "done".into() })
        .await
        .unwrap();
    let dead = q
        .enqueue(Job::PackHousekeeping { key: "dead".into() })
        .await
        .unwrap();
    let leased = q
        .enqueue(Job::PackHousekeeping {
            key: "leased".into(),
        })
        .await
        .unwrap();
    let ready = q
        .enqueue(Job::PackHousekeeping {
            key: "ready".into(),
        })
        .await
        .unwrap();
    let lease = q.lease(visibility).await.unwrap().unwrap();
    q.ack(&lease).await.unwrap();
    let lease = q.lease(visibility).await.unwrap().unwrap();
    q.dead_letter(&lease, "bad").await.unwrap();
    let _held = q.lease(visibility).await.unwrap().unwrap();
    let both = JobRetention {
        done: age,
        dead: Some(age),
    };
    assert_eq!(
        q.remove_finished(both).await.unwrap(),
        0,
        "jobs younger than the retention are kept"
    );
    tokio::time::sleep(age * 2).await;
    let keep_dead = JobRetention {
        done: age,
        dead: None,
    };
    assert_eq!(
        q.remove_finished(keep_dead).await.unwrap(),
        1,
        "the done job goes"
    );
    assert!(
        q.get(done).await.unwrap().is_none(),
        "a removed job reads as absent"
    );
    assert!(
        q.get(dead).await.unwrap().is_some(),
        "dead letters stay when their age is None"
    );
    assert_eq!(
        q.remove_finished(both).await.unwrap(),
        1,
        "then the dead letter goes"
    );
    assert!(q.get(dead).await.unwrap().is_none());
    for id in [leased, ready] {
        assert!(
            q.get(id).await.unwrap().is_some(),
            "retention never removes a job still to run"
        );
    }
}

/// A job leased for [`Duration::MAX`] is held for ever: never a panic on the instant its
/// lease would end at, never delivered to another runner, and renewable and ackable by
/// its holder. Retrying it after [`Duration::MAX`] keeps it out of sight, not a panic.
pub async fn queue_lease_for_ever_holds_the_job<Q: Queue>(q: &Q) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q.lease(Duration::MAX).await.unwrap().expect("a ready job");
    assert_eq!(lease.id, id);
    assert!(
        q.lease(Duration::from_secs(1)).await.unwrap().is_none(),
        "held for ever: nobody else gets it"
    );
    q.renew(&lease, Duration::MAX).await.unwrap();
    q.ack(&lease).await.unwrap();
    let other = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a ready job");
    assert_eq!(lease.id, other);
    let state = q
        .fail(&lease, "try again in an eternity", Duration::MAX)
        .await
        .unwrap();
    assert_eq!(state, JobState::Ready, "one failure: retried, not dead");
    assert!(
        q.lease(Duration::from_secs(1)).await.unwrap().is_none(),
        "retried after an eternity: out of sight"
    );
}

/// A ready, never-leased `pack_housekeeping` job absorbs later enqueues for its key (the
/// enqueue returns its id), so pending housekeeping is bounded by the keys written, not by
/// the writes; once it is leased, the next enqueue makes a new job (the running one may
/// have read the key already). Other keys, sweeps and a user's kinds never coalesce.
pub async fn queue_coalesces_pending_jobs_per_key<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    let pack = |key: &str| Job::PackHousekeeping { key: key.into() };
    let a = q.enqueue(pack("a")).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            q.enqueue(pack("a")).await.unwrap(),
            a,
            "a pending job for the key absorbs the enqueue and says which job holds it"
        );
    }
    let b = q.enqueue(pack("b")).await.unwrap();
    assert_ne!(a, b, "another key is another job");
    let batch = q.enqueue_batch(vec![pack("a"), pack("b"), pack("c")]).await;
    let batch: Vec<JobId> = batch.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        &batch[..2],
        &[a, b],
        "a batch enqueue coalesces like a single one"
    );
    let c = batch[2];
    assert!(c != a && c != b);
    let custom = Job::decode(br#"{"kind":"reindex","key":"a"}"#).unwrap();
    let c1 = q.enqueue(custom.clone()).await.unwrap();
    let c2 = q.enqueue(custom).await.unwrap();
    assert_ne!(c1, c2, "a user's jobs never coalesce");
    let counts = q.counts().await.unwrap();
    assert_eq!(
        counts.ready, 5,
        "three pending housekeeping jobs and two user jobs, whatever the enqueues: {counts:?}"
    );

    let lease = q.lease(visibility).await.unwrap().expect("a ready job");
    assert_eq!(lease.id, a, "oldest first");
    let again = q.enqueue(pack("a")).await.unwrap();
    assert_ne!(
        again, a,
        "a leased job absorbs nothing: a write after its handler read the key needs a new run"
    );
    assert_eq!(
        q.enqueue(pack("a")).await.unwrap(),
        again,
        "the new job is the pending one now"
    );
    q.ack(&lease).await.unwrap();
    assert_eq!(q.get(a).await.unwrap().unwrap().state, JobState::Done);
    assert_eq!(
        q.get(again).await.unwrap().unwrap().job,
        pack("a"),
        "the absorbing job reads back by the id the enqueue returned"
    );
}

/// Sweeps are leased before every other ready job, however many were enqueued first, so a
/// backlog of housekeeping never delays retention.
pub async fn queue_leases_sweeps_first<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    for key in ["a", "b", "c"] {
        q.enqueue(Job::PackHousekeeping { key: key.into() })
            .await
            .unwrap();
    }
    let sweep = q.enqueue(Job::Sweep).await.unwrap();
    let first = q.lease(visibility).await.unwrap().expect("ready jobs");
    assert_eq!(
        (first.id, first.job.clone()),
        (sweep, Job::Sweep),
        "the sweep goes before the housekeeping enqueued ahead of it"
    );
    q.ack(&first).await.unwrap();
    let next = q.lease(visibility).await.unwrap().expect("ready jobs");
    assert_eq!(
        next.job,
        Job::PackHousekeeping { key: "a".into() },
        "then the oldest"
    );
    q.ack(&next).await.unwrap();
}
