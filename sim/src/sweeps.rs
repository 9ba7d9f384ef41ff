//! Retention in the world: the runtime's sweeps of the source host's history, outbox and
//! finished jobs, run on their schedule under the sweeper lock from the worker hosts over
//! the wire, and the ledger that checks them.
//!
//! Worker host 0 (and every even one) runs the runtime's `run_retention` (the schedule,
//! the lock and the sweep in one driver); the odd ones run `run_scheduler`, which enqueues
//! a `sweep` job on each tick for the job runners, whose handlers take it with
//! `with_sweep_job`. Both claim the same durable schedule, so each tick is swept once by
//! one path or the other. Every sweep is `SweepWithJobs`: the source host's
//! `MemorySweep`, then the queue's finished-job retention.
//!
//! What the ledger checks, on the source host, as each call is served:
//! - two owners never hold the sweeper lock at once (a grant while another owner's lease
//!   is live and not released);
//! - a sweep never removes history younger than the policy's `keep`, from the change log
//!   or the events stream (after a restore, the seqs above the backup's head are young
//!   again: the new history reuses them);
//! - a sweep never removes events a durable cursor still needs unless the policy's
//!   `max_age` forces them out (then the cursor is counted as forced; the memory adapter
//!   passes over records retention dropped, and its follower finds what it missed by
//!   reconciling, which the oracle checks at every step);
//! - a sweep never removes an outbox row the relays have not finished;
//! - finished-job retention removes only jobs done at least its `done` age ago, and never
//!   a dead letter (the world keeps them until requeued).
//!
//! What the memory adapter cannot promise is not checked: it does not see a persisted
//! follower's watermark (that lives in the follower's own store), so change-log history
//! older than `keep` may go while such a follower still needs it; that follower then
//! resyncs, and the oracle checks that it converges. A sweep served after its owner's lease
//! ran out (a request held on the wire past its lease) is counted, not failed, as long as
//! nobody took the lock since: its fence is still the newest. A sweep served under a fence
//! older than the newest grant (two sweepers sweeping at once) fails the ledger; the
//! source host's sweep refuses such fences (`MemorySweep::fenced_by` the host's lock).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::{RetentionPolicy, Schedule};
use tidemark::{
    Cursors, DueSchedule, Error, JobRetention, Lock, LockLease, Result, Retention, ScheduleStore,
    StopSignal, Sweep, SweepWithJobs, Swept, run_retention, run_scheduler,
};
use tidemark_memory::{Memory, MemoryLock, MemorySchedules, MemorySweep};

use crate::remote::Remote;
use crate::trace::Trace;
use crate::wire::{Request, Response, SweepAnswer, SweepCall, WireDue, WireLockLease};

/// How often the world sweeps: often, so sweeps land in the fault phase.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// The sweeper lock's lease: short, so a sweeper that crashed holding it is taken over
/// within the run.
pub const SWEEP_LEASE: Duration = Duration::from_secs(2);
/// The world's retention: history goes 2 s after it was written unless a durable cursor
/// needs it, and after 8 s whatever cursors need; so a follower cut off for a few seconds
/// must notice compaction.
pub const POLICY: RetentionPolicy = RetentionPolicy {
    keep: Duration::from_secs(2),
    max_age: Some(Duration::from_secs(8)),
};
/// Done jobs go 2 s after they finished; dead letters stay until requeued.
pub const JOB_RETENTION: JobRetention = JobRetention {
    done: Duration::from_secs(2),
    dead: None,
};

/// The source host's side: its lock, schedules and sweep on the simulation's clock, and
/// the ledger that watches them.
#[derive(Clone, Debug)]
pub struct Sweeps {
    lock: MemoryLock,
    schedules: MemorySchedules,
    sweep: MemorySweep,
    /// The ledger.
    pub ledger: SweepLedger,
}

