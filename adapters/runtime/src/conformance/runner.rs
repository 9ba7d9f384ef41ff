//! The job runner over any `Queue`: renewals, crashes, dead letters and wakes.

use super::common::*;

/// A job that runs for three visibility timeouts, with a second runner waiting for work,
/// runs once: the [`JobRunner`] renews its lease while the handler runs.
pub async fn runner_renews_a_slow_jobs_lease<Q: Queue + Clone + 'static>(
    q: &Q,
    visibility: Duration,
) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let runner = |name: &str| {
        let runs = std::sync::Arc::clone(&runs);
        let handlers = JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let runs = std::sync::Arc::clone(&runs);
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(visibility * 3).await;
                Ok::<(), String>(())
            }
        });
        JobRunner::new(name, q.clone(), handlers)
            .visibility(visibility)
            .idle_poll(visibility / 10)
            .spawn()
    };
    let (a, b) = (runner("a"), runner("b"));
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let attempts = wait_for_state(q, id, JobState::Done, visibility * 20).await;
    let renewals = a.counters().renewals + b.counters().renewals;
    a.stop_within(visibility * 5).await.unwrap();
    b.stop_within(visibility * 5).await.unwrap();
    assert_eq!(attempts, 1, "a renewed lease is never delivered again");
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the slow job ran once though another runner was idle"
    );
    assert!(
        renewals >= 2,
        "renewed every third of the visibility ({renewals} renewals)"
    );
}

/// A runner that dies mid-job (aborted, as a crash) loses nothing: once its lease
/// expires, a new runner gets the job and finishes it.
pub async fn runner_crash_redelivers_its_job<Q: Queue + Clone + 'static>(
    q: &Q,
    visibility: Duration,
) {
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let crashing = {
        let started = std::sync::Arc::clone(&started);
        JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let started = std::sync::Arc::clone(&started);
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<(), String>(())
            }
        })
    };
    let a = JobRunner::new("a", q.clone(), crashing)
        .visibility(visibility)
        .idle_poll(visibility / 10)
        .spawn();
    let id = q.enqueue(Job::Sweep).await.unwrap();
    tokio::time::timeout(visibility * 20, started.notified())
        .await
        .expect("the first runner starts the job");
    a.abort();
    let ok = JobHandlers::new().on(["sweep"], |_: Job, _| async { Ok::<(), String>(()) });
    let b = JobRunner::new("b", q.clone(), ok)
        .visibility(visibility)
        .idle_poll(visibility / 10)
        .spawn();
    let attempts = wait_for_state(q, id, JobState::Done, visibility * 20).await;
    let counters = b.stop_within(visibility * 5).await.unwrap();
    assert_eq!(
        attempts, 2,
        "the crashed attempt counts, and the job runs again"
    );
    assert_eq!(counters.acked, 1, "the new runner finished it");
}

/// A job of a kind no handler takes, or whose payload does not decode into its handler's
/// type, is dead-lettered at its first attempt with an error that says so; the runner
/// goes on with the next job.
pub async fn runner_dead_letters_what_it_cannot_run<Q: Queue + Clone + 'static>(q: &Q) {
    #[derive(serde::Serialize, serde::Deserialize)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    enum Mine {
        Resize { width: u32 },
    }
    let unknown = q
        .enqueue(Job::decode(br#"{"kind":"reboot"}"#).unwrap())
        .await
        .unwrap();
    let undecodable = q
        .enqueue(Job::decode(br#"{"kind":"resize","width":"wide"}"#).unwrap())
        .await
        .unwrap();
    let good = q
        .enqueue(Job::custom(&Mine::Resize { width: 640 }).unwrap())
        .await
        .unwrap();
    let handlers = JobHandlers::new().on(["resize"], |job: Mine, _| async move {
        let Mine::Resize { width } = job;
        if width == 640 {
            Ok(())
        } else {
            Err(format!("width {width}"))
        }
    });
    let runner = JobRunner::new("r", q.clone(), handlers)
        .idle_poll(Duration::from_millis(20))
        .spawn();
    let within = Duration::from_secs(30);
    assert_eq!(wait_for_state(q, good, JobState::Done, within).await, 1);
    for (id, says) in [(unknown, "no handler"), (undecodable, "does not decode")] {
        assert_eq!(
            wait_for_state(q, id, JobState::DeadLettered, within).await,
            1,
            "no retry can help a job nothing can run: dead-lettered at once"
        );
        let error = q
            .get(id)
            .await
            .unwrap()
            .unwrap()
            .last_error
            .unwrap_or_default();
        assert!(error.contains(says), "the dead letter says why: {error}");
    }
    let counters = runner.stop_within(within).await.unwrap();
    assert_eq!((counters.acked, counters.dead_lettered), (1, 2));
}

/// A runner waiting on an empty queue that signals readiness
/// ([`Queue::ready_signal`]) runs a job enqueued meanwhile at once, not after its idle
/// poll, which here is an hour: the poll is only the backstop.
pub async fn runner_wakes_on_enqueue<Q: Queue + Clone + 'static>(q: &Q) {
    const POLL: Duration = Duration::from_secs(3600);
    assert!(
        q.ready_signal().is_some(),
        "this queue says it can tell a runner when jobs are ready"
    );
    let ran = std::sync::Arc::new(tokio::sync::Notify::new());
    let handlers = {
        let ran = std::sync::Arc::clone(&ran);
        JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let ran = std::sync::Arc::clone(&ran);
            async move {
                ran.notify_one();
                Ok::<(), String>(())
            }
        })
    };
    let runner = JobRunner::new("woken", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    // Long enough for the runner to find the queue empty and wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let enqueued = tokio::time::Instant::now();
    q.enqueue(Job::Sweep).await.unwrap();
    tokio::time::timeout(POLL / 2, ran.notified())
        .await
        .expect("the enqueue wakes the waiting runner before its idle poll");
    assert!(
        enqueued.elapsed() < Duration::from_secs(30),
        "woken by the enqueue, not by the poll: {:?}",
        enqueued.elapsed()
    );
    runner.stop_within(Duration::from_secs(10)).await.unwrap();
}
