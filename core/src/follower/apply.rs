//! How feed entries, reconciles, snapshots and fetches change the cache: the per-seq and
//! per-key rules, gaps, and the watermark.

use std::collections::HashSet;
use std::collections::hash_map::Entry as Slot;
use std::sync::Arc;
use std::time::Duration;

use super::confirm::{Claim, Claimed, Confirmation};
use super::switch::{Rest, Switch};
use super::{Follower, Held, Pending};
use crate::decode::Decode;
use crate::entry::{CacheChange, Entry, Op};
use crate::follower::io::{Apply, CaughtUp, Follow, Notice, Output};
use crate::follower::status::{Diagnostic, InvalidReason};

/// Reads of a marker's key, each older than the marker, after which the marker is taken
/// for one the source never made (a replica behind catches up within a few backoffs).
const STALE_FETCHES: u32 = 3;
use crate::limits::KeyProblem;
use crate::time::Time;

impl<D: Decode> Follower<D> {
    pub(super) fn on_item(&mut self, item: Held) {
        match item {
            Held::Entry(entry) => self.on_entry(entry),
            Held::Undecodable {
                position,
                seq,
                reason,
            } => self.on_undecodable(position, seq, reason),
            Held::Head(head) => self.raise_head(head),
            Held::Refetch {
                key,
                seq,
                position,
                stale,
            } => self.refetch(key, seq, position, stale),
        }
    }

    /// A marker held behind the read of the whole source its stale fetch asked for (see
    /// [`on_fetched`](Self::on_fetched)): that read reached the watermark, and the cache
    /// holds every change the source made up to it, so a marker at or below it is settled
    /// by it whatever its key holds — the change it announced was read, or this history
    /// never made it (a marker of a history the source no longer serves). Above it, the key
    /// is fetched again.
    fn refetch(&mut self, key: String, seq: u64, position: u64, stale: u32) {
        if seq <= self.watermark {
            self.counters.stale += 1;
            self.checkpoint(position);
            return;
        }
        self.send(Pending::Fetch {
            key,
            seq,
            position,
            stale,
        });
    }

    /// The feed's head moved up: until the follower is ready, it must reach the new head
    /// too (never lowered: a head only says how far the initial sync must read).
    fn raise_head(&mut self, head: u64) {
        if self.is_ready() {
            return;
        }
        if let Some(info) = self.feed.as_mut().and_then(|f| f.info.as_mut()) {
            info.head = info.head.max(head);
        }
    }

    /// Something that is not an entry: counted and checkpointed past; where its seq is
    /// known it is skipped over like a poison entry (a gap first, on a gapless feed).
    pub(super) fn on_undecodable(&mut self, position: u64, seq: Option<u64>, reason: String) {
        if let Some(seq) = seq
            && self.gapless()
            && seq > self.watermark.saturating_add(1)
        {
            self.gap(seq);
            return;
        }
        self.invalid(seq.unwrap_or(0), "", InvalidReason::Undecodable(reason));
        if let Some(seq) = seq
            && seq > self.watermark
        {
            self.advance_on_feed(seq);
        }
        self.checkpoint(position);
        if let Some(head) = self.feed_head() {
            self.check_ready(head);
        }
    }

    pub(super) fn gap(&mut self, seq: u64) {
        self.counters.gaps += 1;
        self.diag(Diagnostic::Gap {
            expected: self.watermark.saturating_add(1),
            got: seq,
        });
        self.drop_feed();
        if self.busy() {
            self.rewake = true;
        } else {
            self.send(Pending::Reconcile);
        }
    }

