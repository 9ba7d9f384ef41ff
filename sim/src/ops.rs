//! Operations in the world: the runtime's [`JobRunner`] consuming the maintenance jobs the
//! announce legs enqueue on the source host's queue, over the wire, and the ledger that
//! checks it: no job runs on two runners whose leases overlapped, and every enqueued job
//! ends acked or dead-lettered with its last error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::{BackoffPolicy, Job, JobId};
use tidemark::{
    Error, JobContext, JobCounts, JobHandlers, JobRecord, JobRetention, JobRunner, JobState,
    Leased, Queue, Result, StopSignal, TickKey,
};
use tidemark_memory::MemoryQueue;

use crate::remote::Remote;
use crate::trace::Trace;
use crate::wire::{QueueAnswer, QueueCall, Request, Response, WireLease};

/// How long a runner's lease on a job lasts in the simulated world: short, so a crashed
/// runner's job is taken over within the run, and a slow job needs its lease renewed.
pub const JOB_VISIBILITY: Duration = Duration::from_secs(2);

/// How long a slow job's handler runs: several leases long, so only renewals keep it.
pub const SLOW_JOB: Duration = Duration::from_secs(5);

/// Attempts before the source host's queue dead-letters a job.
pub const JOB_ATTEMPTS: u32 = 3;

/// Serves one queue call on the source host's queue, telling the ledger of leases,
/// renewals and settlements.
pub async fn serve(queue: &MemoryQueue, ledger: &JobLedger, call: QueueCall) -> Response {
    let now = turmoil::sim_elapsed().unwrap_or_default();
    let answer = match call {
        QueueCall::Enqueue(job) => queue.enqueue(job).await.map(QueueAnswer::Id),
        QueueCall::EnqueueTick {
            schedule,
            anchor,
            tick,
            job,
            by: _,
        } => {
            let key = TickKey {
                schedule,
                anchor,
                tick,
            };
            queue.enqueue_tick(&key, job).await.map(QueueAnswer::Tick)
        }
        QueueCall::Lease { visibility, by } => queue.lease(visibility).await.map(|l| {
            if let Some(l) = &l {
                ledger.leased(
                    l.id,
                    l.attempt,
                    by.as_deref().unwrap_or("?"),
                    now + visibility,
                );
            }
            QueueAnswer::Leased(l.as_ref().map(WireLease::from))
        }),
        QueueCall::Renew { lease, visibility } => {
            let (id, attempt) = (lease.id, lease.attempt);
            queue.renew(&lease.into(), visibility).await.map(|()| {
                ledger.renewed(id, attempt, now + visibility);
                QueueAnswer::Done
            })
        }
        QueueCall::Ack { lease } => {
            let id = lease.id;
            queue.ack(&lease.into()).await.map(|()| {
                ledger.acked(id, now);
                QueueAnswer::Done
            })
        }
        QueueCall::Fail {
            lease,
            error,
            retry_after,
        } => queue
            .fail(&lease.into(), &error, retry_after)
            .await
            .map(|state| QueueAnswer::Failed {
                dead: state == JobState::DeadLettered,
            }),
        QueueCall::DeadLetter { lease, error } => queue
            .dead_letter(&lease.into(), &error)
            .await
            .map(|()| QueueAnswer::Done),
        QueueCall::Counts => queue.counts().await.map(|c| QueueAnswer::Counts {
            ready: c.ready,
            leased: c.leased,
            done: c.done,
            dead: c.dead,
        }),
        QueueCall::RemoveFinished { done, dead } => {
            let before = queue.jobs();
            let removed = queue.remove_finished(JobRetention { done, dead }).await;
            if let Ok(n) = removed {
                let after: std::collections::BTreeSet<JobId> =
                    queue.jobs().into_iter().map(|r| r.id).collect();
                let gone: Vec<JobRecord> = before
                    .into_iter()
                    .filter(|r| !after.contains(&r.id))
                    .collect();
                ledger.removed(&gone, JobRetention { done, dead }, now, n);
            }
            removed.map(QueueAnswer::Removed)
        }
    };
    match answer {
        Ok(a) => Response::Queue(a),
        Err(Error::LeaseLost(why)) => Response::Queue(QueueAnswer::LeaseLost(why)),
        Err(e) => Response::Failed(e.to_string()),
    }
}

fn unexpected(r: &Response) -> Error {
    Error::unavailable("queue", format!("unexpected answer {r:?}"))
}

impl Remote {
    async fn queue_call(&self, call: QueueCall) -> Result<QueueAnswer> {
        match self.call("queue", Request::Queue(call)).await? {
            Response::Queue(QueueAnswer::LeaseLost(why)) => Err(Error::LeaseLost(why)),
            Response::Queue(a) => Ok(a),
            r => Err(unexpected(&r)),
        }
    }
}

