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

/// A model of the NATS queue's job: its message on a work-queue stream (delivered again
/// once an ack wait passes, removed by any ack of it, even a stale one, as the server
/// does) and its state in a KV bucket, with two runners whose steps — each one server
/// operation, atomic — interleave in any order, crash while running, and see their lease
/// expire under them. The runners do what the adapter does: take a delivery, read the
/// state and decide ([`delivery`]), write it by compare-and-set (deciding again from a
/// fresh read when that is lost, up to [`CLAIM_ATTEMPTS`]), run, check the lease is still
/// theirs, write "done" by compare-and-set, ack.
#[cfg(test)]
mod model {
    use proptest::prelude::*;

    use super::*;
    use crate::KeyWrite;

    const MAX_ATTEMPTS: u32 = 3;

    /// A job's recorded state.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum State {
        Leased { attempt: u32 },
        Done,
        Dead,
    }

    impl State {
        fn recorded(self) -> Recorded {
            match self {
                State::Leased { .. } => Recorded::Leased,
                State::Done | State::Dead => Recorded::Ended,
            }
        }
    }

    /// How a runner writes the state: by compare-and-set (the adapter), or a plain put
    /// (the defect: a lease's "leased" over another runner's "done").
    #[derive(Clone, Copy, Debug)]
    enum Writes {
        CompareAndSet,
        Plain,
    }

    #[derive(Debug, Default)]
    struct World {
        /// The state and its revision.
        state: Option<(State, u64)>,
        revision: u64,
        /// The job's message is still on the stream.
        message: bool,
        /// How many times the server delivered it.
        delivered: u32,
        /// Out to a runner, its ack wait not yet passed.
        out: bool,
    }

    impl World {
        fn write(&mut self, how: Writes, write: KeyWrite, state: State) -> bool {
            let holds = match (how, write) {
                (Writes::Plain, _) => true,
                (Writes::CompareAndSet, KeyWrite::Create) => self.state.is_none(),
                (Writes::CompareAndSet, KeyWrite::Replace { revision }) => {
                    self.state.is_some_and(|(_, r)| r == revision)
                }
            };
            if holds {
                self.revision += 1;
                self.state = Some((state, self.revision));
            }
            holds
        }

        fn read(&self) -> (Option<State>, KeyWrite) {
            (
                self.state.map(|(s, _)| s),
                KeyWrite::of(self.state.map(|(_, r)| r)),
            )
        }
    }

    /// One runner's delivery, as a state machine: each `step` is one server operation.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Runner {
        Idle,
        Decide {
            attempt: u32,
            tries: usize,
        },
        WriteLeased {
            attempt: u32,
            tries: usize,
            write: KeyWrite,
        },
        WriteDead {
            attempt: u32,
            tries: usize,
            write: KeyWrite,
        },
        Running {
            attempt: u32,
        },
        WriteDone {
            write: KeyWrite,
        },
        Ack,
    }

    fn step(r: Runner, w: &mut World, how: Writes) -> Runner {
        let again = |attempt, tries: usize| {
            if tries + 1 < CLAIM_ATTEMPTS {
                Runner::Decide {
                    attempt,
                    tries: tries + 1,
                }
            } else {
                // Given up: the message comes back after its ack wait.
                Runner::Idle
            }
        };
        match r {
            Runner::Idle if w.message && !w.out => {
                w.delivered += 1;
                w.out = true;
                Runner::Decide {
                    attempt: w.delivered,
                    tries: 0,
                }
            }
            Runner::Idle => Runner::Idle,
            Runner::Decide { attempt, tries } => {
                let (state, write) = w.read();
                match delivery(state.map(State::recorded), attempt, MAX_ATTEMPTS) {
                    Delivery::Terminate => Runner::Ack,
                    Delivery::DeadLetter => Runner::WriteDead {
                        attempt,
                        tries,
                        write,
                    },
                    Delivery::Run => Runner::WriteLeased {
                        attempt,
                        tries,
                        write,
                    },
                }
            }
            Runner::WriteLeased {
                attempt,
                tries,
                write,
            } => {
                if w.write(how, write, State::Leased { attempt }) {
                    Runner::Running { attempt }
                } else {
                    again(attempt, tries)
                }
            }
            Runner::WriteDead {
                attempt,
                tries,
                write,
            } => {
                if w.write(how, write, State::Dead) {
                    Runner::Ack
                } else {
                    again(attempt, tries)
                }
            }
            // The handler ran; the lease is checked still this runner's before its end.
            Runner::Running { attempt } => match w.read() {
                (Some(State::Leased { attempt: held }), write) if held == attempt => {
                    Runner::WriteDone { write }
                }
                _ => Runner::Idle,
            },
            Runner::WriteDone { write } => {
                if w.write(how, write, State::Done) {
                    Runner::Ack
                } else {
                    Runner::Idle
                }
            }
            Runner::Ack => {
                w.message = false;
                w.out = false;
                Runner::Idle
            }
        }
    }

    /// Runs one job through two runners by `schedule` (0, 1: that runner steps; 2: the
    /// ack wait passes; 3, 4: runner 0, 1 crashes if running), then lets them work it off
    /// with no more crashes. Err says how the job was left.
    fn run(how: Writes, schedule: &[u8]) -> Result<(), String> {
        let mut w = World {
            message: true,
            ..World::default()
        };
        let mut runners = [Runner::Idle; 2];
        for &choice in schedule {
            match choice {
                0 | 1 => {
                    let i = usize::from(choice);
                    runners[i] = step(runners[i], &mut w, how);
                }
                2 => w.out = false,
                _ => {
                    let i = usize::from(choice - 3);
                    if matches!(runners[i], Runner::Running { .. }) {
                        runners[i] = Runner::Idle;
                    }
                }
            }
        }
        for turn in 0..1_000 {
            if !w.message && runners.iter().all(|r| *r == Runner::Idle) {
                break;
            }
            if turn % 7 == 6 {
                w.out = false;
            }
            let i = turn % 2;
            runners[i] = step(runners[i], &mut w, how);
        }
        match (w.message, w.state) {
            (false, Some((State::Done | State::Dead, _))) => Ok(()),
            (true, state) => Err(format!("the message never ended; state {state:?}")),
            (false, state) => Err(format!(
                "the message is gone and the job left {state:?}: nothing can end it"
            )),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4_000))]

        /// However two runners' operations interleave, crash and outlive their leases,
        /// every job ends (done or dead) and its message with it.
        #[test]
        fn every_job_ends_however_runners_race_and_crash(
            schedule in proptest::collection::vec(0u8..5, 0..60),
        ) {
            let outcome = run(Writes::CompareAndSet, &schedule);
            prop_assert!(outcome.is_ok(), "{:?} (schedule {:?})", outcome, schedule);
        }
    }

    /// The model catches the defect the compare-and-set fixes (the campaign's "job left
    /// leased"): runner 0's lease expires while it finishes; runner 1 takes the delivery
    /// again and reads "leased"; runner 0 records "done" and acks (the server removes the
    /// message); runner 1's plain "leased" lands over "done" and it crashes.
    #[test]
    fn the_model_catches_a_lease_written_over_an_end() {
        let schedule = [0, 0, 0, 2, 1, 1, 0, 0, 0, 1, 4];
        let left = run(Writes::Plain, &schedule);
        assert!(
            left.as_ref().is_err_and(|e| e.contains("Leased")),
            "a plain put leaves the job leased: {left:?}"
        );
        assert_eq!(run(Writes::CompareAndSet, &schedule), Ok(()));
    }

    /// And the random schedules find it on their own, often.
    #[test]
    fn random_schedules_find_the_plain_put_left_leased() {
        use proptest::test_runner::{Config, TestRunner};
        let mut runner = TestRunner::new(Config::with_cases(4_000));
        let found = runner.run(&proptest::collection::vec(0u8..5, 0..60), |schedule| {
            prop_assert!(run(Writes::Plain, &schedule).is_ok());
            Ok(())
        });
        assert!(found.is_err(), "4,000 schedules never left a job leased");
    }
}
