//! A snapshot read part by part ([`Input::SnapshotPart`](crate::Input::SnapshotPart)):
//! what a resync keeps while the parts pass — the keys they name, and only the entries that
//! differ from the cache — so that it holds what changed, not a second copy of the source,
//! and how the last part applies exactly what the whole snapshot would have. A snapshot of
//! a new history keeps every entry, but of one whose value the sink already holds (see
//! [`Cached`]) only its key and seq.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use super::cached::Cached;
use super::confirm::Confirmation;
use super::switch::Rest;
use super::{Follower, Pending};
use crate::decode::Decode;
use crate::entry::{Entry, Op};
use crate::follower::io::Token;
use crate::follower::status::Cause;
use crate::time::Time;

/// A resync whose parts are arriving.
#[derive(Debug)]
pub(super) struct Parts {
    /// The snapshot request's token.
    pub(super) token: Token,
    /// The watermark of the first part: every other must carry it.
    source_watermark: u64,
    /// The snapshot is of a new history (its watermark is below the follower's): every
    /// entry is kept, since the seqs held mean nothing against it.
    reset: bool,
    /// The keys named so far.
    seen: Seen,
    /// The entries the last part must see, in the order they came: every entry that
    /// differs from the index, names a key an announcement claims, carries an expiry,
    /// repeats a key, or is invalid.
    kept: Vec<Vec<Kept>>,
    /// The entries of a new history whose values the sink holds already: their keys
    /// (the index's own allocation) and seqs, in the order they came. At the switch they
    /// are restamped before any kept entry is put: a later put of the key then wins or is
    /// stale by seq, as it would be against the put they stand for.
    same: Vec<(Arc<str>, u64)>,
    /// What the entries passed so far say of the announcements held unconfirmed: the first
    /// verdict found for each key (the whole snapshot's `find_map`).
    found: BTreeMap<String, Confirmation>,
    /// The highest seq named so far.
    top: u64,
    /// An entry named a key at a lower seq than the cache holds it at, at or below the
    /// snapshot's watermark: the snapshot is of another history (see
    /// [`Follower::went_back`]).
    went_back: bool,
}

/// An entry kept for the last part. A plain put (the whole of a new history, nearly) is
/// kept as what applying it reads — key, seq, value: 48 bytes beside its value, not an
/// [`Entry`]'s 128 (at 1M keys, 76 MiB less held until the switch) — and any other
/// entry whole.
#[derive(Debug)]
pub(super) enum Kept {
    Put {
        key: Arc<str>,
        seq: u64,
        value: Vec<u8>,
    },
    Other(Box<Entry>),
}

impl From<Entry> for Kept {
    fn from(entry: Entry) -> Self {
        // What a snapshot's apply reads of an entry: its key, seq, op, value and expiry
        // (a feed's position, pending count and stamp mean nothing in a snapshot).
        if entry.op == Op::Put && entry.expires_in.is_none() {
            let Entry {
                key, seq, value, ..
            } = entry;
            Kept::Put { key, seq, value }
        } else {
            Kept::Other(Box::new(entry))
        }
    }
}

impl Kept {
    fn key(&self) -> &str {
        match self {
            Kept::Put { key, .. } => key,
            Kept::Other(entry) => &entry.key,
        }
    }

    pub(super) fn into_entry(self) -> Entry {
        match self {
            Kept::Put { key, seq, value } => Entry::put(seq, key, value),
            Kept::Other(entry) => *entry,
        }
    }
}

/// The keys a snapshot named, to tell at its end which cached keys are gone. Parts in key
/// order (every source's) are kept in a sorted vector of the keys, 16 bytes a key sharing
/// the index's own allocation where the entry is dropped; any other order falls back to a
/// set.
#[derive(Debug)]
enum Seen {
    Sorted(Vec<Arc<str>>),
    Set(HashSet<Arc<str>, foldhash::fast::FixedState>),
}

impl Seen {
    /// Records `key`; `false` when it was named before.
    fn insert(&mut self, key: Arc<str>) -> bool {
        match self {
            Seen::Sorted(keys) => match keys.last() {
                Some(last) if **last == *key => false,
                Some(last) if **last > *key => {
                    let mut set: HashSet<Arc<str>, _> =
                        HashSet::with_capacity_and_hasher(keys.len() + 1, Default::default());
                    set.extend(keys.drain(..));
                    let new = set.insert(key);
                    *self = Seen::Set(set);
                    new
                }
                _ => {
                    keys.push(key);
                    true
                }
            },
            Seen::Set(keys) => keys.insert(key),
        }
    }

