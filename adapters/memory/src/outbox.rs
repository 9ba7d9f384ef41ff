//! The in-process outbox: rows appended by an announcing [`MemorySource`](crate::MemorySource)
//! in the same critical section as the write, handed to relays under leases.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidemark::instant_after;
use tidemark::tidemark_core::{AnnouncePlan, AnnounceReport};
use tidemark::{Claimed, Outbox, OutboxRow, OutboxUpdate, OutboxWatch, Result};
use tokio::time::Instant;

use crate::clock::Now;
use crate::faults::{Faults, Port};
use crate::signal::Signal;

#[derive(Clone, Debug)]
struct Slot {
    row: OutboxRow,
    /// The owner holding the row and until when (tokio time).
    claim: Option<(String, Instant)>,
}

#[derive(Clone, Debug, Default)]
struct State {
    next_id: u64,
    /// Rows not done, by id: what claims scan.
    pending: BTreeMap<u64, Slot>,
    /// Rows done, kept for oracles until a sweep removes them.
    done: BTreeMap<u64, OutboxRow>,
}

/// A copy of a [`MemoryOutbox`]'s rows, taken by [`MemoryOutbox::backup`].
#[derive(Clone, Debug)]
pub struct MemoryOutboxBackup {
    state: State,
}

struct Inner {
    state: Mutex<State>,
    /// Bumped when a row is appended or released.
    changed: Signal,
    faults: Faults,
    /// Where leases are measured: tokio's clock, or the caller's.
    clock: Now,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("state", &self.state)
            .field("changed", &self.changed)
            .field("faults", &self.faults)
            .field("clock", &self.clock)
            .finish()
    }
}

/// An in-process [`Outbox`] with the same claim semantics as SQLite's: leases in tokio
/// time (so paused time and simulators drive them), one owner per row at a time.
///
/// A cheap handle: clones share the rows, which can live outside a simulated host that
/// crashes, like a disk. Its calls consult [`Port::Outbox`] faults (appends by a source are
/// part of the source's write and do not).
#[derive(Clone, Debug)]
pub struct MemoryOutbox {
    inner: Arc<Inner>,
}

impl Default for MemoryOutbox {
    fn default() -> Self {
        MemoryOutbox::new(Faults::new())
    }
}

impl MemoryOutbox {
    /// An empty outbox whose calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        Self::build(faults, Now::default())
    }

    /// An empty outbox whose leases are measured on `clock` instead of tokio's.
    ///
    /// The rows outlive the runtime that claimed them (a simulated host that crashes and
    /// comes back runs on a new runtime, whose `Instant`s start from a new base): a clock
    /// that outlives every runtime keeps a lease taken before a restart comparable with
    /// the time after it, as SQLite's wall-clock `claim_until` is.
    #[must_use]
    pub fn with_clock(faults: Faults, clock: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        Self::build(faults, Now::given(clock))
    }

    fn build(faults: Faults, clock: Now) -> Self {
        MemoryOutbox {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                changed: Signal::default(),
                faults,
                clock,
            }),
        }
    }

    fn now(&self) -> Instant {
        self.inner.clock.now()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the announcement of the write at `seq`. Called by an announcing source
    /// while it holds its own state, so the row and the write are one step.
    pub(crate) fn append(&self, seq: u64, plan: AnnouncePlan) {
        {
            let mut s = self.state();
            s.next_id += 1;
            let id = s.next_id;
            s.pending.insert(
                id,
                Slot {
                    row: OutboxRow {
                        id,
                        seq,
                        plan,
                        landed: AnnounceReport::default(),
                    },
                    claim: None,
                },
            );
        }
        self.inner.changed.bump();
    }

    /// A copy of every row as it is now: what a backup of the database that holds the
    /// outbox holds (take it with the source's [`backup`](crate::MemorySource::backup)).
    #[must_use]
    pub fn backup(&self) -> MemoryOutboxBackup {
        MemoryOutboxBackup {
            state: self.state().clone(),
        }
    }

    /// Puts `backup` back in place of every row, as restoring the database does: rows
    /// appended since are gone (their ids are used again), claims are as they were.
    pub fn restore(&self, backup: &MemoryOutboxBackup) {
        *self.state() = backup.state.clone();
        self.inner.changed.bump();
    }

    /// Removes every row the relay finished (retention); returns how many.
    pub(crate) fn drop_done(&self) -> u64 {
        let mut s = self.state();
        let n = s.done.len() as u64;
        s.done.clear();
        n
    }

    /// Every row, done or not, with whether it is done, in id order, without consulting
    /// faults (for oracles). Done rows a sweep removed are gone.
    #[must_use]
    pub fn rows(&self) -> Vec<(OutboxRow, bool)> {
        let s = self.state();
        let mut rows: Vec<(OutboxRow, bool)> = s
            .pending
            .values()
            .map(|slot| (slot.row.clone(), false))
            .chain(s.done.values().map(|row| (row.clone(), true)))
            .collect();
        rows.sort_by_key(|(row, _)| row.id);
        rows
    }
}

