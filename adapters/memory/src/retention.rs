//! Retention in memory: the same semantics as SQLite's sweep, on tokio's clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::{Mark, RetentionPolicy};
use tidemark::{LockLease, Result, Sweep, Swept};
use tokio::time::Instant;

use crate::clock::Now;
use crate::faults::Port;
use crate::{Memory, MemoryEvents, MemoryLock, MemoryOutbox, MemorySource};

/// The memory adapter's [`Sweep`]: removes finished outbox rows, change-log history no
/// durable cursor needs once older than the policy's `keep` (and any older than its
/// `max_age`), and events records likewise. Ages come from marks taken at each sweep, on
/// tokio's clock, so paused time drives them.
#[derive(Clone, Debug)]
pub struct MemorySweep {
    source: MemorySource,
    events: MemoryEvents,
    outbox: MemoryOutbox,
    /// The lock whose fencing tokens a sweep's fence is checked against.
    lock: MemoryLock,
    policy: RetentionPolicy,
    origin: Instant,
    clock: Now,
    /// (when, watermark, events head) at each sweep.
    marks: Arc<Mutex<Vec<(Duration, u64, u64)>>>,
    /// How many of the source's restores the marks already account for.
    restores_seen: Arc<Mutex<usize>>,
}

impl Memory {
    /// A sweep of these ports under `policy`.
    #[must_use]
    pub fn sweeper(&self, policy: RetentionPolicy) -> MemorySweep {
        MemorySweep {
            source: self.source.clone(),
            events: self.events.clone(),
            outbox: self.outbox.clone(),
            lock: self.lock.clone(),
            policy,
            origin: Instant::now(),
            clock: Now::default(),
            marks: Arc::default(),
            restores_seen: Arc::new(Mutex::new(self.source.restore_count())),
        }
    }

    /// A sweep of these ports under `policy` whose ages are read on `clock` instead of
    /// tokio's (a simulator's clock, which outlives the runtimes of hosts that restart).
    #[must_use]
    pub fn sweeper_with_clock(
        &self,
        policy: RetentionPolicy,
        clock: impl Fn() -> Instant + Send + Sync + 'static,
    ) -> MemorySweep {
        let clock = Now::given(clock);
        MemorySweep {
            origin: clock.now(),
            clock,
            ..self.sweeper(policy)
        }
    }
}

impl MemorySweep {
    /// The same sweep, its fences checked against `lock` instead of its [`Memory`]'s (a
    /// simulator's lock on its own clock).
    #[must_use]
    pub fn fenced_by(mut self, lock: MemoryLock) -> Self {
        self.lock = lock;
        self
    }
}

impl Sweep for MemorySweep {
    /// The fence is checked against the lock right before the removals, which run in one
    /// step with no await between them.
    async fn sweep(&self, fence: &LockLease) -> Result<Swept> {
        self.source.faults().check(Port::Source)?;
        self.lock.check_fence(fence)?;
        let now = self.clock.now().saturating_duration_since(self.origin);
        let (watermark, restores) = self.source.watermark_and_restores();
        let (events_head, cursor_floor) = self.events.head_and_floor();
        let cursor_floor = cursor_floor.map(|c| c.saturating_add(1));
        let (log_marks, event_marks): (Vec<Mark>, Vec<Mark>) = {
            let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
            // A restore took the history back to its backup's watermark: a mark taken
            // before it vouches only for the seqs the backup kept, as the seqs above are
            // reused by younger changes (else a sweep soon after a restore cuts them).
            let mut seen = self.restores_seen.lock().unwrap_or_else(|e| e.into_inner());
            for &restored in restores.get(*seen..).unwrap_or_default() {
                for mark in marks.iter_mut() {
                    mark.1 = mark.1.min(restored);
                }
            }
            *seen = restores.len();
            marks.push((now, watermark, events_head));
            let log: Vec<Mark> = marks
                .iter()
                .map(|&(at, head, _)| Mark { at, head })
                .collect();
            if let Some(oldest) = self.policy.marks_to_keep(&log, now).first() {
                marks.retain(|m| m.0 >= oldest.at);
            }
            marks
                .iter()
                .map(|&(at, seq, pos)| (Mark { at, head: seq }, Mark { at, head: pos }))
                .unzip()
        };
        let horizon = self.policy.horizon(&log_marks, cursor_floor, now);
        let (log_rows, first_available) = self.source.compact_counting(horizon);
        let first_event = self.policy.horizon(&event_marks, cursor_floor, now);
        let events = self.events.truncate_below(first_event);
        Ok(Swept {
            outbox_rows: self.outbox.drop_done(),
            events,
            log_rows,
            tombstones: 0,
            jobs: 0,
            first_available,
            first_event,
        })
    }
}
