//! The retention driver: a durable schedule whose every tick runs one sweep under the
//! sweeper lock, so storage stays bounded with nobody calling anything.

use std::time::Duration;

use tidemark_core::{Cadence, ConfigError, Job, Schedule};
use tracing::{info, warn};

use crate::error::Result;
use crate::jobs::{JobContext, JobHandlers};
use crate::ports::{JobRetention, Lock, LockLease, Queue, ScheduleStore, Sweep, Swept};
use crate::shutdown::StopSignal;

/// The lock a sweep runs under: one process sweeps at a time.
pub const SWEEP_LOCK: &str = "tidemark.sweep";
/// The name of the default sweep schedule.
pub const SWEEP_SCHEDULE: &str = "tidemark.sweep";
/// How often the default schedule sweeps.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// The sweeper lock's lease, renewed every third of it while a sweep runs.
pub const DEFAULT_SWEEP_LEASE: Duration = Duration::from_secs(60);

/// Runs `sweep` once if this process can take the sweeper lock: `Ok(None)` when another
/// holds it. The lease is renewed every third of it while the sweep runs; when a renewal
/// fails (this process stalled past its lease and another took over) the sweep is
/// abandoned there with [`Error::LeaseLost`](crate::Error::LeaseLost).
///
/// The lease goes with the sweep as its fence ([`Sweep::sweep`]): a process stalled past
/// its lease, whose lock another process has taken since, has its sweep refused by the
/// store where it acts, so two sweeps never both remove. (Every sweep is also built to be
/// safe at any time: SQLite records its new horizon before it deletes below it.)
pub async fn sweep_under_lock<L: Lock, S: Sweep>(
    lock: &L,
    sweep: &S,
    owner: &str,
    lease: Duration,
) -> Result<Option<Swept>> {
    let Some(held) = lock.try_lock(SWEEP_LOCK, owner, lease).await? else {
        return Ok(None);
    };
    let work = sweep.sweep(&held);
    tokio::pin!(work);
    let renew_every = (lease / 3).max(Duration::from_millis(1));
    let result = loop {
        tokio::select! {
            biased;
            r = &mut work => break r,
            () = tokio::time::sleep(renew_every) => {
                if let Err(e) = lock.renew(&held, lease).await {
                    break Err(e);
                }
            }
        }
    };
    if let Err(e) = lock.release(&held).await {
        warn!(error = %e, "could not release the sweeper lock; it expires with its lease");
    }
    result.map(Some)
}

/// An adapter's sweep that also applies the queue's finished-job retention
/// ([`Queue::remove_finished`]), so one sweep bounds everything: what the adapter keeps and
/// the jobs its announcements enqueued.
#[derive(Clone, Debug)]
pub struct SweepWithJobs<S, Q> {
    sweep: S,
    queue: Q,
    retention: JobRetention,
}

impl<S: Sweep, Q: Queue> SweepWithJobs<S, Q> {
    /// `sweep`, then `queue`'s finished jobs older than `retention`.
    pub fn new(sweep: S, queue: Q, retention: JobRetention) -> Self {
        SweepWithJobs {
            sweep,
            queue,
            retention,
        }
    }
}

impl<S: Sweep, Q: Queue> Sweep for SweepWithJobs<S, Q> {
    /// The fence goes to the adapter's sweep; the queue's retention runs only after it
    /// was let through.
    async fn sweep(&self, fence: &LockLease) -> Result<Swept> {
        let mut swept = self.sweep.sweep(fence).await?;
        swept.jobs += self.queue.remove_finished(self.retention).await?;
        Ok(swept)
    }
}

/// `handlers` with the built-in `sweep` job: each one runs `sweep` under the sweeper lock
/// as `owner` (a sweep job that finds the lock held by another process succeeds at once:
/// that process is sweeping). Fire it on a schedule with [`Retention::install`] and
/// [`run_scheduler`](crate::run_scheduler), and run the handlers in a
/// [`JobRunner`](crate::JobRunner).
pub fn with_sweep_job<L, S>(
    handlers: JobHandlers,
    lock: L,
    sweep: S,
    owner: impl Into<String>,
    lease: Duration,
) -> JobHandlers
where
    L: Lock + Clone + 'static,
    S: Sweep + Clone + 'static,
{
    let owner: String = owner.into();
    handlers.on(["sweep"], move |_job: Job, ctx: JobContext| {
        let (lock, sweep, owner) = (lock.clone(), sweep.clone(), owner.clone());
        async move {
            match sweep_under_lock(&lock, &sweep, &owner, lease).await? {
                Some(s) => info!(
                    job = %ctx.id,
                    outbox_rows = s.outbox_rows,
                    events = s.events,
                    log_rows = s.log_rows,
                    tombstones = s.tombstones,
                    jobs = s.jobs,
                    first_available = s.first_available,
                    "swept"
                ),
                None => info!(job = %ctx.id, "another process holds the sweeper lock"),
            }
            Ok::<(), crate::error::Error>(())
        }
    })
}

/// How the retention driver runs: its schedule, its lease and who it is.
#[derive(Clone, Debug)]
pub struct Retention {
    schedule: Schedule,
    owner: String,
    lease: Duration,
}

