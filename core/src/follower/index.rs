//! The key index: the seq of every key the cache holds, the removals applied above the
//! watermark, and — when the driver commits batches — how to undo what the last batch did.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::time::Time;

// Hashed with foldhash seeded from the follower's configured seed: the same on every run
// (std's `RandomState` reads OS randomness), keyed per follower, and a fraction of
// SipHash's cost on the sync hot path. Nothing iterates it into an output without sorting
// first. Keys are the entries' own `Arc<str>`: the index, the cache and the feed share one
// allocation per key rather than copying it (the follower_task bench).
pub(super) type Map = HashMap<Arc<str>, u64, foldhash::fast::FixedState>;

/// One change to the index, recorded so that it can be undone.
#[derive(Debug)]
pub(super) enum Step {
    /// `key` held `seq` (`None`: it was absent).
    Seq(Arc<str>, Option<u64>),
    /// `key`'s tombstone was `seq` (`None`: it had none).
    Tomb(Arc<str>, Option<u64>),
    /// An expiry (when, key, seq) was consumed.
    Expiry(Time, Arc<str>, u64),
}

#[derive(Debug)]
pub(super) struct KeyIndex {
    /// Key → seq of its value in the cache.
    pub(super) seqs: Map,
    /// Removals applied above the watermark (announcements): a late, older put for such a
    /// key must not bring it back. Pruned as the watermark passes them.
    pub(super) tombstones: BTreeMap<Arc<str>, u64>,
    /// Keys the sink holds that this index was not told about: a warm start that loads
    /// seqs lazily ([`Follower::resume_lazily`](super::Follower::resume_lazily)).
    pub(super) unknown: usize,
    /// Steps since the last commit, when the driver commits batches.
    pub(super) undo: Option<Vec<Step>>,
    /// Whether the index was empty at the last commit (an initial sync's batch): going
    /// back empties it, so no step is recorded (a step per key was a tenth of a cold
    /// start's CPU into a persisted cache).
    pub(super) from_empty: bool,
    /// When values expire (a source that drops aged values silently): (when, key, seq).
    /// An entry whose key no longer holds that seq is dropped when it comes due.
    pub(super) expiries: BTreeSet<(Time, Arc<str>, u64)>,
    /// How many keys an initial sync into an empty index has made room for so far, from
    /// the feed's pending counts (0: none).
    pub(super) presized: usize,
}

impl KeyIndex {
    pub(super) fn new(seed: u64) -> Self {
        KeyIndex {
            seqs: Map::with_hasher(foldhash::fast::FixedState::with_seed(seed)),
            tombstones: BTreeMap::new(),
            unknown: 0,
            undo: None,
            from_empty: false,
            expiries: BTreeSet::new(),
            presized: 0,
        }
    }

    /// Keys the cache holds, known or not.
    pub(super) fn len(&self) -> usize {
        self.seqs.len().saturating_add(self.unknown)
    }

    pub(super) fn get(&self, key: &str) -> Option<u64> {
        self.seqs.get(key).copied()
    }

    /// The seq of the newest change the cache reflects for `key`: its value, or a removal
    /// applied above the watermark.
    pub(super) fn newest(&self, key: &str) -> Option<u64> {
        let held = self.get(key);
        if self.tombstones.is_empty() {
            return held;
        }
        held.max(self.tombstones.get(key).copied())
    }

    /// Learns what the sink holds of a key it did not know: not a change, so nothing to
    /// undo. A key it knows keeps its seq: the index has every change since (the sink is
    /// asked only between commits), and a seq it set aside (0: a read replaced it, a new
    /// history forgot it) must not come back. Returns whether the key was new to it.
    pub(super) fn learn(&mut self, key: String, seq: u64) -> bool {
        if self.seqs.contains_key(key.as_str()) {
            return false;
        }
        self.seqs.insert(key.into(), seq);
        self.unknown = self.unknown.saturating_sub(1);
        // What the sink holds is no change to undo: the index is no longer empty under it.
        self.from_empty = false;
        true
    }

    /// Learns that the sink removed `key` at `seq` (what it holds, not a change: nothing
    /// to undo). A tombstone it has at a higher seq stays.
    pub(super) fn learn_removed(&mut self, key: &str, seq: u64) {
        let tomb = self.tombstones.entry(key.into()).or_insert(0);
        *tomb = (*tomb).max(seq);
        self.from_empty = false;
    }

    /// Whether steps are recorded for undo.
    pub(super) fn tracking(&self) -> bool {
        self.undo.is_some() && !self.from_empty
    }

    /// Records that `key` held `before` (for undo), when the driver commits batches.
    pub(super) fn record(&mut self, key: &Arc<str>, before: Option<u64>) {
        if let Some(undo) = steps(&mut self.undo, self.from_empty) {
            undo.push(Step::Seq(Arc::clone(key), before));
        }
    }

    /// Sets `key`'s seq (off the apply hot path, which writes in place).
    pub(super) fn set(&mut self, key: Arc<str>, seq: u64) {
        let before = self.seqs.insert(Arc::clone(&key), seq);
        self.record(&key, before);
    }

