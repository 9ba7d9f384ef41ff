//! The source host's job queue, reached over the wire: a [`Queue`] for the announce legs,
//! the job runners and the sweeps.

use std::time::Duration;

use tidemark::tidemark_core::{Job, JobId};
use tidemark::{
    Error, JobCounts, JobRecord, JobRetention, JobState, Leased, Queue, Result, TickKey,
};

use crate::clients::remote::Remote;
use crate::wire::{QueueAnswer, QueueCall, Request, Response};

fn unexpected(r: &Response) -> Error {
    Error::unavailable("queue", format!("unexpected answer {r:?}"))
}

impl Remote {
    async fn queue_call(&self, call: QueueCall) -> Result<QueueAnswer> {
        match self.call("queue", Request::Queue(call)).await? {
            Response::Queue(QueueAnswer::LeaseLost(why)) => Err(Error::LeaseLost(why)),
            Response::Queue(a) => Ok(a),
            r => Err(unexpected(&r)),
        }
    }
}

fn not_served(what: &str) -> Error {
    Error::unavailable(
        "queue",
        format!("{what} is an operator's call, not served over the simulator's wire"),
    )
}

/// The source host's job queue, reached over the wire: what the announce legs enqueue on,
/// what the job runners lease from and what sweeps remove finished jobs from. The
/// operator's calls (reading a job back, the dead letter list, requeue) are not served
/// here: nothing in the world makes them.
impl Queue for Remote {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        match self.queue_call(QueueCall::Enqueue(job)).await? {
            QueueAnswer::Id(id) => Ok(id),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn enqueue_tick(&self, tick: &TickKey, job: Job) -> Result<Option<JobId>> {
        let call = QueueCall::EnqueueTick {
            schedule: tick.schedule.clone(),
            anchor: tick.anchor,
            tick: tick.tick,
            job,
            by: self.owner().map(str::to_owned),
        };
        match self.queue_call(call).await? {
            QueueAnswer::Tick(id) => Ok(id),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn get(&self, _id: JobId) -> Result<Option<JobRecord>> {
        Err(not_served("reading a job back"))
    }

    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        let call = QueueCall::Lease {
            visibility,
            by: self.owner().map(str::to_owned),
        };
        match self.queue_call(call).await? {
            QueueAnswer::Leased(l) => Ok(l.map(Leased::from)),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn ack(&self, lease: &Leased) -> Result<()> {
        self.queue_call(QueueCall::Ack {
            lease: lease.into(),
        })
        .await
        .map(drop)
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        let call = QueueCall::Fail {
            lease: lease.into(),
            error: error.to_owned(),
            retry_after,
        };
        match self.queue_call(call).await? {
            QueueAnswer::Failed { dead: true } => Ok(JobState::DeadLettered),
            QueueAnswer::Failed { dead: false } => Ok(JobState::Ready),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn renew(&self, lease: &Leased, visibility: Duration) -> Result<()> {
        self.queue_call(QueueCall::Renew {
            lease: lease.into(),
            visibility,
        })
        .await
        .map(drop)
    }

    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        self.queue_call(QueueCall::DeadLetter {
            lease: lease.into(),
            error: error.to_owned(),
        })
        .await
        .map(drop)
    }

    async fn dead_letters(&self, _after: Option<JobId>, _limit: usize) -> Result<Vec<JobRecord>> {
        Err(not_served("listing dead letters"))
    }

    async fn requeue(&self, _id: JobId) -> Result<JobId> {
        Err(not_served("requeueing a dead letter"))
    }

    async fn counts(&self) -> Result<JobCounts> {
        match self.queue_call(QueueCall::Counts).await? {
            QueueAnswer::Counts {
                ready,
                leased,
                done,
                dead,
            } => Ok(JobCounts {
                ready,
                leased,
                done,
                dead,
            }),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }

    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        let call = QueueCall::RemoveFinished {
            done: retention.done,
            dead: retention.dead,
        };
        match self.queue_call(call).await? {
            QueueAnswer::Removed(n) => Ok(n),
            a => Err(Error::unavailable("queue", format!("unexpected {a:?}"))),
        }
    }
}
