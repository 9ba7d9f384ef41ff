//! The source host's retention: its sweeper lock, durable schedules and sweep on the
//! simulation's clock, served over the wire and told to the sweeps' ledger as it serves.
//! Every sweep is `SweepWithJobs`' first half here (the source host's `MemorySweep`, fenced
//! by the host's lock); its second half is the queue's finished-job retention.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tidemark::tidemark_core::Schedule;
use tidemark::{Cursors, Error, Lock, LockLease, Result, ScheduleStore, Sweep};
use tidemark_memory::{Memory, MemoryLock, MemorySchedules, MemorySweep};

use crate::checks::oracle::History;
use crate::checks::sweeps::{SweepLedger, SweepSeen};
use crate::scenario::POLICY;
use crate::wire::{Response, SweepAnswer, SweepCall, WireDue, WireLockLease};

/// The source host's side: its lock, schedules and sweep on the simulation's clock, and
/// the ledger that watches them.
#[derive(Clone, Debug)]
pub struct Sweeps {
    lock: MemoryLock,
    schedules: MemorySchedules,
    sweep: MemorySweep,
    /// The ledger.
    pub ledger: SweepLedger,
    /// The source's history, told how far each sweep compacted the change log (the
    /// oracle allows a follower compacted past its watermark to put its entries again).
    history: History,
}

impl Sweeps {
    /// Over `memory`, on `clock` (which outlives the source host's runtimes); `cursors`
    /// names the durable consumers whose events the ledger checks are kept; `history` is
    /// told how far each sweep compacts the change log.
    pub fn new(
        memory: &Memory,
        clock: impl Fn() -> tokio::time::Instant + Clone + Send + Sync + 'static,
        cursors: Vec<String>,
        history: History,
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
            ledger: SweepLedger::watching(cursors),
            history,
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
                        self.ledger.doom_if_armed(by, false);
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
                let crash = by
                    .as_deref()
                    .is_some_and(|by| self.ledger.doom_if_armed(by, true));
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
        for name in self.ledger.cursors() {
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
        self.history.compacted(swept.first_available);
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