    pub(super) fn on_entry(&mut self, entry: Entry) {
        let Entry {
            position,
            seq,
            key,
            op,
            value,
            pending,
            expires_in,
            stamp,
        } = entry;
        if let Some(pending) = pending
            && !self.is_ready()
            && self.index.seqs.len() >= self.index.seqs.capacity()
        {
            self.presize(pending);
        }
        if seq == 0 {
            self.invalid(0, &key, InvalidReason::ZeroSeq);
            self.checkpoint(position);
            return;
        }
        let (last_seq, head) = match self.feed.as_mut() {
            Some(f) => {
                let last = f.last_seq;
                f.last_seq = f.last_seq.max(seq);
                (last, f.info.map_or(0, |i| i.head))
            }
            None => (0, 0),
        };
        if seq <= self.watermark {
            if seq == self.watermark && self.feed_of_another_history(stamp) {
                return;
            }
            if seq < last_seq {
                self.diag(Diagnostic::SeqRegressed {
                    previous: last_seq,
                    got: seq,
                });
            }
            self.counters.stale += 1;
            self.checkpoint(position);
            return;
        }
        if seq > self.watermark.saturating_add(1) && self.gapless() {
            self.gap(seq);
            return;
        }
        if self.feed_speaks_for_source() {
            self.note_stamp(seq, stamp);
        }
        if !self.keeps(&key) {
            // Not ours (an announcement of another part of the source, an unfiltered
            // feed): passed like a stale entry, and the watermark moves past it.
            self.counters.outside += 1;
            self.advance_on_feed(seq);
            self.checkpoint(position);
            self.check_ready(head);
            return;
        }
        if self.follow == Follow::Announcements {
            let known = self.known_source.max(self.watermark);
            if seq.saturating_sub(known) > self.config.max_ahead {
                self.invalid(seq, &key, InvalidReason::SeqAhead { known });
                self.checkpoint(position);
                return;
            }
        }
        if op == Op::Mutation && self.check_key(&key).is_ok() && !self.newer_in_cache(&key, seq) {
            let key = key.to_string();
            self.send(Pending::Fetch {
                key,
                seq,
                position,
                stale: 0,
            });
            return;
        }
        // An announcement claims a change; a read of the source must confirm it, down to
        // its value (a forged event can copy a real change's key and seq).
        // (A marker that reaches here is stale, and an unknown operation a skip: neither
        // changes the cache, so neither claims anything.)
        // Only announcements pay for this: a replayed feed's hot path copies nothing.
        let claim = if self.holds_unconfirmed(seq) {
            match op.cache_change() {
                CacheChange::Upsert => Some(Claimed::Put(value.clone())),
                CacheChange::Remove => Some(Claimed::Removed),
                CacheChange::Fetch | CacheChange::Skip => None,
            }
            .map(|claimed| (key.clone(), claimed))
        } else {
            None
        };
        let (puts, _) = self.apply(seq, key, op, value, expires_in);
        // A put that was stale changed nothing, and claims nothing.
        let claimed = claim.is_some_and(|(key, claimed)| {
            (puts > 0 || claimed == Claimed::Removed) && self.claim(&key, seq, claimed)
        });
        self.advance_on_feed(seq);
        self.checkpoint(position);
        self.check_ready(head);
        if claimed {
            self.confirm_soon();
        }
    }

    pub(super) fn advance(&mut self, seq: u64) {
        if seq > self.watermark {
            self.watermark = seq;
            self.index.prune_tombstones(seq);
        }
    }

    /// A feed entry at `seq` was handled. Feeds that deliver in seq order move the
    /// watermark; an announcements stream can reorder and lose entries, so there only a
    /// reconcile moves it, and per-key seqs (with tombstones) keep applies never-older.
    pub(super) fn advance_on_feed(&mut self, seq: u64) {
        if self.feed_speaks_for_source() {
            self.advance(seq);
        }
    }

    /// Makes room in the key index for the `pending` entries the feed says are still to
    /// come in an initial sync: first in an empty index
    /// ([`presize_for`](crate::presize_for) says how many), then each time that room is
    /// full ([`presize_more`](crate::presize_more)).
    pub(super) fn presize(&mut self, pending: u64) {
        let index = &mut self.index;
        let held = index.seqs.len();
        let want = if index.presized == 0 {
            if index.len() > 0 {
                // A warm start or a resync: the index already has its size.
                return;
            }
            crate::limits::presize_for(pending)
        } else {
            crate::limits::presize_more(pending, held)
        };
        index.seqs.reserve(want);
        index.presized = held.saturating_add(want);
    }

