//! The outbox: announcements committed with their writes, waiting for a relay. Rows are
//! claimed with a lease, so relays in several processes on one store publish each row once.

use std::future::Future;
use std::time::Duration;

use tidemark_core::{AnnouncePlan, AnnounceReport};

use crate::error::Result;

/// One pending announcement, as a claim hands it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    /// Its position in the outbox: rows are claimed in increasing id order.
    pub id: u64,
    /// The seq of the write it announces.
    pub seq: u64,
    /// Which legs to run, with the event's bytes and the job.
    pub plan: AnnouncePlan,
    /// The legs that already landed on an earlier attempt: a retry redoes only the others.
    pub landed: AnnounceReport,
}

/// What a relay did with one claimed row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxUpdate {
    /// The row's id.
    pub id: u64,
    /// Every leg that has landed so far (the row's earlier legs included).
    pub landed: AnnounceReport,
    /// Whether the row is finished: it is never handed out again.
    pub done: bool,
}

/// What one claim got.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// The rows now claimed for the caller, in id order.
    pub rows: Vec<OutboxRow>,
    /// How long until the first pending row held by another owner's lease becomes
    /// claimable (`None`: no other owner holds one; a claim that got `max` rows may also
    /// leave it `None`, as the relay claims again anyway). A relay whose peer crashed
    /// after a claim wakes then to take the rows over: nothing commits when a lease runs
    /// out.
    pub held_by_others: Option<Duration>,
}

/// Waits for changes to an outbox.
pub trait OutboxWatch: Send {
    /// Resolves once rows may have been added or released since this watch was made or
    /// last resolved ("something may have changed": the caller claims to find out).
    ///
    /// Must be cancel-safe: the relay drops it whenever stop or a timer comes first.
    fn changed(&mut self) -> impl Future<Output = ()> + Send;
}

/// An outbox that relays drain. Rows are written by an announcing source in each write's
/// own transaction; this port only hands them out and records what became of them.
pub trait Outbox: Send + Sync {
    /// What [`watch`](Self::watch) returns.
    type Watch: OutboxWatch + 'static;

    /// Claims for `owner` up to `max` rows with an id above `after`, in id order, that are
    /// not done and not held by a live lease of another owner (rows `owner` holds itself
    /// are handed out again), until `lease` from now — atomically, so two relays never
    /// hold one row at once. A relay must complete its rows within the lease: after it,
    /// another relay may take them over and run their legs again.
    fn claim(
        &self,
        owner: &str,
        after: u64,
        max: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Claimed>> + Send;

    /// Records what became of rows `owner` claimed (which legs landed, whether done) and
    /// releases their claims — for each row only if `owner` still holds it, so a relay
    /// whose lease was taken over changes nothing. Returns how many rows were recorded.
    fn complete(
        &self,
        owner: &str,
        updates: Vec<OutboxUpdate>,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// How many rows are not done (claimed or not).
    fn pending(&self) -> impl Future<Output = Result<u64>> + Send;

    /// A watch of this outbox, starting now: make it before claiming, so a row written
    /// during the claim is not missed.
    fn watch(&self) -> Self::Watch;
}
