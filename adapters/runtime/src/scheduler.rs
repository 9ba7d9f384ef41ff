//! The schedule runner: enqueues each due tick exactly once across several runners.

use std::time::Duration;

use tidemark_core::JobId;
use tracing::{debug, info, warn};

use crate::error::Result;
use crate::ports::{Queue, ScheduleStore, TickKey};
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
/// one wins it) and its job enqueued under the tick's key ([`Queue::enqueue_tick`]). A tick
/// missed while no runner ran fires once. Interval and cron schedules alike: ticks are
/// decided by the core from the store's clock.
///
/// A schedule with no tick due has its last claimed tick's job enqueued again under the
/// same key: a runner that died between the claim and the enqueue left it to be enqueued,
/// and one that died after it left nothing (the queue says so, and no second job is made).
/// So each claimed tick's job is enqueued exactly once, whichever step a crash cut, when a
/// pass comes before the next tick is due (a later tick due first supersedes it: missed
/// ticks fire once). A tick claimed by [`run_retention`](crate::run_retention), which
/// sweeps without a queue, has no record in the queue either: a pass between ticks (a
/// scheduler starting, or retrying after a store error) enqueues a `sweep` job for it, one
/// sweep more for that tick.
/// Returns what this runner fired and how long until the next tick is due.
pub async fn fire_due<T: ScheduleStore, Q: Queue>(
    store: &T,
    queue: &Q,
) -> Result<(Vec<Fired>, Option<Duration>)> {
    let mut fired = Vec::new();
    let mut next: Option<Duration> = None;
    for due in store.schedules().await? {
        let s = &due.schedule;
        let key = |tick| TickKey {
            schedule: s.name().to_owned(),
            anchor: due.clock.anchor,
            tick,
        };
        match s.tick_to_fire(due.last_fired, due.clock) {
            Some(tick) => {
                if store.mark_fired(&due, tick).await? {
                    // The tick is this pass's now: its job is enqueued, a passing failure
                    // retried (until the next tick would be due, at most
                    // CLAIMED_TICK_RETRY); a tick still not enqueued then is enqueued by
                    // the next pass that finds no newer tick due.
                    let within = s
                        .until_next(due.clock)
                        .unwrap_or(CLAIMED_TICK_RETRY)
                        .min(CLAIMED_TICK_RETRY);
                    let deadline = crate::instant_after(tokio::time::Instant::now(), within);
                    let claimed = key(tick);
                    let enqueued = crate::settle::settle(
                        deadline,
                        || queue.enqueue_tick(&claimed, s.job().clone()),
                        |e, delay| {
                            debug!(schedule = s.name(), tick, error = %e, ?delay, "enqueue of a claimed tick failed; trying again");
                        },
                    )
                    .await;
                    record(&mut fired, s.name(), tick, enqueued, "schedule fired");
                }
            }
            None => {
                if let Some(tick) = due.last_fired {
                    let enqueued = queue.enqueue_tick(&key(tick), s.job().clone()).await;
                    record(
                        &mut fired,
                        s.name(),
                        tick,
                        enqueued,
                        "a claimed tick's job was not enqueued (its runner stopped); enqueued now",
                    );
                }
            }
        }
        if let Some(wait) = s.until_next(due.clock) {
            next = Some(next.map_or(wait, |n| n.min(wait)));
        }
    }
    Ok((fired, next))
}

/// Notes the outcome of a tick's enqueue: a job this pass enqueued is fired; a tick
/// already enqueued is nothing; a failure is logged (the next pass tries again).
fn record(
    fired: &mut Vec<Fired>,
    schedule: &str,
    tick: u64,
    enqueued: Result<Option<JobId>>,
    what: &'static str,
) {
    match enqueued {
        Ok(Some(job)) => {
            info!(schedule, tick, %job, "{what}");
            fired.push(Fired {
                schedule: schedule.to_owned(),
                tick,
                job,
            });
        }
        Ok(None) => {}
        Err(e) => {
            warn!(schedule, tick, error = %e, "enqueue of a claimed tick failed; the next pass tries again");
        }
    }
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