    pub(super) fn remove(&mut self, key: &str) -> Option<u64> {
        let (key, before) = self.seqs.remove_entry(key)?;
        self.record(&key, Some(before));
        Some(before)
    }

    pub(super) fn tomb(&mut self, key: &Arc<str>, seq: u64) {
        let before = self.tombstones.insert(Arc::clone(key), seq);
        if let Some(undo) = steps(&mut self.undo, self.from_empty) {
            undo.push(Step::Tomb(Arc::clone(key), before));
        }
    }

    pub(super) fn untomb(&mut self, key: &str) {
        if let Some((key, before)) = self.tombstones.remove_entry(key)
            && let Some(undo) = steps(&mut self.undo, self.from_empty)
        {
            undo.push(Step::Tomb(key, Some(before)));
        }
    }

    /// Drops tombstones the watermark has passed.
    pub(super) fn prune_tombstones(&mut self, watermark: u64) {
        if self.tombstones.is_empty() {
            return;
        }
        match steps(&mut self.undo, self.from_empty) {
            None => self.tombstones.retain(|_, s| *s > watermark),
            Some(undo) => self.tombstones.retain(|k, s| {
                let keep = *s > watermark;
                if !keep {
                    undo.push(Step::Tomb(Arc::clone(k), Some(*s)));
                }
                keep
            }),
        }
    }

    /// Forgets the seq of every key (a new history): each stays held at seq 0, so a
    /// snapshot replaces or removes it.
    pub(super) fn forget_seqs(&mut self) {
        for (key, seq) in &mut self.seqs {
            if let Some(undo) = steps(&mut self.undo, self.from_empty) {
                undo.push(Step::Seq(Arc::clone(key), Some(*seq)));
            }
            *seq = 0;
        }
        let tombs = std::mem::take(&mut self.tombstones);
        if let Some(undo) = steps(&mut self.undo, self.from_empty) {
            undo.extend(tombs.into_iter().map(|(k, s)| Step::Tomb(k, Some(s))));
        }
    }

    /// The earliest expiry, if any.
    pub(super) fn next_expiry(&self) -> Option<Time> {
        self.expiries.first().map(|(at, _, _)| *at)
    }

    /// Takes the expiries due at `now`: the (key, seq) of each, in expiry order.
    pub(super) fn take_expired(&mut self, now: Time) -> Vec<(Arc<str>, u64)> {
        let mut due = Vec::new();
        while self.expiries.first().is_some_and(|(at, _, _)| *at <= now) {
            let Some((at, key, seq)) = self.expiries.pop_first() else {
                break;
            };
            if let Some(undo) = steps(&mut self.undo, self.from_empty) {
                undo.push(Step::Expiry(at, Arc::clone(&key), seq));
            }
            due.push((key, seq));
        }
        due
    }

    /// Starts or stops recording steps for [`rewind`](Self::rewind).
    pub(super) fn track(&mut self, on: bool) {
        self.undo = on.then(Vec::new);
        self.from_empty = on && self.holds_nothing();
    }

    /// The batch was committed: its steps need no undo.
    pub(super) fn commit(&mut self) {
        if let Some(undo) = &mut self.undo {
            undo.clear();
            self.from_empty = self.holds_nothing();
        }
    }

    /// The sink holds `held` keys it was not told about (a lazy warm start, before any
    /// change).
    pub(super) fn hold_unknown(&mut self, held: usize) {
        self.unknown = held;
        self.from_empty &= held == 0;
    }

    /// Whether it holds nothing an undo would have to give back: no key (known or not),
    /// no tombstone, no expiry.
    fn holds_nothing(&self) -> bool {
        self.seqs.is_empty()
            && self.unknown == 0
            && self.tombstones.is_empty()
            && self.expiries.is_empty()
    }

    /// Undoes every step since the last commit. `false` when steps were not recorded.
    pub(super) fn rewind(&mut self) -> bool {
        let Some(undo) = &mut self.undo else {
            return false;
        };
        if self.from_empty {
            // The batch began on an empty index: what it left goes, expiries included.
            undo.clear();
            self.seqs.clear();
            self.tombstones.clear();
            self.expiries.clear();
            return true;
        }
        for step in std::mem::take(undo).into_iter().rev() {
            match step {
                Step::Seq(key, Some(seq)) => {
                    self.seqs.insert(key, seq);
                }
                Step::Seq(key, None) => {
                    self.seqs.remove(&*key);
                }
                Step::Tomb(key, Some(seq)) => {
                    self.tombstones.insert(key, seq);
                }
                Step::Tomb(key, None) => {
                    self.tombstones.remove(&*key);
                }
                Step::Expiry(at, key, seq) => {
                    self.expiries.insert((at, key, seq));
                }
            }
        }
        true
    }
}

/// The steps to record into: none when nothing is tracked, or when the batch began on an
/// empty index (its undo empties it).
fn steps(undo: &mut Option<Vec<Step>>, from_empty: bool) -> Option<&mut Vec<Step>> {
    undo.as_mut().filter(|_| !from_empty)
}
