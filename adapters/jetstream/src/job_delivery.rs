//! What a runner does with a job's message the server delivered to it, from the job's
//! state as the queue's state bucket holds it.
//!
//! The NATS queue records each job's state (ready, leased, done, dead) in a KV bucket and
//! its message on a work-queue stream; a job's end is recorded before its message is
//! acked, so a message delivered again after an end is terminated, not run. The server
//! delivers a message again once a lease's ack wait has passed, and the runner that held
//! it may still be recording the end of its run at that moment. The lease's record of
//! "leased" must then never overwrite that end: if it did, the first runner's ack removes
//! the message, and a crash of the second runner before its own ack leaves the job
//! "leased" with no message that could ever end it (the NATS campaign's "job left leased",
//! seeds 60104, 60113, 70028). So every write of a job's state is a compare-and-set on
//! the revision the decision was made from ([`KeyWrite`](crate::KeyWrite)): a write that loses it was
//! raced by another runner, and the decision is taken again from the state read anew —
//! up to [`CLAIM_ATTEMPTS`] times, after which the message is left to be delivered again.
//!
//! ```
//! use tidemark_jetstream::job_delivery::{Recorded, Delivery, delivery};
//!
//! // Another runner recorded the job's end while this delivery was on its way.
//! assert_eq!(delivery(Some(Recorded::Ended), 2, 5), Delivery::Terminate);
//! // A lease that expired: run it again, its second attempt.
//! assert_eq!(delivery(Some(Recorded::Leased), 2, 5), Delivery::Run);
//! // The sixth delivery of a job allowed five attempts.
//! assert_eq!(delivery(Some(Recorded::Leased), 6, 5), Delivery::DeadLetter);
//! ```

/// How many times a runner reads a job's state and decides again after losing the
/// compare-and-set of its write, before it gives the delivery up (the message comes back
/// after its ack wait). Losing it takes another runner writing the same job's state in
/// between, which only a redelivery racing the end of a run does: more than a couple in a
/// row means something else is wrong.
pub const CLAIM_ATTEMPTS: usize = 8;

/// A job's state as recorded, as far as a delivery's fate depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// Waiting for a lease (never leased, or a failed attempt to be retried).
    Ready,
    /// Leased by a runner, whose lease may have expired (this delivery says it has).
    Leased,
    /// Done or dead-lettered: the job has ended.
    Ended,
}

/// What a runner does with a delivered job message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The job has ended: terminate the message without running it.
    Terminate,
    /// Its attempts are used up: record it dead, then terminate the message.
    DeadLetter,
    /// Record it leased (this delivery's attempt) and run it.
    Run,
}

/// Decides a delivery of a job whose state is `recorded` (`None`: none recorded yet),
/// delivered for the `attempt`th time (the server's delivery count), on a queue that
/// allows `max_attempts`.
#[must_use]
pub fn delivery(recorded: Option<Recorded>, attempt: u32, max_attempts: u32) -> Delivery {
    match recorded {
        Some(Recorded::Ended) => Delivery::Terminate,
        _ if attempt > max_attempts.max(1) => Delivery::DeadLetter,
        _ => Delivery::Run,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ended_job_is_terminated_whatever_its_attempt() {
        for attempt in [1, 2, 5, 6, u32::MAX] {
            assert_eq!(
                delivery(Some(Recorded::Ended), attempt, 5),
                Delivery::Terminate
            );
        }
    }

    #[test]
    fn a_delivery_past_the_attempts_allowed_is_dead_lettered_unless_ended() {
        assert_eq!(delivery(None, 6, 5), Delivery::DeadLetter);
        assert_eq!(delivery(Some(Recorded::Ready), 6, 5), Delivery::DeadLetter);
        assert_eq!(delivery(Some(Recorded::Leased), 6, 5), Delivery::DeadLetter);
        assert_eq!(delivery(Some(Recorded::Leased), 5, 5), Delivery::Run);
    }

    #[test]
    fn a_queue_that_allows_no_attempt_still_runs_the_first() {
        assert_eq!(delivery(None, 1, 0), Delivery::Run);
        assert_eq!(delivery(None, 2, 0), Delivery::DeadLetter);
    }
}