fn not_served(what: &str) -> Error {
    Error::unavailable(
        "queue",
        format!("{what} is an operator's call, not served over the simulator's wire"),
    )
}

/// The source host's job queue, reached over the wire: what the announce legs enqueue on,
/// what the job runners lease from and what sweeps remove finished jobs from. The
/// operator's calls (reading a job back, the dead letter list, requeue) are not served
/// here: nothing in the world makes them.
impl Queue for Remote {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        match self.queue_call(QueueCall::Enqueue(job)).await? {
            QueueAnswer::Id(id) => Ok(id),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn enqueue_tick(&self, tick: &TickKey, job: Job) -> Result<Option<JobId>> {
        let call = QueueCall::EnqueueTick {
            schedule: tick.schedule.clone(),
            anchor: tick.anchor,
            tick: tick.tick,
            job,
            by: self.owner().map(str::to_owned),
        };
        match self.queue_call(call).await? {
            QueueAnswer::Tick(id) => Ok(id),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn get(&self, _id: JobId) -> Result<Option<JobRecord>> {
        Err(not_served("reading a job back"))
    }

    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        let call = QueueCall::Lease {
            visibility,
            by: self.owner().map(str::to_owned),
        };
        match self.queue_call(call).await? {
            QueueAnswer::Leased(l) => Ok(l.map(Leased::from)),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn ack(&self, lease: &Leased) -> Result<()> {
        self.queue_call(QueueCall::Ack {
            lease: lease.into(),
        })
        .await
        .map(drop)
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        let call = QueueCall::Fail {
            lease: lease.into(),
            error: error.to_owned(),
            retry_after,
        };
        match self.queue_call(call).await? {
            QueueAnswer::Failed { dead: true } => Ok(JobState::DeadLettered),
            QueueAnswer::Failed { dead: false } => Ok(JobState::Ready),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn renew(&self, lease: &Leased, visibility: Duration) -> Result<()> {
        self.queue_call(QueueCall::Renew {
            lease: lease.into(),
            visibility,
        })
        .await
        .map(drop)
    }

    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        self.queue_call(QueueCall::DeadLetter {
            lease: lease.into(),
            error: error.to_owned(),
        })
        .await
        .map(drop)
    }

    async fn dead_letters(&self, _after: Option<JobId>, _limit: usize) -> Result<Vec<JobRecord>> {
        Err(not_served("listing dead letters"))
    }

    async fn requeue(&self, _id: JobId) -> Result<JobId> {
        Err(not_served("requeueing a dead letter"))
    }

    async fn counts(&self) -> Result<JobCounts> {
        match self.queue_call(QueueCall::Counts).await? {
            QueueAnswer::Counts {
                ready,
                leased,
                done,
                dead,
            } => Ok(JobCounts {
                ready,
                leased,
                done,
                dead,
            }),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        let call = QueueCall::RemoveFinished {
            done: retention.done,
            dead: retention.dead,
        };
        match self.queue_call(call).await? {
            QueueAnswer::Removed(n) => Ok(n),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }
}

/// Job faults armed by the orchestrator, read by the runners' handlers (outlive hosts).
#[derive(Debug, Default)]
pub struct JobFaults {
    /// The next job handled runs for [`SLOW_JOB`].
    pub slow_next: AtomicBool,
    /// The next this-many handler calls fail.
    pub fail_next: AtomicU32,
    /// The sweep schedulers enqueue without the (schedule, tick) key (the `naive-ticks`
    /// strategy).
    pub naive_ticks: AtomicBool,
}

/// One handler run of a job, as the ledger saw it.
#[derive(Clone, Debug)]
struct Run {
    runner: String,
    started: Duration,
    ended: Option<Duration>,
    slow: bool,
}

#[derive(Debug, Default)]
struct JobEntry {
    /// Lease expiry by attempt, as the queue last granted or renewed it.
    leases: BTreeMap<u32, (String, Duration)>,
    /// Handler runs by attempt.
    runs: BTreeMap<u32, Run>,
}

#[derive(Debug, Default)]
struct LedgerState {
    jobs: BTreeMap<JobId, JobEntry>,
    /// When each job was acked, as the queue answered it.
    done_at: BTreeMap<JobId, Duration>,
    /// Finished jobs retention removed.
    removed: u64,
    violations: Vec<String>,
    takeovers: u32,
    renewals: u32,
    slow_redelivered: u32,
}

/// What the job runners did, checked as they do it: a handler that starts while another
/// runner's run of the same job still holds an unexpired lease is a violation (the lease
/// is the queue's promise of exclusivity, and a runner whose lease is lost must stop).
/// A start after another run's lease ran out is a takeover, counted and by design.
#[derive(Clone, Debug, Default)]
pub struct JobLedger {
    inner: Arc<Mutex<LedgerState>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl JobLedger {
    fn leased(&self, id: JobId, attempt: u32, by: &str, until: Duration) {
        let mut s = lock(&self.inner);
        s.jobs
            .entry(id)
            .or_default()
            .leases
            .insert(attempt, (by.to_owned(), until));
    }

    fn renewed(&self, id: JobId, attempt: u32, until: Duration) {
        let mut s = lock(&self.inner);
        s.renewals += 1;
        if let Some(l) = s.jobs.entry(id).or_default().leases.get_mut(&attempt) {
            l.1 = until;
        }
    }

    fn started(&self, id: JobId, attempt: u32, runner: &str, slow: bool) {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let entry = s.jobs.entry(id).or_default();
        let mut found = Vec::new();
        let mut takeover = false;
        for (other, run) in &entry.runs {
            if *other == attempt || run.ended.is_some() {
                continue;
            }
            let until = entry.leases.get(other).map_or(Duration::ZERO, |l| l.1);
            if until > now {
                found.push(format!(
                    "job {id} attempt {attempt} started on {runner} at {now:?} while attempt {other} ran on {} since {:?} under a lease until {until:?}",
                    run.runner, run.started
                ));
            } else {
                takeover = true;
            }
        }
        let slow_taken = takeover && entry.runs.values().any(|r| r.slow && r.ended.is_none());
        entry.runs.insert(
            attempt,
            Run {
                runner: runner.to_owned(),
                started: now,
                ended: None,
                slow,
            },
        );
        s.takeovers += u32::from(takeover);
        s.slow_redelivered += u32::from(slow_taken);
        s.violations.extend(found);
    }

    fn ended(&self, id: JobId, attempt: u32) {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        if let Some(run) = s.jobs.get_mut(&id).and_then(|e| e.runs.get_mut(&attempt)) {
            run.ended = Some(now);
        }
    }

    fn acked(&self, id: JobId, now: Duration) {
        lock(&self.inner).done_at.entry(id).or_insert(now);
    }

    /// Checks what finished-job retention removed: only jobs done at least `retention`'s
    /// `done` age ago, and dead letters only past its `dead` age.
    fn removed(&self, gone: &[JobRecord], retention: JobRetention, now: Duration, n: u64) {
        let mut s = lock(&self.inner);
        s.removed += n;
        let mut found = Vec::new();
        for r in gone {
            let ok = match r.state {
                JobState::Done => s
                    .done_at
                    .get(&r.id)
                    .is_some_and(|at| now.saturating_sub(*at) >= retention.done),
                // The queue's own dead-letter time is not seen here: only a retention that
                // never removes dead letters is checked exactly.
                JobState::DeadLettered => retention.dead.is_some(),
                _ => false,
            };
            if !ok {
                found.push(format!(
                    "job retention ({retention:?}) removed job {} ({:?}, acked at {:?}) at {now:?}",
                    r.id,
                    r.state,
                    s.done_at.get(&r.id)
                ));
            }
        }
        s.violations.extend(found);
    }

    /// Finished jobs removed by retention so far.
    #[must_use]
    pub fn jobs_removed(&self) -> u64 {
        lock(&self.inner).removed
    }

    /// Violations found so far.
    #[must_use]
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner).violations.clone()
    }

    /// (jobs handled at least once, runs started after another run's lease ran out,
    /// lease renewals, slow jobs delivered again while their first run went on).
    #[must_use]
    pub fn counts(&self) -> (u32, u32, u32, u32) {
        let s = lock(&self.inner);
        let handled = s.jobs.values().filter(|e| !e.runs.is_empty()).count();
        (
            u32::try_from(handled).unwrap_or(u32::MAX),
            s.takeovers,
            s.renewals,
            s.slow_redelivered,
        )
    }

    /// Whether a run of some job is going on on `runner` now.
    #[must_use]
    pub fn running_on(&self, runner: &str) -> bool {
        lock(&self.inner).jobs.values().any(|e| {
            e.runs
                .values()
                .any(|r| r.runner == runner && r.ended.is_none())
        })
    }
}

/// Marks a run ended when the handler's future ends or is dropped (its lease lost, its
/// host crashed).
struct RunGuard {
    ledger: JobLedger,
    id: JobId,
    attempt: u32,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.ledger.ended(self.id, self.attempt);
    }
}

/// Every enqueued job that has not ended acked or dead-lettered with its last error, as
/// failure lines (empty when all did).
#[must_use]
pub fn unsettled(queue: &MemoryQueue) -> Vec<String> {
    queue
        .jobs()
        .into_iter()
        .filter_map(|r| match r.state {
            JobState::Done => None,
            JobState::DeadLettered if r.last_error.is_some() => None,
            state => Some(format!(
                "job {} ({}) ended {state:?} after {} attempts, last error {:?}",
                r.id,
                r.job.kind(),
                r.attempts,
                r.last_error
            )),
        })
        .collect()
}

/// The source host's queue, its leases on `clock` (which outlives the host's runtimes).
#[must_use]
pub fn source_queue(
    faults: tidemark_memory::Faults,
    clock: impl Fn() -> tokio::time::Instant + Send + Sync + 'static,
) -> MemoryQueue {
    MemoryQueue::with_clock(faults, clock).with_max_attempts(JOB_ATTEMPTS)
}

/// A job runner on host `owner` (a worker process beside its relay), running the runtime's
/// [`JobRunner`] over the source host's queue until its host crashes. Housekeeping takes
/// a few tens of milliseconds, [`SLOW_JOB`] when the plan made it slow, and fails when the
/// plan armed a failure.
pub async fn runner(
    owner: String,
    seed: u64,
    ledger: JobLedger,
    faults: Arc<JobFaults>,
    trace: Trace,
) -> Result<()> {
    let remote = Remote::relay(crate::scenario::SOURCE, owner.clone());
    let name = owner.clone();
    let handlers =
        JobHandlers::new().on(["pack_housekeeping"], move |job: Job, ctx: JobContext| {
            let (ledger, faults, name) = (ledger.clone(), Arc::clone(&faults), name.clone());
            async move {
                let slow = faults.slow_next.swap(false, Ordering::SeqCst);
                ledger.started(ctx.id, ctx.attempt, &name, slow);
                let _guard = RunGuard {
                    ledger,
                    id: ctx.id,
                    attempt: ctx.attempt,
                };
                let took = if slow {
                    SLOW_JOB
                } else {
                    Duration::from_millis(20 + (ctx.id.0 * 37 + u64::from(ctx.attempt)) % 60)
                };
                tokio::time::sleep(took).await;
                let failing = faults
                    .fail_next
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if failing {
                    return Err(format!("injected failure of {job:?}"));
                }
                Ok::<(), String>(())
            }
        });
    // The `sweep` jobs the sweep scheduler enqueues: a sweep under the sweeper lock.
    let handlers = tidemark::with_sweep_job(
        handlers,
        remote.clone(),
        crate::sweeps::sweep_of(&remote),
        owner.clone(),
        crate::sweeps::SWEEP_LEASE,
    );
    let retry = BackoffPolicy::new(
        Duration::from_millis(200),
        2.0,
        Duration::from_secs(2),
        Duration::from_secs(10),
        0.5,
    )
    .map_err(|e| Error::unavailable("job runner", e.to_string()))?;
    let runner = JobRunner::new(owner.clone(), remote, handlers)
        .concurrency(2)
        .visibility(JOB_VISIBILITY)
        .idle_poll(Duration::from_millis(250))
        .retry_backoff(retry)
        .seed(seed);
    trace.line(format!("{owner} job runner starts"));
    let counters = runner.run(StopSignal::never()).await?;
    trace.line(format!("{owner} job runner ended: {counters:?}"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_started_while_another_runner_holds_a_live_lease_on_it_is_a_violation() {
        let ledger = JobLedger::default();
        let id = JobId(7);
        ledger.leased(id, 1, "relay-0", Duration::from_secs(2));
        ledger.started(id, 1, "relay-0", false);
        // A queue that handed the job out again under that lease.
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("relay-0") && v[0].contains("relay-1"),
            "{v:?}"
        );
    }

    #[test]
    fn a_job_started_after_the_other_runs_lease_ran_out_is_a_takeover_not_a_violation() {
        let ledger = JobLedger::default();
        let id = JobId(7);
        // Outside a simulation the clock reads zero: a lease until zero has run out.
        ledger.leased(id, 1, "relay-0", Duration::ZERO);
        ledger.started(id, 1, "relay-0", true);
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        assert!(ledger.violations().is_empty());
        assert_eq!(ledger.counts(), (1, 1, 0, 1));
        assert!(ledger.running_on("relay-0") && ledger.running_on("relay-1"));
    }

    #[test]
    fn a_run_whose_handler_is_dropped_has_ended() {
        let ledger = JobLedger::default();
        let id = JobId(3);
        ledger.leased(id, 1, "relay-0", Duration::from_secs(2));
        ledger.started(id, 1, "relay-0", false);
        drop(RunGuard {
            ledger: ledger.clone(),
            id,
            attempt: 1,
        });
        assert!(!ledger.running_on("relay-0"));
        // Ended: a later attempt on another runner is no overlap, whatever the lease said.
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        assert!(ledger.violations().is_empty());
    }
}
