//! Whether an enqueue is absorbed by a pending job of its coalesce key.
//!
//! The NATS queue names the waiting housekeeping job of a coalesce key by a `pending` key
//! in its state bucket. An enqueue publishes its job before it can point the key at it
//! (the job's id is the sequence the server gives the message), so a runner may lease —
//! and finish — the job before the key names it: the lease then finds no key to release,
//! and the key, once written, names a job whose handler has run. Absorbing into it would
//! lose the write, for this enqueue and every later one.
//!
//! [`coalesce`] therefore never trusts the key alone: the enqueue reads the key, then the
//! state of the job it names, and is absorbed only by a job still waiting for its first
//! lease. The lease writes "leased" before the handler runs, so a job read as waiting
//! after the enqueue's write will run its handler after that write. Any other key is
//! stale and is replaced — compare-and-set on the revision read — by the key of the job
//! this enqueue publishes, so a stale key lasts until the next enqueue for its key at
//! most, and never absorbs one.

/// What an enqueue found under the pending key of its coalesce key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// No pending key.
    Nothing,
    /// A key that names no job (unreadable, or a delete marker) at `revision`.
    Unreadable {
        /// The key's revision, for the compare-and-set that replaces it.
        revision: u64,
    },
    /// A key at `revision` naming `job`, whose state — read after the key — is `state`.
    Job {
        /// The job the key names.
        job: u64,
        /// The key's revision, for the compare-and-set that replaces it.
        revision: u64,
        /// The job's state, read after the key.
        state: Named,
    },
}

/// The state of the job a pending key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    /// No state: removed by retention or a requeue (a pending key is written only after
    /// its job's state), or unreadable.
    Missing,
    /// Ready, leased `attempts` times before (0: never leased).
    Ready {
        /// How many times it was leased.
        attempts: u32,
    },
    /// Leased: its handler may have read the key already.
    Leased,
    /// Done or dead-lettered.
    Finished,
}

/// What an enqueue does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coalesce {
    /// Return `job`'s id: its handler has not started, so it covers this enqueue's write.
    Absorb {
        /// The waiting job.
        job: u64,
    },
    /// Publish a new job, then point the pending key at it with `key`.
    Publish {
        /// How the key is written.
        key: KeyWrite,
    },
}

/// A compare-and-set write of a key of the queue's state bucket, naming the revision its
/// writer decided from, so a write raced by another fails instead of overwriting it.
///
/// An enqueue points the pending key at the job it published with one; if it fails,
/// another enqueue or a lease changed the key meanwhile and the job just published still
/// runs (at least once): it returns its id all the same. A runner writes a job's state
/// with one ([`job_delivery`](crate::job_delivery)): if it fails, it decides again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyWrite {
    /// Create the key; there was none.
    Create,
    /// Replace the key if it is still at `revision`.
    Replace {
        /// The revision read.
        revision: u64,
    },
}

impl KeyWrite {
    /// The write for a key read at `revision` (`None`: the key was not there).
    #[must_use]
    pub fn of(revision: Option<u64>) -> KeyWrite {
        match revision {
            None => KeyWrite::Create,
            Some(revision) => KeyWrite::Replace { revision },
        }
    }
}