impl Sweeps {
    /// Over `memory`, on `clock` (which outlives the source host's runtimes); `cursors`
    /// names the durable consumers whose events the ledger checks are kept.
    pub fn new(
        memory: &Memory,
        clock: impl Fn() -> tokio::time::Instant + Clone + Send + Sync + 'static,
        cursors: Vec<String>,
    ) -> Self {
        let lock = MemoryLock::with_clock(memory.faults.clone(), clock.clone());
        Sweeps {
            lock: lock.clone(),
            schedules: MemorySchedules::with_clock(
                memory.faults.clone(),
                Duration::from_secs(1_700_000_000),
                clock.clone(),
            ),
            sweep: memory.sweeper_with_clock(POLICY, clock).fenced_by(lock),
            ledger: SweepLedger {
                inner: Arc::default(),
                cursors: Arc::new(cursors),
            },
        }
    }

    /// Serves one call, telling the ledger.
    pub async fn serve(&self, memory: &Memory, call: SweepCall) -> Response {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let answer = match call {
            SweepCall::TryLock { name, owner, ttl } => {
                self.lock.try_lock(&name, &owner, ttl).await.map(|l| {
                    if let Some(l) = &l {
                        self.ledger.granted(l, now, now + ttl);
                    }
                    SweepAnswer::Locked(l.as_ref().map(WireLockLease::from))
                })
            }
            SweepCall::Renew { lease, ttl } => {
                let lease = LockLease::from(lease);
                self.lock.renew(&lease, ttl).await.map(|()| {
                    self.ledger.renewed(&lease, now + ttl);
                    SweepAnswer::Done
                })
            }
            SweepCall::Release { lease } => {
                let lease = LockLease::from(lease);
                self.lock.release(&lease).await.map(|()| {
                    self.ledger.released(&lease);
                    SweepAnswer::Done
                })
            }
            SweepCall::Schedules => self.schedules.schedules().await.map(|all| {
                SweepAnswer::Schedules(all.into_iter().filter_map(|d| WireDue::of(&d)).collect())
            }),
            SweepCall::PutSchedule { name, every, job } => match Schedule::new(name, every, job) {
                Ok(s) => self
                    .schedules
                    .put_schedule(s)
                    .await
                    .map(|()| SweepAnswer::Done),
                Err(e) => Err(Error::unavailable("schedules", e.to_string())),
            },
            SweepCall::RemoveSchedule { name } => self
                .schedules
                .remove_schedule(&name)
                .await
                .map(SweepAnswer::Yes),
            SweepCall::MarkFired { by, .. } | SweepCall::JobEnqueued { by, .. }
                if self.ledger.is_doomed(by.as_deref()) =>
            {
                Err(Error::unavailable("schedules", "the scheduler is crashing"))
            }
            SweepCall::MarkFired {
                due,
                tick,
                for_job,
                by,
            } => match due.into_due() {
                Ok(read) if for_job => {
                    let won = self.schedules.claim_for_job(&read, tick).await;
                    if let (Ok(true), Some(by)) = (&won, &by) {
                        self.ledger.claimed_for_job(by, tick);
                        let mut s = lock(&self.ledger.inner);
                        if let Some((false, down)) = s.scheduler_armed {
                            s.scheduler_armed = None;
                            s.doomed = Some((by.clone(), down));
                        }
                    }
                    won.map(SweepAnswer::Yes)
                }
                Ok(read) => self
                    .schedules
                    .mark_fired(&read, tick)
                    .await
                    .map(SweepAnswer::Yes),
                Err(e) => Err(e),
            },
            SweepCall::JobEnqueued { name, tick, by } => {
                let crash = {
                    let mut s = lock(&self.ledger.inner);
                    match (s.scheduler_armed, &by) {
                        (Some((true, down)), Some(by)) => {
                            s.scheduler_armed = None;
                            s.doomed = Some((by.clone(), down));
                            true
                        }
                        _ => false,
                    }
                };
                if crash {
                    // The enqueue landed; the host dies before recording it.
                    Err(Error::unavailable("schedules", "the scheduler is crashing"))
                } else {
                    self.schedules
                        .job_enqueued(&name, tick)
                        .await
                        .map(|()| SweepAnswer::Done)
                }
            }
            SweepCall::Sweep { by, fence } => {
                let fence = LockLease::from(fence);
                self.swept(memory, by.as_deref().unwrap_or("?"), &fence, now)
                    .await
            }
        };
        match answer {
            Ok(a) => Response::Sweeps(a),
            Err(Error::LeaseLost(why)) => Response::Sweeps(SweepAnswer::LeaseLost(why)),
            Err(e) => Response::Failed(e.to_string()),
        }
    }

