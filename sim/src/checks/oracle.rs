//! The oracle: the source's full history, per-follower probes that check safety on every
//! change they see, and the convergence check of the liveness phase.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::{Held, Result, Sink};
use tidemark_memory::MemoryCacheStore;

use crate::trace::Trace;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One committed mutation: its key, and the value put (`None` for a removal).
type Commit = (String, Option<Vec<u8>>);

/// Every committed mutation, by seq (recorded by the source host as it commits, so it
/// survives compaction of the source's own log). A restore from a backup starts a new
/// epoch: the history is cut back to the backup's seq, and the histories it replaced are
/// kept, so that a follower that has not yet noticed the restore can be told from one that
/// is wrong.
#[derive(Clone, Debug, Default)]
pub struct History {
    inner: Arc<Mutex<Current>>,
    /// The histories restores replaced, oldest first (epoch `i` is `past[i]`; the current
    /// one is epoch `past.len()`).
    past: Arc<Mutex<Vec<BTreeMap<u64, Commit>>>>,
    /// The seq each restore went back to, in order.
    heads: Arc<Mutex<Vec<u64>>>,
}

/// The current epoch's history, and how many times it changed other than by a commit
/// past its last seq (a [`StateCursor`] on it is good only within one generation).
#[derive(Debug, Default)]
struct Current {
    commits: BTreeMap<u64, Commit>,
    generation: u64,
    /// The highest seq the source's log was ever compacted below (kept across restores:
    /// it only makes the oracle allow a resync's puts again where it need not).
    compacted_below: u64,
}

/// One epoch's state at a watermark (key → its last seq and value at or below it, `None`
/// for a removal), kept by a probe between its checks and moved forward by the commits
/// since, as its follower's watermark mostly moves forward; a step back, or a history
/// that changed below the watermark, rebuilds it. Every committed watermark of every
/// follower is checked against such a state: rebuilding it from the whole history each
/// time made the oracle's cost grow with the history's length at every commit.
#[derive(Debug, Default)]
pub struct StateCursor {
    /// The epoch and generation `state` is of, and the commits it holds: every one at or
    /// below the seq given (`None`: none yet). That seq is the watermark asked for, or the
    /// history's last seq then if lower: a commit recorded later, above that, is one
    /// `state` does not hold yet.
    at: Option<(usize, u64, Option<u64>)>,
    state: State,
}

impl StateCursor {
    /// The state of `history` (epoch `epoch`, generation `generation`) at `watermark`.
    fn seek(
        &mut self,
        (epoch, generation): (usize, u64),
        history: &BTreeMap<u64, Commit>,
        watermark: u64,
    ) -> &State {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let from = match self.at {
            Some((e, g, held)) if e == epoch && g == generation && held <= Some(watermark) => {
                held.map_or(Unbounded, Excluded)
            }
            _ => {
                self.state.clear();
                Unbounded
            }
        };
        for (seq, (key, value)) in history.range((from, Included(watermark))) {
            match self.state.get_mut(key.as_str()) {
                Some(slot) => *slot = (*seq, value.clone()),
                None => {
                    self.state.insert(key.clone(), (*seq, value.clone()));
                }
            }
        }
        let last = history.last_key_value().map(|(seq, _)| *seq);
        self.at = Some((epoch, generation, last.map(|l| l.min(watermark))));
        &self.state
    }

    /// The state of `history` at `watermark`, built once from its start.
    fn state_at(history: &BTreeMap<u64, Commit>, watermark: u64) -> State {
        let mut cursor = StateCursor::default();
        cursor.seek((0, 0), history, watermark);
        cursor.state
    }
}

/// One epoch's state at a watermark: key → its last seq and value at or below it (`None`
/// for a removal).
type State = BTreeMap<String, (u64, Option<Vec<u8>>)>;

/// A probe's [`StateCursor`]s, one for each epoch it was checked against.
pub type StateCursors = BTreeMap<usize, StateCursor>;

/// What a follower's cache should hold for one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Exactly this value at this seq.
    Value(u64, String),
    /// The latest value (at this seq) is poison: the follower skips it, so it holds an
    /// older value or none.
    OlderThan(u64),
}

impl History {
    /// Records a commit: `Some(value)` for a put, `None` for a removal.
    pub fn record(&self, seq: u64, key: &str, value: Option<Vec<u8>>) {
        let mut current = lock(&self.inner);
        if current
            .commits
            .last_key_value()
            .is_some_and(|(last, _)| *last >= seq)
        {
            current.generation += 1;
        }
        current.commits.insert(seq, (key.to_owned(), value));
    }

    /// Whether the source put `value` in `key` at `seq` (not so: a foreign event's claim,
    /// which may copy a real change's key and seq with another value).
    #[must_use]
    pub fn wrote(&self, key: &str, seq: u64, value: &str) -> bool {
        lock(&self.inner)
            .commits
            .get(&seq)
            .is_some_and(|(k, v)| k == key && v.as_deref() == Some(value.as_bytes()))
    }

    /// The source's log was compacted below seq `below`.
    pub fn compacted(&self, below: u64) {
        let mut current = lock(&self.inner);
        current.compacted_below = current.compacted_below.max(below);
    }

    /// Whether the source's log was compacted past `watermark`: a follower there resyncs
    /// from a snapshot, and where no stamp at its watermark is left to tell its history
    /// from a restored one, it puts every entry again, at the seqs it holds.
    #[must_use]
    pub fn compacted_past(&self, watermark: u64) -> bool {
        lock(&self.inner).compacted_below > watermark.saturating_add(1)
    }

    /// The source was restored from a backup taken at seq `head`: what came after is
    /// another epoch's history.
    pub fn restore(&self, head: u64) {
        let mut current = lock(&self.inner);
        lock(&self.past).push(current.commits.clone());
        lock(&self.heads).push(head);
        current.commits.split_off(&(head + 1));
        current.generation += 1;
    }

    /// The seq the last restore went back to (0 before any).
    #[must_use]
    pub fn restored_head(&self) -> u64 {
        lock(&self.heads).last().copied().unwrap_or(0)
    }

    /// How many restores there were: the current epoch.
    #[must_use]
    pub fn epoch(&self) -> usize {
        lock(&self.past).len()
    }

