//! The `handle_*` family: a fact arrived (an input) or time passed (a timeout).

use super::{Cached, Follower, Held, Pending, Stage};
use crate::decode::Decode;
use crate::follower::io::{Input, Notice, Output, Request, Token};
use crate::follower::status::{Cause, Diagnostic};
use crate::time::Time;

impl<D: Decode> Follower<D> {
    // ---- handle_* ----

    /// Time passed: retries whose backoff is over happen now.
    pub fn handle_timeout(&mut self, now: Time) {
        self.finish_switch();
        if self.stopped() {
            return;
        }
        self.now = self.now.max(now);
        self.expire(now);
        if self.timers.take_due_presence(now) {
            if self.busy() {
                self.schedule_presence_check();
            } else {
                self.send(Pending::ListKeys);
            }
        }
        if self.timers.take_due_confirm(now) {
            self.confirm_now();
        }
        if self.timers.take_due_checkpoint(now) {
            self.save_owed_checkpoint();
        }
        // One request at a time: a retry waits for an answer still outstanding.
        if self.request.is_none()
            && let Some(request) = self.timers.take_due_retry(now)
        {
            self.send(request);
        }
        if self.timers.take_due_reopen(now) {
            self.settle();
        }
    }

    /// A fact happened at `now`.
    pub fn handle_input(&mut self, input: Input, now: Time) {
        self.handle(input, now, None);
    }

    /// A fact happened at `now`; a new history's snapshot parts compare their entries
    /// with what the sink holds, where `cached` says ([`Cached`]).
    pub(super) fn handle(
        &mut self,
        input: Input,
        now: Time,
        cached: Option<&dyn Cached<D::Value>>,
    ) {
        self.finish_switch();
        if self.stopped() {
            return;
        }
        self.now = self.now.max(now);
        match input {
            Input::SourceFound { token } => self.on_source_found(token),
            Input::FeedOpened { token, info } => self.on_feed_opened(token, info, now),
            Input::Entry { token, entry } => self.on_feed_item(token, Held::Entry(entry)),
            Input::Undecodable {
                token,
                position,
                seq,
                reason,
            } => self.on_feed_item(
                token,
                Held::Undecodable {
                    position,
                    seq,
                    reason,
                },
            ),
            Input::FeedHead { token, head } => self.on_feed_item(token, Held::Head(head)),
            Input::FeedFailed { token, error } => {
                self.on_feed_lost(token, Cause::FeedFailed, error, now);
            }
            Input::FeedEnded { token } => {
                self.on_feed_lost(token, Cause::FeedEnded, "feed ended".into(), now);
            }
            Input::Lineage { token, lineage } => {
                if self.request.as_ref().is_some_and(|(t, _)| *t == token) {
                    self.read_lineage = Some((token, lineage));
                } else {
                    self.counters.ignored += 1;
                }
            }
            Input::Changes {
                token,
                changes,
                source_watermark,
            } => {
                let read = self.read_lineage(token);
                if self.take_request(token, |r| matches!(r, Pending::Reconcile)) {
                    self.backoffs.failure.healthy(now);
                    let watermark = self.watermark;
                    if read.is_none_or(|read| self.same_history(read, watermark)) {
                        self.on_changes(changes, source_watermark);
                    }
                }
            }
            Input::ChangesUnavailable {
                token,
                first_available,
            } => {
                let read = self.read_lineage(token);
                if self.take_request(token, |r| matches!(r, Pending::Reconcile)) {
                    let watermark = self.watermark;
                    if read.is_some_and(|read| !self.same_history(read, watermark)) {
                        return;
                    }
                    let wanted = self.watermark.saturating_add(1);
                    self.diag(Diagnostic::Compacted {
                        wanted,
                        first_available,
                    });
                    self.unconfirmed_at_compaction(read);
                    self.resync();
                }
            }
            Input::Snapshot {
                token,
                entries,
                source_watermark,
            } => {
                let read = self.read_lineage(token);
                if self.has_parts(token) {
                    self.on_last_part(entries, source_watermark, now, cached);
                } else if self.take_request(token, |r| matches!(r, Pending::Snapshot)) {
                    self.backoffs.failure.healthy(now);
                    self.on_snapshot(entries, source_watermark, read);
                }
            }
            Input::SnapshotPart {
                token,
                entries,
                source_watermark,
            } => self.on_snapshot_part(token, entries, source_watermark, now, cached),
            Input::Fetched {
                token,
                value,
                source_watermark,
            } => self.on_fetch_answer(token, (value, source_watermark), now),
            Input::Keys {
                token,
                keys,
                source_watermark,
            } => {
                let read = self.read_lineage(token);
                if self.take_request(token, |r| matches!(r, Pending::ListKeys)) {
                    // A listing of another history (the bucket made again between a
                    // feed's open and the listing it asked for) names none of the keys
                    // it would drop: the follower takes the new history instead (a NATS
                    // campaign round whose mirror dropped keys of its own history).
                    let watermark = self.watermark;
                    if read.is_none_or(|read| self.same_history(read, watermark)) {
                        self.on_keys(keys, source_watermark);
                    } else {
                        self.list_before_feed = false;
                    }
                }
            }
            Input::RequestFailed { token, error } => self.on_request_failed(token, error, now),
            Input::Wake => self.on_wake(),
            Input::Reconnected => self.on_path_back(now),
            Input::Resumed => {
                self.counters.resumes += 1;
                self.on_path_back(now);
            }
            Input::SinkFailed { error } => self.rewind(error, now),
            Input::CheckpointFailed { position, error } => {
                self.on_checkpoint_failed(position, error, now);
            }
            Input::Stop => self.on_stop(),
        }
    }