    /// One sweep of the source host's ports, checked against what it found before.
    async fn swept(
        &self,
        memory: &Memory,
        by: &str,
        fence: &LockLease,
        now: Duration,
    ) -> Result<SweepAnswer> {
        let watermark = memory.source.current_watermark();
        let first_log = tidemark::Source::first_available(&memory.source)
            .await
            .unwrap_or(1);
        let events_head = memory.events.records().last().map_or(0, |r| r.position);
        let mut cursors = BTreeMap::new();
        for name in self.ledger.cursors.iter() {
            if let Ok(Some(at)) = Cursors::load(&memory.events, name).await {
                cursors.insert(name.clone(), at);
            }
        }
        let pending: BTreeSet<u64> = memory
            .outbox
            .rows()
            .into_iter()
            .filter(|(_, done)| !done)
            .map(|(row, _)| row.id)
            .collect();
        let swept = self.sweep.sweep(fence).await?;
        let still: BTreeSet<u64> = memory
            .outbox
            .rows()
            .into_iter()
            .map(|(row, _)| row.id)
            .collect();
        let lost: Vec<u64> = pending.difference(&still).copied().collect();
        self.ledger.check_sweep(&SweepSeen {
            by,
            now,
            watermark,
            first_log,
            events_head,
            cursors,
            lost,
            swept,
            fencing: fence.fencing,
        });
        Ok(SweepAnswer::Swept {
            outbox_rows: swept.outbox_rows,
            events: swept.events,
            log_rows: swept.log_rows,
            jobs: swept.jobs,
            first_available: swept.first_available,
            first_event: swept.first_event,
        })
    }
}

/// What the source host saw around one sweep.
struct SweepSeen<'a> {
    by: &'a str,
    now: Duration,
    watermark: u64,
    first_log: u64,
    events_head: u64,
    cursors: BTreeMap<String, u64>,
    /// Outbox rows pending before the sweep and gone after it.
    lost: Vec<u64>,
    swept: Swept,
    /// The fencing token the sweep ran under.
    fencing: u64,
}

#[derive(Debug)]
struct Hold {
    owner: String,
    until: Duration,
    released: bool,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Grants of the sweeper lock by fencing token.
    holds: BTreeMap<u64, Hold>,
    /// (when, change-log head, events head) at each sweep, as the sweep's own marks.
    marks: Vec<(Duration, u64, u64)>,
    /// The first events position kept after the last sweep.
    first_event: u64,
    violations: Vec<String>,
    sweeps: u32,
    /// Sweeps served after their owner's lease had run out.
    late: u32,
    /// Grants after another owner's lease ran out unreleased (a crashed sweeper's).
    takeovers: u32,
    /// Rows removed: (change log, events, outbox).
    removed: (u64, u64, u64),
    /// Durable cursors the maximum age forced past.
    forced: BTreeSet<String>,
    /// A sweeper crash armed, with the host's time down.
    crash_armed: Option<Duration>,
    /// A scheduler crash armed: after the enqueue (or right after the claim), and the
    /// host's time down.
    scheduler_armed: Option<(bool, Duration)>,
    /// The scheduler host to crash now, with its time down: the source host serves it
    /// nothing more until it restarted.
    doomed: Option<(String, Duration)>,
    /// A sweeper stall armed, with how long it lasts.
    stall_armed: Option<Duration>,
    /// Ticks claimed for their job, and `sweep` jobs enqueued (by key or not).
    claimed_for_job: u64,
    tick_jobs: u64,
}