    /// How `cache` fails to be the state at `watermark` of the current history (empty when
    /// it is), unless it is that state in an epoch at or after `since` that a restore
    /// replaced: a follower that has not yet read the restored source. Returns the
    /// differences, and the oldest epoch at or after `since` the cache matched (the current
    /// one when it matched none): where a replaced history and the restored one agree (at
    /// or below the seq the restore went back to, or past it when an announcement ahead of
    /// the watermark hides the only replaced change), the cache does not show which of
    /// them the follower is reading. A revision `skipped` says the follower's sparse feed
    /// never delivered (an overwrite removed it first) may be missing: see
    /// [`FeedSkips`]. A key `removed` past the watermark (an announced removal applied
    /// ahead of it) may be missing too: an announcement is a claim held unconfirmed until
    /// a read of the source, whichever history made it, or none (a foreign one), as a put
    /// ahead of the watermark is.
    #[must_use]
    pub fn inconsistencies_since(
        &self,
        cache: &BTreeMap<String, (u64, String)>,
        removed: &BTreeMap<String, u64>,
        watermark: u64,
        since: usize,
        cursors: &mut StateCursors,
        skipped: Skipped<'_>,
    ) -> (Vec<String>, usize) {
        // Cursors of epochs before `since` are no longer asked for.
        *cursors = cursors.split_off(&since);
        let current = lock(&self.inner);
        let past = lock(&self.past);
        // Every epoch's history, the current one last: an announcement applied ahead of
        // the watermark may come from any of them (seed 777: the restored history's
        // removal, announced before the follower read the restored source).
        let all: Vec<&BTreeMap<u64, Commit>> = past
            .iter()
            .chain(std::iter::once(&current.commits))
            .collect();
        for (epoch, history) in past.iter().enumerate().skip(since) {
            let state = cursors
                .entry(epoch)
                .or_default()
                .seek((epoch, 0), history, watermark);
            if inconsistencies_in(&all, state, cache, removed, watermark, skipped).is_empty() {
                return (Vec::new(), epoch);
            }
        }
        let epoch = past.len();
        let state = cursors.entry(epoch).or_default().seek(
            (epoch, current.generation),
            &current.commits,
            watermark,
        );
        (
            inconsistencies_in(&all, state, cache, removed, watermark, skipped),
            epoch,
        )
    }

    /// The lowest seq the restores since `epoch` went back to: past it, that epoch's
    /// history is not the current one (`None` for the current epoch).
    #[must_use]
    pub fn replaced_past(&self, epoch: usize) -> Option<u64> {
        lock(&self.heads)
            .get(epoch..)
            .and_then(|heads| heads.iter().copied().min())
    }

    /// Whether the source removed `key` at `seq`.
    #[must_use]
    pub fn removed(&self, key: &str, seq: u64) -> bool {
        lock(&self.inner)
            .commits
            .get(&seq)
            .is_some_and(|(k, v)| k == key && v.is_none())
    }

    /// The source's removal that a follower's removal of `key` at `seq` stands for, where
    /// the source put a value it can decode in `key` at `seq` and removed `key` at no
    /// `seq` in any epoch: a fetch of a marker at `seq` that found the key absent, whose
    /// removal came after the marker. The first removal of `key` after `seq`; `None`
    /// where `seq` is no such put, or no removal followed it.
    #[must_use]
    pub fn removal_behind(&self, key: &str, seq: u64) -> Option<u64> {
        let is_removal = |c: Option<&Commit>| c.is_some_and(|(k, v)| k == key && v.is_none());
        if lock(&self.past)
            .iter()
            .any(|history| is_removal(history.get(&seq)))
        {
            return None;
        }
        let current = lock(&self.inner);
        let put = current.commits.get(&seq).is_some_and(|(k, v)| {
            k == key && v.as_deref().is_some_and(|b| std::str::from_utf8(b).is_ok())
        });
        if !put {
            return None;
        }
        current
            .commits
            .range(seq + 1..)
            .find(|(_, (k, v))| k == key && v.is_none())
            .map(|(at, _)| *at)
    }

    /// The highest seq committed.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        lock(&self.inner)
            .commits
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
    }

    /// What a cache converged at `watermark` should hold.
    #[must_use]
    pub fn expected_at(&self, watermark: u64) -> BTreeMap<String, Expect> {
        StateCursor::state_at(&lock(&self.inner).commits, watermark)
            .into_iter()
            .filter_map(|(key, (seq, value))| {
                let value = value?;
                Some(match String::from_utf8(value) {
                    Ok(text) => (key, Expect::Value(seq, text)),
                    Err(_) => (key, Expect::OlderThan(seq)),
                })
            })
            .collect()
    }
}

impl History {
    /// How `cache` fails to be the source's state at `watermark`, described for a report
    /// (empty when it is). A key may also hold a newer value than the watermark's, or be
    /// absent through a newer removal, when the history has that change (announcements
    /// and fetched markers run ahead of the watermark); a poison value may be skipped, and
    /// so may a revision `skipped` says a sparse feed never delivered.
    #[must_use]
    pub fn inconsistencies(
        &self,
        cache: &BTreeMap<String, (u64, String)>,
        watermark: u64,
        skipped: Skipped<'_>,
    ) -> Vec<String> {
        let current = lock(&self.inner);
        let past = lock(&self.past);
        let state = StateCursor::state_at(&current.commits, watermark);
        let all: Vec<&BTreeMap<u64, Commit>> = past
            .iter()
            .chain(std::iter::once(&current.commits))
            .collect();
        inconsistencies_in(&all, &state, cache, &BTreeMap::new(), watermark, skipped)
    }
}

/// Whether the follower's sparse feed never delivered the revision at a seq (see
/// [`FeedSkips`]); `&|_| false` for every other feed.
pub type Skipped<'a> = &'a dyn Fn(u64) -> bool;

/// The revisions each follower's sparse feeds (a KV bucket's, keeping one revision per
/// key) never delivered, as the source host's stream recorded them: those an overwrite
/// removed from a consumer's range before it was made or before it delivered them, and
/// every revision but the latest of each key for one that starts at the latest per key.
/// A follower that commits a watermark past such a revision holds the key's older value
/// (or none) until the newer revision arrives, as a reader of the server's stream does.
/// It is no excuse at ready, nor for what a replay that ended (a snapshot, changes since
/// a seq) brought: those read until nothing is above what they delivered.
#[derive(Clone, Debug, Default)]
pub struct FeedSkips {
    inner: Arc<Mutex<BTreeMap<String, BTreeSet<u64>>>>,
}

impl FeedSkips {
    /// `follower`'s feed will never deliver the revisions at `seqs`.
    pub fn record(&self, follower: &str, seqs: Vec<u64>) {
        if seqs.is_empty() {
            return;
        }
        let mut all = lock(&self.inner);
        match all.get_mut(follower) {
            Some(set) => set.extend(seqs),
            None => {
                all.insert(follower.to_owned(), seqs.into_iter().collect());
            }
        }
    }

    /// Whether a feed of `follower` never delivered the revision at `seq`.
    #[must_use]
    pub fn skipped(&self, follower: &str, seq: u64) -> bool {
        lock(&self.inner)
            .get(follower)
            .is_some_and(|set| set.contains(&seq))
    }

    /// The source was restored to `head`: the seqs above it will be another history's.
    pub fn restored(&self, head: u64) {
        for set in lock(&self.inner).values_mut() {
            set.split_off(&(head + 1));
        }
    }
}

