//! The job runner over the memory queue, under paused time: its concurrency limit, drain
//! on stop within a budget, retries with backoff up to the dead letter, panicking
//! handlers, and typed user jobs. (Lease renewal, crash redelivery and undecodable jobs
//! are conformance bodies every adapter runs.)
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tidemark::{Error, Job, JobHandlers, JobId, JobRunner, JobState, Queue};
use tidemark_memory::{Faults, MemoryQueue, Port};
use tokio::time::Instant;

const POLL: Duration = Duration::from_millis(10);

async fn wait_for(q: &MemoryQueue, id: JobId, state: JobState) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(3_600);
    loop {
        // Read past the queue's injected faults: they are the runner's to meet.
        let rec = q.jobs().into_iter().find(|r| r.id == id).unwrap();
        if rec.state == state {
            return rec.attempts;
        }
        assert!(Instant::now() < deadline, "{id} never reached {state:?}");
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_concurrency_limit_holds() {
    let q = MemoryQueue::default();
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handlers = {
        let (now, most) = (Arc::clone(&now), Arc::clone(&most));
        JobHandlers::new().on(["pack_housekeeping"], move |_: Job, _| {
            let (now, most) = (Arc::clone(&now), Arc::clone(&most));
            async move {
                let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(running, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                Ok::<(), String>(())
            }
        })
    };
    let mut ids = Vec::new();
    for i in 0..10 {
        let job = Job::PackHousekeeping {
            key: format!("k{i}"),
        };
        ids.push(q.enqueue(job).await.unwrap());
    }
    let runner = JobRunner::new("limited", q.clone(), handlers)
        .concurrency(3)
        .idle_poll(POLL)
        .spawn();
    for id in &ids {
        wait_for(&q, *id, JobState::Done).await;
    }
    let counters = runner.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "ten jobs waiting, a limit of three: three at once, never more"
    );
    assert_eq!(counters.acked, 10);
}

#[tokio::test(start_paused = true)]
async fn stop_drains_the_jobs_in_flight_and_leases_no_more() {
    let q = MemoryQueue::default();
    let started = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let started = Arc::clone(&started);
        JobHandlers::new().on(["pack_housekeeping"], move |_: Job, _| {
            let started = Arc::clone(&started);
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<(), String>(())
            }
        })
    };
    let mut ids = Vec::new();
    for i in 0..3 {
        let job = Job::PackHousekeeping {
            key: format!("k{i}"),
        };
        ids.push(q.enqueue(job).await.unwrap());
    }
    let runner = JobRunner::new("draining", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    while started.load(Ordering::SeqCst) < 3 {
        tokio::time::sleep(POLL).await;
    }
    let late = q
        .enqueue(Job::PackHousekeeping { key: "late".into() })
        .await
        .unwrap();
    let counters = runner.stop_within(Duration::from_secs(30)).await.unwrap();
    for id in ids {
        assert_eq!(
            q.get(id).await.unwrap().unwrap().state,
            JobState::Done,
            "a job in flight at stop finishes and is acked"
        );
    }
    assert_eq!(counters.acked, 3);
    assert_eq!(
        q.get(late).await.unwrap().unwrap().state,
        JobState::Ready,
        "a stopping runner leases nothing more"
    );
}

