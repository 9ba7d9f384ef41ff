//! The feed: when it opens, what its opening says (compaction, a head behind the
//! watermark, how it must be followed), its items, checkpoints and readiness.

use super::{FeedState, Follower, Held, MAX_HELD, Pending, Stage};
use crate::decode::Decode;
use crate::follower::io::{Continuity, FeedInfo, Follow, Notice, Request, Token};
use crate::follower::status::{Cause, Diagnostic};
use crate::time::Time;

impl<D: Decode> Follower<D> {
    /// Opens the feed if it should be open and nothing stands in the way.
    pub(super) fn maybe_open_feed(&mut self) {
        if !self.follow.uses_feed()
            || self.stopped()
            || self.stage == Stage::Starting
            || self.feed.is_some()
            || self.busy()
            || self.timers.reopen_pending()
        {
            return;
        }
        if self.opened_once {
            self.counters.reopens += 1;
        }
        self.opened_once = true;
        let token = self.token();
        let from = self.watermark.saturating_add(1);
        self.feed = Some(FeedState {
            token,
            from,
            info: None,
            last_seq: 0,
        });
        let after_position = self.last_checkpoint;
        self.request_out(Request::OpenFeed {
            token,
            from,
            after_position,
        });
    }

    pub(super) fn feed_is(&self, token: Token, opened: bool) -> bool {
        self.feed
            .as_ref()
            .is_some_and(|f| f.token == token && (!opened || f.info.is_some()))
    }

    pub(super) fn drop_feed(&mut self) {
        self.list_before_feed = false;
        if let Some(feed) = self.feed.take() {
            self.request_out(Request::CloseFeed { token: feed.token });
        }
        self.held.clear();
    }

    pub(super) fn on_feed_item(&mut self, token: Token, item: Held) {
        if !self.feed_is(token, true) {
            self.counters.ignored += 1;
        } else if self.busy() {
            if self.held.len() >= MAX_HELD {
                // The request is slow to come back: stop buffering and let the feed
                // redeliver from watermark+1 once it has.
                self.drop_feed();
            } else {
                self.held.push_back(item);
            }
        } else {
            self.on_item(item);
        }
    }

    pub(super) fn on_feed_opened(&mut self, token: Token, info: FeedInfo, now: Time) {
        let Some(feed) = self
            .feed
            .as_mut()
            .filter(|f| f.token == token && f.info.is_none())
        else {
            self.counters.ignored += 1;
            return;
        };
        feed.info = Some(info);
        let from = feed.from;
        self.backoffs.failure.healthy(now);
        self.backoffs.end.healthy(now);
        if info.follow != self.follow {
            // The feed decides how it is followed: a follower told to replay an
            // announcements stream would take its head for the source's and resync on
            // every reopen, and drop announcements that come out of order.
            self.diag(Diagnostic::FollowChanged {
                from: self.follow,
                to: info.follow,
            });
            self.follow = info.follow;
            if self.follow.syncs_by_reconcile() && !self.is_ready() && !self.busy() {
                self.send(Pending::Reconcile);
            }
        }
        // A source recreated or restored since the watermark was reached: the feed's
        // seqs past it are another history's, whatever its head says.
        if self.feed_speaks_for_source() && !self.same_history(info.lineage, from.saturating_sub(1))
        {
            return;
        }
        // A sparse feed replayed into an empty cache is itself a full sync: the server keeps
        // the latest entry of every key, so a compacted prefix hides nothing we hold.
        let empty_replay = matches!(info.continuity, Continuity::Sparse | Continuity::PerKey)
            && self.watermark == 0
            && self.index.len() == 0;
        if self.feed_speaks_for_source() && info.head < self.watermark {
            // Behind us: either the newest entries were purged (a resync sorts that out) or
            // this is a new history; the snapshot's watermark tells which.
            let watermark = self.watermark;
            self.diag(Diagnostic::HeadBehind {
                head: info.head,
                watermark,
            });
            self.source_behind();
            self.resync();
            return;
        }
        if self.feed_speaks_for_source()
            && info.first_available > from
            && !empty_replay
            && info.continuity == Continuity::PerKey
        {
            // Only older revisions of keys written again, or purged keys, are gone: a
            // listing finds what a purge took, and the feed brings the rest. Listed before
            // the feed's entries are applied (they wait while it runs), so a crash before
            // it lands finds the same first seq and lists again.
            if self
                .listed_at
                .is_some_and(|w| w.saturating_add(1) >= info.first_available)
            {
                self.check_ready(info.head);
            } else {
                self.diag(Diagnostic::Rewritten {
                    wanted: from,
                    first_available: info.first_available,
                });
                self.list_before_feed = true;
                if !self.busy() {
                    self.send(Pending::ListKeys);
                }
            }
            return;
        }
        if self.feed_speaks_for_source() && info.first_available > from && !empty_replay {
            self.diag(Diagnostic::Compacted {
                wanted: from,
                first_available: info.first_available,
            });
            self.unconfirmed_at_compaction(Some(info.lineage));
            self.resync();
            return;
        }
        self.check_ready(info.head);
    }

