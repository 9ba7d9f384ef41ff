//! The maintenance job queue: at-least-once delivery with leases and a dead letter.

use std::future::Future;
use std::time::Duration;

use tidemark_core::{Job, JobId};

use crate::error::Result;

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to be leased (possibly not before a retry delay).
    Ready,
    /// Leased to a worker until its visibility timeout.
    Leased,
    /// Acknowledged: done.
    Done,
    /// Failed its maximum number of attempts; kept with its last error.
    DeadLettered,
}

/// A job as the queue holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRecord {
    /// Its id.
    pub id: JobId,
    /// The job.
    pub job: Job,
    /// Where it is.
    pub state: JobState,
    /// How many times it was leased.
    pub attempts: u32,
    /// The last failure (an explicit fail, or an expired lease).
    pub last_error: Option<String>,
}

/// A leased job. Ack or fail it before its visibility timeout, or it is delivered again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leased {
    /// Its id.
    pub id: JobId,
    /// The job.
    pub job: Job,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// Identifies this lease: acking or failing with an older receipt is
    /// [`Error::LeaseLost`](crate::Error::LeaseLost).
    pub receipt: u64,
}

/// A durable queue of maintenance jobs.
pub trait Queue: Send + Sync {
    /// Enqueues `job`; returns its id.
    fn enqueue(&self, job: Job) -> impl Future<Output = Result<JobId>> + Send;

    /// Reads a job back by id.
    fn get(&self, id: JobId) -> impl Future<Output = Result<Option<JobRecord>>> + Send;

    /// Leases the oldest ready job for `visibility`; `None` if none is ready. A job whose
    /// attempts are used up is dead-lettered instead of leased.
    fn lease(&self, visibility: Duration) -> impl Future<Output = Result<Option<Leased>>> + Send;

    /// Completes a leased job.
    fn ack(&self, lease: &Leased) -> impl Future<Output = Result<()>> + Send;

    /// Records a failure of a leased job: ready again after `retry_after`, or dead-lettered
    /// with `error` once its attempts are used up. Returns where the job went.
    fn fail(
        &self,
        lease: &Leased,
        error: &str,
        retry_after: Duration,
    ) -> impl Future<Output = Result<JobState>> + Send;
}
