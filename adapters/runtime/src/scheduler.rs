//! The schedule runner: enqueues each due tick exactly once across several runners.

use std::time::Duration;

use tidemark_core::JobId;
use tracing::{debug, info, warn};

use crate::error::Result;
use crate::ports::{Queue, ScheduleStore};
use crate::shutdown::StopSignal;

/// One tick this runner fired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fired {
    /// The schedule's name.
    pub schedule: String,
    /// The tick fired.
    pub tick: u64,
    /// The job enqueued.
    pub job: JobId,
}

/// How long a scheduler pass retries the enqueue of a tick it claimed (less when the
/// schedule's next tick comes sooner).
const CLAIMED_TICK_RETRY: Duration = Duration::from_secs(5);

/// Fires every due tick once: for each schedule, the latest due tick newer than its last
/// fired one is claimed by a compare-and-set in the store (so of several runners exactly
/// one wins it) and its job enqueued. A tick missed while no runner ran fires once.
/// Interval and cron schedules alike: ticks are decided by the core from the store's clock.
/// Returns what this runner fired and how long until the next tick is due.
pub async fn fire_due<T: ScheduleStore, Q: Queue>(
    store: &T,
    queue: &Q,
) -> Result<(Vec<Fired>, Option<Duration>)> {
    let mut fired = Vec::new();
    let mut next: Option<Duration> = None;
    for due in store.schedules().await? {
        let s = &due.schedule;
        if let Some(tick) = s.tick_to_fire(due.last_fired, due.clock)
            && store.mark_fired(&due, tick).await?
        {
            // The tick is this pass's now: its job is enqueued, a passing failure retried
            // (until the next tick would be due, at most CLAIMED_TICK_RETRY), since no
            // other scheduler will fire this tick again.
            let within = s
                .until_next(due.clock)
                .unwrap_or(CLAIMED_TICK_RETRY)
                .min(CLAIMED_TICK_RETRY);
            let deadline = crate::instant_after(tokio::time::Instant::now(), within);
            let enqueued = crate::settle::settle(
                deadline,
                || queue.enqueue(s.job().clone()),
                |e, delay| {
                    debug!(schedule = s.name(), tick, error = %e, ?delay, "enqueue of a claimed tick failed; trying again");
                },
            )
            .await;
            match enqueued {
                Ok(job) => {
                    info!(schedule = s.name(), tick, %job, "schedule fired");
                    fired.push(Fired {
                        schedule: s.name().to_owned(),
                        tick,
                        job,
                    });
                }
                // Still failing: the tick is lost and the next one fires (one lost tick
                // beats two jobs for it). So is a tick whose process dies between the
                // claim and the enqueue; `SqliteSchedules::fire_due` does both in one
                // transaction.
                Err(e) => {
                    warn!(schedule = s.name(), tick, error = %e, "tick claimed but its enqueue kept failing; the tick is lost")
                }
            }
        }
        if let Some(wait) = s.until_next(due.clock) {
            next = Some(next.map_or(wait, |n| n.min(wait)));
        }
    }
    Ok((fired, next))
}

/// Runs [`fire_due`] until `stop`, sleeping until the next tick is due (at most `idle`,
/// so schedules added by others are noticed). A store failure is logged and retried
/// after `idle`.
pub async fn run_scheduler<T: ScheduleStore, Q: Queue>(
    store: &T,
    queue: &Q,
    idle: Duration,
    mut stop: StopSignal,
) {
    loop {
        let wait = match fire_due(store, queue).await {
            Ok((_, next)) => next.unwrap_or(idle).min(idle),
            Err(e) => {
                warn!(error = %e, "scheduler pass failed");
                idle
            }
        };
        tokio::select! {
            biased;
            () = stop.stopped() => return,
            () = tokio::time::sleep(wait.max(Duration::from_millis(1))) => {}
        }
    }
}