/// [`History::inconsistencies`] against one epoch's history, whose state at `watermark`
/// is `state`. A key may also be absent through a removal past the watermark in any epoch
/// (`all`): an announcement of another history (one a restore
/// replaced, or the restored one announced before the follower read it), applied ahead of
/// the watermark like any announcement, and held unconfirmed until the next read of the
/// source.
fn inconsistencies_in(
    all: &[&BTreeMap<u64, Commit>],
    state: &State,
    cache: &BTreeMap<String, (u64, String)>,
    removed: &BTreeMap<String, u64>,
    watermark: u64,
    skipped: Skipped<'_>,
) -> Vec<String> {
    let newer = |key: &str, pred: &dyn Fn(&Option<Vec<u8>>) -> bool| {
        all.iter().any(|h| {
            // Past the watermark: nothing, at the top of the seqs (a follower may commit
            // u64::MAX, where `watermark + 1` would wrap to the whole history).
            h.range((
                std::ops::Bound::Excluded(watermark),
                std::ops::Bound::Unbounded,
            ))
            .any(|(_, (k, v))| k == key && pred(v))
        })
    };
    let mut out = Vec::new();
    for (key, (seq, value)) in cache {
        if *seq > watermark {
            // An announcement ahead of the source: a real change, or a foreign one the
            // follower holds unconfirmed until a read of the source covers its seq
            // (then it must be gone: checked below at that watermark, and at the end).
            continue;
        }
        match state.get(key.as_str()) {
            Some((want, Some(bytes))) if want == seq && bytes.as_slice() == value.as_bytes() => {}
            Some((want, Some(bytes))) if std::str::from_utf8(bytes).is_err() && seq < want => {}
            // The feed never delivered the revision the source had at the watermark: an
            // older one stands until the newer revision that removed it arrives.
            Some((want, _)) if seq < want && skipped(*want) => {}
            want => out.push(format!(
                "{key}: holds seq {seq}, the source at {watermark} has {:?}",
                want.map(|(s, v)| (s, v.is_some()))
            )),
        }
    }
    for (key, (seq, value)) in state {
        let Some(bytes) = value else { continue };
        if cache.contains_key(key) || std::str::from_utf8(bytes).is_err() || skipped(*seq) {
            continue;
        }
        // A removal applied ahead of the watermark: a claim, like a put ahead (above).
        if removed.get(key).is_some_and(|&at| at > watermark) {
            continue;
        }
        // Absent: fine only if a newer removal (or a newer poison put) explains it.
        if !newer(key, &|v| {
            v.as_ref().is_none_or(|b| std::str::from_utf8(b).is_err())
        }) {
            out.push(format!(
                "{key}: missing; the source at {watermark} has seq {seq}"
            ));
        }
    }
    out
}

/// Differences between a cache and what it should hold, described for a report.
#[must_use]
pub fn differences(
    cache: &BTreeMap<String, (u64, String)>,
    expected: &BTreeMap<String, Expect>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (key, want) in expected {
        match (want, cache.get(key)) {
            (Expect::Value(seq, value), Some((s, v))) if s == seq && v == value => {}
            (Expect::Value(seq, _), got) => {
                out.push(format!(
                    "{key}: want seq {seq}, have {:?}",
                    got.map(|(s, _)| s)
                ));
            }
            (Expect::OlderThan(seq), Some((s, _))) if s >= seq => {
                out.push(format!("{key}: poison at {seq} but cache holds seq {s}"));
            }
            (Expect::OlderThan(_), _) => {}
        }
    }
    for key in cache.keys() {
        if !expected.contains_key(key) {
            out.push(format!("{key}: in the cache but not in the source"));
        }
    }
    out
}

/// Whether `cache` holds what it should: [`differences`] is empty. One pass over both
/// (each is in key order) and nothing built: the liveness phase asks it of every follower
/// at every step from the first one where all reach the head until the run converges.
#[must_use]
pub fn holds(cache: &BTreeMap<String, (u64, String)>, expected: &BTreeMap<String, Expect>) -> bool {
    let mut have = cache.iter().peekable();
    for (key, want) in expected {
        let got = match have.peek() {
            // A key the source does not have.
            Some((k, _)) if *k < key => return false,
            Some((k, v)) if *k == key => {
                let v = *v;
                have.next();
                Some(v)
            }
            _ => None,
        };
        let fine = match (want, got) {
            (Expect::Value(seq, value), Some((s, v))) => s == seq && v == value,
            (Expect::Value(..), None) => false,
            (Expect::OlderThan(seq), Some((s, _))) => s < seq,
            (Expect::OlderThan(_), None) => true,
        };
        if !fine {
            return false;
        }
    }
    have.next().is_none()
}

/// One change of a batch not yet committed: key, seq, and the value (`None`: removed).
type Pending = (String, u64, Option<String>);

/// What one follower has committed, checked as it goes. Lives outside the follower's host;
/// a restarted follower's view is rebuilt from what survived the crash (nothing, or its
/// durable store).
#[derive(Debug, Default)]
pub struct ProbeState {
    /// The committed cache: key → (seq, value).
    pub cache: BTreeMap<String, (u64, String)>,
    /// The watermark last committed.
    pub watermark: u64,
    /// Whether the current incarnation reported ready.
    pub ready: bool,
    /// Puts committed to this cache, as (seq, key, value) (double-apply detection). The
    /// key and value with the seq: a foreign event may claim a seq the source gave another
    /// key, or copy a real change's key and seq with another value; the source's put that
    /// replaces it is no second apply.
    pub applied: BTreeSet<(u64, String, String)>,
    /// The batch applied since the last commit, in order.
    pending: Vec<Pending>,
    /// Safety violations seen.
    pub violations: Vec<String>,
    /// Restarts so far.
    pub incarnation: u32,
    /// Commits that failed (and were rolled back).
    pub failed_commits: u32,
    /// Restarts that found keys in the durable store.
    pub warm_restarts: u32,
    /// Restarts of a supervised worker by its supervisor (in this host's life).
    pub worker_restarts: u32,
    /// The history epoch its cache was last seen to match (see [`History::restore`]): it
    /// may hold an older epoch's state until it reads the restored source, and its
    /// watermark may go back once, when it takes the new history.
    pub epoch: usize,
    /// The last epoch for which its watermark went back (taking that restored history):
    /// once per restore.
    pub fell_back_for: usize,
    /// The seq of each committed removal of a key it does not hold.
    removed: BTreeMap<String, u64>,
    /// How many of the pending changes were applied before a restore, and the seq it went
    /// back to: their puts above it were of the replaced history, and commit or not, they
    /// are no applies a new-history change could repeat.
    replaced_pending: Option<(usize, u64)>,
    /// The source's state at the watermark last checked, in each epoch checked.
    cursors: StateCursors,
}

impl ProbeState {
    /// What `key` holds with the pending batch applied: its seq and value, if present.
    fn working(&self, key: &str) -> Option<(u64, &str)> {
        match self.pending.iter().rev().find(|(k, _, _)| k == key) {
            Some((_, seq, Some(v))) => Some((*seq, v.as_str())),
            Some((_, _, None)) => None,
            None => self.cache.get(key).map(|(seq, v)| (*seq, v.as_str())),
        }
    }

    /// The seq of `key`'s last removal, with the pending batch applied, if it is absent
    /// through one.
    fn removed_at(&self, key: &str) -> Option<u64> {
        match self.pending.iter().rev().find(|(k, _, _)| k == key) {
            Some((_, seq, None)) => Some(*seq),
            Some((_, _, Some(_))) => None,
            None if self.cache.contains_key(key) => None,
            None => self.removed.get(key).copied(),
        }
    }

    fn pending_applied(&self, key: &str, seq: u64, value: &str) -> bool {
        self.pending
            .iter()
            .any(|(k, s, v)| v.as_deref() == Some(value) && *s == seq && k == key)
    }

