//! Announcing: the three independent, fail-soft legs run for a plan ([`Announcer`]), once
//! for every caller (the registry below and the outbox [`Relay`](crate::Relay)), and the
//! registry that writes durably first and announces after.

use tidemark_core::{AnnouncePlan, AnnounceReport, Event, Legs};
use tracing::warn;

use crate::error::Result;
use crate::ports::{Publish, Queue, Source, Wake};

/// Runs the announce legs of an [`AnnouncePlan`]: publish to the events stream keyed by
/// key, notify the wake channel, enqueue the plan's job. The one place these legs run, so
/// the [`AnnouncingRegistry`] and the outbox [`Relay`](crate::Relay) follow one rule: every
/// planned leg runs whatever the others did, a failing leg affects no other leg, and
/// failures are logged and reported, never returned.
#[derive(Clone, Debug)]
pub struct Announcer<P, W, Q> {
    events: P,
    wake: W,
    queue: Q,
    channel: String,
}

impl<P: Publish, W: Wake, Q: Queue> Announcer<P, W, Q> {
    /// Publishes on `events`, notifies `channel` on `wake`, enqueues on `queue`.
    pub fn new(events: P, wake: W, queue: Q, channel: impl Into<String>) -> Self {
        Announcer {
            events,
            wake,
            queue,
            channel: channel.into(),
        }
    }

    /// The wake channel it notifies.
    #[must_use]
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// Runs every leg of `plan` (the announcement of the write at `seq`) that `already`
    /// does not record as landed; returns `already` plus the legs that landed now. A retry
    /// passes the previous report, so it redoes only the legs that failed.
    pub async fn run_legs(
        &self,
        seq: u64,
        plan: &AnnouncePlan,
        already: AnnounceReport,
    ) -> AnnounceReport {
        let mut report = already;
        report.as_marker = plan.as_marker;
        let key = plan.key.as_str();
        if plan.publish && !report.published {
            match self.events.publish(key, plan.payload.clone()).await {
                Ok(_) => report.published = true,
                Err(e) => warn!(key, seq, error = %e, "announce: publish failed"),
            }
        }
        if plan.notify && !report.notified {
            match self.wake.notify(&self.channel, plan.payload.clone()).await {
                Ok(()) => report.notified = true,
                Err(e) => warn!(key, seq, error = %e, "announce: notify failed"),
            }
        }
        if let (Some(job), None) = (&plan.job, report.enqueued) {
            match self.queue.enqueue(job.clone()).await {
                Ok(id) => report.enqueued = Some(id),
                Err(e) => warn!(key, seq, error = %e, "announce: enqueue failed"),
            }
        }
        report
    }

    /// Runs the legs of a batch of announcements, as [`run_legs`](Self::run_legs) does for
    /// each `(seq, plan, already)`, but leg by leg for the whole batch: one
    /// [`Publish::publish_batch`], one [`Wake::notify_batch`], one [`Queue::enqueue_batch`].
    /// A backend that batches pays one commit or round trip per leg instead of one per
    /// row. Every row's legs keep their order (publish, then notify, then enqueue) and
    /// stay independent: an item that fails affects only its own row's leg.
    pub async fn run_legs_batch(
        &self,
        rows: &[(u64, &AnnouncePlan, AnnounceReport)],
    ) -> Vec<AnnounceReport> {
        let mut reports: Vec<AnnounceReport> = rows
            .iter()
            .map(|(_, plan, already)| AnnounceReport {
                as_marker: plan.as_marker,
                ..*already
            })
            .collect();
        let publish: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].1.publish && !reports[i].published)
            .collect();
        if !publish.is_empty() {
            let items = publish
                .iter()
                .map(|&i| (rows[i].1.key.clone(), rows[i].1.payload.clone()))
                .collect();
            let results = self.events.publish_batch(items).await;
            for (&i, result) in publish.iter().zip(results) {
                match result {
                    Ok(_) => reports[i].published = true,
                    Err(e) => {
                        warn!(key = rows[i].1.key, seq = rows[i].0, error = %e, "announce: publish failed");
                    }
                }
            }
        }
        let notify: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].1.notify && !reports[i].notified)
            .collect();
        if !notify.is_empty() {
            let payloads = notify.iter().map(|&i| rows[i].1.payload.clone()).collect();
            let results = self.wake.notify_batch(&self.channel, payloads).await;
            for (&i, result) in notify.iter().zip(results) {
                match result {
                    Ok(()) => reports[i].notified = true,
                    Err(e) => {
                        warn!(key = rows[i].1.key, seq = rows[i].0, error = %e, "announce: notify failed");
                    }
                }
            }
        }
        let enqueue: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].1.job.is_some() && reports[i].enqueued.is_none())
            .collect();
        if !enqueue.is_empty() {
            let jobs = enqueue
                .iter()
                .filter_map(|&i| rows[i].1.job.clone())
                .collect();
            let results = self.queue.enqueue_batch(jobs).await;
            for (&i, result) in enqueue.iter().zip(results) {
                match result {
                    Ok(id) => reports[i].enqueued = Some(id),
                    Err(e) => {
                        warn!(key = rows[i].1.key, seq = rows[i].0, error = %e, "announce: enqueue failed");
                    }
                }
            }
        }
        reports
    }
}