    /// The path to the source is back: what waits out a backoff is tried now, and the
    /// first success forgets the failures of the outage (a failure soon after, of what
    /// was open across it, must not wait out a backoff the outage grew).
    fn on_path_back(&mut self, now: Time) {
        self.backoffs.failure.outage_over();
        self.backoffs.end.outage_over();
        self.backoffs.checkpoint.outage_over();
        self.timers.expedite(now);
        self.handle_timeout(now);
    }

    fn on_source_found(&mut self, token: Token) {
        if self.take_request(token, |r| matches!(r, Pending::Lookup)) {
            self.stage = Stage::Syncing;
            self.backoffs.lookup.reset();
            if self.follow.syncs_by_reconcile() {
                self.send(Pending::Reconcile);
            } else {
                self.maybe_open_feed();
            }
        }
    }

    /// The feed failed or ended: reopen after the backoff of `cause`.
    fn on_feed_lost(&mut self, token: Token, cause: Cause, error: String, now: Time) {
        if self.feed_is(token, false) {
            self.drop_feed();
            self.schedule_reopen(cause, error, now);
        } else {
            self.counters.ignored += 1;
        }
    }

    fn on_fetch_answer(
        &mut self,
        token: Token,
        answer: (Option<(u64, Vec<u8>)>, Option<u64>),
        now: Time,
    ) {
        if let Some((
            _,
            Pending::Fetch {
                key,
                seq,
                position,
                stale,
            },
        )) = self
            .request
            .take_if(|(t, r)| *t == token && matches!(r, Pending::Fetch { .. }))
        {
            self.backoffs.failure.healthy(now);
            self.on_fetched(key, (seq, stale), position, answer, now);
        } else {
            self.counters.ignored += 1;
        }
    }

    fn on_request_failed(&mut self, token: Token, error: String, now: Time) {
        if let Some((_, Pending::ListKeys)) = self
            .request
            .take_if(|(t, r)| *t == token && matches!(r, Pending::ListKeys))
        {
            if self.list_before_feed {
                // The feed waits for it: the feed fails, and its reopen (after the
                // failure backoff) decides again.
                self.drop_feed();
                self.schedule_reopen(Cause::FeedFailed, error, now);
                return;
            }
            // A listing is periodic: it is tried again at the next interval.
            self.diag(Diagnostic::ListingFailed { error });
            self.schedule_presence_check();
            self.settle();
        } else if let Some((_, request)) = self.request.take_if(|(t, _)| *t == token) {
            // A read that failed midway: what its parts kept goes with it.
            self.parts = None;
            let cause = match request {
                Pending::Lookup => Cause::Lookup,
                _ => Cause::RequestFailed,
            };
            self.schedule_retry(request, cause, error, now);
        } else {
            self.counters.ignored += 1;
        }
    }

    fn on_wake(&mut self) {
        if self.stage == Stage::Starting
            || matches!(self.request, Some((_, Pending::Snapshot | Pending::Lookup)))
        {
            // The coming sync or resync reads the source anyway.
        } else if self.busy() {
            // A wake during a catch-up must cause another, or a commit that landed after
            // the source was read would wait for the next wake.
            self.rewake = true;
        } else {
            self.send(Pending::Reconcile);
        }
    }

    fn on_stop(&mut self) {
        if let Some(feed) = self.feed.take() {
            self.request_out(Request::CloseFeed { token: feed.token });
        }
        self.request = None;
        self.parts = None;
        self.timers.clear();
        self.timers.presence_at(None);
        self.timers.confirmed();
        self.held.clear();
        self.stage = Stage::Stopped {
            ready: self.is_ready(),
        };
        self.out.push_back(Output::Notice(Notice::Stopped));
    }
}