    /// Takes the pending batch, with whether each change counts as applied (not so: a put
    /// of a history a restore replaced while the batch was open).
    fn take_pending(&mut self) -> Vec<(Pending, bool)> {
        let replaced = self.replaced_pending.take();
        std::mem::take(&mut self.pending)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let counts = replaced.is_none_or(|(n, head)| i >= n || p.1 <= head);
                (p, counts)
            })
            .collect()
    }

    /// Folds the pending batch into the committed cache.
    fn fold(&mut self) {
        for ((key, seq, value), counts) in self.take_pending() {
            match value {
                Some(v) => {
                    self.removed.remove(&key);
                    if counts {
                        self.applied.insert((seq, key.clone(), v.clone()));
                    }
                    self.cache.insert(key, (seq, v));
                }
                None => {
                    self.cache.remove(&key);
                    self.removed.insert(key, seq);
                }
            }
        }
    }
}

/// The oracle's view of one follower: a shared handle to what it committed. Its
/// [`sink`](Self::sink) wraps the follower's real sink and checks, on every change:
/// per-key never-older, no seq applied twice, watermark monotone, and — at ready and at
/// every committed watermark — that the committed cache is the source's state at that
/// watermark.
#[derive(Clone, Debug)]
pub struct Probe {
    name: String,
    state: Arc<Mutex<ProbeState>>,
    history: History,
    trace: Trace,
    /// For a follower of a sparse feed: the revisions its feeds never delivered.
    skips: Option<FeedSkips>,
}

impl Probe {
    /// A probe for the follower called `name`.
    #[must_use]
    pub fn new(name: impl Into<String>, history: History, trace: Trace) -> Self {
        Probe {
            name: name.into(),
            state: Arc::default(),
            history,
            trace,
            skips: None,
        }
    }

    /// The probe of a follower of a sparse feed, whose feeds never delivered the revisions
    /// `skips` records for it: between ready and its next start, and in its durable store,
    /// a committed watermark past such a revision may hold the key's older value (or
    /// none). At ready it may not.
    #[must_use]
    pub fn reading_a_sparse_feed(mut self, skips: FeedSkips) -> Self {
        self.skips = Some(skips);
        self
    }

    /// Whether this follower's feeds never delivered the revision at `seq`.
    fn skipped(&self, seq: u64) -> bool {
        self.skips
            .as_ref()
            .is_some_and(|skips| skips.skipped(&self.name, seq))
    }

    /// Adds a line to the run's trace.
    pub fn trace_line(&self, line: String) {
        self.trace.line(line);
    }

    /// The probe's state.
    pub fn state(&self) -> MutexGuard<'_, ProbeState> {
        lock(&self.state)
    }

    /// The follower's sink: `inner` (the follower's own sink), checked.
    #[must_use]
    pub fn sink<K>(&self, inner: K) -> Probed<K> {
        Probed {
            probe: self.clone(),
            inner,
        }
    }

    /// A new incarnation of the follower. Without a durable store its cache and watermark
    /// were lost with the crash; with one, the view is what the store holds now (a commit
    /// the crash interrupted is in it whole or not at all), and it must be the source's
    /// state at the store's watermark.
    pub fn restart(&self, durable: Option<&MemoryCacheStore>) {
        let mut s = self.state();
        s.incarnation += 1;
        s.ready = false;
        let pending = s.take_pending();
        s.worker_restarts = 0;
        let Some(store) = durable else {
            s.cache.clear();
            s.watermark = 0;
            s.applied.clear();
            s.removed.clear();
            return;
        };
        let watermark = store.watermark().unwrap_or(0);
        let cache: BTreeMap<String, (u64, String)> = store
            .entries()
            .into_iter()
            .map(|(k, (seq, v))| (k, (seq, String::from_utf8_lossy(&v).into_owned())))
            .collect();
        // A store that went back is one that took the restored history (its commit landed
        // just before the crash), if the cache was still on a replaced history and the
        // store is the restored history's state at its watermark; otherwise it lost a
        // commit.
        // The restored history it took may itself have been replaced by a later restore
        // while it was down (seed 229): any epoch after the one it was on will do.
        let took = (watermark < s.watermark && self.may_fall_back(&s)).then(|| {
            let mut cursors = StateCursors::default();
            self.history.inconsistencies_since(
                &cache,
                &s.removed,
                watermark,
                s.epoch + 1,
                &mut cursors,
                &|seq| self.skipped(seq),
            )
        });
        let took_restored = took.as_ref().is_some_and(|(diffs, _)| diffs.is_empty());
        if let Some((_, epoch)) = took.filter(|_| took_restored) {
            s.epoch = epoch;
            s.fell_back_for = epoch;
        } else if watermark < s.watermark {
            let what = format!(
                "the durable store went back from watermark {} to {watermark}",
                s.watermark
            );
            self.violation(&mut s, what);
        }
        // Whether the interrupted commit landed: its watermark is the store's, or (on an
        // announcements stream, whose claims do not move the watermark) the store holds
        // the last change the batch made to each key it touched.
        let holds = |(key, seq, value): &Pending| match (value, cache.get(key)) {
            (Some(v), Some((have, held))) => have == seq && held == v,
            (None, held) => held.is_none(),
            (Some(_), None) => false,
        };
        let mut last: BTreeMap<&str, &Pending> = BTreeMap::new();
        for (p, _) in &pending {
            last.insert(p.0.as_str(), p);
        }
        // A removal of a key the committed cache did not hold looks the same landed or
        // not: only a put, or a removal of a held key, tells.
        let tells = |(key, _, value): &Pending| value.is_some() || s.cache.contains_key(key);
        let landed = watermark > s.watermark
            || took_restored
            || (last.values().all(|p| holds(p)) && last.values().any(|p| tells(p)));
        if landed {
            // Its puts count as applied, and its removals as the keys' last changes.
            for ((key, seq, value), counts) in &pending {
                match value {
                    Some(v) => {
                        s.removed.remove(key);
                        if *counts {
                            s.applied.insert((*seq, key.clone(), v.clone()));
                        }
                    }
                    None => {
                        s.removed.insert(key.clone(), *seq);
                    }
                }
            }
        }
        s.watermark = watermark;
        s.warm_restarts += u32::from(!store.is_empty());
        s.cache = cache;
        self.trace.line(format!(
            "{} restarts from its store at {watermark} with {} keys",
            self.name,
            s.cache.len()
        ));
        let diff = self.inconsistencies(&mut s, watermark, Skips::Excused);
        if !diff.is_empty() {
            let what = format!(
                "restarted from a store that is not the source's state at its watermark {watermark}: {}",
                diff.join("; ")
            );
            self.violation(&mut s, what);
        }
    }

    /// How the cache `s` holds fails to be the source's state at `watermark`: in the
    /// current history, or in a history a restore replaced that the follower has not yet
    /// left. Remembers the oldest epoch it matched: a cache that is the state of both a
    /// replaced history and the restored one does not show that the follower left the
    /// replaced one. Entries of it the source sent before the restore may still be on
    /// their way (seed 6577: held on the wire, they took a follower from the restored seq
    /// 67 to 72 of the replaced history after the restore, and the feed's end after them
    /// then sent it to the restored source); and past the restored seq, an announcement
    /// ahead of the watermark can hide the only replaced change, so taking the restored
    /// history puts the same seqs again.
    fn inconsistencies(&self, s: &mut ProbeState, watermark: u64, skips: Skips) -> Vec<String> {
        let skipped = |seq| skips == Skips::Excused && self.skipped(seq);
        let (diff, epoch) = self.history.inconsistencies_since(
            &s.cache,
            &s.removed,
            watermark,
            s.epoch,
            &mut s.cursors,
            &skipped,
        );
        if diff.is_empty() {
            s.epoch = epoch;
        }
        diff
    }

    /// Whether a watermark that went back is the follower taking a restored history (see
    /// [`may_fall_back`](Self::may_fall_back)): allowed once per restore.
    fn took_restored_history(&self, s: &mut ProbeState) -> bool {
        if self.may_fall_back(s) {
            self.fell_back(s);
            true
        } else {
            false
        }
    }

    /// Whether the follower's watermark may go back now: once per restore, if it is on a
    /// history a restore replaced, past the seq where the restored one parted from it.
    fn may_fall_back(&self, s: &ProbeState) -> bool {
        s.fell_back_for < self.history.epoch() && self.past_replaced(s)
    }

    /// Whether the follower holds a history a restore replaced past the seq where the
    /// restored history parted from it: it must take the restored history, and doing so
    /// puts the restored history's changes again, under seqs it held.
    fn past_replaced(&self, s: &ProbeState) -> bool {
        self.history
            .replaced_past(s.epoch)
            .is_some_and(|head| s.watermark > head)
    }

    /// The follower took a restored history: one after the epoch it was on, not
    /// necessarily the current one. A snapshot read before a later restore is the state of
    /// a history that restore replaced (seed 268: read at 57 of the first restored
    /// history, applied after the second restore went back to 53); the check that follows
    /// finds which, and the follower may go back once more to take the next.
    fn fell_back(&self, s: &mut ProbeState) {
        let next = (s.epoch + 1).min(self.history.epoch());
        s.epoch = next;
        s.fell_back_for = next;
    }

    /// Whether the follower has left every history a restore replaced: its watermark (or
    /// its durable store's, which a restart resumes from) is at or below the seq the last
    /// restore went back to, where the two histories agree, or it went back to take the
    /// restored one.
    #[must_use]
    pub fn on_restored_history(&self, durable: Option<&MemoryCacheStore>) -> bool {
        let s = self.state();
        let stored = durable.and_then(MemoryCacheStore::watermark).unwrap_or(0);
        s.fell_back_for >= self.history.epoch()
            || s.watermark.max(stored) <= self.history.restored_head()
    }

    /// The follower's cache was thrown away (its durable store wiped, its host
    /// restarted): it starts over as a new follower of the current history, at simulated
    /// time `at`.
    pub fn wiped(&self, at: std::time::Duration) {
        let mut s = self.state();
        let epoch = self.history.epoch();
        let ProbeState {
            violations,
            incarnation,
            failed_commits,
            warm_restarts,
            ..
        } = std::mem::take(&mut *s);
        *s = ProbeState {
            violations,
            incarnation,
            failed_commits,
            warm_restarts,
            epoch,
            fell_back_for: epoch,
            ..ProbeState::default()
        };
        self.trace.line_at(
            at,
            format!("{} starts over with its cache wiped", self.name),
        );
    }

    /// The source was restored from a backup taken at `head`, at simulated time `at`
    /// (the orchestrator does it, outside every host): puts above it were of another
    /// history, and the seqs they used will be used again.
    pub fn restored(&self, head: u64, at: std::time::Duration) {
        let mut s = self.state();
        s.applied.retain(|(seq, _, _)| *seq <= head);
        if !s.pending.is_empty() {
            let n = s.pending.len();
            let head = s.replaced_pending.map_or(head, |(_, h)| h.min(head));
            s.replaced_pending = Some((n, head));
        }
        self.trace.line_at(
            at,
            format!("{} sees the source restored to {head}", self.name),
        );
    }

    fn violation(&self, s: &mut ProbeState, what: String) {
        self.trace.line(format!("VIOLATION {}: {what}", self.name));
        s.violations.push(what);
    }
}