impl Outbox for MemoryOutbox {
    type Watch = MemoryOutboxWatch;

    async fn claim(&self, owner: &str, after: u64, max: usize, lease: Duration) -> Result<Claimed> {
        self.inner.faults.check(Port::Outbox)?;
        let now = self.now();
        let until = instant_after(now, lease);
        let mut s = self.state();
        let mut claimed = Claimed::default();
        for slot in s.pending.values_mut() {
            let held_by_other = slot
                .claim
                .as_ref()
                .filter(|(holder, expires)| holder != owner && *expires > now);
            if let Some((_, expires)) = held_by_other {
                let left = *expires - now;
                claimed.held_by_others = Some(claimed.held_by_others.map_or(left, |l| l.min(left)));
                continue;
            }
            if slot.row.id > after && claimed.rows.len() < max {
                slot.claim = Some((owner.to_owned(), until));
                claimed.rows.push(slot.row.clone());
            }
        }
        Ok(claimed)
    }

    async fn complete(&self, owner: &str, updates: Vec<OutboxUpdate>) -> Result<u64> {
        self.inner.faults.check(Port::Outbox)?;
        let mut recorded = 0;
        {
            let mut s = self.state();
            for update in updates {
                let Some(slot) = s.pending.get_mut(&update.id) else {
                    continue;
                };
                if slot
                    .claim
                    .as_ref()
                    .is_none_or(|(holder, _)| holder != owner)
                {
                    continue;
                }
                let landed = &mut slot.row.landed;
                landed.published |= update.landed.published;
                landed.notified |= update.landed.notified;
                landed.enqueued = landed.enqueued.or(update.landed.enqueued);
                slot.claim = None;
                recorded += 1;
                if update.done
                    && let Some(slot) = s.pending.remove(&update.id)
                {
                    s.done.insert(update.id, slot.row);
                }
            }
        }
        if recorded > 0 {
            self.inner.changed.bump();
        }
        Ok(recorded)
    }

    async fn pending(&self) -> Result<u64> {
        self.inner.faults.check(Port::Outbox)?;
        Ok(self.state().pending.len() as u64)
    }

    fn watch(&self) -> MemoryOutboxWatch {
        MemoryOutboxWatch {
            inner: Arc::clone(&self.inner),
            seen: self.inner.changed.version(),
        }
    }
}

/// Resolves when rows were appended to or released in a [`MemoryOutbox`].
#[derive(Debug)]
pub struct MemoryOutboxWatch {
    inner: Arc<Inner>,
    seen: u64,
}

impl OutboxWatch for MemoryOutboxWatch {
    async fn changed(&mut self) {
        self.inner.changed.changed_since(self.seen).await;
        self.seen = self.inner.changed.version();
    }
}
