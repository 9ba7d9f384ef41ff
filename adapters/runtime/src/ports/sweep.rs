//! Retention: what an adapter removes when asked to sweep.

use std::future::Future;

use crate::error::Result;
use crate::ports::LockLease;

/// What one sweep removed, by kind, and where the logs it cut now start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Outbox rows removed (only rows already relayed).
    pub outbox_rows: u64,
    /// Events-stream records removed.
    pub events: u64,
    /// Change-log entries removed.
    pub log_rows: u64,
    /// Tombstones (removed keys' markers) dropped.
    pub tombstones: u64,
    /// Finished jobs removed.
    pub jobs: u64,
    /// The first change-log seq served afterwards (a reader below it resyncs).
    pub first_available: u64,
    /// The first events-stream position kept afterwards.
    pub first_event: u64,
}

impl Swept {
    /// Everything removed, of every kind.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.outbox_rows + self.events + self.log_rows + self.tombstones + self.jobs
    }
}

/// Storage that retention keeps bounded: relayed outbox rows, old events, change-log
/// history no known reader needs, finished jobs. Each adapter says what its limits are.
///
/// A sweep is safe to run at any time and from any process, and idempotent; the drivers
/// run one at a time under the sweeper lock ([`sweep_under_lock`](crate::sweep_under_lock)),
/// so several processes do not repeat each other's work, and the lock's fencing token goes
/// with the sweep, so a sweeper stalled past its lease cannot sweep beside its successor.
pub trait Sweep: Send + Sync {
    /// Removes what the retention limits allow, once, under the sweeper lock's lease
    /// `fence`: [`Error::LeaseLost`](crate::Error::LeaseLost) if the lock has been taken
    /// since with a newer fencing token ([`LockLease::check_fence`]), checked where the
    /// sweep acts (SQLite: in every transaction that deletes; memory: in the step that
    /// removes; NATS: before each stream it changes, when the sweep knows the lock).
    fn sweep(&self, fence: &LockLease) -> impl Future<Output = Result<Swept>> + Send;
}
