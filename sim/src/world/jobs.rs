//! The job runners: the runtime's [`JobRunner`] on each worker host, consuming the
//! maintenance jobs the announce legs enqueue on the source host's queue, over the wire,
//! with the faults the plan arms in their handlers. Every run is told to the jobs' ledger.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{BackoffPolicy, Job};
use tidemark::{Error, JobContext, JobHandlers, JobRunner, Result, StopSignal};

use crate::checks::jobs::{JobLedger, RunGuard};
use crate::clients::remote::Remote;
use crate::clients::sweeps::sweep_of;
use crate::scenario::{SOURCE, SWEEP_LEASE};
use crate::trace::Trace;

/// How long a runner's lease on a job lasts in the simulated world: short, so a crashed
/// runner's job is taken over within the run, and a slow job needs its lease renewed.
pub const JOB_VISIBILITY: Duration = Duration::from_secs(2);

/// How long a slow job's handler runs: several leases long, so only renewals keep it.
pub const SLOW_JOB: Duration = Duration::from_secs(5);

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
    let remote = Remote::relay(SOURCE, owner.clone());
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
        sweep_of(&remote),
        owner.clone(),
        SWEEP_LEASE,
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