/// A committed write: its durable seq, and what its announcement achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    /// The seq the source gave the write. It is the write's result whatever the legs did.
    pub seq: u64,
    /// Which announce legs landed. A missing leg is closed by the next reconcile.
    pub report: AnnounceReport,
}

/// Wraps a [`Source`]: every write commits first and only then is announced on three
/// legs (publish to the events stream keyed by key, notify the wake channel, enqueue a
/// `pack_housekeeping` job). Each leg is independent and fail-soft: a failing leg affects
/// no other leg and never fails the write.
#[derive(Clone, Debug)]
pub struct AnnouncingRegistry<S, P, W, Q> {
    source: S,
    announcer: Announcer<P, W, Q>,
    legs: Legs,
}

impl<S: Source, P: Publish, W: Wake, Q: Queue> AnnouncingRegistry<S, P, W, Q> {
    /// A registry announcing on wake channel `channel` with all three legs.
    pub fn new(source: S, events: P, wake: W, queue: Q, channel: impl Into<String>) -> Self {
        AnnouncingRegistry {
            source,
            announcer: Announcer::new(events, wake, queue, channel),
            legs: Legs::default(),
        }
    }

    /// Runs only the given legs.
    #[must_use]
    pub fn with_legs(mut self, legs: Legs) -> Self {
        self.legs = legs;
        self
    }

    /// The wrapped source, for reads.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The legs it runs after each write (shared with the outbox relay's rules).
    pub fn announcer(&self) -> &Announcer<P, W, Q> {
        &self.announcer
    }

    /// Writes `value` under `key`, then announces it.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<Written> {
        let seq = self.source.put(key, value.clone()).await?;
        Ok(self.announce_put(seq, key, value).await)
    }

    /// Writes `value` as JSON under `key`, then announces it (see
    /// [`to_json`](crate::to_json) for a value that cannot be written).
    pub async fn put_json<T: serde::Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<Written> {
        self.put(key, crate::json::to_json(key, value)?).await
    }

    /// Compare-and-set write of `value` as JSON, then announces it.
    pub async fn update_json<T: serde::Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        expected: u64,
    ) -> Result<Written> {
        self.update(key, crate::json::to_json(key, value)?, expected)
            .await
    }

    /// Compare-and-set write (see [`Source::update`]), then announces it.
    pub async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<Written> {
        let seq = self.source.update(key, value.clone(), expected).await?;
        Ok(self.announce_put(seq, key, value).await)
    }

    async fn announce_put(&self, seq: u64, key: &str, value: Vec<u8>) -> Written {
        let event = Event::Put {
            seq,
            key: key.to_owned(),
            value,
        };
        Written {
            seq,
            report: self.announce(&event).await,
        }
    }

    /// Removes `key`, then announces the removal; `None` if the key was absent.
    pub async fn remove(&self, key: &str) -> Result<Option<Written>> {
        let Some(seq) = self.source.remove(key).await? else {
            return Ok(None);
        };
        let report = self
            .announce(&Event::Removed {
                seq,
                key: key.to_owned(),
            })
            .await;
        Ok(Some(Written { seq, report }))
    }

    /// Runs the announce legs for an already committed `event`. An event that cannot be
    /// serialised yields an empty report. Never fails: failures are logged and reported.
    pub async fn announce(&self, event: &Event) -> AnnounceReport {
        let plan = match AnnouncePlan::new(event, self.legs) {
            Ok(plan) => plan,
            Err(e) => {
                warn!(
                    key = event.key(),
                    seq = event.seq(),
                    error = %e,
                    "not announced"
                );
                return AnnounceReport::default();
            }
        };
        self.announcer
            .run_legs(event.seq(), &plan, AnnounceReport::default())
            .await
    }
}