    pub(super) fn invalid(&mut self, seq: u64, key: &str, reason: InvalidReason) {
        self.counters.invalid += 1;
        let key = if key.len() > 128 {
            crate::limits::shorten(key, 128)
        } else {
            key.to_owned()
        };
        self.diag(Diagnostic::InvalidEntry { seq, key, reason });
    }

    pub(super) fn check_key(&self, key: &str) -> Result<(), InvalidReason> {
        crate::limits::check_key(key, self.config.max_key_bytes).map_err(|p| match p {
            KeyProblem::Empty => InvalidReason::EmptyKey,
            KeyProblem::TooLong { len } => InvalidReason::KeyTooLong { len },
            KeyProblem::ControlCharacter => InvalidReason::ControlCharacterInKey,
        })
    }

    pub(super) fn newer_in_cache(&self, key: &str, seq: u64) -> bool {
        self.index.newest(key).is_some_and(|s| s >= seq)
    }

    /// Applies one change above the watermark, with the per-key never-older rule.
    /// Returns (puts applied, removals applied).
    pub(super) fn apply(
        &mut self,
        seq: u64,
        key: Arc<str>,
        op: Op,
        value: Vec<u8>,
        expires_in: Option<Duration>,
    ) -> (usize, usize) {
        if !self.keeps(&key) {
            self.counters.outside += 1;
            return (0, 0);
        }
        if let Err(reason) = self.check_key(&key) {
            self.invalid(seq, &key, reason);
            return (0, 0);
        }
        match op.cache_change() {
            CacheChange::Upsert => {
                let expiring =
                    expires_in.map(|ttl| (self.now.saturating_add(ttl), Arc::clone(&key)));
                let applied = self.apply_put(seq, key, value);
                if applied.0 == 1
                    && let Some((at, key)) = expiring
                {
                    self.index.expiries.insert((at, key, seq));
                }
                applied
            }
            CacheChange::Remove => {
                if self.newer_in_cache(&key, seq) {
                    self.counters.stale += 1;
                    return (0, 0);
                }
                if self.follow == Follow::Announcements && seq > self.watermark {
                    self.index.tomb(&key, seq);
                }
                if self.index.remove(&key).is_none() {
                    return (0, 0);
                }
                self.counters.removed += 1;
                self.out
                    .push_back(Output::Apply(Apply::Remove { key, seq }));
                (0, 1)
            }
            CacheChange::Fetch => {
                self.invalid(seq, &key, InvalidReason::UnexpectedInRows);
                (0, 0)
            }
            CacheChange::Skip => {
                let Op::Unknown(name) = op else { return (0, 0) };
                self.invalid(seq, &key, InvalidReason::UnknownOperation(name));
                (0, 0)
            }
        }
    }

    pub(super) fn apply_put(&mut self, seq: u64, key: Arc<str>, value: Vec<u8>) -> (usize, usize) {
        if value.len() > self.config.max_value_bytes {
            self.invalid(seq, &key, InvalidReason::ValueTooLarge { len: value.len() });
            return (0, 0);
        }
        // Strictly newer: a put and a removal never share a seq, but a marker's fetch that
        // found nothing leaves a tombstone at the marker's seq, which must not block the
        // put made at that seq (a replica that had not seen it yet).
        if !self.index.tombstones.is_empty() && self.index.tombstones.get(&*key) > Some(&seq) {
            self.counters.stale += 1;
            return (0, 0);
        }
        // One hash lookup, whether the index holds the key or not (a new key's slot is
        // filled in place once its value decodes): this is the hot path of every sync.
        let slot = self.index.seqs.entry(Arc::clone(&key));
        if let Slot::Occupied(held) = &slot
            && *held.get() >= seq
        {
            self.counters.stale += 1;
            return (0, 0);
        }
        match self.decoder.decode(&key, value) {
            Ok(value) => {
                let before = match slot {
                    Slot::Occupied(mut held) => Some(held.insert(seq)),
                    Slot::Vacant(free) => {
                        free.insert(seq);
                        None
                    }
                };
                if self.index.tracking() {
                    self.index.record(&key, before);
                }
                if !self.index.tombstones.is_empty() {
                    self.index.untomb(&key);
                }
                self.counters.applied += 1;
                self.out
                    .push_back(Output::Apply(Apply::Put { key, seq, value }));
                (1, 0)
            }
            Err(e) => {
                self.counters.poison += 1;
                let error = e.to_string();
                let key = key.to_string();
                self.diag(Diagnostic::DecodeFailed { key, seq, error });
                (0, 0)
            }
        }
    }