/// Decides an enqueue from what it found under its pending key: absorbed by a job still
/// waiting for its first lease, else a new job that takes the key over.
#[must_use]
pub fn coalesce(found: Found) -> Coalesce {
    match found {
        Found::Nothing => Coalesce::Publish {
            key: KeyWrite::Create,
        },
        Found::Job {
            job,
            state: Named::Ready { attempts: 0 },
            ..
        } => Coalesce::Absorb { job },
        // A job leased once absorbs nothing, even when ready again for a retry: its
        // handler may have read the key before this write (and a retry can dead-letter).
        Found::Job { revision, .. } | Found::Unreadable { revision } => Coalesce::Publish {
            key: KeyWrite::Replace { revision },
        },
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet, VecDeque};

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_key_read_names_its_revision_in_the_write() {
        assert_eq!(KeyWrite::of(None), KeyWrite::Create);
        assert_eq!(KeyWrite::of(Some(7)), KeyWrite::Replace { revision: 7 });
    }

    #[test]
    fn only_a_job_never_leased_absorbs_an_enqueue() {
        let job = |state| Found::Job {
            job: 7,
            revision: 3,
            state,
        };
        assert_eq!(
            coalesce(job(Named::Ready { attempts: 0 })),
            Coalesce::Absorb { job: 7 },
            "a waiting job runs after the write: it covers it"
        );
        for state in [
            Named::Ready { attempts: 1 },
            Named::Leased,
            Named::Finished,
            Named::Missing,
        ] {
            assert_eq!(
                coalesce(job(state)),
                Coalesce::Publish {
                    key: KeyWrite::Replace { revision: 3 }
                },
                "a key naming a job {state:?} is stale: a new job replaces it at the \
                 revision read, or every later enqueue would return a job that never \
                 runs again"
            );
        }
        assert_eq!(
            coalesce(Found::Nothing),
            Coalesce::Publish {
                key: KeyWrite::Create
            }
        );
        assert_eq!(
            coalesce(Found::Unreadable { revision: 9 }),
            Coalesce::Publish {
                key: KeyWrite::Replace { revision: 9 }
            }
        );
    }

    /// A model of the NATS queue's state bucket and work queue, and of enqueues and
    /// runners as sequences of single server operations, each atomic, interleaved in any
    /// order: the enqueue as the adapter does it (read the key, read the named job's
    /// state, publish, create the job's state, write the key by compare-and-set) and the
    /// lease as it does it (take the message, read the state, release the key if it names
    /// this job, write "leased", run the handler, write "done").
    #[derive(Default)]
    struct World {
        /// The pending key: the job it names and its revision.
        key: Option<(u64, u64)>,
        revision: u64,
        /// Job states.
        states: BTreeMap<u64, Named>,
        /// How many times each job was leased.
        attempts: BTreeMap<u64, u32>,
        queue: VecDeque<u64>,
        next_id: u64,
        /// Jobs whose handler has started, in order.
        started: Vec<u64>,
    }

    impl World {
        fn bump(&mut self) -> u64 {
            self.revision += 1;
            self.revision
        }
    }

    /// One enqueue, as a state machine: each `step` is one server operation.
    enum Enqueue {
        ReadKey,
        ReadState { job: u64, revision: u64 },
        Publish(KeyWrite),
        CreateState { id: u64, key: KeyWrite },
        WriteKey { id: u64, key: KeyWrite },
        Returned(u64),
    }

    /// One lease and its outcome, as a state machine: even jobs fail their first attempt
    /// and are retried, every other attempt is acked.
    enum Lease {
        Take,
        ReadState(u64),
        Release(u64),
        WriteLeased(u64),
        Finish(u64),
    }

    fn step_enqueue(
        e: Enqueue,
        w: &mut World,
        rule: fn(Found) -> Coalesce,
        started_before: &BTreeSet<u64>,
    ) -> Result<Enqueue, String> {
        Ok(match e {
            Enqueue::ReadKey => match w.key {
                None => match rule(Found::Nothing) {
                    Coalesce::Publish { key } => Enqueue::Publish(key),
                    Coalesce::Absorb { job } => return Err(format!("absorbed by {job}, unnamed")),
                },
                Some((job, revision)) => Enqueue::ReadState { job, revision },
            },
            Enqueue::ReadState { job, revision } => {
                let state = w.states.get(&job).copied().unwrap_or(Named::Missing);
                match rule(Found::Job {
                    job,
                    revision,
                    state,
                }) {
                    Coalesce::Absorb { job } => {
                        if started_before.contains(&job) {
                            return Err(format!(
                                "absorbed by job {job}, whose handler started before the \
                                 enqueue began"
                            ));
                        }
                        Enqueue::Returned(job)
                    }
                    Coalesce::Publish { key } => Enqueue::Publish(key),
                }
            }
            Enqueue::Publish(key) => {
                w.next_id += 1;
                w.queue.push_back(w.next_id);
                Enqueue::CreateState { id: w.next_id, key }
            }
            Enqueue::CreateState { id, key } => {
                w.states.entry(id).or_insert(Named::Ready { attempts: 0 });
                Enqueue::WriteKey { id, key }
            }
            Enqueue::WriteKey { id, key } => {
                let holds = match key {
                    KeyWrite::Create => w.key.is_none(),
                    KeyWrite::Replace { revision } => w.key.is_some_and(|(_, r)| r == revision),
                };
                if holds {
                    let revision = w.bump();
                    w.key = Some((id, revision));
                }
                Enqueue::Returned(id)
            }
            done @ Enqueue::Returned(_) => done,
        })
    }

    fn step_lease(l: Lease, w: &mut World) -> Lease {
        match l {
            Lease::Take => w.queue.pop_front().map_or(Lease::Take, Lease::ReadState),
            Lease::ReadState(id) => match w.states.get(&id) {
                Some(Named::Finished) => Lease::Take,
                _ => Lease::Release(id),
            },
            Lease::Release(id) => {
                if w.key.is_some_and(|(job, _)| job == id) {
                    w.key = None;
                }
                Lease::WriteLeased(id)
            }
            Lease::WriteLeased(id) => {
                w.states.insert(id, Named::Leased);
                *w.attempts.entry(id).or_default() += 1;
                w.started.push(id);
                Lease::Finish(id)
            }
            Lease::Finish(id) => {
                let attempts = w.attempts.get(&id).copied().unwrap_or_default();
                if id % 2 == 0 && attempts == 1 {
                    w.states.insert(id, Named::Ready { attempts });
                    w.queue.push_back(id);
                } else {
                    w.states.insert(id, Named::Finished);
                }
                Lease::Take
            }
        }
    }

    /// Runs `enqueues` enqueues one after another (each from the latest one's return)
    /// against a runner, interleaved by `schedule` (true: the runner steps), then drains
    /// the queue, then enqueues once more alone. Err names the first enqueue absorbed by
    /// a job already started when it began.
    fn run(rule: fn(Found) -> Coalesce, enqueues: usize, schedule: &[bool]) -> Result<(), String> {
        let mut w = World::default();
        let mut lease = Lease::Take;
        let mut done = 0;
        let mut enqueue = Enqueue::ReadKey;
        let mut started_before: BTreeSet<u64> = BTreeSet::new();
        for &runner in schedule.iter().cycle().take(schedule.len().max(1) * 50) {
            if done == enqueues {
                break;
            }
            if runner {
                lease = step_lease(lease, &mut w);
            } else {
                enqueue = step_enqueue(enqueue, &mut w, rule, &started_before)?;
                if let Enqueue::Returned(_) = enqueue {
                    done += 1;
                    enqueue = Enqueue::ReadKey;
                    started_before = w.started.iter().copied().collect();
                }
            }
        }
        while !w.queue.is_empty() || !matches!(lease, Lease::Take) {
            lease = step_lease(lease, &mut w);
        }
        let started: BTreeSet<u64> = w.started.iter().copied().collect();
        let mut enqueue = Enqueue::ReadKey;
        loop {
            enqueue = step_enqueue(enqueue, &mut w, rule, &started)?;
            if let Enqueue::Returned(id) = enqueue {
                return if w.states.get(&id) == Some(&Named::Ready { attempts: 0 }) {
                    Ok(())
                } else {
                    Err(format!(
                        "with the runner idle, an enqueue returned job {id}, not waiting"
                    ))
                };
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// However an enqueue's operations interleave with a runner's, it is absorbed only
        /// by a job whose handler had not started when the enqueue began, and once the
        /// runner is idle an enqueue names a job still to run: a key never sticks to a
        /// finished job.
        #[test]
        fn no_interleaving_absorbs_an_enqueue_into_a_started_job(
            enqueues in 1usize..12,
            schedule in proptest::collection::vec(any::<bool>(), 1..60),
        ) {
            let outcome = run(coalesce, enqueues, &schedule);
            prop_assert!(outcome.is_ok(), "{:?} (schedule {:?})", outcome, schedule);
        }
    }

    /// The model catches the defect the rule fixes: trusting the key alone (as the queue
    /// did) sticks the key to a job a runner finished between its publish and its key.
    #[test]
    fn the_model_catches_an_enqueue_that_trusts_the_key_alone() {
        fn trust_the_key(found: Found) -> Coalesce {
            match found {
                Found::Job { job, .. } => Coalesce::Absorb { job },
                Found::Nothing => Coalesce::Publish {
                    key: KeyWrite::Create,
                },
                Found::Unreadable { revision } => Coalesce::Publish {
                    key: KeyWrite::Replace { revision },
                },
            }
        }
        // The enqueue reads the key and publishes; the runner leases, finds no key to
        // release and finishes the job; then the enqueue writes the key.
        let schedule = [
            false, false, true, true, true, true, true, false, false, false,
        ];
        assert!(
            run(trust_the_key, 2, &schedule).is_err(),
            "trusting the key absorbs the next enqueue into the finished job"
        );
        assert_eq!(run(coalesce, 2, &schedule), Ok(()));
    }
}
