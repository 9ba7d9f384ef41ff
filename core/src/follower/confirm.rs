//! Announcements applied ahead of the source's read, and how a later read of the source
//! confirms or replaces them (a foreign or corrupt producer's change must not stay in the
//! cache).
//!
//! An announcement is trusted for one thing only: that the key may have changed. Its seq,
//! its operation and its value are a claim, held unconfirmed until a read of the source
//! (a reconcile or a snapshot) shows the same change — the same seq, the same operation,
//! the same bytes — and replaced by the read's answer otherwise. Feeds that are the
//! source's own history ([`Follow::Replay`]) are not announcements: nothing of this runs
//! for them.

use super::{Follower, Pending};
use crate::decode::Decode;
use crate::entry::{CacheChange, Entry};
use crate::follower::io::Follow;
use crate::follower::status::InvalidReason;

/// What an announcement the cache applied said the key became.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Claimed {
    /// These bytes (as the announcement or the marker's fetch carried them).
    Put(Vec<u8>),
    /// Removed.
    Removed,
    /// Not known: a key a restarted sink holds past its watermark (its bytes are in the
    /// sink, not in the follower). Its seq alone is checked.
    Unknown,
}

/// An applied change no read of the source has confirmed yet.
#[derive(Clone, Debug)]
pub(super) struct Claim {
    /// The seq it was applied at.
    pub(super) seq: u64,
    /// `reads` when it was applied: a read asked for later must have it.
    pub(super) applied_at: u64,
    /// What it said.
    pub(super) value: Claimed,
}

impl Claim {
    /// Whether `entry`, read from the source, is this change.
    pub(super) fn is(&self, entry: &Entry) -> bool {
        entry.seq == self.seq
            && match &self.value {
                Claimed::Put(bytes) => {
                    entry.op.cache_change() == CacheChange::Upsert && entry.value == *bytes
                }
                Claimed::Removed => entry.op.cache_change() == CacheChange::Remove,
                Claimed::Unknown => true,
            }
    }
}

impl<D: Decode> Follower<D> {
    /// Remembers the change an announcement (or a marker's fetch) just applied to `key` at
    /// `seq` as unconfirmed. A change that was stale (an older seq arriving late) changed
    /// nothing and claims nothing. Returns whether it remembered one.
    pub(super) fn remember_ahead(&mut self, key: &str, seq: u64, value: Claimed) -> bool {
        if self.index.newest(key) != Some(seq) || seq <= self.watermark {
            return false;
        }
        // The first change applied at a seq is what the cache holds: a later copy of it
        // (the real announcement after a forged one, or the reverse) changed nothing.
        if self.ahead.get(key).is_some_and(|held| held.seq >= seq) {
            return false;
        }
        let applied_at = self.reads;
        self.ahead.insert(
            key.to_owned(),
            Claim {
                seq,
                applied_at,
                value,
            },
        );
        true
    }

    /// Asks for a read of the source to confirm what announcements applied, within
    /// [`confirm_after`](crate::FollowerConfigBuilder::confirm_after): a wake's read
    /// that comes sooner does it, and announcements keep flowing meanwhile, so a busy
    /// stream costs one read per interval, not one per announcement, and a quiet source is
    /// still read once after the last.
    pub(super) fn confirm_soon(&mut self) {
        if !self.stopped() {
            let at = self.now.saturating_add(self.config.confirm_after);
            self.timers.confirm_by(at);
        }
    }

    /// The confirming read is due: now if the follower is idle, after the request out now
    /// otherwise.
    pub(super) fn confirm_now(&mut self) {
        if self.busy() {
            self.rewake = true;
        } else {
            self.send(Pending::Reconcile);
        }
    }

    /// Whether an announcement (or a marker) at `seq` must be held unconfirmed: on an
    /// announcements stream, every change above the watermark, however close to what the
    /// source is known to have reached (a forged event can copy a real seq).
    pub(super) fn holds_unconfirmed(&self, seq: u64) -> bool {
        self.follow == Follow::Announcements && seq > self.watermark
    }

    /// Checks the unconfirmed announcements a read of the source at `source_watermark`
    /// covers: `confirm(key, claim)` says whether the read has that change. What the read
    /// does not confirm is forgotten (its seq set to 0, its tombstone dropped), so the
    /// read's own answer replaces it. Returns whether some key was not named by the read
    /// at all (then only a snapshot can say what it holds).
    pub(super) fn confirm_ahead(
        &mut self,
        source_watermark: u64,
        confirm: impl Fn(&str, &Claim) -> Confirmation,
    ) -> bool {
        self.known_source = self.known_source.max(source_watermark);
        if self.ahead.is_empty() {
            return false;
        }
        // Due: what the read covers, and what it should have covered. A writer announces
        // after it commits, so a read asked for after an announcement was applied reaches
        // its seq, unless the source never made it (a foreign producer, another history):
        // then no read ever would, and it must not stay in the cache for good.
        let asked = self.read_asked;
        let due: Vec<String> = self
            .ahead
            .iter()
            .filter(|(_, c)| c.seq <= source_watermark || c.applied_at < asked)
            .map(|(k, _)| k.clone())
            .collect();
        let mut unexplained = false;
        for key in due {
            let Some(claim) = self.ahead.remove(&key) else {
                continue;
            };
            let verdict = confirm(&key, &claim);
            if verdict == Confirmation::Confirmed {
                continue;
            }
            self.invalid(claim.seq, &key, InvalidReason::Unconfirmed);
            if self.index.get(&key).is_some() {
                self.index.set(key.as_str().into(), 0);
            }
            self.index.untomb(&key);
            if verdict == Confirmation::Unexplained {
                // Only the snapshot this asks for settles the key: the claim stays until
                // then, so a batch that fails before the snapshot lands (its rewind goes
                // back to a commit made while the request was out) still holds it.
                self.ahead.insert(key, claim);
                unexplained = true;
            }
        }
        unexplained
    }
}

/// What a read of the source says of an unconfirmed announcement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Confirmation {
    /// The read has the change at that seq, with the same operation and value.
    Confirmed,
    /// The read names the key with other changes (or the same seq with another value):
    /// they replace the announcement's.
    Replaced,
    /// The read does not name the key: the cache's older value for it is unknown.
    Unexplained,
}