    /// A marker's fetch came back: `seq` is the marker's, `stale` how many reads of the
    /// key before this one were older than it; `value` what the read found, and the
    /// source's watermark then where the driver knows it.
    pub(super) fn on_fetched(
        &mut self,
        key: String,
        (seq, stale): (u64, u32),
        position: u64,
        (value, source_watermark): (Option<(u64, Vec<u8>)>, Option<u64>),
        now: Time,
    ) {
        // How far the read had got: a value's own seq, or for an absent key the source's
        // watermark. A source behind the marker cannot show its change, and an absent key
        // there is no removal after it (seed 93041109: a marker of a history a restore
        // replaced, read from the restored source, was held as a removal past the
        // follower's watermark that no history made).
        let read_at = match &value {
            Some((value_seq, _)) => Some(*value_seq),
            None => source_watermark,
        };
        if let Some(read_at) = read_at
            && read_at < seq
        {
            let announcements = self.follow == Follow::Announcements;
            // A source whose head is behind the marker (or the follower's own watermark)
            // is no replica catching up with it: a writer announces after it commits, so
            // the history the source serves never made the marker's change (the marker is
            // another history's, or the source lost its newest entries), and only a read
            // of the whole source settles that. Waiting out the stale reads first, under a
            // backoff grown by the outage that hid the restore, took longer than a minute
            // (seed 2282: the restored source never reached the replaced history's marker
            // at 161, its writers having stopped at 158); and three reads a marker, each
            // after a backoff, for the markers a recreated bucket's old history left on
            // the stream made a follower 3-53 s late (the NATS campaign, seed 20002).
            // (A marker is fetched only above the watermark, which no read moves while its
            // fetch is out: a head below the watermark is below the marker too.)
            let below_follower = source_watermark.is_some_and(|w| w < self.watermark);
            let behind = announcements && source_watermark.is_some_and(|w| w < seq);
            if behind || stale + 1 >= STALE_FETCHES {
                self.backoffs.stale.reset();
                // Read after read, the source has never had the change: the marker is not
                // the source's (a replaced history's, a forged one), and fetching it again
                // would wedge the follower behind it for good. A read of the whole source
                // settles the key instead: a reconcile on an announcements stream (which
                // moves the watermark only by reads), a resync on a replayed feed (whose
                // entries move it, so the marker cannot just be passed).
                self.invalid(seq, &key, InvalidReason::Unconfirmed);
                if self.follow == Follow::Announcements {
                    self.checkpoint(position);
                    if below_follower || stale > 0 {
                        self.confirm_now();
                    } else {
                        // The source is at or past what the follower read, only short of
                        // the marker: the marker is another history's, the cache is not
                        // in question. One read, soon, for all such markers (a recreated
                        // bucket's old history left hundreds on the events stream; a read
                        // for each, and the snapshot each found the old history's claims
                        // called for, held a durable consumer's cursor 4 s short of the
                        // stream's end: campaign seed 20060).
                        self.confirm_soon();
                    }
                } else {
                    self.resync();
                }
                self.settle();
                return;
            }
            // A read older than the marker from a source whose head has passed it: a
            // replica behind the leader, or a marker of another history whose seqs this
            // one has passed. Storing the old value under the marker's seq would make the
            // real one look stale. On an announcements stream a read of the whole source
            // tells the two apart at once: it moves the watermark, and the marker is
            // judged again behind it (`refetch`) — settled if the read covered it, else
            // fetched again on the stale reads' backoff.
            if announcements && stale == 0 && !self.busy() {
                self.held.push_front(Held::Refetch {
                    key,
                    seq,
                    position,
                    stale: 1,
                });
                self.send(Pending::Reconcile);
                return;
            }
            let error = match value {
                Some(_) => format!("stale read: {key} at seq {read_at}, marker at {seq}"),
                None => format!("stale read: {key} absent at watermark {read_at}, marker at {seq}"),
            };
            let request = Pending::Fetch {
                key,
                seq,
                position,
                stale: stale + 1,
            };
            self.schedule_stale_retry(request, error, now);
            return;
        }
        self.backoffs.stale.reset();
        self.counters.fetches += 1;
        // The fetched value is the source's, but the seq it is held at is the marker's
        // claim: held unconfirmed like any announcement.
        let (at, claimed) = match &value {
            Some((value_seq, bytes)) => ((*value_seq).max(seq), Claimed::Put(bytes.clone())),
            None => (seq, Claimed::Removed),
        };
        let claim = self.holds_unconfirmed(at).then(|| key.clone());
        let absent = value.is_none();
        match value {
            // The value may be newer than the marker; the index keeps its own seq so an
            // older entry for the key arriving later is skipped.
            Some((_, bytes)) => {
                self.apply(at, key.into(), Op::Put, bytes, None);
            }
            None => {
                self.apply(seq, key.into(), Op::Delete, Vec::new(), None);
            }
        }
        let claimed = claim.is_some_and(|key| self.claim(&key, at, claimed));
        self.advance_on_feed(seq);
        self.checkpoint(position);
        let head = self.feed_head().unwrap_or(u64::MAX);
        self.check_ready(head);
        if claimed && absent {
            // A key the read found absent was removed after the marker, at a seq this read
            // does not give (the source's watermark was read before the key; the removal
            // may have landed after it). Held at the marker's seq, the removal is older
            // than changes the source made before it: their announcements, held behind
            // this fetch or still to come, would bring the key back with values the source
            // had already removed (the NATS campaign with markers: a key dropped, then
            // shown again at an older seq). A read of the source dates the removal before
            // anything behind the marker is applied: it is asked for now, so the held
            // items wait for it, and its watermark passes the removal.
            self.confirm_now();
        } else if claimed {
            self.confirm_soon();
        }
        self.settle();
    }