    /// Whether the feed is the source's own history (a change log, a KV watch): its seqs
    /// arrive in order, so an entry moves the watermark, a jump is a gap, and its head is
    /// the source's. An announcements stream is none of these; only a reconcile speaks for
    /// the source there.
    pub(super) fn feed_speaks_for_source(&self) -> bool {
        self.follow == Follow::Replay
    }

    /// Whether a jump past watermark+1 is a gap: on a gapless feed, and only where feed
    /// entries move the watermark (announcements do not, so every jump would look like one).
    pub(super) fn gapless(&self) -> bool {
        self.feed_speaks_for_source()
            && self
                .feed
                .as_ref()
                .and_then(|f| f.info)
                .is_some_and(|i| i.continuity == Continuity::Gapless)
    }

    /// The feed's head, once it opened.
    pub(super) fn feed_head(&self) -> Option<u64> {
        self.feed.as_ref().and_then(|f| f.info).map(|i| i.head)
    }

    /// The feed or the source cannot bring the cache up to date from its watermark: resync
    /// from a snapshot.
    pub(super) fn resync(&mut self) {
        self.counters.resyncs += 1;
        self.drop_feed();
        self.send(Pending::Snapshot);
    }

    /// A replayed feed completes the initial sync once the watermark reaches its head;
    /// other modes become ready from a reconcile.
    pub(super) fn check_ready(&mut self, head: u64) {
        if !self.is_ready() && self.feed_speaks_for_source() && self.watermark >= head {
            self.become_ready();
        }
    }

    pub(super) fn become_ready(&mut self) {
        if self.stage != Stage::Live {
            self.stage = Stage::Live;
            let watermark = self.watermark;
            self.notice(Notice::Ready { watermark });
            if !self.timers.presence_pending() {
                self.schedule_presence_check();
            }
        }
    }

    pub(super) fn checkpoint(&mut self, position: u64) {
        let wants = self
            .feed
            .as_ref()
            .and_then(|f| f.info)
            .is_some_and(|i| i.checkpoints);
        if wants && self.last_checkpoint.is_none_or(|last| position > last) {
            self.last_checkpoint = Some(position);
            // Saves are monotone: this one stands for any that failed before it.
            self.timers.checkpoint_at(None);
            self.backoffs.checkpoint.healthy(self.now);
            self.request_out(Request::Checkpoint { position });
        }
    }

    /// The save of `position` failed: ask for it again after the checkpoint backoff,
    /// unless a later checkpoint was asked for since (it stands for this one). A position
    /// never asked for is not one to save. The save owed is the last checkpoint asked for
    /// while its timer runs: a later one clears the timer.
    pub(super) fn on_checkpoint_failed(&mut self, position: u64, error: String, now: Time) {
        if self.last_checkpoint != Some(position) {
            return;
        }
        let delay = self.backoffs.checkpoint.next_delay(now, &mut self.rng);
        let attempt = self.backoffs.checkpoint.attempt();
        self.timers.checkpoint_at(Some(now.saturating_add(delay)));
        self.diag(Diagnostic::BackingOff {
            cause: Cause::Checkpoint,
            attempt,
            delay,
            error,
        });
    }

    /// The owed cursor save (the last checkpoint asked for), asked for again.
    pub(super) fn save_owed_checkpoint(&mut self) {
        if let Some(position) = self.last_checkpoint {
            self.backoffs.checkpoint.healthy(self.now);
            self.request_out(Request::Checkpoint { position });
        }
    }
}