/// What the sweepers did, checked as the source host serves them.
#[derive(Clone, Debug, Default)]
pub struct SweepLedger {
    inner: Arc<Mutex<LedgerState>>,
    cursors: Arc<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first position to keep if everything at least `age` old went: one past the
/// newest mark's head at or before `now - age` (1 when there is none).
fn older_than(marks: &[(Duration, u64)], now: Duration, age: Duration) -> u64 {
    marks
        .iter()
        .filter(|(at, _)| now.checked_sub(age).is_some_and(|t| *at <= t))
        .map(|(_, head)| head + 1)
        .max()
        .unwrap_or(1)
}

impl SweepLedger {
    fn granted(&self, lease: &LockLease, now: Duration, until: Duration) {
        let mut s = lock(&self.inner);
        let mut found = Vec::new();
        let mut takeover = false;
        for (fencing, h) in &s.holds {
            if *fencing == lease.fencing || h.released || h.owner == lease.owner {
                continue;
            }
            if h.until > now {
                found.push(format!(
                    "{} got the sweeper lock (fencing {}) at {now:?} while {} held it (fencing {fencing}) until {:?}",
                    lease.owner, lease.fencing, h.owner, h.until
                ));
            } else {
                takeover = true;
            }
        }
        // Only the newest grant matters from here on.
        s.holds.retain(|f, _| *f >= lease.fencing);
        s.holds.insert(
            lease.fencing,
            Hold {
                owner: lease.owner.clone(),
                until,
                released: false,
            },
        );
        s.takeovers += u32::from(takeover);
        s.violations.extend(found);
    }

    fn renewed(&self, lease: &LockLease, until: Duration) {
        if let Some(h) = lock(&self.inner).holds.get_mut(&lease.fencing) {
            h.until = until;
        }
    }

    fn released(&self, lease: &LockLease) {
        if let Some(h) = lock(&self.inner).holds.get_mut(&lease.fencing) {
            h.released = true;
        }
    }

    /// The source was restored to a backup whose head is `head`: the seqs above it are
    /// reused by the new history's changes, younger than any mark taken before. A mark
    /// vouches from now on only for the seqs the backup kept, as the sweep's own marks do;
    /// left as they were, the marks let a sweep cut the new history's young changes unseen.
    pub fn restored(&self, head: u64) {
        for mark in &mut lock(&self.inner).marks {
            mark.1 = mark.1.min(head);
        }
    }

    fn check_sweep(&self, seen: &SweepSeen<'_>) {
        let mut s = lock(&self.inner);
        let now = seen.now;
        s.sweeps += 1;
        let held = s
            .holds
            .values()
            .any(|h| h.owner == seen.by && !h.released && h.until > now);
        s.late += u32::from(!held);
        let newest = s.holds.keys().next_back().copied();
        if let Some(newest) = newest.filter(|&n| n > seen.fencing) {
            s.violations.push(format!(
                "a sweep by {} at {now:?} ran under fencing {} while the sweeper lock was granted again (fencing {newest}): two sweeps at once",
                seen.by, seen.fencing
            ));
        }
        s.marks.push((now, seen.watermark, seen.events_head));
        let log: Vec<(Duration, u64)> = s.marks.iter().map(|m| (m.0, m.1)).collect();
        let events: Vec<(Duration, u64)> = s.marks.iter().map(|m| (m.0, m.2)).collect();
        let mut found = Vec::new();
        let kept_log = older_than(&log, now, POLICY.keep).max(seen.first_log);
        if seen.swept.first_available > kept_log {
            found.push(format!(
                "a sweep by {} at {now:?} cut the change log to {} where history younger than {:?} starts at {kept_log}",
                seen.by, seen.swept.first_available, POLICY.keep
            ));
        }
        let before = s.first_event.max(1);
        let kept_events = older_than(&events, now, POLICY.keep).max(before);
        if seen.swept.first_event > kept_events {
            found.push(format!(
                "a sweep by {} at {now:?} cut the events stream to {} where records younger than {:?} start at {kept_events}",
                seen.by, seen.swept.first_event, POLICY.keep
            ));
        }
        let forced = POLICY
            .max_age
            .map_or(1, |age| older_than(&events, now, age));
        for (name, at) in &seen.cursors {
            if seen.swept.first_event > at + 1 {
                if seen.swept.first_event > forced.max(before) {
                    found.push(format!(
                        "a sweep by {} at {now:?} cut the events stream to {} past durable cursor {name} at {at}, with no maximum age forcing it (forced up to {forced})",
                        seen.by, seen.swept.first_event
                    ));
                } else {
                    s.forced.insert(name.clone());
                }
            }
        }
        if !seen.lost.is_empty() {
            found.push(format!(
                "a sweep by {} at {now:?} removed outbox rows the relays had not finished: {:?}",
                seen.by, seen.lost
            ));
        }
        s.first_event = s.first_event.max(seen.swept.first_event);
        s.removed.0 += seen.swept.log_rows;
        s.removed.1 += seen.swept.events;
        s.removed.2 += seen.swept.outbox_rows;
        // The policy's marks reach back at most its maximum age, and one before it: the
        // newest mark older than that still vouches that its history is old. Dropping it
        // too forgot what an earlier sweep had proven, and history a restore put back
        // was taken for young (seed 85219939: a mark at 4.39s showed the change log up to
        // 56, the restore at 17.03s put back 45..56, and the ledger then said history
        // younger than 2s started at 45 when the sweep at 17.84s cut it again).
        if let Some(age) = POLICY.max_age
            && let Some(cut) = now.checked_sub(age + SWEEP_EVERY * 4)
        {
            let newest_old = s.marks.iter().map(|m| m.0).filter(|&at| at < cut).max();
            s.marks.retain(|m| m.0 >= cut || Some(m.0) == newest_old);
        }
        s.violations.extend(found);
    }

