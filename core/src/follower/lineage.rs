//! How a follower keeps and checks the history its source serves (see [`Lineage`] for the
//! two facts that tell histories apart): the history and the stamp of the entry at its
//! watermark are kept with the watermark, and a read that names its watermark (a feed
//! opened after it, a reconcile since it) or its source's history contradicting either
//! makes the follower take the new history: the next snapshot replaces the cache whatever
//! seqs it held. A fact a source cannot tell (`None`) contradicts nothing.

use super::Follower;
use crate::decode::Decode;
use crate::follower::io::Token;
use crate::follower::status::Diagnostic;
use crate::lineage::Lineage;

/// What a follower knows of its source's history: the history, and the stamp of an entry
/// at a seq (kept while that seq is the watermark).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Known {
    pub(super) history: Option<u64>,
    pub(super) stamp_at: Option<(u64, u64)>,
}

impl Known {
    /// The lineage at `watermark`.
    pub(super) fn at(self, watermark: u64) -> Lineage {
        Lineage {
            history: self.history,
            stamp: self
                .stamp_at
                .filter(|(seq, _)| *seq == watermark)
                .map(|(_, stamp)| stamp),
        }
    }
}

/// Whether a snapshot at `source_watermark` naming a key at `seq` proves another
/// history, the cache holding that key at `held` (from the source): within one history a
/// key's seq only grows.
pub(super) fn went_back(held: Option<u64>, seq: u64, source_watermark: u64) -> bool {
    held.is_some_and(|held| seq < held && held <= source_watermark)
}

impl<D: Decode> Follower<D> {
    /// What the follower knows of its source's history at its watermark: a durable sink
    /// keeps it with the watermark and gives it back on a warm start
    /// ([`remember_lineage`](Self::remember_lineage)).
    #[must_use]
    pub fn lineage(&self) -> Lineage {
        self.known.at(self.watermark)
    }

    /// A warm start: the lineage the sink kept with the watermark it resumed from (see
    /// [`lineage`](Self::lineage)). The first read of the source checks it.
    pub fn remember_lineage(&mut self, lineage: Lineage) {
        self.finish_switch();
        self.known = Known {
            history: lineage.history,
            stamp_at: lineage.stamp.map(|s| (self.watermark, s)),
        };
        self.mark.known = self.known;
    }

    /// An entry at `seq` with `stamp` moved the watermark (or will): its stamp is the one
    /// at the watermark from now on.
    pub(super) fn note_stamp(&mut self, seq: u64, stamp: Option<u64>) {
        if let Some(stamp) = stamp
            && self.known.stamp_at.is_none_or(|(at, _)| seq >= at)
        {
            self.known.stamp_at = Some((seq, stamp));
        }
    }

    /// Whether the feed's entry at the watermark, stamped `fed`, is another history's
    /// than the one the follower holds there; if so, the feed is reopened. A read of the
    /// source (a reconcile, a snapshot) can take the follower past a restore before the
    /// feed it opened earlier ends: that feed still delivers the replaced history, and its
    /// next entry above the watermark would be applied over the restored one (seed 6577).
    /// The entry at the watermark is where the two first meet.
    pub(super) fn feed_of_another_history(&mut self, fed: Option<u64>) -> bool {
        let held = self.known.at(self.watermark).stamp;
        let (Some(held), Some(fed)) = (held, fed) else {
            return false;
        };
        if held == fed || !self.feed_speaks_for_source() {
            return false;
        }
        let watermark = self.watermark;
        self.diag(Diagnostic::FeedOfAnotherHistory {
            watermark,
            held,
            fed,
        });
        self.drop_feed();
        self.maybe_open_feed();
        true
    }

    /// The lineage a read under `token` reported, if it is the one outstanding's.
    pub(super) fn read_lineage(&self, token: Token) -> Option<Lineage> {
        self.read_lineage
            .filter(|(t, _)| *t == token)
            .map(|(_, l)| l)
    }

