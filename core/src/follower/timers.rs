//! The follower's timers, keyed by what they end: a reopen of the feed, or the retry of a
//! request that failed (at most one of each is pending), how they are scheduled from the
//! backoffs, and the rewind after a failed sink that schedules the next attempt.

use super::{Follower, Stage};
use crate::decode::Decode;
use crate::follower::io::Request;
use crate::follower::status::{Cause, Diagnostic};
use crate::time::Time;

/// A request the follower has in flight or will retry.
#[derive(Clone, Debug)]
pub(super) enum Pending {
    Lookup,
    Reconcile,
    Snapshot,
    Fetch {
        key: String,
        seq: u64,
        position: u64,
        /// Reads of the key so far that came back older than the marker.
        stale: u32,
    },
    ListKeys,
}

#[derive(Debug, Default)]
pub(super) struct Timers {
    /// When to reopen the feed, and which backoff that ends.
    reopen: Option<(Time, Cause)>,
    /// When to send a request again, and which backoff that ends.
    retry: Option<(Time, Pending, Cause)>,
    /// When the next listing of the source's keys is due.
    presence: Option<Time>,
    /// When a read of the source must confirm the announcements applied since the last.
    confirm: Option<Time>,
    /// When to ask again for a cursor save that failed.
    checkpoint: Option<Time>,
}

impl Timers {
    pub(super) fn reopen_at(&mut self, at: Time, cause: Cause) {
        self.reopen = Some((at, cause));
    }

    pub(super) fn retry_at(&mut self, at: Time, request: Pending, cause: Cause) {
        self.retry = Some((at, request, cause));
    }

    /// The earliest deadline and what it ends.
    pub(super) fn next(&self) -> Option<(Time, Cause)> {
        let retry = self.retry.as_ref().map(|(at, _, cause)| (*at, *cause));
        let presence = self.presence.map(|at| (at, Cause::PresenceCheck));
        let confirm = self.confirm.map(|at| (at, Cause::Confirm));
        let checkpoint = self.checkpoint.map(|at| (at, Cause::Checkpoint));
        [self.reopen, retry, presence, confirm, checkpoint]
            .into_iter()
            .flatten()
            .min_by_key(|(at, _)| *at)
    }

    pub(super) fn presence_at(&mut self, at: Option<Time>) {
        self.presence = at;
    }

    pub(super) fn presence_pending(&self) -> bool {
        self.presence.is_some()
    }

    /// Whether the listing is due at `now` (and clears it).
    pub(super) fn take_due_presence(&mut self, now: Time) -> bool {
        take_due(&mut self.presence, now)
    }

    /// Asks for a confirming read at `at`, unless one is asked for sooner.
    pub(super) fn confirm_by(&mut self, at: Time) {
        self.confirm = Some(self.confirm.map_or(at, |was| was.min(at)));
    }

    /// A read of the source went out: it confirms everything applied so far.
    pub(super) fn confirmed(&mut self) {
        self.confirm = None;
    }

    /// Whether the confirming read is due at `now` (and clears it).
    pub(super) fn take_due_confirm(&mut self, now: Time) -> bool {
        take_due(&mut self.confirm, now)
    }

    /// Asks again for a cursor save at `at` (`None`: no save is owed).
    pub(super) fn checkpoint_at(&mut self, at: Option<Time>) {
        self.checkpoint = at;
    }

    /// Whether the owed cursor save is due at `now` (and clears it).
    pub(super) fn take_due_checkpoint(&mut self, now: Time) -> bool {
        take_due(&mut self.checkpoint, now)
    }

    /// Whether a backoff is pending (the periodic listing is not one, nor a cursor save
    /// asked again).
    pub(super) fn any(&self) -> bool {
        self.reopen.is_some() || self.retry.is_some()
    }

    pub(super) fn retry_pending(&self) -> bool {
        self.retry.is_some()
    }

    pub(super) fn reopen_pending(&self) -> bool {
        self.reopen.is_some()
    }

    /// The request whose retry is due at `now`.
    pub(super) fn take_due_retry(&mut self, now: Time) -> Option<Pending> {
        if self.retry.as_ref().is_some_and(|(at, _, _)| *at <= now) {
            self.retry.take().map(|(_, request, _)| request)
        } else {
            None
        }
    }

    /// Whether the reopen is due at `now` (and clears it).
    pub(super) fn take_due_reopen(&mut self, now: Time) -> bool {
        if self.reopen.is_some_and(|(at, _)| at <= now) {
            self.reopen = None;
            true
        } else {
            false
        }
    }

