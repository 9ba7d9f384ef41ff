//! The job queue's calls and answers on the wire: the [`Queue`](tidemark::Queue) methods a
//! runner and the announce legs use.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tidemark::Leased;
use tidemark::tidemark_core::{Job, JobId};

/// A queue call on the wire (the [`Queue`](tidemark::Queue) methods a runner and the
/// announce legs use).
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum QueueCall {
    Enqueue(#[serde(with = "crate::wire::job")] Job),
    /// `by`: the runner leasing, named to the ledger.
    Lease {
        visibility: Duration,
        by: Option<String>,
    },
    Renew {
        lease: WireLease,
        visibility: Duration,
    },
    Ack {
        lease: WireLease,
    },
    Fail {
        lease: WireLease,
        error: String,
        retry_after: Duration,
    },
    DeadLetter {
        lease: WireLease,
        error: String,
    },
    Counts,
    /// The queue's finished-job retention (a sweep's second half).
    RemoveFinished {
        done: Duration,
        dead: Option<Duration>,
    },
    /// The job of a schedule's tick, once per tick (last, so the other variants keep
    /// their wire form).
    EnqueueTick {
        schedule: String,
        anchor: Duration,
        tick: u64,
        #[serde(with = "crate::wire::job")]
        job: Job,
        /// The scheduler enqueueing, named to the ledger.
        by: Option<String>,
    },
}

/// A queue call's answer on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum QueueAnswer {
    Id(JobId),
    Leased(Option<WireLease>),
    Done,
    /// Where a failed job went: `true` if it was dead-lettered.
    Failed {
        dead: bool,
    },
    Counts {
        ready: u64,
        leased: u64,
        done: u64,
        dead: u64,
    },
    /// [`Error::LeaseLost`](tidemark::Error::LeaseLost): the runner must stop the job's
    /// handler.
    LeaseLost(String),
    /// Finished jobs removed.
    Removed(u64),
    /// A tick's job: its id if this call enqueued it.
    Tick(Option<JobId>),
}

/// A lease on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireLease {
    pub id: JobId,
    #[serde(with = "crate::wire::job")]
    pub job: Job,
    pub attempt: u32,
    pub receipt: u64,
}

impl From<&Leased> for WireLease {
    fn from(l: &Leased) -> Self {
        WireLease {
            id: l.id,
            job: l.job.clone(),
            attempt: l.attempt,
            receipt: l.receipt,
        }
    }
}

impl From<WireLease> for Leased {
    fn from(w: WireLease) -> Self {
        Leased {
            id: w.id,
            job: w.job,
            attempt: w.attempt,
            receipt: w.receipt,
        }
    }
}