    fn contains(&self, key: &str) -> bool {
        match self {
            Seen::Sorted(keys) => keys.binary_search_by(|k| (**k).cmp(key)).is_ok(),
            Seen::Set(keys) => keys.contains(key),
        }
    }
}

impl<D: Decode> Follower<D> {
    /// A part of the snapshot asked for under `token` arrived.
    pub(super) fn on_snapshot_part(
        &mut self,
        token: Token,
        entries: Vec<Entry>,
        source_watermark: u64,
        now: Time,
        cached: Option<&dyn Cached<D::Value>>,
    ) {
        if !self.snapshot_outstanding(token) {
            self.counters.ignored += 1;
            return;
        }
        let parts = match self.parts.take() {
            Some(parts) if parts.token == token => parts,
            _ => {
                let reset = self.snapshot_is_new(source_watermark, self.read_lineage(token));
                // The snapshot names about as many keys as the cache holds: room for them
                // at once, not a regrowth that holds one and a half times as much.
                let keys = self.index.len();
                Box::new(Parts {
                    token,
                    source_watermark,
                    reset,
                    seen: Seen::Sorted(Vec::with_capacity(keys)),
                    // A new history keeps every entry, or where the sink says what it
                    // holds, about every key and seq.
                    kept: Vec::new(),
                    same: Vec::with_capacity(if reset && cached.is_some() { keys } else { 0 }),
                    found: BTreeMap::new(),
                    top: source_watermark,
                    went_back: false,
                })
            }
        };
        let Some(mut parts) = self.same_point(parts, source_watermark, now) else {
            return;
        };
        self.absorb(&mut parts, entries, cached);
        self.parts = Some(parts);
    }

    /// Whether parts of the snapshot asked for under `token` were kept: its
    /// [`Input::Snapshot`](crate::Input::Snapshot) is then the last part.
    pub(super) fn has_parts(&self, token: Token) -> bool {
        self.snapshot_outstanding(token) && self.parts.as_ref().is_some_and(|p| p.token == token)
    }

    /// The last part of a snapshot read in parts ([`has_parts`](Self::has_parts)).
    pub(super) fn on_last_part(
        &mut self,
        entries: Vec<Entry>,
        source_watermark: u64,
        now: Time,
        cached: Option<&dyn Cached<D::Value>>,
    ) {
        let Some(parts) = self.parts.take() else {
            return;
        };
        let Some(mut parts) = self.same_point(parts, source_watermark, now) else {
            return;
        };
        self.request = None;
        self.backoffs.failure.healthy(now);
        self.absorb(&mut parts, entries, cached);
        if self.read_again_as_new(&parts) {
            return;
        }
        self.finish_parts(*parts);
    }

    /// A snapshot read as the history followed turned out to be another's (a key went
    /// back; decided at its last part, as every other decision of a snapshot read in
    /// parts): what was kept is dropped (entries passed over as unchanged may be another
    /// history's at the same seq) and the snapshot read again, to replace the cache.
    fn read_again_as_new(&mut self, parts: &Parts) -> bool {
        if !parts.went_back || parts.reset {
            return false;
        }
        self.history_went_back();
        self.parts = None;
        self.send(Pending::Snapshot);
        true
    }

    fn snapshot_outstanding(&self, token: Token) -> bool {
        matches!(self.request, Some((t, Pending::Snapshot)) if t == token)
    }

    /// `parts` back when `source_watermark` is theirs; otherwise the parts came from
    /// different points in time, and no cache built from them is the source's: what was
    /// kept is dropped and the snapshot read again after the failure backoff.
    fn same_point(
        &mut self,
        parts: Box<Parts>,
        source_watermark: u64,
        now: Time,
    ) -> Option<Box<Parts>> {
        if parts.source_watermark == source_watermark {
            return Some(parts);
        }
        let error = format!(
            "snapshot parts from different points in time: watermark {} then {source_watermark}",
            parts.source_watermark
        );
        drop(parts);
        self.request = None;
        self.schedule_retry(Pending::Snapshot, Cause::RequestFailed, error, now);
        None
    }