    /// Arms a stall of the next worker host seen holding the sweeper lock, for `stall`.
    pub fn arm_stall(&self, stall: Duration) {
        lock(&self.inner).stall_armed = Some(stall);
    }

    /// The host holding the sweeper lock now, if a stall is armed (disarming it), with how
    /// long the stall lasts.
    #[must_use]
    pub fn stalled_holder(&self) -> Option<(String, Duration)> {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let stall = s.stall_armed?;
        let holder = s
            .holds
            .values()
            .find(|h| !h.released && h.until > now)?
            .owner
            .clone();
        s.stall_armed = None;
        Some((holder, stall))
    }

    /// Arms a crash of the next sweep scheduler that claims a tick for its job: right after
    /// the claim, or (`after_enqueue`) when it records the job enqueued; it comes back
    /// after `down`.
    pub fn arm_scheduler_crash(&self, after_enqueue: bool, down: Duration) {
        lock(&self.inner).scheduler_armed = Some((after_enqueue, down));
    }

    /// The scheduler host to crash now, if one is doomed, with its time down (taken: the
    /// world crashes it once).
    #[must_use]
    pub fn doomed_scheduler(&self) -> Option<(String, Duration)> {
        lock(&self.inner).doomed.take()
    }

    /// Whether `host` is a scheduler doomed to crash (served nothing more).
    pub(crate) fn is_doomed(&self, host: Option<&str>) -> bool {
        let s = lock(&self.inner);
        host.is_some_and(|h| s.doomed.as_ref().is_some_and(|(d, _)| d == h))
    }

    /// A tick was claimed for its job: every tick claimed before must have its job by now
    /// (a scheduler enqueues a pending tick's job before it claims a newer one).
    fn claimed_for_job(&self, by: &str, tick: u64) {
        let mut s = lock(&self.inner);
        if s.tick_jobs < s.claimed_for_job {
            let (claimed, jobs) = (s.claimed_for_job, s.tick_jobs);
            s.violations.push(format!(
                "{by} claimed tick {tick} while {} of {claimed} ticks claimed for their job had none: a tick never fired",
                claimed - jobs
            ));
        }
        s.claimed_for_job += 1;
    }

    /// A `sweep` job was enqueued for a tick (by the source host's queue): never more of
    /// them than ticks claimed for their job.
    pub fn tick_job_enqueued(&self, by: Option<&str>) {
        let mut s = lock(&self.inner);
        s.tick_jobs += 1;
        if s.tick_jobs > s.claimed_for_job {
            let (claimed, jobs) = (s.claimed_for_job, s.tick_jobs);
            s.violations.push(format!(
                "{jobs} sweep jobs enqueued for {claimed} ticks claimed for their job (the last by {}): a tick fired twice",
                by.unwrap_or("?")
            ));
        }
    }

    /// Arms a crash of the next worker host seen holding the sweeper lock; it comes back
    /// after `down`.
    pub fn arm_crash(&self, down: Duration) {
        lock(&self.inner).crash_armed = Some(down);
    }