    pub(super) fn on_changes(&mut self, changes: Vec<Entry>, source_watermark: u64) {
        self.counters.reconciles += 1;
        if source_watermark < self.watermark {
            // The source is behind what we applied: only a snapshot can say what it holds.
            self.source_behind();
            self.resync();
            return;
        }
        let verdict = |key: &str, claim: &Claim| {
            let mut named = false;
            for c in &changes {
                if *c.key == *key {
                    if let Some(verdict) = claim.is(c) {
                        return verdict;
                    }
                    named = true;
                }
            }
            if named {
                Confirmation::Replaced
            } else {
                Confirmation::Unexplained
            }
        };
        let verdicts = self.judge_ahead(source_watermark, verdict);
        if verdicts
            .iter()
            .any(|(_, v)| *v == Confirmation::Unexplained)
        {
            // An announcement the source never made overwrote a key this read does not
            // name: only a snapshot says what that key holds. The watermark stays where
            // it is until then: a commit past the forged change would claim a cache that
            // still holds it (a durable sink would keep it across a restart). Every claim
            // stays for the snapshot to settle: this read's answers are not applied, so
            // one it replaced would otherwise be committed as forgotten while the sink
            // still holds it, and the snapshot would put the same change again (seeds
            // 85219625, 85220732).
            self.known_source = self.known_source.max(source_watermark);
            self.resync();
            return;
        }
        self.settle_ahead(source_watermark, verdicts);
        let floor = self.watermark;
        let (mut applied, mut removed, mut top) = (0, 0, source_watermark);
        for change in changes {
            top = top.max(change.seq);
            self.note_stamp(change.seq, change.stamp);
            if change.seq == 0 {
                self.invalid(0, &change.key, InvalidReason::ZeroSeq);
            } else if change.seq <= floor {
                self.counters.stale += 1;
            } else {
                let (a, r) = self.apply(
                    change.seq,
                    change.key,
                    change.op,
                    change.value,
                    change.expires_in,
                );
                applied += a;
                removed += r;
            }
        }
        removed += self.remove_unreplaced(top.max(self.watermark));
        self.advance(top);
        // A reconcile reads the source up to its watermark: whatever the cache held before,
        // it now holds every current entry.
        self.caught_up(applied, removed, false);
    }