    /// Checks what a read that names the watermark (`at`) says of the history. On a
    /// contradiction the follower takes the new history: it resyncs, and the snapshot
    /// replaces the cache whatever seqs it held. Returns whether the read may be used;
    /// otherwise it learns the source's history if it knew none.
    pub(super) fn same_history(&mut self, read: Lineage, at: u64) -> bool {
        if self.contradicted(read, at) {
            let held = self.known.at(self.watermark);
            let watermark = self.watermark;
            self.diag(Diagnostic::HistoryChanged {
                watermark,
                held,
                read,
            });
            self.other_history = true;
            self.resync();
            return false;
        }
        if self.known.history.is_none() {
            self.known.history = read.history;
        }
        true
    }

    /// A read found the source behind the watermark: another history (restored,
    /// recreated), or its newest entries purged. From a source that says which history it
    /// serves (and whose head goes back only with its history) it is taken for another:
    /// the snapshot that follows replaces the cache whatever seqs it held, since by the
    /// time it is read the new history may have passed the watermark, where its seqs name
    /// other changes and its stamp at the snapshot's watermark proves nothing of the
    /// watermark (seed 149). From a source that cannot tell, the snapshot decides by its
    /// watermark alone, as before.
    pub(super) fn source_behind(&mut self) {
        if self.known.history.is_some() {
            self.other_history = true;
        }
    }

    /// Whether a snapshot entry at or below `source_watermark` names its key at a lower
    /// seq than the cache holds it at (where the cache took it from the source, not from
    /// an unconfirmed announcement): within one history a key's seq only grows, so the
    /// snapshot is of another (a copy restored from a backup, compacted past the
    /// watermark where no stamp is left to tell; seed 274).
    pub(super) fn went_back(&self, entry: &crate::entry::Entry, source_watermark: u64) -> bool {
        !self.ahead.contains_key(&*entry.key)
            && went_back(self.index.get(&entry.key), entry.seq, source_watermark)
    }

    /// A snapshot proved another history by a key whose seq went back: the follower takes
    /// the new history.
    pub(super) fn history_went_back(&mut self) {
        let watermark = self.watermark;
        let held = self.lineage();
        self.diag(Diagnostic::HistoryChanged {
            watermark,
            held,
            read: held,
        });
        self.other_history = true;
    }

    /// Whether a snapshot at `source_watermark` reporting `read` is of another history
    /// than the cache's: one was found already, the source is behind the watermark, its
    /// history differs, or its stamp at the watermark does.
    pub(super) fn snapshot_is_new(&self, source_watermark: u64, read: Option<Lineage>) -> bool {
        self.other_history
            || source_watermark < self.watermark
            || read.is_some_and(|read| self.contradicted(read, source_watermark))
    }

    /// Whether a read's lineage at seq `at` contradicts what the follower knows: its
    /// history always, its stamp only when `at` is the watermark.
    fn contradicted(&self, read: Lineage, at: u64) -> bool {
        let held = self.known.at(self.watermark);
        if at == self.watermark {
            held.contradicts(read)
        } else {
            held.other_history(read)
        }
    }

    /// A read found the source compacted past the watermark, saying `read` of its history
    /// at the watermark. Where the source states its lineage but no longer the stamp at the
    /// watermark, nothing tells this history from a copy restored from a backup and written
    /// past the watermark since: such a copy may hold a key at the very seq the cache holds
    /// it at, with another value. The snapshot that follows then puts again every entry
    /// the cache holds at the same seq (the cost of a compaction resync becomes that of a
    /// cold one) rather than pass it over as unchanged (seed 7519). A source that states
    /// nothing of its lineage keeps the cheap resync: it could not tell a restore anyway.
    pub(super) fn unconfirmed_at_compaction(&mut self, read: Option<Lineage>) {
        let states = self.known.history.is_some() || self.known.stamp_at.is_some();
        let confirmed = read.is_some_and(|read| {
            read.stamp.is_some() && read.stamp == self.known.at(self.watermark).stamp
        });
        self.unconfirmed = states && self.watermark > 0 && !confirmed;
    }

    /// A snapshot at `source_watermark` was applied: what it said of the history is the
    /// follower's from now on.
    pub(super) fn adopt_snapshot_lineage(&mut self, source_watermark: u64, read: Option<Lineage>) {
        self.other_history = false;
        self.unconfirmed = false;
        if let Some(read) = read {
            if read.history.is_some() {
                self.known.history = read.history;
            }
            if let Some(stamp) = read.stamp {
                self.known.stamp_at = Some((source_watermark, stamp));
            }
        }
    }
}
