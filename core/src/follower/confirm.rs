//! Announcements applied ahead of the source, and how a later read of the source confirms
//! or replaces them (a foreign or corrupt producer's change must not stay in the cache).

use super::Follower;
use crate::decode::Decode;
use crate::follower::io::Follow;
use crate::follower::status::InvalidReason;

impl<D: Decode> Follower<D> {
    /// Remembers `key`'s newest change as unconfirmed, if an announcement applied it: one
    /// that was stale (an older seq arriving late) changed nothing and confirms nothing.
    pub(super) fn remember_ahead(&mut self, key: String) {
        if let Some(seq) = self.index.newest(&key)
            && seq > self.known_source.max(self.watermark)
        {
            let reads = self.reads;
            let held = self.ahead.entry(key).or_insert((seq, reads));
            *held = (held.0.max(seq), reads);
        }
    }

    /// For an announcement at `seq` above what the source is known to have reached:
    /// the key to remember as unconfirmed, until a read of the source covers the seq.
    pub(super) fn note_ahead(&self, key: &str, seq: u64) -> Option<String> {
        (self.follow == Follow::Announcements && seq > self.known_source.max(self.watermark))
            .then(|| key.to_owned())
    }

    /// Checks the unconfirmed announcements a read of the source at `source_watermark`
    /// covers: `confirm(key, seq)` says whether the read has that change. What the read
    /// does not confirm is forgotten (its seq set to 0, its tombstone dropped), so the
    /// read's own answer replaces it. Returns whether some key was not named by the read
    /// at all (then only a snapshot can say what it holds).
    pub(super) fn confirm_ahead(
        &mut self,
        source_watermark: u64,
        confirm: impl Fn(&str, u64) -> Confirmation,
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
        let due: Vec<(String, u64)> = self
            .ahead
            .iter()
            .filter(|(_, (seq, applied_at))| *seq <= source_watermark || *applied_at < asked)
            .map(|(k, (s, _))| (k.clone(), *s))
            .collect();
        let mut unexplained = false;
        for (key, seq) in due {
            self.ahead.remove(&key);
            let verdict = confirm(&key, seq);
            if verdict == Confirmation::Confirmed {
                continue;
            }
            self.invalid(seq, &key, InvalidReason::Unconfirmed);
            if self.index.get(&key).is_some() {
                self.index.set(key.as_str().into(), 0);
            }
            self.index.untomb(&key);
            unexplained |= verdict == Confirmation::Unexplained;
        }
        unexplained
    }
}

/// What a read of the source says of an unconfirmed announcement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Confirmation {
    /// The read has the change at that seq.
    Confirmed,
    /// The read names the key with other changes: they replace the announcement's.
    Replaced,
    /// The read does not name the key: the cache's older value for it is unknown.
    Unexplained,
}