    /// A read is applied (a reconcile's, or a snapshot's switch when `resynced`): ready at
    /// the watermark, said in a [`Notice::CaughtUp`], then settled.
    pub(super) fn caught_up(&mut self, applied: usize, removed: usize, resynced: bool) {
        self.become_ready();
        let watermark = self.watermark;
        self.notice(Notice::CaughtUp(CaughtUp {
            applied,
            removed,
            watermark,
            resynced,
        }));
        self.settle();
    }

    /// Removes, at `seq`, every key a read left holding a value no read confirmed: an
    /// announcement the read replaced, or a history a resync left, whose key the read
    /// named with an entry the follower could not apply (poison, too large, invalid).
    /// Skipping poison keeps the key's older value only when that value is the source's;
    /// this one never was. Returns how many it removed.
    pub(super) fn remove_unreplaced(&mut self, seq: u64) -> usize {
        let mut stale: Vec<Arc<str>> = self
            .index
            .seqs
            .iter()
            .filter(|(_, held)| **held == 0)
            .map(|(k, _)| k.clone())
            .collect();
        stale.sort_unstable();
        let removed = stale.len();
        for key in stale {
            self.index.remove(&key);
            self.counters.removed += 1;
            self.out
                .push_back(Output::Apply(Apply::Remove { key, seq }));
        }
        removed
    }

    pub(super) fn on_snapshot(
        &mut self,
        entries: Vec<Entry>,
        source_watermark: u64,
        read: Option<crate::lineage::Lineage>,
    ) {
        let new = self.snapshot_is_new(source_watermark, read);
        if !new && entries.iter().any(|e| self.went_back(e, source_watermark)) {
            // Read again to replace the cache, as a snapshot read in parts must (its
            // unchanged entries were passed over): one way for both.
            self.history_went_back();
            self.send(super::Pending::Snapshot);
            return;
        }
        // A snapshot names every key it holds: an announcement it does not confirm is
        // replaced by its answer (or removed).
        let verdicts = self.judge_ahead(source_watermark, |key, claim| {
            entries
                .iter()
                .filter(|e| *e.key == *key)
                .find_map(|e| claim.is(e))
                .unwrap_or(Confirmation::Replaced)
        });
        self.settle_ahead(source_watermark, verdicts);
        self.reset_if_new(source_watermark, new);
        let present = Present::of(&entries);
        let gone = self.gone(source_watermark, |key| present.contains(key));
        drop(present);
        let at = (source_watermark, source_watermark);
        self.apply_snapshot(Rest::Whole(entries.into_iter()), Vec::new(), gone, at);
    }

    /// A snapshot of a new history (below the watermark, or one a read's lineage proved
    /// new: [`snapshot_is_new`](Self::snapshot_is_new)): seqs held from the old one mean
    /// nothing against it. They are forgotten, so every snapshot entry is applied and
    /// every other key removed.
    pub(super) fn reset_if_new(&mut self, source_watermark: u64, new: bool) {
        if new {
            self.counters.resets += 1;
            let watermark = self.watermark;
            self.diag(Diagnostic::SourceReset {
                watermark,
                source_watermark,
            });
            self.watermark = 0;
            self.known_source = source_watermark;
            self.ahead.clear();
            self.index.forget_seqs();
            self.known.stamp_at = None;
        }
    }