impl<K> Probed<K> {
    /// Checks a put (or what stands for one: `what`) of `value` at `seq` against what the
    /// probe saw, and records it for the commit.
    fn check_put(&self, what: &str, key: String, seq: u64, value: String) {
        let p = &self.probe;
        let mut s = lock(&p.state);
        // A follower taking a restored history forgets every seq it held and puts the
        // source's state again: the same change again is no regression then.
        // So does a follower whose source compacted past its watermark, where nothing
        // may be left to tell its history from a restored one.
        let adopting = p.past_replaced(&s) || p.history.compacted_past(s.watermark);
        let again = |have: u64, held: &str| adopting && have == seq && held == value;
        // A foreign event's seq and value are no real version: replacing them is no
        // regression.
        if let Some((have, held)) = s.working(&key)
            && have >= seq
            && p.history.wrote(&key, have, held)
            && !again(have, held)
        {
            p.violation(
                &mut s,
                format!("{key}: put at seq {seq} over newer-or-equal {have}"),
            );
        }
        // A removal shown at the seq of a put the source made there stands for a
        // removal the source made later (a marker's fetch found the key absent): a
        // real put older than that removal, shown after it, brings back a value the
        // source had removed.
        if !adopting
            && let Some(at) = s.removed_at(&key)
            && at < seq
            && p.history.wrote(&key, seq, &value)
            && let Some(removal) = p.history.removal_behind(&key, at)
            && seq < removal
        {
            p.violation(
                &mut s,
                format!(
                    "{key}: put at seq {seq} after its removal shown at {at}, which the \
                     source made at {removal}: older than the removal"
                ),
            );
        }
        // Putting a real change again over a forged value is the repair of the forgery
        // (a read of the source replaced it), not a second apply.
        let over_forged = match s.working(&key) {
            Some((have, held)) => !p.history.wrote(&key, have, held),
            None => s
                .removed_at(&key)
                .is_some_and(|at| !p.history.removed(&key, at)),
        };
        // Only a change the source made has a seq to apply twice: a claim it never
        // made (a replaced history's, a forged one) comes again whenever the stream
        // delivers it again, and the next read replaces it again.
        if !over_forged
            && !adopting
            && p.history.wrote(&key, seq, &value)
            && (s.applied.contains(&(seq, key.clone(), value.clone()))
                || s.pending_applied(&key, seq, &value))
        {
            p.violation(&mut s, format!("seq {seq} applied twice"));
        }
        p.trace.line(format!("{} {what} {key}@{seq}", p.name));
        s.pending.push((key, seq, Some(value)));
    }
}

/// Whether a check excuses the revisions a follower's sparse feed never delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Skips {
    /// Between ready and the next start: the feed skips what an overwrite removed first.
    Excused,
    /// At ready: the cache is the source's state at the watermark, every key of it.
    NoExcuse,
}

/// A follower's sink wrapped by its [`Probe`]: every call goes to the inner sink, and what
/// the inner sink commits is checked.
#[derive(Debug)]
pub struct Probed<K> {
    probe: Probe,
    inner: K,
}

