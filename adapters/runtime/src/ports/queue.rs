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

/// How many jobs are in each state (a queue's depth is `ready + leased`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobCounts {
    /// Waiting to be leased, retry delays included.
    pub ready: u64,
    /// Leased (on NATS: as last recorded; a lease that expired counts until redelivered).
    pub leased: u64,
    /// Done and not yet removed by retention.
    pub done: u64,
    /// Dead-lettered and not yet requeued or removed.
    pub dead: u64,
}

/// How long finished jobs are kept before [`Queue::remove_finished`] removes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobRetention {
    /// Done jobs are removed this long after they finished (default 1 minute: a done job
    /// is kept only to be seen; as Oban's pruner does, it goes soon, or a busy queue's
    /// history outgrows its data).
    pub done: Duration,
    /// Dead letters are removed this long after they died; `None` keeps them until
    /// requeued (default 7 days: long enough for an operator to look).
    pub dead: Option<Duration>,
}

impl Default for JobRetention {
    fn default() -> Self {
        JobRetention {
            done: Duration::from_secs(60),
            dead: Some(Duration::from_secs(7 * 24 * 60 * 60)),
        }
    }
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

/// One tick of one schedule: the key that makes the enqueue of its job idempotent. The
/// schedule's anchor is part of it, so a replaced schedule (whose ticks count afresh from a
/// new anchor) never shares a key with the one it replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TickKey {
    /// The schedule's name.
    pub schedule: String,
    /// The schedule's anchor, by the store's clock (see
    /// [`ScheduleClock`](tidemark_core::ScheduleClock)).
    pub anchor: Duration,
    /// The tick.
    pub tick: u64,
}

impl TickKey {
    /// Whether this tick's job is still to be enqueued when the schedule's newest enqueued
    /// tick is `enqueued` (its anchor and tick; `None`: none yet): only a tick after it, on
    /// the same or a later anchor, is. A tick at or before it was enqueued already, or was
    /// passed over by a later one (missed ticks fire once), or belongs to a schedule
    /// replaced since.
    #[must_use]
    pub fn is_due_after(&self, enqueued: Option<(Duration, u64)>) -> bool {
        enqueued.is_none_or(|last| (self.anchor, self.tick) > last)
    }
}

/// Tells a job runner that jobs may have become ready (an enqueue, a failed job back, a
/// commit by another process), so it leases at once instead of waiting out its idle
/// poll, which stays as the backstop. "May have": the runner leases to find out.
#[derive(Clone, Debug)]
pub struct ReadySignal(tokio::sync::watch::Receiver<u64>);

impl ReadySignal {
    /// A signal that fires whenever `changes` changes.
    #[must_use]
    pub fn new(changes: tokio::sync::watch::Receiver<u64>) -> Self {
        ReadySignal(changes)
    }

    /// Resolves at the next change after the last one seen; never, once the queue is gone.
    /// Cancel-safe.
    pub async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A durable queue of maintenance jobs.
pub trait Queue: Send + Sync {
    /// A signal of jobs that may have become ready, where the queue can tell (memory: its
    /// enqueues; SQLite: commits to the file by any process). `None` (the default, and
    /// NATS): runners poll an empty queue every idle poll.
    fn ready_signal(&self) -> Option<ReadySignal> {
        None
    }

    /// Enqueues `job`; returns its id. A job with a [`coalesce_key`](Job::coalesce_key)
    /// (`pack_housekeeping`, per key) is absorbed by a ready, never-leased job with the
    /// same key, whose id comes back: pending jobs are bounded by the keys written, not by
    /// the writes. A job already leased absorbs nothing (it may have read the key already).
    fn enqueue(&self, job: Job) -> impl Future<Output = Result<JobId>> + Send;

    /// Enqueues `job` as the job of a schedule's tick, once per [`TickKey`]: the queue
    /// keeps each schedule's newest enqueued tick (never removed by retention) and enqueues
    /// only a tick after it ([`TickKey::is_due_after`]), in one atomic step with the job.
    /// `Ok(Some(id))` when this call enqueued it; `Ok(None)` when the tick's job was
    /// enqueued already (by this or any process) or a later tick's was. So a scheduler
    /// that claimed a tick and died, before or after the enqueue, is followed by one that
    /// enqueues the tick again and makes no second job.
    ///
    /// On NATS the job's message carries the tick as its `Nats-Msg-Id`, and the tick is
    /// recorded after the publish: a scheduler that dies between the two is covered by the
    /// stream's duplicate window (2 minutes by default).
    fn enqueue_tick(
        &self,
        tick: &TickKey,
        job: Job,
    ) -> impl Future<Output = Result<Option<JobId>>> + Send;

