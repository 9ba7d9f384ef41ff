//! Durable named schedules, and the compare-and-set that fires each tick once.

use std::future::Future;

use tidemark_core::{Schedule, ScheduleClock};

use crate::error::Result;

/// A stored schedule, with how far its clock has run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueSchedule {
    /// The schedule.
    pub schedule: Schedule,
    /// The last tick fired, if any.
    pub last_fired: Option<u64>,
    /// A tick claimed with [`ScheduleStore::claim_for_job`] whose job is not known to be
    /// enqueued (not yet settled with [`ScheduleStore::job_enqueued`]: its runner may have
    /// died between the two). Usually the last fired tick; older when a runner that does
    /// its ticks' work itself ([`ScheduleStore::mark_fired`], which leaves this alone)
    /// claimed a newer one meanwhile.
    pub pending: Option<u64>,
    /// The schedule's anchor (when it was stored) and now, both by the store's clock: the
    /// one clock every runner shares (a database's or a server's, never each process's).
    pub clock: ScheduleClock,
}

/// Durable schedules.
pub trait ScheduleStore: Send + Sync {
    /// Stores `schedule`, replacing one of the same name (its anchor restarts now and its
    /// ticks count afresh).
    fn put_schedule(&self, schedule: Schedule) -> impl Future<Output = Result<()>> + Send;

    /// Removes the schedule called `name`; whether it existed.
    fn remove_schedule(&self, name: &str) -> impl Future<Output = Result<bool>> + Send;

    /// Every stored schedule with its last fired tick and clock, in name order.
    fn schedules(&self) -> impl Future<Output = Result<Vec<DueSchedule>>> + Send;

    /// Compare-and-set of the last fired tick: records `tick` as the last fired tick of the
    /// schedule `read` names only if the store still holds that schedule as it was read —
    /// the same schedule, anchor and last fired tick — so exactly one of several runners
    /// racing for a tick gets `true`, and a schedule replaced (or removed) since `read` was
    /// taken is refused: a stale read neither fires the old job nor sets a tick counted on
    /// the old schedule's clock as the replacement's last.
    fn mark_fired(
        &self,
        read: &DueSchedule,
        tick: u64,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// [`mark_fired`](Self::mark_fired) for a tick whose job is to be enqueued: the same
    /// compare-and-set, which also records `tick` as the schedule's
    /// [`pending`](DueSchedule::pending) tick, in the same write, until
    /// [`job_enqueued`](Self::job_enqueued) settles it. So a runner that dies after the
    /// claim leaves the tick for another to enqueue. (`mark_fired` leaves the pending
    /// tick as it is.)
    fn claim_for_job(
        &self,
        read: &DueSchedule,
        tick: u64,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Records that the job of the schedule `name`'s pending tick `tick` is enqueued: the
    /// schedule's pending tick is cleared if it is still `tick` (anything else is left as
    /// it is). Idempotent.
    fn job_enqueued(&self, name: &str, tick: u64) -> impl Future<Output = Result<()>> + Send;
}