impl<K: Sink<String>> Sink<String> for Probed<K> {
    const FALLIBLE: bool = K::FALLIBLE;

    const HOLDS_VALUES: bool = K::HOLDS_VALUES;

    async fn put(&mut self, shared: Arc<str>, seq: u64, value: String) -> Result<()> {
        self.check_put("put", shared.to_string(), seq, value.clone());
        self.inner.put(shared, seq, value).await
    }

    fn holds(&self, key: &str, new: &String, same: &dyn Fn(&String, &String) -> bool) -> bool {
        self.inner.holds(key, new, same)
    }

    /// Checked as a put of the value held: a restamp stands for it.
    async fn restamp(&mut self, keys: Vec<(Arc<str>, u64)>) -> Result<()> {
        for (key, seq) in &keys {
            let held = lock(&self.probe.state)
                .working(key)
                .map(|(_, v)| v.to_owned());
            let Some(held) = held else {
                let p = &self.probe;
                let what = format!("{key}: restamped at {seq} but not held");
                p.violation(&mut lock(&p.state), what);
                continue;
            };
            self.check_put("restamp", key.to_string(), *seq, held);
        }
        self.inner.restamp(keys).await
    }

    async fn remove(&mut self, shared: Arc<str>, seq: u64) -> Result<()> {
        {
            let key = shared.to_string();
            let p = &self.probe;
            let mut s = lock(&p.state);
            if let Some((have, held)) = s.working(&key)
                && have > seq
                && p.history.wrote(&key, have, held)
            {
                p.violation(
                    &mut s,
                    format!("{key}: removed at seq {seq} over newer {have}"),
                );
            }
            p.trace.line(format!("{} remove {key}@{seq}", p.name));
            s.pending.push((key, seq, None));
        }
        self.inner.remove(shared, seq).await
    }

    async fn commit(&mut self, watermark: u64, lineage: tidemark::Lineage) -> Result<()> {
        if let Err(e) = self.inner.commit(watermark, lineage).await {
            let p = &self.probe;
            let mut s = lock(&p.state);
            s.failed_commits += 1;
            p.trace
                .line(format!("{} commit at {watermark} failed: {e}", p.name));
            return Err(e);
        }
        let p = &self.probe;
        let mut s = lock(&p.state);
        if watermark < s.watermark && !p.took_restored_history(&mut s) {
            let what = format!("watermark fell from {} to {watermark}", s.watermark);
            p.violation(&mut s, what);
        }
        let dirty = !s.pending.is_empty();
        s.fold();
        // The oracle at every step: once ready, every watermark the follower commits must
        // describe its committed cache — the source's state at that seq.
        if s.ready && (dirty || watermark != s.watermark) {
            let diff = p.inconsistencies(&mut s, watermark, Skips::Excused);
            if !diff.is_empty() {
                let what = format!(
                    "cache is not the source's state at watermark {watermark}: {}",
                    diff.join("; ")
                );
                p.violation(&mut s, what);
            }
        }
        s.watermark = watermark;
        Ok(())
    }

    async fn rollback(&mut self) {
        self.inner.rollback().await;
        let p = &self.probe;
        let mut s = lock(&p.state);
        let dropped = s.take_pending().len();
        p.trace
            .line(format!("{} rolled back {dropped} changes", p.name));
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        self.inner.resume().await
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        self.inner.seqs_of(keys).await
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        self.inner.all_seqs().await
    }

    fn ready(&mut self, watermark: u64) {
        self.inner.ready(watermark);
        let p = &self.probe;
        let mut s = lock(&p.state);
        let diff = p.inconsistencies(&mut s, watermark, Skips::NoExcuse);
        if !diff.is_empty() {
            let what = format!(
                "ready at {watermark} with a cache that is not the source's state there: {}",
                diff.join("; ")
            );
            p.violation(&mut s, what);
        }
        s.ready = true;
        p.trace.line(format!("{} ready at {watermark}", p.name));
    }

    async fn drain(&mut self) {
        self.inner.drain().await;
    }
}

impl Probe {
    /// A supervised worker's handler saw `key` put at `seq`. Delivery is at least once (a
    /// failed batch is delivered again after the restart), so the same seq again is fine;
    /// an older one is not.
    pub fn handler_put(&self, key: &str, seq: u64, value: &str) {
        let mut s = self.state();
        // What the handler saw before, if the source wrote it (not so: a forged event, or
        // a history a restore replaced): only that must not be overtaken by older changes.
        let real = |have: u64, held: &str| self.history.wrote(key, have, held);
        match s.cache.get(key) {
            Some((have, held)) if *have > seq && real(*have, held) => {
                let have = *have;
                self.violation(
                    &mut s,
                    format!("{key}: handler saw put at seq {seq} over newer {have}"),
                );
            }
            Some((have, v)) if *have == seq && v != value && real(*have, v) => {
                self.violation(
                    &mut s,
                    format!("{key}: handler saw seq {seq} again with another value"),
                );
            }
            _ => {}
        }
        self.trace.line(format!("{} on_put {key}@{seq}", self.name));
        s.applied.insert((seq, key.to_owned(), value.to_owned()));
        s.cache.insert(key.to_owned(), (seq, value.to_owned()));
    }

    /// A supervised worker's handler saw `key` removed at `seq`.
    pub fn handler_delete(&self, key: &str, seq: u64) {
        let mut s = self.state();
        if let Some((have, held)) = s.cache.get(key)
            && *have > seq
            && self.history.wrote(key, *have, held)
        {
            let have = *have;
            self.violation(
                &mut s,
                format!("{key}: handler saw removal at seq {seq} over newer {have}"),
            );
        }
        self.trace
            .line(format!("{} on_delete {key}@{seq}", self.name));
        s.cache.remove(key);
    }

    /// What a supervisor says of its worker: its watermark, and whether it is live. Once
    /// live, every new watermark must describe what the handlers saw.
    pub fn observe(&self, watermark: u64, live: bool, restarts: u32) {
        let mut s = self.state();
        if restarts != s.worker_restarts {
            self.trace.line(format!(
                "{} supervisor restarted its worker ({restarts} in all)",
                self.name
            ));
            s.worker_restarts = restarts;
        }
        if watermark < s.watermark && !self.took_restored_history(&mut s) {
            let what = format!("watermark fell from {} to {watermark}", s.watermark);
            self.violation(&mut s, what);
        }
        if live && (watermark != s.watermark || !s.ready) {
            let excuse = if s.ready {
                Skips::Excused
            } else {
                Skips::NoExcuse
            };
            let diff = self.inconsistencies(&mut s, watermark, excuse);
            if !diff.is_empty() {
                let what = format!(
                    "handlers did not see the source's state at watermark {watermark}: {}",
                    diff.join("; ")
                );
                self.violation(&mut s, what);
            }
        }
        if live != s.ready || watermark != s.watermark {
            self.trace.line(format!(
                "{} supervisor: watermark {watermark}, live {live}",
                self.name
            ));
        }
        s.watermark = watermark;
        s.ready = live;
    }
}