    /// The host holding the sweeper lock now, if a crash is armed (disarming it), with its
    /// time down.
    #[must_use]
    pub fn armed_holder(&self) -> Option<(String, Duration)> {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let down = s.crash_armed?;
        let holder = s
            .holds
            .values()
            .find(|h| !h.released && h.until > now)?
            .owner
            .clone();
        s.crash_armed = None;
        Some((holder, down))
    }

    /// Violations found so far.
    #[must_use]
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner).violations.clone()
    }

    /// Whether `owner` holds the sweeper lock now (its lease live and not released).
    #[must_use]
    pub fn holding(&self, owner: &str) -> bool {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        lock(&self.inner)
            .holds
            .values()
            .any(|h| h.owner == owner && !h.released && h.until > now)
    }

    /// What the sweepers did (finished jobs removed are the job ledger's to count).
    #[must_use]
    pub fn counts(&self) -> SweepCounts {
        let s = lock(&self.inner);
        SweepCounts {
            sweeps: s.sweeps,
            late: s.late,
            takeovers: s.takeovers,
            removed: s.removed,
            jobs_removed: 0,
            forced: u32::try_from(s.forced.len()).unwrap_or(u32::MAX),
        }
    }
}

/// What the sweepers did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepCounts {
    /// Sweeps served.
    pub sweeps: u32,
    /// Sweeps served after their owner's lease ran out (a request held past it).
    pub late: u32,
    /// Lock grants after another owner's lease ran out unreleased.
    pub takeovers: u32,
    /// Rows removed: (change log, events, outbox).
    pub removed: (u64, u64, u64),
    /// Finished jobs removed.
    pub jobs_removed: u64,
    /// Durable cursors the maximum age forced past.
    pub forced: u32,
}

impl Remote {
    async fn sweep_call(&self, call: SweepCall) -> Result<SweepAnswer> {
        match self.call("retention", Request::Sweeps(call)).await? {
            Response::Sweeps(SweepAnswer::LeaseLost(why)) => Err(Error::LeaseLost(why)),
            Response::Sweeps(a) => Ok(a),
            r => Err(Error::unavailable(
                "retention",
                format!("unexpected answer {r:?}"),
            )),
        }
    }
}

fn unexpected(a: &SweepAnswer) -> Error {
    Error::unavailable("retention", format!("unexpected {a:?}"))
}

/// The source host's sweeper lock, over the wire.
impl Lock for Remote {
    async fn try_lock(&self, name: &str, owner: &str, ttl: Duration) -> Result<Option<LockLease>> {
        let call = SweepCall::TryLock {
            name: name.to_owned(),
            owner: owner.to_owned(),
            ttl,
        };
        match self.sweep_call(call).await? {
            SweepAnswer::Locked(l) => Ok(l.map(LockLease::from)),
            a => Err(unexpected(&a)),
        }
    }

    async fn renew(&self, lease: &LockLease, ttl: Duration) -> Result<()> {
        let call = SweepCall::Renew {
            lease: lease.into(),
            ttl,
        };
        self.sweep_call(call).await.map(drop)
    }

    async fn release(&self, lease: &LockLease) -> Result<()> {
        let call = SweepCall::Release {
            lease: lease.into(),
        };
        self.sweep_call(call).await.map(drop)
    }
}

/// The source host's durable schedules, over the wire (interval schedules).
impl ScheduleStore for Remote {
    async fn put_schedule(&self, schedule: Schedule) -> Result<()> {
        let Some(every) = schedule.interval() else {
            return Err(Error::unavailable(
                "schedules",
                "cron schedules are not served over the simulator's wire",
            ));
        };
        let call = SweepCall::PutSchedule {
            name: schedule.name().to_owned(),
            every,
            job: schedule.job().clone(),
        };
        self.sweep_call(call).await.map(drop)
    }

    async fn remove_schedule(&self, name: &str) -> Result<bool> {
        let call = SweepCall::RemoveSchedule {
            name: name.to_owned(),
        };
        match self.sweep_call(call).await? {
            SweepAnswer::Yes(y) => Ok(y),
            a => Err(unexpected(&a)),
        }
    }