    /// Enqueues every job in order; one result per job, in the same order. A job with a
    /// [`coalesce_key`](Job::coalesce_key) that a ready, never-leased job already has is
    /// absorbed by it and gets its id (as with [`enqueue`](Self::enqueue)). The default
    /// enqueues one at a time; SQLite overrides it with one transaction.
    fn enqueue_batch(&self, jobs: Vec<Job>) -> impl Future<Output = Vec<Result<JobId>>> + Send {
        async move {
            let mut out = Vec::with_capacity(jobs.len());
            for job in jobs {
                out.push(self.enqueue(job).await);
            }
            out
        }
    }

    /// Enqueues a user job of any serde type tagged by `"kind"` (see [`Job::custom`]);
    /// [`Error::Job`](crate::Error::Job) if it is not tagged or takes a built-in kind.
    fn enqueue_typed<T: serde::Serialize + ?Sized>(
        &self,
        job: &T,
    ) -> impl Future<Output = Result<JobId>> + Send
    where
        Self: Sized,
    {
        let job = Job::custom(job);
        async move { self.enqueue(job?).await }
    }

    /// Reads a job back by id.
    fn get(&self, id: JobId) -> impl Future<Output = Result<Option<JobRecord>>> + Send;

    /// Leases the oldest ready job for `visibility`; `None` if none is ready. A job whose
    /// attempts are used up is dead-lettered instead of leased.
    fn lease(&self, visibility: Duration) -> impl Future<Output = Result<Option<Leased>>> + Send;

    /// Completes a leased job. [`Error::LeaseLost`](crate::Error::LeaseLost) once the lease
    /// has ended, by the queue's clock, even if nobody has leased the job since: so do
    /// [`fail`](Self::fail), [`renew`](Self::renew) and [`dead_letter`](Self::dead_letter).
    /// The job is then delivered again (or dead-lettered, if that was its last attempt).
    fn ack(&self, lease: &Leased) -> impl Future<Output = Result<()>> + Send;

    /// Records a failure of a leased job: ready again after `retry_after`, or dead-lettered
    /// with `error` once its attempts are used up. Returns where the job went.
    fn fail(
        &self,
        lease: &Leased,
        error: &str,
        retry_after: Duration,
    ) -> impl Future<Output = Result<JobState>> + Send;

    /// Extends a lease held by `lease` to `visibility` from now, so a slow job is not
    /// delivered again while it runs; [`Error::LeaseLost`](crate::Error::LeaseLost) if it
    /// is no longer held. On NATS the extension is the queue's ack wait, whatever
    /// `visibility` says (see `NatsQueue`).
    fn renew(
        &self,
        lease: &Leased,
        visibility: Duration,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Dead-letters a leased job at once with `error`, whatever attempts it has left: for a
    /// job no retry can help (no handler for its kind, a payload that does not decode).
    fn dead_letter(&self, lease: &Leased, error: &str) -> impl Future<Output = Result<()>> + Send;

    /// Dead letters in id order, those after `after` (`None`: from the first), at most
    /// `limit` of them.
    fn dead_letters(
        &self,
        after: Option<JobId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<JobRecord>>> + Send;

    /// Makes a dead letter ready again with fresh attempts. Returns the id it now has: the
    /// same on memory and SQLite (which keep its last error until it next fails), a new one
    /// on NATS (where a job's id is its message's sequence; the old id is gone).
    /// [`Error::NotFound`](crate::Error::NotFound) if `id` is not a dead letter.
    ///
    /// A requeued job has not run since, so it is its key's pending job for coalescing
    /// (it absorbs later enqueues for its key), unless the key already has a pending job:
    /// that one keeps absorbing (on NATS the requeue itself is absorbed by it, and its id
    /// comes back).
    fn requeue(&self, id: JobId) -> impl Future<Output = Result<JobId>> + Send;

    /// How many jobs are in each state.
    fn counts(&self) -> impl Future<Output = Result<JobCounts>> + Send;

    /// Retention: removes done jobs that finished at least `retention.done` ago and dead
    /// letters that died at least `retention.dead` ago. Ready and leased jobs are never
    /// removed. Returns how many jobs it removed. Ages are measured on the clock the
    /// queue's leases use (tokio's for memory, the wall clock for SQLite and NATS).
    fn remove_finished(&self, retention: JobRetention) -> impl Future<Output = Result<u64>> + Send;
}
