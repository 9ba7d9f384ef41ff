//! The source host's retention, reached over the wire: its sweeper [`Lock`], its durable
//! schedules ([`ScheduleStore`], interval schedules only) and its [`Sweep`], and what a
//! worker host sweeps with.

use std::time::Duration;

use tidemark::tidemark_core::Schedule;
use tidemark::{
    DueSchedule, Error, Lock, LockLease, Result, ScheduleStore, Sweep, SweepWithJobs, Swept,
};

use crate::clients::remote::Remote;
use crate::scenario::JOB_RETENTION;
use crate::wire::{Request, Response, SweepAnswer, SweepCall, WireDue};

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