    async fn schedules(&self) -> Result<Vec<DueSchedule>> {
        match self.sweep_call(SweepCall::Schedules).await? {
            SweepAnswer::Schedules(all) => all.into_iter().map(WireDue::into_due).collect(),
            a => Err(unexpected(&a)),
        }
    }

    async fn mark_fired(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        let Some(due) = WireDue::of(read) else {
            return Err(Error::unavailable(
                "schedules",
                "cron schedules are not served over the simulator's wire",
            ));
        };
        let call = SweepCall::MarkFired {
            due,
            tick,
            for_job: false,
            by: self.owner().map(str::to_owned),
        };
        match self.sweep_call(call).await? {
            SweepAnswer::Yes(y) => Ok(y),
            a => Err(unexpected(&a)),
        }
    }

    async fn claim_for_job(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        let Some(due) = WireDue::of(read) else {
            return Err(Error::unavailable(
                "schedules",
                "cron schedules are not served over the simulator's wire",
            ));
        };
        let call = SweepCall::MarkFired {
            due,
            tick,
            for_job: true,
            by: self.owner().map(str::to_owned),
        };
        match self.sweep_call(call).await? {
            SweepAnswer::Yes(y) => Ok(y),
            a => Err(unexpected(&a)),
        }
    }

    async fn job_enqueued(&self, name: &str, tick: u64) -> Result<()> {
        let call = SweepCall::JobEnqueued {
            name: name.to_owned(),
            tick,
            by: self.owner().map(str::to_owned),
        };
        self.sweep_call(call).await.map(drop)
    }
}

/// The source host's sweep of its history and outbox, over the wire.
impl Sweep for Remote {
    async fn sweep(&self, fence: &LockLease) -> Result<Swept> {
        let call = SweepCall::Sweep {
            by: self.owner().map(str::to_owned),
            fence: fence.into(),
        };
        match self.sweep_call(call).await? {
            SweepAnswer::Swept {
                outbox_rows,
                events,
                log_rows,
                jobs,
                first_available,
                first_event,
            } => Ok(Swept {
                outbox_rows,
                events,
                log_rows,
                tombstones: 0,
                jobs,
                first_available,
                first_event,
            }),
            a => Err(unexpected(&a)),
        }
    }
}

/// What a worker host sweeps with: the source host's sweep, then its queue's finished
/// jobs, both over the wire.
#[must_use]
pub fn sweep_of(remote: &Remote) -> SweepWithJobs<Remote, Remote> {
    SweepWithJobs::new(remote.clone(), remote.clone(), JOB_RETENTION)
}

