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
    /// Not known: a key a restarted sink holds past its watermark, from a sink that does
    /// not give back what it committed ahead ([`Follower::remember_ahead`]): its bytes are
    /// in the sink, not in the follower. A read with a put at its seq puts that again (it
    /// cannot tell whether the sink's bytes are the source's); anything else replaces it.
    Unknown,
}

/// A change a durable sink committed ahead of its watermark: on an announcements stream, an
/// announcement no read of the source had confirmed when the batch holding it was
/// committed. A sink that keeps these gives them back on a warm start, and the follower
/// holds each unconfirmed again ([`Follower::remember_ahead`]), so the first read of the
/// source checks it as it would have before the restart — a removal included, which
/// leaves no row to find.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ahead {
    /// The sink holds `key` at `seq` with `value`: the bytes it was given.
    Put {
        /// The key.
        key: String,
        /// The seq it was put at.
        seq: u64,
        /// The value's bytes, as the sink holds them.
        value: Vec<u8>,
    },
    /// The sink removed `key` at `seq` and holds no value for it.
    Removed {
        /// The key.
        key: String,
        /// The seq it was removed at.
        seq: u64,
    },
}

impl Ahead {
    /// The key it changed.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            Ahead::Put { key, .. } | Ahead::Removed { key, .. } => key,
        }
    }

    /// The seq it was committed at.
    #[must_use]
    pub fn seq(&self) -> u64 {
        match self {
            Ahead::Put { seq, .. } | Ahead::Removed { seq, .. } => *seq,
        }
    }
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
    /// What `entry`, read from the source, says of this change: `None` when it is another
    /// change (a different seq or operation, or other bytes).
    pub(super) fn is(&self, entry: &Entry) -> Option<Confirmation> {
        if entry.seq != self.seq {
            return None;
        }
        let change = entry.op.cache_change();
        match &self.value {
            Claimed::Put(bytes) => (change == CacheChange::Upsert && entry.value == *bytes)
                .then_some(Confirmation::Confirmed),
            Claimed::Removed => (change == CacheChange::Remove).then_some(Confirmation::Confirmed),
            // The sink's bytes are unknown: the source's change at that seq is put again,
            // so the cache holds the source's bytes whatever the sink kept (a new history
            // that reused the seq, a forged value), and nothing is counted invalid.
            Claimed::Unknown => (change == CacheChange::Upsert).then_some(Confirmation::PutAgain),
        }
    }
}

impl<D: Decode> Follower<D> {
    /// Holds unconfirmed a change the sink already committed (a warm start): as
    /// [`claim`](Self::claim), and as committed, so a failed batch that goes back to the
    /// last commit still holds it (the sink does).
    pub(super) fn claim_committed(&mut self, key: &str, seq: u64, value: Claimed) {
        if self.claim(key, seq, value)
            && let Some(claim) = self.ahead.get(key)
        {
            self.committed_ahead.insert(key.to_owned(), claim.clone());
        }
    }

    /// Remembers the change an announcement (or a marker's fetch) just applied to `key` at
    /// `seq` as unconfirmed. A change that was stale (an older seq arriving late) changed
    /// nothing and claims nothing. Returns whether it remembered one.
    pub(super) fn claim(&mut self, key: &str, seq: u64, value: Claimed) -> bool {
        if self.index.newest(key) != Some(seq) || seq <= self.watermark {
            return false;
        }
        // The first change applied at a seq is what the cache holds: a later copy of it
        // (the real announcement after a forged one, or the reverse) changed nothing.
        // Except a put over a removal at its seq: a tombstone at a seq does not block the
        // put made there, so the put is what the cache holds now (seed 85220732: a replaced
        // history's removal, then the restored history's put at the same seq).
        let put_over_removal = |held: &Claim| {
            held.seq == seq
                && held.value == Claimed::Removed
                && matches!(value, Claimed::Put(_))
                && self.index.get(key) == Some(seq)
        };
        if self
            .ahead
            .get(key)
            .is_some_and(|held| held.seq >= seq && !put_over_removal(held))
        {
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

    /// What a read of the source at `source_watermark` says of each unconfirmed
    /// announcement it covers: `confirm(key, claim)` judges one claim, once. Due: what the
    /// read covers, and what it should have covered. A writer announces after it commits,
    /// so a read asked for after an announcement was applied reaches its seq, unless the
    /// source never made it (a foreign producer, another history): then no read ever
    /// would, and it must not stay in the cache for good. Changes nothing: the caller
    /// settles the verdicts ([`settle_ahead`](Self::settle_ahead)), or, when one is
    /// [`Unexplained`](Confirmation::Unexplained), leaves every claim for a snapshot.
    pub(super) fn judge_ahead(
        &self,
        source_watermark: u64,
        confirm: impl Fn(&str, &Claim) -> Confirmation,
    ) -> Vec<(String, Confirmation)> {
        let asked = self.read_asked;
        self.ahead
            .iter()
            .filter(|(_, c)| c.seq <= source_watermark || c.applied_at < asked)
            .map(|(key, c)| (key.clone(), confirm(key, c)))
            .collect()
    }

    /// Settles the verdicts of a read of the source at `source_watermark`
    /// ([`judge_ahead`](Self::judge_ahead), none of them
    /// [`Unexplained`](Confirmation::Unexplained)). What the read does not confirm is
    /// forgotten (its seq set to 0, its tombstone dropped), so the read's own answer
    /// replaces it.
    pub(super) fn settle_ahead(
        &mut self,
        source_watermark: u64,
        verdicts: Vec<(String, Confirmation)>,
    ) {
        self.known_source = self.known_source.max(source_watermark);
        for (key, verdict) in verdicts {
            let Some(claim) = self.ahead.remove(&key) else {
                continue;
            };
            match verdict {
                Confirmation::Confirmed => continue,
                // Held at seq 0, the key takes the read's put at the claim's seq (or, if
                // the read leaves it, is removed as unreplaced).
                Confirmation::PutAgain => {}
                Confirmation::Replaced | Confirmation::Unexplained => {
                    self.invalid(claim.seq, &key, InvalidReason::Unconfirmed);
                    self.index.untomb(&key);
                }
            }
            if self.index.get(&key).is_some() {
                self.index.set(key.as_str().into(), 0);
            }
        }
    }
}

/// What a read of the source says of an unconfirmed announcement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Confirmation {
    /// The read has the change at that seq, with the same operation and value.
    Confirmed,
    /// The read has a put at that seq, and what the sink holds there is not known: the
    /// read's put is applied again (not counted invalid).
    PutAgain,
    /// The read names the key with other changes (or the same seq with another value):
    /// they replace the announcement's.
    Replaced,
    /// The read does not name the key: the cache's older value for it is unknown.
    Unexplained,
}
