//! The in-process job queue: leases with visibility timeouts, retries, a dead letter.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidemark::instant_after;
use tidemark::tidemark_core::{Job, JobId};
use tidemark::{
    Error, JobCounts, JobRecord, JobRetention, JobState, Leased, Queue, ReadySignal, Result,
    TickKey,
};
use tokio::time::Instant;

use crate::clock::Now;
use crate::faults::{Faults, Port};

/// Attempts before a job is dead-lettered, by default.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

#[derive(Debug)]
struct Slot {
    record: JobRecord,
    visible_at: Instant,
    receipt: u64,
    lease_until: Option<Instant>,
    /// When it was done or dead-lettered (for retention).
    finished_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    next_receipt: u64,
    jobs: BTreeMap<JobId, Slot>,
    /// The job each coalesce key last went to; it absorbs later enqueues while it is
    /// still ready and never leased.
    coalesce: BTreeMap<String, JobId>,
    /// Each schedule's newest enqueued tick (anchor, tick): never removed by retention.
    ticks: BTreeMap<String, (Duration, u64)>,
}

impl State {
    /// Expired leases go back to ready, or to the dead letter if their attempts are used.
    fn expire(&mut self, now: Instant, max_attempts: u32) {
        for slot in self.jobs.values_mut() {
            if slot.record.state == JobState::Leased && slot.lease_until.is_some_and(|t| t <= now) {
                slot.lease_until = None;
                slot.record.last_error =
                    Some(format!("lease expired on attempt {}", slot.record.attempts));
                slot.record.state = if slot.record.attempts >= max_attempts {
                    slot.finished_at = Some(now);
                    JobState::DeadLettered
                } else {
                    JobState::Ready
                };
                slot.visible_at = now;
            }
        }
    }

    fn held<'a>(&'a mut self, lease: &Leased, now: Instant) -> Result<&'a mut Slot> {
        match self.jobs.get_mut(&lease.id) {
            Some(slot)
                if slot.record.state == JobState::Leased
                    && slot.receipt == lease.receipt
                    && slot.lease_until.is_some_and(|t| t > now) =>
            {
                Ok(slot)
            }
            _ => Err(Error::LeaseLost(format!(
                "{} (receipt {})",
                lease.id, lease.receipt
            ))),
        }
    }
}

/// An in-process job queue. Time is tokio's (or the clock it was given), so paused time
/// drives visibility timeouts.
#[derive(Clone)]
pub struct MemoryQueue {
    state: Arc<Mutex<State>>,
    /// Bumped when a job becomes ready (enqueued, failed back, requeued).
    ready: Arc<tokio::sync::watch::Sender<u64>>,
    max_attempts: u32,
    faults: Faults,
    clock: Now,
}

impl std::fmt::Debug for MemoryQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryQueue")
            .field("max_attempts", &self.max_attempts)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryQueue {
    fn default() -> Self {
        MemoryQueue::new(Faults::new())
    }
}

