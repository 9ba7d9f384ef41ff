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
/// fired one is claimed by a compare-and-set in the store
/// ([`ScheduleStore::claim_for_job`]: of several runners exactly one wins it), its job
/// enqueued under the tick's key ([`Queue::enqueue_tick`]), and the enqueue recorded in
/// the store ([`ScheduleStore::job_enqueued`]). A tick missed while no runner ran fires
/// once. Interval and cron schedules alike: ticks are decided by the core from the
/// store's clock.
///
/// A schedule whose last claimed tick is still [`pending`](crate::DueSchedule::pending)
/// (its runner died after the claim, before or after the enqueue) has that tick's job
/// enqueued first, under the same key: enqueued now if it never was, nothing if it was.
/// Until that succeeds no newer tick of the schedule is claimed. So each claimed tick's job
/// is enqueued exactly once, whichever step a crash cut. Returns what this runner fired
/// and how long until the next tick is due.
pub async fn fire_due<T: ScheduleStore, Q: Queue>(
    store: &T,
    queue: &Q,
) -> Result<(Vec<Fired>, Option<Duration>)> {
    let mut fired = Vec::new();
    let mut next: Option<Duration> = None;
    for due in store.schedules().await? {
        let s = &due.schedule;
        if let Some(wait) = s.until_next(due.clock) {
            next = Some(next.map_or(wait, |n| n.min(wait)));
        }
        let key = |tick| TickKey {
            schedule: s.name().to_owned(),
            anchor: due.clock.anchor,
            tick,
        };
        if let Some(tick) = due.pending {
            let enqueued = queue.enqueue_tick(&key(tick), s.job().clone()).await;
            let ok = enqueued.is_ok();
            record(
                &mut fired,
                s.name(),
                tick,
                enqueued,
                "a claimed tick's job was not enqueued (its runner stopped); enqueued now",
            );
            if !ok || !settled(store, s.name(), tick).await {
                // The pending tick first: a newer one claimed now would pass it over.
                continue;
            }
        }
        let Some(tick) = s.tick_to_fire(due.last_fired, due.clock) else {
            continue;
        };
        if !store.claim_for_job(&due, tick).await? {
            continue;
        }
        // The tick is this pass's now: its job is enqueued, a passing failure retried
        // (until the next tick would be due, at most CLAIMED_TICK_RETRY); a tick still not
        // enqueued then stays pending, for the next pass.
        let within = s
            .until_next(due.clock)
            .unwrap_or(CLAIMED_TICK_RETRY)
            .min(CLAIMED_TICK_RETRY);
        let deadline = crate::clock::instant_after(tokio::time::Instant::now(), within);
        let claimed = key(tick);
        let enqueued = crate::settle::settle(
            deadline,
            || queue.enqueue_tick(&claimed, s.job().clone()),
            |e, delay| {
                debug!(schedule = s.name(), tick, error = %e, ?delay, "enqueue of a claimed tick failed; trying again");
            },
        )
        .await;
        let ok = enqueued.is_ok();
        record(&mut fired, s.name(), tick, enqueued, "schedule fired");
        if ok {
            settled(store, s.name(), tick).await;
        }
    }
    Ok((fired, next))
}

/// Records in the store that `tick`'s job is enqueued; whether it was recorded (a failure
/// is logged, and the next pass settles the tick again).
async fn settled<T: ScheduleStore>(store: &T, schedule: &str, tick: u64) -> bool {
    match store.job_enqueued(schedule, tick).await {
        Ok(()) => true,
        Err(e) => {
            warn!(schedule, tick, error = %e, "could not record a tick's job as enqueued; the next pass does");
            false
        }
    }
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