/// One claim of an outbox row: who, when (simulated), for how long.
#[derive(Clone, Debug)]
struct ClaimMark {
    owner: String,
    at: std::time::Duration,
    lease: std::time::Duration,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Row id → the seq it announces.
    seq_of: BTreeMap<u64, u64>,
    /// Seq → every claim of its row, in order.
    claims: BTreeMap<u64, Vec<ClaimMark>>,
    /// Seq → every publish of it by a relay: (owner, the claim it held then).
    publishes: BTreeMap<u64, Vec<(String, Option<ClaimMark>)>>,
    /// Seqs (with the relay) whose publish landed but whose relay recorded it as not
    /// landed: the answer was lost on the way back, so a second publish is by design.
    lost_answers: BTreeSet<(u64, String)>,
    /// Publishes of a row again by its own relay (a retried leg whose answer was lost).
    pub_again_same: u32,
    /// Publishes of a row by a second relay after the first one's lease ran out.
    taken_over: u32,
    violations: Vec<String>,
    /// Seqs whose rows a restore removed: a relay may still publish what it claimed of
    /// them before.
    replaced: BTreeSet<u64>,
    /// When restores happened (simulated).
    restores: Vec<std::time::Duration>,
}

/// What the relays did with the outbox, as the source host saw it: every claim, every
/// publish by a relay and every completion. It checks that a row is published by a second
/// relay only when the first one's claim had run out (or its answer was lost and it said
/// so): two relays never hold one row at once.
#[derive(Clone, Debug, Default)]
pub struct RelayLedger {
    inner: Arc<Mutex<LedgerState>>,
}

impl RelayLedger {
    /// `owner` claimed rows `(id, seq)` at `at` for `lease`.
    pub fn claimed(
        &self,
        owner: &str,
        rows: &[(u64, u64)],
        at: std::time::Duration,
        lease: std::time::Duration,
    ) {
        let mut s = lock(&self.inner);
        for &(id, seq) in rows {
            s.seq_of.insert(id, seq);
            s.claims.entry(seq).or_default().push(ClaimMark {
                owner: owner.to_owned(),
                at,
                lease,
            });
        }
    }

    /// `owner` published the event of `seq`.
    pub fn published(&self, owner: &str, seq: u64) {
        let mut s = lock(&self.inner);
        let mine = s
            .claims
            .get(&seq)
            .and_then(|c| c.iter().rev().find(|m| m.owner == owner))
            .cloned();
        if mine.is_none() && s.replaced.contains(&seq) {
            // A row a restore removed, claimed before it: another history's announcement.
            return;
        }
        let earlier = s.publishes.get(&seq).cloned().unwrap_or_default();
        for (other, held) in &earlier {
            if other == owner {
                s.pub_again_same += 1;
                continue;
            }
            if s.lost_answers.contains(&(seq, other.clone())) {
                continue;
            }
            match (held, &mine) {
                // A restore between the two claims put the row back as the backup had
                // it: the first claim was forgotten, as a restored database forgets it.
                (Some(theirs), Some(m))
                    if m.at < theirs.at + theirs.lease
                        && theirs.at < m.at + m.lease
                        && !s
                            .restores
                            .iter()
                            .any(|r| theirs.at.min(m.at) < *r && *r <= theirs.at.max(m.at)) =>
                {
                    s.violations.push(format!(
                        "the row of seq {seq} was published by {other} (claimed at {:?} for {:?}) and by {owner} (claimed at {:?} for {:?}): two relays held one row at once",
                        theirs.at, theirs.lease, m.at, m.lease
                    ));
                }
                (_, None) => s.violations.push(format!(
                    "{owner} published the row of seq {seq} without ever claiming it"
                )),
                _ => s.taken_over += 1,
            }
        }
        s.publishes
            .entry(seq)
            .or_default()
            .push((owner.to_owned(), mine));
    }

    /// `owner` recorded rows `(id, published)`: a row it says was not published although
    /// its publish landed lost its answer.
    pub fn completed(&self, owner: &str, rows: &[(u64, bool)]) {
        let mut s = lock(&self.inner);
        for &(id, published) in rows {
            let Some(&seq) = s.seq_of.get(&id) else {
                continue;
            };
            let landed = s
                .publishes
                .get(&seq)
                .is_some_and(|p| p.iter().any(|(o, _)| o == owner));
            if landed && !published {
                s.lost_answers.insert((seq, owner.to_owned()));
            }
        }
    }

    /// The source and its outbox were restored from a backup taken at `head`: rows above
    /// it are gone, and their seqs and ids will be used again by other rows. What relays do
    /// with the rows they still held from before is no longer checked against the new
    /// rows (it is announcing another history, which followers must survive).
    pub fn restore(&self, head: u64, at: std::time::Duration) {
        let mut s = lock(&self.inner);
        s.restores.push(at);
        let gone: BTreeSet<u64> = s.claims.keys().copied().filter(|seq| *seq > head).collect();
        s.seq_of.retain(|_, seq| *seq <= head);
        s.claims.retain(|seq, _| *seq <= head);
        s.publishes.retain(|seq, _| *seq <= head);
        s.lost_answers.retain(|(seq, _)| *seq <= head);
        s.replaced.extend(gone);
    }

