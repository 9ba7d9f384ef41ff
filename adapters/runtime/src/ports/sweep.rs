//! Retention: what an adapter removes when asked to sweep.

use std::future::Future;

use crate::error::Result;

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
/// so several processes do not repeat each other's work.
pub trait Sweep: Send + Sync {
    /// Removes what the retention limits allow, once.
    fn sweep(&self) -> impl Future<Output = Result<Swept>> + Send;
}
