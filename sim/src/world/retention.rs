//! Retention on the worker hosts: the runtime's sweeps of the source host's history,
//! outbox and finished jobs, run on their schedule under the sweeper lock, over the wire.
//!
//! Worker host 0 (and every even one) runs the runtime's `run_retention` (the schedule,
//! the lock and the sweep in one driver); the odd ones run `run_scheduler`, which enqueues
//! a `sweep` job on each tick for the job runners, whose handlers take it with
//! `with_sweep_job`. Both claim the same durable schedule, so each tick is swept once by
//! one path or the other. Every sweep is `SweepWithJobs`: the source host's
//! `MemorySweep`, then the queue's finished-job retention. The sweeps' ledger
//! ([`crate::checks::sweeps`]) checks them on the source host.

use tidemark::{Error, Result, Retention, StopSignal, run_retention, run_scheduler};

use crate::clients::naive::KeylessTicks;
use crate::clients::remote::Remote;
use crate::clients::sweeps::sweep_of;
use crate::scenario::{SOURCE, SWEEP_EVERY, SWEEP_LEASE};
use crate::trace::Trace;

/// Worker host `i`'s retention: the runtime's `run_retention` on even hosts, its
/// `run_scheduler` enqueueing `sweep` jobs for the job runners on odd ones. Runs until
/// the host crashes.
pub async fn retention(i: usize, owner: String, trace: Trace, naive_ticks: bool) -> Result<()> {
    let remote = Remote::relay(SOURCE, owner.clone());
    let config = Retention::new(owner.clone())
        .and_then(|r| r.every(SWEEP_EVERY))
        .and_then(|r| r.lease(SWEEP_LEASE))
        .map_err(|e| Error::unavailable("retention", e.to_string()))?;
    if i % 2 == 0 {
        trace.line(format!("{owner} retention driver starts"));
        run_retention(
            &remote,
            &remote,
            &sweep_of(&remote),
            config,
            StopSignal::never(),
        )
        .await;
    } else {
        trace.line(format!("{owner} sweep scheduler starts"));
        // Stored by the scheduler's first pass too, if this call fails.
        let _ = config.install(&remote).await;
        if naive_ticks {
            let queue = KeylessTicks(remote.clone());
            run_scheduler(&remote, &queue, SWEEP_EVERY, StopSignal::never()).await;
        } else {
            run_scheduler(&remote, &remote, SWEEP_EVERY, StopSignal::never()).await;
        }
    }
    Ok(())
}
