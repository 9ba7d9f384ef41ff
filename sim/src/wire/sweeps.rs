//! Retention's calls and answers on the wire: the sweeper lock, the durable schedules and
//! the sweep.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tidemark::tidemark_core::{Job, Schedule, ScheduleClock};
use tidemark::{DueSchedule, Error, LockLease, Result};

/// A retention call on the wire: the sweeper lock, the schedules and the sweep.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum SweepCall {
    TryLock {
        name: String,
        owner: String,
        ttl: Duration,
    },
    Renew {
        lease: WireLockLease,
        ttl: Duration,
    },
    Release {
        lease: WireLockLease,
    },
    Schedules,
    /// Interval schedules only: cron is not needed in the world.
    PutSchedule {
        name: String,
        every: Duration,
        #[serde(with = "crate::wire::job")]
        job: Job,
    },
    RemoveSchedule {
        name: String,
    },
    /// The schedule as the runner read it, and the tick it fires (`for_job`: claimed for
    /// a job, pending until settled).
    MarkFired {
        due: WireDue,
        tick: u64,
        for_job: bool,
        by: Option<String>,
    },
    /// `by`: the owner sweeping, named to the ledger; `fence`: the sweeper lock's lease
    /// it sweeps under.
    Sweep {
        by: Option<String>,
        fence: WireLockLease,
    },
    /// A pending tick's job is enqueued.
    JobEnqueued {
        name: String,
        tick: u64,
        by: Option<String>,
    },
}

/// A lock lease on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireLockLease {
    pub name: String,
    pub owner: String,
    pub fencing: u64,
}

impl From<&LockLease> for WireLockLease {
    fn from(l: &LockLease) -> Self {
        WireLockLease {
            name: l.name.clone(),
            owner: l.owner.clone(),
            fencing: l.fencing,
        }
    }
}

impl From<WireLockLease> for LockLease {
    fn from(w: WireLockLease) -> Self {
        LockLease {
            name: w.name,
            owner: w.owner,
            fencing: w.fencing,
        }
    }
}

/// A stored schedule on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireDue {
    pub name: String,
    pub every: Duration,
    #[serde(with = "crate::wire::job")]
    pub job: Job,
    pub last_fired: Option<u64>,
    pub pending: Option<u64>,
    pub anchor: Duration,
    pub now: Duration,
}

impl WireDue {
    /// An interval schedule as read, for the wire (`None` for a cron schedule).
    pub fn of(d: &DueSchedule) -> Option<WireDue> {
        Some(WireDue {
            name: d.schedule.name().to_owned(),
            every: d.schedule.interval()?,
            job: d.schedule.job().clone(),
            last_fired: d.last_fired,
            pending: d.pending,
            anchor: d.clock.anchor,
            now: d.clock.now,
        })
    }

    /// The schedule as read, back from the wire.
    pub fn into_due(self) -> Result<DueSchedule> {
        let schedule = Schedule::new(self.name, self.every, self.job)
            .map_err(|e| Error::unavailable("schedules", e.to_string()))?;
        Ok(DueSchedule {
            schedule,
            last_fired: self.last_fired,
            pending: self.pending,
            clock: ScheduleClock {
                anchor: self.anchor,
                now: self.now,
            },
        })
    }
}

/// A retention call's answer on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum SweepAnswer {
    Locked(Option<WireLockLease>),
    Done,
    Yes(bool),
    Schedules(Vec<WireDue>),
    Swept {
        outbox_rows: u64,
        events: u64,
        log_rows: u64,
        jobs: u64,
        first_available: u64,
        first_event: u64,
    },
    /// [`Error::LeaseLost`].
    LeaseLost(String),
}
