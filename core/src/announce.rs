//! The announce plan: after a write commits, which legs to run and how to report them.

use crate::event::{EncodeError, Event};
use crate::job::{Job, JobId};

/// The largest event payload a plan publishes or notifies by default: NATS' default
/// `max_payload` (1 MiB) less room for headers. A larger put is announced as a marker.
pub const MAX_EVENT_BYTES: usize = 1_000_000;

/// Which announce legs a writer runs. All three by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Legs {
    /// Publish the event to the durable events stream, keyed by the entity key.
    pub publish: bool,
    /// Notify the wake channel with the event.
    pub notify: bool,
    /// Enqueue a `pack_housekeeping` job for the key.
    pub enqueue: bool,
}

impl Default for Legs {
    fn default() -> Self {
        Legs {
            publish: true,
            notify: true,
            enqueue: true,
        }
    }
}

/// What to do to announce one committed write. Each leg is independent and fail-soft: a
/// driver runs every planned leg whatever the others did, and no leg can fail the write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnouncePlan {
    /// The key to publish under (the events stream is keyed by entity key).
    pub key: String,
    /// The event's wire bytes, for the publish and notify legs.
    pub payload: Vec<u8>,
    /// Run the publish leg.
    pub publish: bool,
    /// Run the notify leg.
    pub notify: bool,
    /// The job to enqueue, if the enqueue leg runs.
    pub job: Option<Job>,
    /// The put's event was too large to publish or notify: `payload` is a mutation marker
    /// (key and seq) instead, and readers fetch the value from the source.
    pub as_marker: bool,
}

impl AnnouncePlan {
    /// Plans the announcement of `event` with `legs`. An error when the event cannot be
    /// serialised: the driver then runs no leg at all (not even the enqueue) and reports
    /// [`AnnounceReport::default`], logging the reason.
    ///
    /// A put whose event would exceed [`MAX_EVENT_BYTES`] is announced as a mutation marker
    /// (see [`with_limit`](Self::with_limit)).
    pub fn new(event: &Event, legs: Legs) -> Result<AnnouncePlan, EncodeError> {
        Self::with_limit(event, legs, MAX_EVENT_BYTES)
    }

    /// Plans the announcement of `event` with `legs`, announcing a put whose encoded event
    /// exceeds `max_payload` bytes as a mutation marker: a value that could be written but
    /// whose event no stream or wake channel would carry still reaches every follower,
    /// which fetches it. The plan (and the report) says so.
    pub fn with_limit(
        event: &Event,
        legs: Legs,
        max_payload: usize,
    ) -> Result<AnnouncePlan, EncodeError> {
        let mut payload = event.encode()?;
        let mut as_marker = false;
        if payload.len() > max_payload
            && let Event::Put { seq, key, .. } = event
        {
            let marker = Event::Mutation {
                seq: *seq,
                key: key.clone(),
            };
            payload = marker.encode()?;
            as_marker = true;
        }
        let key = event.key().to_owned();
        let job = legs
            .enqueue
            .then(|| Job::PackHousekeeping { key: key.clone() });
        Ok(AnnouncePlan {
            key,
            payload,
            publish: legs.publish,
            notify: legs.notify,
            job,
            as_marker,
        })
    }
}

/// What an announcement achieved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnnounceReport {
    /// The event reached the durable events stream.
    pub published: bool,
    /// The wake channel was notified.
    pub notified: bool,
    /// The id of the enqueued maintenance job, if one was enqueued.
    pub enqueued: Option<JobId>,
    /// The event was too large to carry: a mutation marker was announced instead, and
    /// readers fetch the value from the source.
    pub as_marker: bool,
}

impl AnnounceReport {
    /// Whether every leg of `plan` landed. If not, the next reconcile closes the window.
    #[must_use]
    pub fn is_complete(&self, plan: &AnnouncePlan) -> bool {
        (!plan.publish || self.published)
            && (!plan.notify || self.notified)
            && (plan.job.is_none() || self.enqueued.is_some())
    }

    /// How many legs of `plan` have not landed: a driver's failure count for a run, and
    /// what a retry still has to do.
    #[must_use]
    pub fn missing(&self, plan: &AnnouncePlan) -> u32 {
        u32::from(plan.publish && !self.published)
            + u32::from(plan.notify && !self.notified)
            + u32::from(plan.job.is_some() && self.enqueued.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_carries_the_event_bytes_and_a_housekeeping_job_for_the_key() {
        let e = Event::Removed {
            seq: 4,
            key: "pkg".into(),
        };
        let plan = AnnouncePlan::new(&e, Legs::default()).unwrap();
        assert_eq!(plan.key, "pkg");
        assert_eq!(Event::decode(&plan.payload).unwrap(), e);
        assert_eq!(plan.job, Some(Job::PackHousekeeping { key: "pkg".into() }));
        assert!(plan.publish && plan.notify);
    }

    #[test]
    fn legs_can_be_switched_off() {
        let e = Event::Mutation {
            seq: 1,
            key: "k".into(),
        };
        let plan = AnnouncePlan::new(
            &e,
            Legs {
                publish: false,
                notify: true,
                enqueue: false,
            },
        )
        .unwrap();
        assert!(!plan.publish && plan.job.is_none());
        let report = AnnounceReport {
            published: false,
            notified: true,
            enqueued: None,
            as_marker: false,
        };
        assert!(report.is_complete(&plan));
    }

    #[test]
    fn a_put_too_large_to_carry_is_announced_as_a_marker_and_says_so() {
        let e = Event::Put {
            seq: 9,
            key: "big".into(),
            value: vec![7; 2048],
        };
        let plan = AnnouncePlan::with_limit(&e, Legs::default(), 1024).unwrap();
        assert!(plan.as_marker);
        assert_eq!(
            Event::decode(&plan.payload).unwrap(),
            Event::Mutation {
                seq: 9,
                key: "big".into()
            },
            "readers learn key and seq, and fetch the value"
        );
        let small = AnnouncePlan::with_limit(&e, Legs::default(), 1 << 20).unwrap();
        assert!(!small.as_marker);
        assert_eq!(Event::decode(&small.payload).unwrap(), e);
    }

    #[test]
    fn an_event_no_reader_could_decode_plans_nothing() {
        for e in [
            Event::Put {
                seq: 0,
                key: "k".into(),
                value: b"v".to_vec(),
            },
            Event::Removed {
                seq: 3,
                key: String::new(),
            },
        ] {
            let err = AnnouncePlan::new(&e, Legs::default()).unwrap_err();
            assert!(
                matches!(err, EncodeError::Invalid(_)),
                "{e:?} must be refused as invalid, got {err}"
            );
        }
    }

    #[test]
    fn a_report_with_a_missing_leg_is_incomplete() {
        let e = Event::Mutation {
            seq: 1,
            key: "k".into(),
        };
        let plan = AnnouncePlan::new(&e, Legs::default()).unwrap();
        let partial = AnnounceReport {
            published: true,
            notified: false,
            enqueued: Some(JobId(1)),
            as_marker: false,
        };
        assert!(!partial.is_complete(&plan));
        assert!(!AnnounceReport::default().is_complete(&plan));
        assert_eq!(partial.missing(&plan), 1, "only the wake leg is missing");
        assert_eq!(AnnounceReport::default().missing(&plan), 3);
    }
}