    /// Takes a part's entries in: records their keys and keeps those the last part must
    /// see. An entry dropped here is one the whole snapshot would have passed over (the
    /// index holds the key at its seq), and its key is recorded with the index's own
    /// allocation, so the entry is freed whole. So is an entry of a new history whose
    /// value `cached` holds for its key (the first named of its key), its seq kept.
    fn absorb(
        &mut self,
        parts: &mut Parts,
        entries: Vec<Entry>,
        cached: Option<&dyn Cached<D::Value>>,
    ) {
        // The part's own list: freed as soon as the switch has decided it.
        let mut kept = Vec::new();
        for entry in entries {
            parts.top = parts.top.max(entry.seq);
            let claim = self.ahead.get(&*entry.key);
            // One lookup of the key for both questions: this is a resync's hot path.
            let found = self.index.seqs.get_key_value(&*entry.key);
            parts.went_back |= claim.is_none()
                && super::lineage::went_back(
                    found.map(|(_, seq)| *seq),
                    entry.seq,
                    parts.source_watermark,
                );
            if let Some(claim) = claim
                && !parts.found.contains_key(&*entry.key)
                && let Some(verdict) = claim.is(&entry)
            {
                parts.found.insert(entry.key.to_string(), verdict);
            }
            // An announced key is settled by the snapshot's entry itself, put as it is.
            if parts.reset
                && claim.is_none()
                && let Some(cached) = cached
                && self.same_as_cached(&entry, cached)
            {
                let key = found.map_or_else(|| Arc::clone(&entry.key), |(k, _)| Arc::clone(k));
                if parts.seen.insert(Arc::clone(&key)) {
                    parts.same.push((key, entry.seq));
                    continue;
                }
                kept.push(Kept::from(entry));
                continue;
            }
            // An expiring value is kept: the index may drop its key before the last part
            // (the expiry comes due), and the whole snapshot would then put it again.
            let unchanged = !parts.reset
                && !self.unconfirmed
                && claim.is_none()
                && entry.seq != 0
                && entry.op == Op::Put
                && entry.expires_in.is_none();
            let held = found
                .filter(|(_, seq)| unchanged && **seq == entry.seq)
                .map(|(key, _)| Arc::clone(key));
            // A repeated key is kept even when unchanged: an earlier entry of it may
            // change the index before this one is looked at.
            let dropped = match held {
                Some(key) => parts.seen.insert(key),
                None => {
                    parts.seen.insert(Arc::clone(&entry.key));
                    false
                }
            };
            if !dropped {
                kept.push(Kept::from(entry));
            }
        }
        if !kept.is_empty() {
            parts.kept.push(kept);
        }
    }

    /// The parts are all in: the cache becomes what the whole snapshot would have made it.
    fn finish_parts(&mut self, parts: Parts) {
        let Parts {
            source_watermark,
            reset,
            seen,
            kept,
            same,
            found,
            top,
            ..
        } = parts;
        let verdicts = self.judge_ahead(source_watermark, |key, _| {
            found.get(key).copied().unwrap_or(Confirmation::Replaced)
        });
        drop(found);
        self.settle_ahead(source_watermark, verdicts);
        self.reset_if_new(source_watermark, reset);
        let gone = self.gone(source_watermark, |key| seen.contains(key));
        drop(seen);
        let kept = Rest::Parts {
            parts: kept.into_iter(),
            part: Vec::new().into_iter(),
        };
        self.apply_snapshot(kept, same, gone, (source_watermark, top));
    }

    /// The index changed between parts (`key` expired, or keys were learned): what was
    /// kept may no longer be what the last part needs, so it is dropped and the snapshot
    /// asked for again under a new token (the old one's parts are ignored). An expiry of a
    /// key whose part has not come, or whose entry was kept, changes nothing kept.
    pub(super) fn parts_disturbed(&mut self, key: Option<&str>) {
        let Some(parts) = &self.parts else { return };
        // A new history's entry standing for the value the sink holds is disturbed when
        // that value goes: it must be put whole.
        let harmless = key.is_some_and(|key| {
            if parts.reset {
                !parts.same.iter().any(|(k, _)| **k == *key)
            } else {
                !parts.seen.contains(key) || parts.kept.iter().flatten().any(|e| e.key() == key)
            }
        });
        if !harmless && self.snapshot_outstanding(parts.token) {
            self.send(Pending::Snapshot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_put_is_its_key_seq_and_value_and_no_more() {
        assert_eq!(
            std::mem::size_of::<Kept>(),
            48,
            "a kept put costs 48 bytes beside its value, not an Entry's {}",
            std::mem::size_of::<Entry>()
        );
        let mut e = Entry::put(7, "k", "v");
        e.stamp = Some(3);
        e.pending = Some(9);
        assert!(
            matches!(Kept::from(e.clone()), Kept::Put { .. }),
            "a plain put is kept without its Entry"
        );
        let back = Kept::from(e.clone()).into_entry();
        assert_eq!(
            (back.seq, back.key, back.op, back.value),
            (7, e.key, Op::Put, e.value)
        );
        let mut expiring = Entry::put(8, "k", "v");
        expiring.expires_in = Some(std::time::Duration::from_secs(1));
        assert_eq!(
            Kept::from(expiring.clone()).into_entry(),
            expiring,
            "kept whole"
        );
    }
}