impl MemoryQueue {
    /// An empty queue dead-lettering after [`DEFAULT_MAX_ATTEMPTS`].
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemoryQueue {
            state: Arc::default(),
            ready: Arc::new(tokio::sync::watch::Sender::new(0)),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            faults,
            clock: Now::default(),
        }
    }

    /// An empty queue whose leases, retry delays and retention ages are measured on
    /// `clock` instead of tokio's.
    ///
    /// The jobs outlive the runtime that leased them (a simulated host that crashes and
    /// comes back runs on a new runtime, whose `Instant`s start from a new base): a clock
    /// that outlives every runtime keeps a lease taken before a restart comparable with
    /// the time after it, as SQLite's wall-clock leases are.
    #[must_use]
    pub fn with_clock(faults: Faults, clock: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        MemoryQueue {
            clock: Now::given(clock),
            ..MemoryQueue::new(faults)
        }
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The same queue dead-lettering after `max_attempts` (at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    fn readied(&self) {
        self.ready.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every job, in id order (for oracles and tests).
    #[must_use]
    pub fn jobs(&self) -> Vec<JobRecord> {
        let mut s = self.state();
        s.expire(self.now(), self.max_attempts);
        s.jobs.values().map(|slot| slot.record.clone()).collect()
    }
}

impl MemoryQueue {
    /// Enqueues `job` on the locked state; returns its id and whether it is a new job
    /// (not absorbed by a pending one).
    fn enqueue_on(&self, s: &mut State, job: Job) -> (JobId, bool) {
        let coalesce = job.coalesce_key();
        if let Some(key) = &coalesce {
            let pending = s.coalesce.get(key).copied().filter(|id| {
                s.jobs.get(id).is_some_and(|slot| {
                    slot.record.state == JobState::Ready && slot.record.attempts == 0
                })
            });
            if let Some(id) = pending {
                return (id, false);
            }
        }
        s.next_id += 1;
        let id = JobId(s.next_id);
        if let Some(key) = coalesce {
            s.coalesce.insert(key, id);
        }
        s.jobs.insert(
            id,
            Slot {
                record: JobRecord {
                    id,
                    job,
                    state: JobState::Ready,
                    attempts: 0,
                    last_error: None,
                },
                visible_at: self.now(),
                receipt: 0,
                lease_until: None,
                finished_at: None,
            },
        );
        (id, true)
    }
}

impl Queue for MemoryQueue {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        self.faults.check(Port::Queue)?;
        let mut s = self.state();
        let (id, new) = self.enqueue_on(&mut s, job);
        drop(s);
        if new {
            self.readied();
        }
        Ok(id)
    }

    async fn enqueue_tick(&self, tick: &TickKey, job: Job) -> Result<Option<JobId>> {
        self.faults.check(Port::Queue)?;
        let mut s = self.state();
        if !tick.is_due_after(s.ticks.get(&tick.schedule).copied()) {
            return Ok(None);
        }
        let (id, new) = self.enqueue_on(&mut s, job);
        s.ticks
            .insert(tick.schedule.clone(), (tick.anchor, tick.tick));
        drop(s);
        if new {
            self.readied();
        }
        Ok(Some(id))
    }

    fn ready_signal(&self) -> Option<ReadySignal> {
        Some(ReadySignal::new(self.ready.subscribe()))
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        self.faults.check(Port::Queue)?;
        let mut s = self.state();
        s.expire(self.now(), self.max_attempts);
        Ok(s.jobs.get(&id).map(|slot| slot.record.clone()))
    }

    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        s.expire(now, self.max_attempts);
        s.next_receipt += 1;
        let receipt = s.next_receipt;
        let ready = |slot: &Slot| slot.record.state == JobState::Ready && slot.visible_at <= now;
        // Priority jobs (sweeps) first, then the oldest.
        let first = s
            .jobs
            .values()
            .find(|slot| ready(slot) && slot.record.job.is_priority())
            .or_else(|| s.jobs.values().find(|slot| ready(slot)))
            .map(|slot| slot.record.id);
        let Some(slot) = first.and_then(|id| s.jobs.get_mut(&id)) else {
            return Ok(None);
        };
        slot.record.attempts += 1;
        slot.record.state = JobState::Leased;
        slot.receipt = receipt;
        slot.lease_until = Some(instant_after(now, visibility));
        Ok(Some(Leased {
            id: slot.record.id,
            job: slot.record.job.clone(),
            attempt: slot.record.attempts,
            receipt,
        }))
    }

    async fn ack(&self, lease: &Leased) -> Result<()> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        let slot = s.held(lease, now)?;
        slot.record.state = JobState::Done;
        slot.lease_until = None;
        slot.finished_at = Some(now);
        Ok(())
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let max_attempts = self.max_attempts;
        let mut s = self.state();
        let slot = s.held(lease, now)?;
        slot.lease_until = None;
        slot.record.last_error = Some(error.to_owned());
        slot.record.state = if slot.record.attempts >= max_attempts {
            slot.finished_at = Some(now);
            JobState::DeadLettered
        } else {
            slot.visible_at = instant_after(now, retry_after);
            JobState::Ready
        };
        let state = slot.record.state;
        drop(s);
        if state == JobState::Ready {
            self.readied();
        }
        Ok(state)
    }

    async fn renew(&self, lease: &Leased, visibility: Duration) -> Result<()> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        let slot = s.held(lease, now)?;
        slot.lease_until = Some(instant_after(now, visibility));
        Ok(())
    }

    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        let slot = s.held(lease, now)?;
        slot.lease_until = None;
        slot.record.last_error = Some(error.to_owned());
        slot.record.state = JobState::DeadLettered;
        slot.finished_at = Some(now);
        Ok(())
    }

    async fn dead_letters(&self, after: Option<JobId>, limit: usize) -> Result<Vec<JobRecord>> {
        self.faults.check(Port::Queue)?;
        let mut s = self.state();
        s.expire(self.now(), self.max_attempts);
        let from = after.map_or(JobId(0), |id| JobId(id.0.saturating_add(1)));
        Ok(s.jobs
            .range(from..)
            .filter(|(_, slot)| slot.record.state == JobState::DeadLettered)
            .take(limit)
            .map(|(_, slot)| slot.record.clone())
            .collect())
    }

    async fn requeue(&self, id: JobId) -> Result<JobId> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        s.expire(now, self.max_attempts);
        match s.jobs.get_mut(&id) {
            Some(slot) if slot.record.state == JobState::DeadLettered => {
                slot.record.state = JobState::Ready;
                slot.record.attempts = 0;
                slot.visible_at = now;
                slot.finished_at = None;
                // It has not run since: its key's pending job, unless the key has one.
                if let Some(key) = slot.record.job.coalesce_key() {
                    let pending = s.coalesce.get(&key).is_some_and(|other| {
                        *other != id
                            && s.jobs.get(other).is_some_and(|o| {
                                o.record.state == JobState::Ready && o.record.attempts == 0
                            })
                    });
                    if !pending {
                        s.coalesce.insert(key, id);
                    }
                }
                drop(s);
                self.readied();
                Ok(id)
            }
            _ => Err(Error::NotFound(format!("dead letter {id}"))),
        }
    }

    async fn counts(&self) -> Result<JobCounts> {
        self.faults.check(Port::Queue)?;
        let mut s = self.state();
        s.expire(self.now(), self.max_attempts);
        let mut counts = JobCounts::default();
        for slot in s.jobs.values() {
            *match slot.record.state {
                JobState::Ready => &mut counts.ready,
                JobState::Leased => &mut counts.leased,
                JobState::Done => &mut counts.done,
                _ => &mut counts.dead,
            } += 1;
        }
        Ok(counts)
    }

    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        self.faults.check(Port::Queue)?;
        let now = self.now();
        let mut s = self.state();
        s.expire(now, self.max_attempts);
        let before = s.jobs.len();
        s.jobs.retain(|_, slot| {
            let age = slot.finished_at.map(|t| now.saturating_duration_since(t));
            let keep_for = match slot.record.state {
                JobState::Done => Some(retention.done),
                JobState::DeadLettered => retention.dead,
                _ => None,
            };
            !matches!((age, keep_for), (Some(age), Some(keep)) if age >= keep)
        });
        let State { jobs, coalesce, .. } = &mut *s;
        coalesce.retain(|_, id| jobs.contains_key(id));
        Ok((before - s.jobs.len()) as u64)
    }
}