/// Worker host `i`'s retention: the runtime's `run_retention` on even hosts, its
/// `run_scheduler` enqueueing `sweep` jobs for the job runners on odd ones. Runs until
/// the host crashes.
pub async fn retention(i: usize, owner: String, trace: Trace, naive_ticks: bool) -> Result<()> {
    let remote = Remote::relay(crate::scenario::SOURCE, owner.clone());
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
            let queue = crate::naive::KeylessTicks(remote.clone());
            run_scheduler(&remote, &queue, SWEEP_EVERY, StopSignal::never()).await;
        } else {
            run_scheduler(&remote, &remote, SWEEP_EVERY, StopSignal::never()).await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(owner: &str, fencing: u64) -> LockLease {
        LockLease {
            name: "tidemark.sweep".into(),
            owner: owner.into(),
            fencing,
        }
    }

    #[test]
    fn a_grant_while_another_owner_holds_a_live_lease_is_a_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.granted(&lease("relay-1", 2), s(1), s(3));
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("relay-0") && v[0].contains("relay-1"),
            "{v:?}"
        );
    }

    #[test]
    fn a_grant_after_a_lease_ran_out_or_was_released_is_no_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.granted(&lease("relay-1", 2), s(3), s(5));
        ledger.released(&lease("relay-1", 2));
        ledger.granted(&lease("relay-0", 3), s(4), s(6));
        assert!(ledger.violations().is_empty());
        assert_eq!(ledger.counts().takeovers, 1);
    }

    fn seen(now: u64, swept: Swept, cursors: &[(&str, u64)]) -> SweepSeen<'static> {
        SweepSeen {
            by: "relay-0",
            now: Duration::from_secs(now),
            watermark: now * 10,
            first_log: 1,
            events_head: now * 10,
            cursors: cursors.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect(),
            lost: Vec::new(),
            swept,
            fencing: 0,
        }
    }

    #[test]
    fn a_sweep_under_a_fence_older_than_the_newest_grant_is_a_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.check_sweep(&SweepSeen {
            fencing: 1,
            ..seen(1, Swept::default(), &[])
        });
        assert!(ledger.violations().is_empty(), "the holder sweeps");
        ledger.granted(&lease("relay-1", 2), s(3), s(5));
        ledger.check_sweep(&SweepSeen {
            fencing: 1,
            ..seen(4, Swept::default(), &[])
        });
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("two sweeps at once"), "{v:?}");
    }

    #[test]
    fn a_sweep_that_cuts_history_younger_than_keep_or_a_cursors_events_is_a_violation() {
        let ledger = SweepLedger::default();
        // Marks at 0..=4 s, ten writes and ten records a second.
        for t in 0..4 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        assert!(ledger.violations().is_empty());
        // At 4 s, what was written by 2 s (head 20) may go: from 21 on stays.
        let fine = Swept {
            first_available: 21,
            first_event: 11,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(4, fine, &[("follower-2", 10)]));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // At 5 s only what was written by 3 s (head 30) may go.
        let young = Swept {
            first_available: 41,
            first_event: 11,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(5, young, &[("follower-2", 10)]));
        let cursor = Swept {
            first_available: 21,
            first_event: 21,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(6, cursor, &[("follower-2", 10)]));
        let v = ledger.violations();
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("change log"), "{v:?}");
        assert!(v[1].contains("follower-2"), "{v:?}");
    }

    #[test]
    fn history_a_sweep_long_ago_proved_old_may_go_again_after_a_restore_put_it_back() {
        // Seed 85219939: a sweep at 3 s saw the change log up to 56; the next came 13 s
        // later, past the marks' reach, and cut to 57; a restore then put back 45..56.
        let ledger = SweepLedger::default();
        let at = |now: u64, first_log: u64, first_available: u64| SweepSeen {
            watermark: if now < 5 { 56 } else { 118 },
            first_log,
            events_head: 0,
            ..seen(
                now,
                Swept {
                    first_available,
                    ..Swept::default()
                },
                &[],
            )
        };
        ledger.check_sweep(&at(3, 45, 45));
        ledger.check_sweep(&at(16, 45, 57));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // After the restore the log starts at 45 again: 45..56 are 14 s old, not young.
        ledger.check_sweep(&at(17, 45, 57));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // The old mark vouches for nothing newer: cutting past 56 is still caught.
        ledger.check_sweep(&at(17, 45, 58));
        assert_eq!(ledger.violations().len(), 1, "{:?}", ledger.violations());
    }

    #[test]
    fn a_sweep_that_cuts_the_seqs_a_restore_gave_back_to_young_changes_is_a_violation() {
        // Marks at 0..=3 s (ten writes a second), a restore at 3.5 s to a backup at 15,
        // and the new history written on from 16 to 25 by 5 s: the old marks vouch for
        // 15 at most, so a sweep at 5 s may cut below 16 but no further.
        let ledger = SweepLedger::default();
        for t in 0..4 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        ledger.restored(15);
        let at = |first_available: u64| SweepSeen {
            watermark: 25,
            events_head: 0,
            ..seen(
                5,
                Swept {
                    first_available,
                    ..Swept::default()
                },
                &[],
            )
        };
        ledger.check_sweep(&at(16));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // 16..25 were written after the restore, within the last 2 s.
        ledger.check_sweep(&at(26));
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("change log to 26"), "{v:?}");
    }

    #[test]
    fn events_a_cursor_needs_may_go_once_the_maximum_age_forces_them() {
        let ledger = SweepLedger::default();
        for t in 0..12 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        // At 12 s, records up to the 4 s mark (head 40) are 8 s old.
        let forced = Swept {
            first_available: 41,
            first_event: 41,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(12, forced, &[("follower-2", 10)]));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        assert_eq!(ledger.counts().forced, 1);
    }
}
