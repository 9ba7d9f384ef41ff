//! Whether a leased job of a schedule's tick is that tick's one job.
//!
//! The NATS queue enqueues a claimed tick's job as a message whose `Nats-Msg-Id` names the
//! tick, then records the schedule's newest enqueued tick in its state bucket. The id keeps
//! racing schedulers (and one that died between the publish and the record) to one message
//! only within the stream's duplicate window: a scheduler that died there and passes again
//! after the window publishes the tick's job a second time.
//!
//! So the runner settles it too, by the same record: a job leased for a tick the record
//! has not reached claims the tick for itself (compare-and-set on the record, naming its
//! job), and a job leased for the tick the record names with another job is a duplicate,
//! finished without running. Whichever of the two is leased first runs; a tick's job
//! runs once however long the scheduler was down.

/// What the state bucket records of a schedule's newest enqueued tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TickRecord {
    /// The schedule's anchor (milliseconds, by the schedule store's clock).
    pub anchor_ms: u64,
    /// The tick.
    pub tick: u64,
    /// The job (stream sequence) that is the tick's, once known (`None`: recorded by a
    /// scheduler before it recorded which message its publish made).
    pub job: Option<u64>,
}

/// What a runner does with a job it leased for a schedule's tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TickJob {
    /// Run it: the record names this job for its tick, or the tick is older than the
    /// record's (a late job of a tick passed over since; nothing tells a duplicate there).
    Run,
    /// Record the tick as this job's (compare-and-set on the record read, or create it
    /// when there was none), then run it; on a lost compare-and-set, read and decide again.
    Claim,
    /// Another job is the tick's: finish this one without running it.
    Duplicate {
        /// The job the record names for the tick.
        of: u64,
    },
}

/// Decides what a runner does with job `job`, leased for tick `tick` of anchor
/// `anchor_ms`, when the schedule's record is `record`.
#[must_use]
pub fn tick_job(record: Option<TickRecord>, anchor_ms: u64, tick: u64, job: u64) -> TickJob {
    let Some(r) = record else {
        return TickJob::Claim;
    };
    match (anchor_ms, tick).cmp(&(r.anchor_ms, r.tick)) {
        std::cmp::Ordering::Greater => TickJob::Claim,
        std::cmp::Ordering::Less => TickJob::Run,
        std::cmp::Ordering::Equal => match r.job {
            None => TickJob::Claim,
            Some(of) if of == job => TickJob::Run,
            Some(of) => TickJob::Duplicate { of },
        },
    }
}

/// The tick a job message's `Nats-Msg-Id` names (`tick.<schedule in hex>.<anchor
/// ms>.<tick>`): the schedule's record key (`tick.<schedule in hex>`), its anchor and its
/// tick. `None` for any other id (a job enqueued by key, or none).
#[must_use]
pub fn tick_of_message_id(id: &str) -> Option<(&str, u64, u64)> {
    let rest = id.strip_prefix("tick.")?;
    let mut parts = rest.rsplitn(3, '.');
    let tick = parts.next()?.parse().ok()?;
    let anchor_ms = parts.next()?.parse().ok()?;
    let name = parts.next()?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some((&id[..5 + name.len()], anchor_ms, tick))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_message_id_names_its_record_key_anchor_and_tick() {
        assert_eq!(
            tick_of_message_id("tick.7377656570.1700000000000.42"),
            Some(("tick.7377656570", 1_700_000_000_000, 42))
        );
        for other in [
            "",
            "tick.",
            "tick.zz.1.2",
            "tick.ab.1",
            "tick..1.2",
            "job.ab.1.2",
            "tick.ab.x.2",
        ] {
            assert_eq!(tick_of_message_id(other), None, "{other}");
        }
    }

    #[test]
    fn the_first_job_leased_for_a_tick_claims_it_and_a_second_is_a_duplicate() {
        assert_eq!(tick_job(None, 0, 5, 10), TickJob::Claim);
        let claimed = TickRecord {
            anchor_ms: 0,
            tick: 5,
            job: Some(10),
        };
        assert_eq!(tick_job(Some(claimed), 0, 5, 10), TickJob::Run);
        assert_eq!(
            tick_job(Some(claimed), 0, 5, 11),
            TickJob::Duplicate { of: 10 }
        );
        let unnamed = TickRecord {
            job: None,
            ..claimed
        };
        assert_eq!(tick_job(Some(unnamed), 0, 5, 11), TickJob::Claim);
        assert_eq!(tick_job(Some(claimed), 0, 6, 12), TickJob::Claim);
        assert_eq!(tick_job(Some(claimed), 1, 0, 12), TickJob::Claim);
        assert_eq!(tick_job(Some(claimed), 0, 4, 9), TickJob::Run);
    }

    proptest! {
        /// Two messages of one tick, leased in either order against a record that a
        /// scheduler may or may not have written first: exactly one runs.
        #[test]
        fn of_two_messages_of_one_tick_exactly_one_runs(
            first in 1u64..1000,
            gap in 1u64..1000,
            scheduler_recorded in prop::option::of(prop::bool::ANY),
            older in 0u64..5,
        ) {
            let (a, b) = (first, first + gap);
            // The scheduler's record: none, an older tick, or this tick naming the message
            // its last publish made (`b`) or not naming one.
            let mut record = match scheduler_recorded {
                None => (older > 0).then_some(TickRecord { anchor_ms: 0, tick: 5 - older, job: Some(1) }),
                Some(named) => Some(TickRecord { anchor_ms: 0, tick: 5, job: named.then_some(b) }),
            };
            let mut ran = Vec::new();
            for job in [a, b] {
                loop {
                    match tick_job(record, 0, 5, job) {
                        TickJob::Run => { ran.push(job); break; }
                        TickJob::Claim => {
                            record = Some(TickRecord { anchor_ms: 0, tick: 5, job: Some(job) });
                        }
                        TickJob::Duplicate { .. } => break,
                    }
                }
            }
            prop_assert_eq!(ran.len(), 1, "{:?}", ran);
        }
    }
}