    /// Brings every deadline forward to `now`: the path to the source is back.
    pub(super) fn expedite(&mut self, now: Time) {
        if let Some((at, _)) = &mut self.reopen {
            *at = (*at).min(now);
        }
        if let Some((at, _, _)) = &mut self.retry {
            *at = (*at).min(now);
        }
        if let Some(at) = &mut self.checkpoint {
            *at = (*at).min(now);
        }
    }

    /// Clears the backoffs; the periodic listing, the confirming read and an owed cursor
    /// save (of entries the sink committed) stay scheduled.
    pub(super) fn clear(&mut self) {
        self.reopen = None;
        self.retry = None;
    }
}

/// Whether the deadline in `at` is due at `now` (and clears it).
fn take_due(at: &mut Option<Time>, now: Time) -> bool {
    at.take_if(|at| *at <= now).is_some()
}

impl<D: Decode> Follower<D> {
    pub(super) fn schedule_retry(
        &mut self,
        request: Pending,
        cause: Cause,
        error: String,
        now: Time,
    ) {
        let backoff = match cause {
            Cause::Lookup => &mut self.backoffs.lookup,
            _ => &mut self.backoffs.failure,
        };
        let delay = backoff.next_delay(now, &mut self.rng);
        let attempt = backoff.attempt();
        self.retry_after(request, cause, error, now, delay, attempt);
    }

    /// Retries a marker's fetch that read the source before the marker's change, on the
    /// stale reads' own backoff (see `Backoffs::stale`).
    pub(super) fn schedule_stale_retry(&mut self, request: Pending, error: String, now: Time) {
        let delay = self.backoffs.stale.next_delay(now, &mut self.rng);
        let attempt = self.backoffs.stale.attempt();
        self.retry_after(request, Cause::RequestFailed, error, now, delay, attempt);
    }

    /// Sends `request` again after `delay`, the `attempt`-th of its backoff.
    fn retry_after(
        &mut self,
        request: Pending,
        cause: Cause,
        error: String,
        now: Time,
        delay: std::time::Duration,
        attempt: u32,
    ) {
        self.timers
            .retry_at(now.saturating_add(delay), request, cause);
        self.diag(Diagnostic::BackingOff {
            cause,
            attempt,
            delay,
            error,
        });
    }

    pub(super) fn schedule_reopen(&mut self, cause: Cause, error: String, now: Time) {
        let backoff = match cause {
            Cause::FeedEnded => &mut self.backoffs.end,
            _ => &mut self.backoffs.failure,
        };
        let delay = backoff.next_delay(now, &mut self.rng);
        let attempt = backoff.attempt();
        self.timers.reopen_at(now.saturating_add(delay), cause);
        self.diag(Diagnostic::BackingOff {
            cause,
            attempt,
            delay,
            error,
        });
    }

    /// The sink failed: go back to what it last committed and decide everything since
    /// again, after the failure backoff.
    pub(super) fn rewind(&mut self, error: String, now: Time) {
        self.counters.rewinds += 1;
        // Whatever was still to be carried out belongs to the batch that failed.
        self.out.clear();
        if let Some(feed) = self.feed.take() {
            self.request_out(Request::CloseFeed { token: feed.token });
        }
        self.request = None;
        self.parts = None;
        self.timers.clear();
        self.held.clear();
        self.rewake = false;
        let exact = self.index.rewind();
        // What the sink holds is what it last committed, unconfirmed announcements
        // included: a read in the failed batch that confirmed or replaced one did not land.
        self.ahead.clone_from(&self.committed_ahead);
        self.watermark = self.mark.watermark;
        self.known = self.mark.known;
        self.read_lineage = None;
        self.last_checkpoint = self.mark.checkpoint;
        if self.stage == Stage::Live && !self.mark.ready {
            self.stage = Stage::Syncing;
        }
        let watermark = self.watermark;
        self.diag(Diagnostic::Rewound {
            watermark,
            error: error.clone(),
        });
        if self.stage == Stage::Starting {
            self.schedule_retry(Pending::Lookup, Cause::SinkFailed, error, now);
        } else if !exact {
            // What the failed batch changed was not recorded: forget every seq and let a
            // snapshot replace the cache.
            self.index.forget_seqs();
            self.counters.resyncs += 1;
            self.schedule_retry(Pending::Snapshot, Cause::SinkFailed, error, now);
        } else if self.follow.syncs_by_reconcile() {
            self.schedule_retry(Pending::Reconcile, Cause::SinkFailed, error, now);
        } else {
            self.schedule_reopen(Cause::SinkFailed, error, now);
        }
    }
}