impl Retention {
    /// Sweeps every [`DEFAULT_SWEEP_EVERY`] under a [`DEFAULT_SWEEP_LEASE`] lease, as
    /// `owner` (unique per process: a host name and process id, say).
    ///
    /// # Errors
    /// [`ConfigError::EmptyName`] for an empty owner.
    pub fn new(owner: impl Into<String>) -> std::result::Result<Self, ConfigError> {
        let owner = owner.into();
        if owner.trim().is_empty() {
            return Err(ConfigError::EmptyName {
                field: "sweeper owner",
            });
        }
        Ok(Retention {
            schedule: Schedule::new(SWEEP_SCHEDULE, DEFAULT_SWEEP_EVERY, Job::Sweep)?,
            owner,
            lease: DEFAULT_SWEEP_LEASE,
        })
    }

    /// Sweeps every `interval` instead.
    ///
    /// # Errors
    /// [`ConfigError::ZeroDuration`] for a zero interval.
    pub fn every(mut self, interval: Duration) -> std::result::Result<Self, ConfigError> {
        self.schedule = Schedule::new(SWEEP_SCHEDULE, interval, Job::Sweep)?;
        Ok(self)
    }

    /// Sweeps when a cron expression (UTC) matches instead, e.g. `"*/5 * * * *"`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidCron`] for an expression that does not parse.
    pub fn cron(mut self, expr: &str) -> std::result::Result<Self, ConfigError> {
        self.schedule = Schedule::cron(SWEEP_SCHEDULE, expr, Job::Sweep)?;
        Ok(self)
    }

    /// The sweeper lock's lease (renewed every third of it while sweeping).
    ///
    /// # Errors
    /// [`ConfigError::ZeroDuration`] for a zero lease.
    pub fn lease(mut self, lease: Duration) -> std::result::Result<Self, ConfigError> {
        if lease.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "sweeper lease",
            });
        }
        self.lease = lease;
        Ok(self)
    }

    /// The schedule it keeps in the store.
    #[must_use]
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Who it sweeps as.
    #[must_use]
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The sweeper lock's lease.
    #[must_use]
    pub fn lease_time(&self) -> Duration {
        self.lease
    }

    /// Stores the sweep schedule in `store` unless the same one is there (restarts and
    /// other processes keep its anchor and last tick): the job path, where
    /// [`run_scheduler`](crate::run_scheduler) enqueues a `sweep` job on each tick and a
    /// runner with [`with_sweep_job`] runs it.
    pub async fn install<T: ScheduleStore>(&self, store: &T) -> Result<()> {
        ensure_schedule(store, &self.schedule).await
    }
}

/// Stores the sweep schedule unless the same one is there (so restarts and other
/// processes keep its anchor and last tick).
async fn ensure_schedule<T: ScheduleStore>(store: &T, schedule: &Schedule) -> Result<()> {
    let same = store.schedules().await?.into_iter().any(|d| {
        d.schedule.name() == schedule.name() && d.schedule.cadence() == schedule.cadence()
    });
    if !same {
        store.put_schedule(schedule.clone()).await?;
    }
    Ok(())
}

/// One pass: if the sweep schedule has a due tick and this process wins it (the store's
/// compare-and-set), sweeps under the lock. Returns the sweep, if this pass ran one, and
/// how long until the next tick.
async fn pass<T: ScheduleStore, L: Lock, S: Sweep>(
    store: &T,
    lock: &L,
    sweep: &S,
    retention: &Retention,
) -> Result<(Option<Swept>, Option<Duration>)> {
    let Some(due) = store
        .schedules()
        .await?
        .into_iter()
        .find(|d| d.schedule.name() == retention.schedule.name())
    else {
        store.put_schedule(retention.schedule.clone()).await?;
        return Ok((None, retention.schedule.interval()));
    };
    let next = due.schedule.until_next(due.clock);
    let Some(tick) = due.schedule.tick_to_fire(due.last_fired, due.clock) else {
        return Ok((None, next));
    };
    if !store.mark_fired(&due, tick).await? {
        return Ok((None, next));
    }
    let swept = sweep_under_lock(lock, sweep, &retention.owner, retention.lease).await?;
    match &swept {
        Some(s) => info!(
            tick,
            outbox_rows = s.outbox_rows,
            events = s.events,
            log_rows = s.log_rows,
            tombstones = s.tombstones,
            jobs = s.jobs,
            first_available = s.first_available,
            "swept"
        ),
        None => info!(tick, "another process holds the sweeper lock"),
    }
    Ok((swept, next))
}

/// Keeps storage bounded until `stop`: stores the sweep schedule (see [`Retention`]) and
/// on each of its due ticks, claimed once across every process running this driver on
/// the same store, runs one sweep under the sweeper lock. A tick missed while nobody ran
/// fires once. A failure is logged and the next tick tried.
pub async fn run_retention<T: ScheduleStore, L: Lock, S: Sweep>(
    store: &T,
    lock: &L,
    sweep: &S,
    retention: Retention,
    mut stop: StopSignal,
) {
    // At most this long between looks at the store, so a schedule replaced by another
    // process (a new interval) is noticed.
    let idle = match retention.schedule.cadence() {
        Cadence::Every(d) => (*d).min(DEFAULT_SWEEP_EVERY),
        Cadence::Cron(_) => DEFAULT_SWEEP_EVERY,
    };
    let mut ensured = false;
    loop {
        if !ensured {
            match ensure_schedule(store, &retention.schedule).await {
                Ok(()) => ensured = true,
                Err(e) => warn!(error = %e, "could not store the sweep schedule"),
            }
        }
        let wait = match pass(store, lock, sweep, &retention).await {
            Ok((_, next)) => next.unwrap_or(idle).min(idle),
            Err(e) => {
                warn!(error = %e, "sweep pass failed");
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