    /// The cached keys a snapshot at `source_watermark` leaves out (`present` says which
    /// it names), in key order: gone, unless the cache holds one at a seq past the snapshot
    /// (applied from a fetch or an announcement after it was read).
    pub(super) fn gone(
        &self,
        source_watermark: u64,
        present: impl Fn(&str) -> bool,
    ) -> Vec<Arc<str>> {
        let mut gone: Vec<Arc<str>> = self
            .index
            .seqs
            .iter()
            .filter(|(k, seq)| **seq <= source_watermark && !present(k))
            .map(|(k, _)| k.clone())
            .collect();
        gone.sort_unstable();
        gone
    }

    /// Applies a snapshot once its verdicts are settled: removes the `gone` keys,
    /// restamps the `same` keys (a new history's entries whose values the sink holds),
    /// puts each entry the index does not hold at its seq, and catches up to the highest
    /// seq named (`top`, at least `source_watermark`).
    pub(super) fn apply_snapshot(
        &mut self,
        entries: Rest,
        same: Vec<(Arc<str>, u64)>,
        gone: Vec<Arc<str>>,
        (source_watermark, top): (u64, u64),
    ) {
        let removal_seq = source_watermark.max(self.watermark);
        for key in &gone {
            self.index.remove(key);
            self.counters.removed += 1;
            self.out.push_back(Output::Apply(Apply::Remove {
                key: key.clone(),
                seq: removal_seq,
            }));
        }
        let applied = self.restamp(same);
        self.start_switch(Switch {
            rest: entries,
            applied,
            top: top.max(source_watermark),
            removal_seq,
            removed: gone.len(),
            source_watermark,
        });
    }

    /// Restamps the keys of a new history's entries whose values the sink holds: each
    /// keeps its value as of its seq, as a put of that value would (never older: a
    /// repeated key's newer seq stands). Returns how many.
    fn restamp(&mut self, mut keys: Vec<(Arc<str>, u64)>) -> usize {
        keys.retain(|(key, seq)| {
            if self.index.get(key).is_some_and(|held| held >= *seq) {
                self.counters.stale += 1;
                return false;
            }
            self.index.set(Arc::clone(key), *seq);
            true
        });
        let restamped = keys.len();
        self.counters.applied += restamped as u64;
        if restamped > 0 {
            self.out.push_back(Output::Apply(Apply::Restamp { keys }));
        }
        restamped
    }

    /// Whether a snapshot entry naming `key` at the seq the cache holds it at is put
    /// again: when a compaction left the history at the watermark unconfirmed, the same
    /// seq may name another change (see
    /// [`unconfirmed_at_compaction`](Self::unconfirmed_at_compaction)). Its seq is
    /// forgotten first, so the put is not taken for a stale one.
    pub(super) fn put_again(&mut self, key: &Arc<str>) -> bool {
        if self.unconfirmed {
            self.index.set(Arc::clone(key), 0);
        }
        self.unconfirmed
    }
}

/// The keys a snapshot names, to tell which cached keys are gone. A snapshot in key order
/// (a memory source's) is searched in place: a resync's peak memory is the snapshot itself,
/// and a set of its keys beside it adds about 36 bytes a key (the `memory` bench). Any
/// other order is indexed in a set.
enum Present<'a> {
    Sorted(&'a [Entry]),
    Set(HashSet<&'a str>),
}

impl<'a> Present<'a> {
    fn of(entries: &'a [Entry]) -> Self {
        if entries.is_sorted_by(|a, b| a.key <= b.key) {
            Present::Sorted(entries)
        } else {
            Present::Set(entries.iter().map(|e| &*e.key).collect())
        }
    }

    fn contains(&self, key: &str) -> bool {
        match self {
            Present::Sorted(entries) => entries.binary_search_by(|e| (*e.key).cmp(key)).is_ok(),
            Present::Set(keys) => keys.contains(key),
        }
    }
}