    /// Violations found so far.
    #[must_use]
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner).violations.clone()
    }

    /// How many times a relay's publish of a row repeated by design: (by the same relay
    /// after a lost answer, by another relay after a lease ran out).
    #[must_use]
    pub fn repeats(&self) -> (u32, u32) {
        let s = lock(&self.inner);
        (s.pub_again_same, s.taken_over)
    }

    /// Seqs some relay published.
    #[must_use]
    pub fn published_seqs(&self) -> BTreeSet<u64> {
        lock(&self.inner).publishes.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A history of four changes (a, b, a again, b removed), restored to its seq 2, and a
    /// supervised worker's probe that saw `a@1`, live at 1.
    fn restored_at_2() -> (History, Probe) {
        let history = History::default();
        history.record(1, "a", Some(b"v1".to_vec()));
        history.record(2, "b", Some(b"v2".to_vec()));
        history.record(3, "a", Some(b"v3".to_vec()));
        history.record(4, "b", None);
        let probe = Probe::new("f", history.clone(), Trace::new(false));
        probe.handler_put("a", 1, "v1");
        probe.observe(1, true, 0);
        history.restore(2);
        probe.restored(2, std::time::Duration::ZERO);
        // At the restored seq the two histories agree.
        probe.handler_put("b", 2, "v2");
        probe.observe(2, true, 0);
        (history, probe)
    }

    /// [`restored_at_2`], then the restored history's own seq 3 (`c@3`), which the probe's
    /// follower read: it left the replaced history.
    fn read_the_restored_history_to_3() -> Probe {
        let (history, probe) = restored_at_2();
        history.record(3, "c", Some(b"w3".to_vec()));
        probe.handler_put("c", 3, "w3");
        probe.observe(3, true, 0);
        probe
    }

    /// The state of the current epoch at `watermark`, rebuilt from the whole history.
    fn rebuilt(history: &History, watermark: u64) -> State {
        lock(&history.inner)
            .commits
            .range(..=watermark)
            .map(|(seq, (key, value))| (key.clone(), (*seq, value.clone())))
            .collect()
    }

    #[test]
    fn a_cache_holds_what_it_should_exactly_when_it_has_no_differences() {
        let mut rng = tidemark::tidemark_core::Rng::new(11);
        let mut seen = (0, 0);
        for _ in 0..5_000 {
            let mut cache = BTreeMap::new();
            let mut expected = BTreeMap::new();
            for k in 0..4 {
                let key = format!("k{k}");
                let (seq, value) = (rng.next_u64() % 3, format!("v{}", rng.next_u64() % 2));
                match rng.next_u64() % 4 {
                    0 => {}
                    1 => {
                        expected.insert(key.clone(), Expect::Value(seq, value.clone()));
                    }
                    _ => {
                        expected.insert(key.clone(), Expect::OlderThan(seq));
                    }
                }
                if rng.next_u64() % 3 != 0 {
                    let (s, v) = if rng.next_u64() % 2 == 0 {
                        (seq, value)
                    } else {
                        (rng.next_u64() % 3, format!("v{}", rng.next_u64() % 2))
                    };
                    cache.insert(key, (s, v));
                }
            }
            let want = differences(&cache, &expected).is_empty();
            assert_eq!(holds(&cache, &expected), want, "{cache:?} {expected:?}");
            if want {
                seen.0 += 1;
            } else {
                seen.1 += 1;
            }
        }
        assert!(
            seen.0 > 100 && seen.1 > 100,
            "both outcomes drawn: {seen:?}"
        );
    }

    #[test]
    fn a_cache_checked_at_the_top_seq_is_compared_not_overflowed() {
        // A follower may commit u64::MAX (a foreign event's seq); "past the watermark" is
        // then nothing, not the whole history from 0, whose removal at 2 would excuse the
        // missing key.
        let history = History::default();
        history.record(1, "a", Some(b"v".to_vec()));
        history.record(2, "a", None);
        history.record(3, "a", Some(b"w".to_vec()));
        assert_eq!(
            history.inconsistencies(&BTreeMap::new(), u64::MAX, &|_| false),
            vec!["a: missing; the source at 18446744073709551615 has seq 3"]
        );
    }

    #[test]
    fn a_state_cursor_is_the_state_rebuilt_from_the_history_wherever_it_moves() {
        let history = History::default();
        let mut cursors = StateCursors::new();
        let mut rng = tidemark::tidemark_core::Rng::new(7);
        let mut head = 0;
        for step in 0..2_000 {
            match rng.next_u64() % 10 {
                // Commits, some past a watermark a cursor was already asked for.
                0..=4 => {
                    head += 1;
                    let key = format!("k{}", rng.next_u64() % 12);
                    let value = (rng.next_u64() % 3 != 0).then(|| vec![b'v'; step % 5]);
                    history.record(head, &key, value);
                }
                // A restore back to an earlier seq: the next commits reuse seqs.
                5 if head > 3 => {
                    head -= rng.next_u64() % 4;
                    history.restore(head);
                }
                // Checks at watermarks forward, back, past the head and at zero.
                _ => {
                    let watermark = rng.next_u64() % (head + 3);
                    let current = lock(&history.inner);
                    let epoch = lock(&history.past).len();
                    let state = cursors.entry(epoch).or_default().seek(
                        (epoch, current.generation),
                        &current.commits,
                        watermark,
                    );
                    let state = state.clone();
                    drop(current);
                    assert_eq!(state, rebuilt(&history, watermark), "step {step}");
                }
            }
        }
    }

    #[test]
    fn a_follower_at_the_restored_seq_may_still_apply_the_replaced_history_then_take_the_restored_one()
     {
        // Seeds 6577 and 7894: the source sent 3 and 4 before the restore, and they reach
        // the follower after it; the feed's end after them sends it to the restored
        // source, which is behind it, and it resyncs.
        let (_, probe) = restored_at_2();
        probe.handler_put("a", 3, "v3");
        probe.handler_delete("b", 4);
        probe.observe(4, true, 0);
        assert_eq!(probe.state().violations, Vec::<String>::new());
        probe.handler_put("a", 1, "v1");
        probe.handler_put("b", 2, "v2");
        probe.observe(2, true, 0);
        assert_eq!(probe.state().violations, Vec::<String>::new());
        assert_eq!(probe.state().fell_back_for, 1);
    }

    #[test]
    fn a_follower_that_read_the_restored_history_past_its_seq_may_not_go_back_or_return_to_the_replaced_one()
     {
        let probe = read_the_restored_history_to_3();
        assert_eq!(probe.state().violations, Vec::<String>::new());
        probe.handler_delete("c", 3);
        probe.observe(2, true, 0);
        let violations = probe.state().violations.clone();
        assert!(
            violations
                .first()
                .is_some_and(|v| v.contains("watermark fell from 3 to 2")),
            "{violations:?}"
        );

        let probe = read_the_restored_history_to_3();
        probe.handler_delete("c", 3);
        probe.handler_put("a", 3, "v3");
        probe.handler_delete("b", 4);
        probe.observe(4, true, 0);
        let violations = probe.state().violations.clone();
        assert!(
            violations
                .first()
                .is_some_and(|v| v.contains("handlers did not see the source's state")),
            "{violations:?}"
        );
    }

    /// A probe's sink over a memory cache store, at watermark 2 holding `a`@1 and `b`@2.
    async fn holding_a_and_b(
        history: &History,
    ) -> (Probe, Probed<tidemark_memory::MemoryCacheSink>) {
        history.record(1, "a", Some(b"v1".to_vec()));
        history.record(2, "b", Some(b"v2".to_vec()));
        let probe = Probe::new("f", history.clone(), Trace::new(false));
        let mut sink = probe.sink(MemoryCacheStore::new().sink());
        sink.put("a".into(), 1, "v1".into()).await.unwrap();
        sink.put("b".into(), 2, "v2".into()).await.unwrap();
        sink.commit(2, tidemark::Lineage::default()).await.unwrap();
        (probe, sink)
    }

    #[tokio::test]
    async fn a_follower_compacted_past_its_watermark_may_put_what_it_holds_again_and_no_other() {
        // Seed 7519: where compaction took the stamp at the watermark, a resync puts every
        // entry again, at the seqs the cache holds them at.
        let history = History::default();
        let (probe, mut sink) = holding_a_and_b(&history).await;
        history.record(3, "c", Some(b"v3".to_vec()));
        history.record(4, "d", Some(b"v4".to_vec()));
        history.compacted(4);
        sink.put("a".into(), 1, "v1".into()).await.unwrap();
        sink.put("b".into(), 2, "v2".into()).await.unwrap();
        assert_eq!(probe.state().violations, Vec::<String>::new());
        // The same seq with a value the source never wrote there is still caught.
        sink.put("a".into(), 1, "forged".into()).await.unwrap();
        assert_eq!(
            probe.state().violations.len(),
            1,
            "{:?}",
            probe.state().violations
        );

        // Not compacted past the watermark: the same change again is a second apply.
        let history = History::default();
        let (probe, mut sink) = holding_a_and_b(&history).await;
        history.record(3, "c", Some(b"v3".to_vec()));
        history.compacted(3);
        sink.put("a".into(), 1, "v1".into()).await.unwrap();
        let violations = probe.state().violations.clone();
        assert!(
            violations.iter().any(|v| v.contains("applied twice")),
            "{violations:?}"
        );
    }
}
