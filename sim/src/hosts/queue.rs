//! The source host's job queue: what the announce legs enqueue on, what the job runners
//! lease from and what sweeps remove finished jobs from, served over the wire and told to
//! the jobs' ledger as it serves.

use tidemark::tidemark_core::JobId;
use tidemark::{Error, JobRecord, JobRetention, JobState, Queue, TickKey};
use tidemark_memory::MemoryQueue;

use crate::checks::jobs::JobLedger;
use crate::wire::{QueueAnswer, QueueCall, Response, WireLease};

/// Attempts before the source host's queue dead-letters a job.
pub const JOB_ATTEMPTS: u32 = 3;

/// Serves one queue call on the source host's queue, telling the ledger of leases,
/// renewals and settlements.
pub async fn serve(queue: &MemoryQueue, ledger: &JobLedger, call: QueueCall) -> Response {
    let now = turmoil::sim_elapsed().unwrap_or_default();
    let answer = match call {
        QueueCall::Enqueue(job) => queue.enqueue(job).await.map(QueueAnswer::Id),
        QueueCall::EnqueueTick {
            schedule,
            anchor,
            tick,
            job,
            by: _,
        } => {
            let key = TickKey {
                schedule,
                anchor,
                tick,
            };
            queue.enqueue_tick(&key, job).await.map(QueueAnswer::Tick)
        }
        QueueCall::Lease { visibility, by } => queue.lease(visibility).await.map(|l| {
            if let Some(l) = &l {
                ledger.leased(
                    l.id,
                    l.attempt,
                    by.as_deref().unwrap_or("?"),
                    now + visibility,
                );
            }
            QueueAnswer::Leased(l.as_ref().map(WireLease::from))
        }),
        QueueCall::Renew { lease, visibility } => {
            let (id, attempt) = (lease.id, lease.attempt);
            queue.renew(&lease.into(), visibility).await.map(|()| {
                ledger.renewed(id, attempt, now + visibility);
                QueueAnswer::Done
            })
        }
        QueueCall::Ack { lease } => {
            let id = lease.id;
            queue.ack(&lease.into()).await.map(|()| {
                ledger.acked(id, now);
                QueueAnswer::Done
            })
        }
        QueueCall::Fail {
            lease,
            error,
            retry_after,
        } => queue
            .fail(&lease.into(), &error, retry_after)
            .await
            .map(|state| QueueAnswer::Failed {
                dead: state == JobState::DeadLettered,
            }),
        QueueCall::DeadLetter { lease, error } => queue
            .dead_letter(&lease.into(), &error)
            .await
            .map(|()| QueueAnswer::Done),
        QueueCall::Counts => queue.counts().await.map(|c| QueueAnswer::Counts {
            ready: c.ready,
            leased: c.leased,
            done: c.done,
            dead: c.dead,
        }),
        QueueCall::RemoveFinished { done, dead } => {
            let before = queue.jobs();
            let removed = queue.remove_finished(JobRetention { done, dead }).await;
            if let Ok(n) = removed {
                let after: std::collections::BTreeSet<JobId> =
                    queue.jobs().into_iter().map(|r| r.id).collect();
                let gone: Vec<JobRecord> = before
                    .into_iter()
                    .filter(|r| !after.contains(&r.id))
                    .collect();
                ledger.removed(&gone, JobRetention { done, dead }, now, n);
            }
            removed.map(QueueAnswer::Removed)
        }
    };
    match answer {
        Ok(a) => Response::Queue(a),
        Err(Error::LeaseLost(why)) => Response::Queue(QueueAnswer::LeaseLost(why)),
        Err(e) => Response::Failed(e.to_string()),
    }
}

/// Every enqueued job that has not ended acked or dead-lettered with its last error, as
/// failure lines (empty when all did).
#[must_use]
pub fn unsettled(queue: &MemoryQueue) -> Vec<String> {
    queue
        .jobs()
        .into_iter()
        .filter_map(|r| match r.state {
            JobState::Done => None,
            JobState::DeadLettered if r.last_error.is_some() => None,
            state => Some(format!(
                "job {} ({}) ended {state:?} after {} attempts, last error {:?}",
                r.id,
                r.job.kind(),
                r.attempts,
                r.last_error
            )),
        })
        .collect()
}

/// The source host's queue, its leases on `clock` (which outlives the host's runtimes).
#[must_use]
pub fn source_queue(
    faults: tidemark_memory::Faults,
    clock: impl Fn() -> tokio::time::Instant + Send + Sync + 'static,
) -> MemoryQueue {
    MemoryQueue::with_clock(faults, clock).with_max_attempts(JOB_ATTEMPTS)
}