#[tokio::test(start_paused = true)]
async fn a_drain_past_its_budget_is_cut_and_the_job_comes_back() {
    let q = MemoryQueue::default();
    let handlers = JobHandlers::new().on(["sweep"], |_: Job, _| async {
        tokio::time::sleep(Duration::from_secs(3_600)).await;
        Ok::<(), String>(())
    });
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let runner = JobRunner::new("slow", q.clone(), handlers)
        .visibility(Duration::from_secs(3))
        .idle_poll(POLL)
        .spawn();
    wait_for(&q, id, JobState::Leased).await;
    let stopped = runner.stop_within(Duration::from_secs(1)).await;
    assert!(
        matches!(stopped, Err(Error::Timeout { .. })),
        "a drain that overruns its budget is cut: {stopped:?}"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let again = q.lease(Duration::from_secs(3)).await.unwrap();
    assert_eq!(
        again.map(|l| (l.id, l.attempt)),
        Some((id, 2)),
        "its lease is no longer renewed, so the job is delivered again"
    );
}

#[tokio::test(start_paused = true)]
async fn failures_retry_after_a_growing_backoff_then_dead_letter_with_the_last_error() {
    let q = MemoryQueue::default().with_max_attempts(3);
    let attempts_at = Arc::new(Mutex::new(Vec::new()));
    let handlers = {
        let attempts_at = Arc::clone(&attempts_at);
        JobHandlers::new().on(["sweep"], move |_: Job, ctx| {
            attempts_at.lock().unwrap().push(Instant::now());
            async move { Err::<(), String>(format!("broken on attempt {}", ctx.attempt)) }
        })
    };
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let runner = JobRunner::new("failing", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    assert_eq!(wait_for(&q, id, JobState::DeadLettered).await, 3);
    let counters = runner.stop_within(Duration::from_secs(5)).await.unwrap();
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(
        rec.last_error.as_deref(),
        Some("broken on attempt 3"),
        "the dead letter keeps the last error"
    );
    assert_eq!((counters.failed, counters.dead_lettered), (2, 1));
    let at = attempts_at.lock().unwrap().clone();
    let gaps: Vec<_> = at.windows(2).map(|w| w[1] - w[0]).collect();
    // job_retry: 1 s then 2 s, each cut by at most half at random.
    assert!(
        gaps[0] >= Duration::from_millis(500) && gaps[0] <= Duration::from_millis(1_100),
        "the first retry waits about the first backoff delay: {gaps:?}"
    );
    assert!(
        gaps[1] >= Duration::from_secs(1) && gaps[1] <= Duration::from_millis(2_100),
        "the second waits about twice as long: {gaps:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_fails_its_attempt_and_the_runner_goes_on() {
    let q = MemoryQueue::default();
    let handlers = JobHandlers::new().on(["pack_housekeeping"], |job: Job, _| async move {
        if job == (Job::PackHousekeeping { key: "boom".into() }) {
            panic!("the handler blew up");
        }
        Ok::<(), String>(())
    });
    let boom = q
        .enqueue(Job::PackHousekeeping { key: "boom".into() })
        .await
        .unwrap();
    let fine = q
        .enqueue(Job::PackHousekeeping { key: "fine".into() })
        .await
        .unwrap();
    let runner = JobRunner::new("panics", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    wait_for(&q, fine, JobState::Done).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let error = loop {
        let rec = q.get(boom).await.unwrap().unwrap();
        if let Some(e) = rec.last_error {
            break e;
        }
        assert!(Instant::now() < deadline, "the panic was recorded");
        tokio::time::sleep(POLL).await;
    };
    assert!(error.contains("the handler blew up"), "{error}");
    assert!(
        !runner.is_finished(),
        "a panicking handler does not end the runner"
    );
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_runner_runs_its_handlers_inside_its_own_task_and_spawns_none() {
    // A simulator that crashes a host drops its tasks in an order that follows tokio's
    // process-wide task ids; a runner that spawned its handlers made a seed's replay
    // depend on what else the process had spawned before.
    let q = MemoryQueue::default();
    let most_tasks = Arc::new(AtomicUsize::new(usize::MAX));
    let ran = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let (most_tasks, ran) = (Arc::clone(&most_tasks), Arc::clone(&ran));
        JobHandlers::new().on(["pack_housekeeping"], move |_: Job, _| {
            let (most_tasks, ran) = (Arc::clone(&most_tasks), Arc::clone(&ran));
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let alive = tokio::runtime::Handle::current()
                    .metrics()
                    .num_alive_tasks();
                most_tasks
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |m| {
                        Some(if m == usize::MAX { alive } else { m.max(alive) })
                    })
                    .unwrap();
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<(), String>(())
            }
        })
    };
    for i in 0..6 {
        q.enqueue(Job::PackHousekeeping {
            key: format!("k{i}"),
        })
        .await
        .unwrap();
    }
    let runner = JobRunner::new("inline", q.clone(), handlers)
        .concurrency(3)
        .idle_poll(POLL);
    let shutdown = tidemark::Shutdown::new();
    let watch = async {
        while ran.load(Ordering::SeqCst) < 6 {
            tokio::time::sleep(POLL).await;
        }
        shutdown.trigger();
    };
    // The runner's future runs right here, in the test's own (unspawned) future.
    let (counters, ()) = tokio::join!(runner.run(shutdown.signal()), watch);
    assert_eq!(counters.unwrap().acked, 6);
    assert_eq!(
        most_tasks.load(Ordering::SeqCst),
        0,
        "while three handlers ran, the runtime had tasks alive: the runner spawned them"
    );
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Mail {
    Welcome { to: String },
    Digest { to: String, day: u32 },
}

#[tokio::test(start_paused = true)]
async fn typed_user_jobs_reach_their_handler_beside_the_built_in_ones() {
    let q = MemoryQueue::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let handlers = {
        let (mail, builtin) = (Arc::clone(&seen), Arc::clone(&seen));
        JobHandlers::new()
            .on(["welcome", "digest"], move |m: Mail, ctx| {
                mail.lock().unwrap().push(format!("{}: {m:?}", ctx.kind));
                async { Ok::<(), String>(()) }
            })
            .on(["sweep"], move |job: Job, _| {
                builtin.lock().unwrap().push(format!("{job:?}"));
                async { Ok::<(), String>(()) }
            })
    };
    let jobs = [
        Job::custom(&Mail::Welcome { to: "ann".into() }).unwrap(),
        Job::Sweep,
        Job::custom(&Mail::Digest {
            to: "bo".into(),
            day: 3,
        })
        .unwrap(),
    ];
    let mut ids = Vec::new();
    for job in jobs {
        ids.push(q.enqueue(job).await.unwrap());
    }
    let runner = JobRunner::new("typed", q.clone(), handlers)
        .concurrency(1)
        .idle_poll(POLL)
        .spawn();
    for id in ids {
        wait_for(&q, id, JobState::Done).await;
    }
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            "Sweep".to_owned(),
            r#"welcome: Welcome { to: "ann" }"#.to_owned(),
            r#"digest: Digest { to: "bo", day: 3 }"#.to_owned(),
        ],
        "each job reaches the handler of its kind, decoded as the type registered (the \
         sweep first: sweeps go before other ready jobs)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_queue_blip_at_ack_does_not_run_a_finished_job_again() {
    let faults = Faults::new();
    let q = MemoryQueue::new(faults.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let (runs, faults) = (Arc::clone(&runs), faults.clone());
        JobHandlers::new().on(["sweep"], move |_: Job, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            // The queue is away for the next two calls: the ack's.
            faults.fail_next(Port::Queue, 2);
            async { Ok::<(), String>(()) }
        })
    };
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let runner = JobRunner::new("blip", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    let attempts = wait_for(&q, id, JobState::Done).await;
    let counters = runner.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        (attempts, runs.load(Ordering::SeqCst)),
        (1, 1),
        "the ack is tried again within the lease, so the job runs once"
    );
    assert_eq!((counters.acked, counters.queue_errors), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn a_queue_that_is_away_is_backed_off_and_jobs_run_once_it_is_back() {
    let faults = Faults::new();
    let q = MemoryQueue::new(faults.clone());
    let handlers = JobHandlers::new().on(["sweep"], |_: Job, _| async { Ok::<(), String>(()) });
    let id = q.enqueue(Job::Sweep).await.unwrap();
    faults.set_failing(Port::Queue, true);
    let runner = JobRunner::new("away", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let errors = runner.counters().queue_errors;
    // 50 ms doubling to 5 s: about 20 tries in a minute, not 6,000 polls.
    assert!(
        (5..=40).contains(&errors),
        "a queue that is away is retried with backoff, not hammered: {errors} tries"
    );
    faults.set_failing(Port::Queue, false);
    wait_for(&q, id, JobState::Done).await;
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_long_handler_hears_the_stop_and_its_job_comes_back_later() {
    let q = MemoryQueue::default();
    let handlers = JobHandlers::new().on(
        ["sweep"],
        |_: Job, mut ctx: tidemark::JobContext| async move {
            tokio::select! {
                biased;
                () = ctx.stopping.stopped() => Err("stopped before the end; later".to_owned()),
                () = tokio::time::sleep(Duration::from_secs(3_600)) => Ok(()),
            }
        },
    );
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let runner = JobRunner::new("long", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    wait_for(&q, id, JobState::Leased).await;
    let counters = runner.stop_within(Duration::from_secs(1)).await.unwrap();
    assert_eq!(
        counters.failed, 1,
        "the handler ended early, within the budget"
    );
    let rec = q.jobs().into_iter().find(|r| r.id == id).unwrap();
    assert_eq!(
        (rec.state, rec.last_error.as_deref()),
        (JobState::Ready, Some("stopped before the end; later")),
        "its job is ready again for the next runner"
    );
}

/// Counts a job's runs going at once, and notes when the first attempt's run ended (its
/// future completed or was dropped).
struct RunGuard {
    running: Arc<AtomicUsize>,
    first_ended: Option<Arc<Mutex<Option<Instant>>>>,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::SeqCst);
        if let Some(ended) = &self.first_ended {
            *ended.lock().unwrap() = Some(Instant::now());
        }
    }
}

/// A runner that cannot renew a lease (the queue is unreachable) stops the job's handler
/// before the lease ends and does not ack for it: when the job is delivered again, its
/// first run is over. Why: past its lease the job may be another runner's, and a handler
/// still running then runs the job twice at the same time. At least once stays; at the
/// same time goes.
#[tokio::test(start_paused = true)]
async fn a_lease_that_cannot_be_renewed_stops_its_handler_before_it_ends() {
    const VISIBILITY: Duration = Duration::from_millis(300);
    let faults = Faults::new();
    let q = MemoryQueue::new(faults.clone());
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let first_ended: Arc<Mutex<Option<Instant>>> = Arc::default();
    let started = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let (running, most) = (Arc::clone(&running), Arc::clone(&most));
        let (first_ended, started) = (Arc::clone(&first_ended), Arc::clone(&started));
        JobHandlers::new().on(["sweep"], move |_: Job, ctx| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            started.fetch_add(1, Ordering::SeqCst);
            let guard = RunGuard {
                running: Arc::clone(&running),
                first_ended: (ctx.attempt == 1).then(|| Arc::clone(&first_ended)),
            };
            async move {
                let _guard = guard;
                if ctx.attempt == 1 {
                    // Works on for ever: only the runner can end it.
                    std::future::pending::<()>().await;
                }
                Ok::<(), String>(())
            }
        })
    };
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let leased_by = Instant::now();
    let runner = JobRunner::new("cut off", q.clone(), handlers)
        .visibility(VISIBILITY)
        .idle_poll(POLL)
        .spawn();
    while started.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // From here the queue answers nothing: no renewal goes through.
    faults.set_failing(Port::Queue, true);
    tokio::time::sleep(VISIBILITY * 2).await;
    let ended = *first_ended.lock().unwrap();
    assert!(
        ended.is_some_and(|at| at <= leased_by + VISIBILITY),
        "the handler is stopped by the end of a lease it could not renew (lease taken by \
         {leased_by:?} for {VISIBILITY:?}; the run ended {ended:?})"
    );
    faults.set_failing(Port::Queue, false);
    assert_eq!(
        wait_for(&q, id, JobState::Done).await,
        2,
        "the job runs again: at least once"
    );
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "never two runs of the job at the same time"
    );
    let counters = runner.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(counters.acked, 1, "only the second run is acked");
    assert!(counters.lost >= 1, "the lease that ended is counted lost");
}
