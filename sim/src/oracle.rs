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
/// survives compaction of the source's own log).
#[derive(Clone, Debug, Default)]
pub struct History {
    inner: Arc<Mutex<BTreeMap<u64, Commit>>>,
}

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
        lock(&self.inner).insert(seq, (key.to_owned(), value));
    }

    /// Whether the source wrote `key` at `seq` (not so: a foreign event's claim).
    #[must_use]
    pub fn wrote(&self, key: &str, seq: u64) -> bool {
        lock(&self.inner).get(&seq).is_some_and(|(k, _)| k == key)
    }

    /// The highest seq committed.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        lock(&self.inner).keys().next_back().copied().unwrap_or(0)
    }

    /// What a cache converged at `watermark` should hold.
    #[must_use]
    pub fn expected_at(&self, watermark: u64) -> BTreeMap<String, Expect> {
        let mut state: BTreeMap<String, (u64, Option<Vec<u8>>)> = BTreeMap::new();
        for (seq, (key, value)) in lock(&self.inner).range(..=watermark) {
            state.insert(key.clone(), (*seq, value.clone()));
        }
        state
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
    /// and fetched markers run ahead of the watermark); a poison value may be skipped.
    #[must_use]
    pub fn inconsistencies(
        &self,
        cache: &BTreeMap<String, (u64, String)>,
        watermark: u64,
    ) -> Vec<String> {
        let history = lock(&self.inner);
        let mut state: BTreeMap<&str, (u64, Option<&Vec<u8>>)> = BTreeMap::new();
        for (seq, (key, value)) in history.range(..=watermark) {
            state.insert(key, (*seq, value.as_ref()));
        }
        let newer = |key: &str, pred: &dyn Fn(&Option<Vec<u8>>) -> bool| {
            history
                .range(watermark + 1..)
                .any(|(_, (k, v))| k == key && pred(v))
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
                Some((want, Some(bytes)))
                    if want == seq && bytes.as_slice() == value.as_bytes() => {}
                Some((want, Some(bytes))) if std::str::from_utf8(bytes).is_err() && seq < want => {}
                want => out.push(format!(
                    "{key}: holds seq {seq}, the source at {watermark} has {:?}",
                    want.map(|(s, v)| (s, v.is_some()))
                )),
            }
        }
        for (key, (seq, value)) in &state {
            let Some(bytes) = value else { continue };
            if cache.contains_key(*key) || std::str::from_utf8(bytes).is_err() {
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
    /// Seqs of puts committed to this cache (double-apply detection).
    /// (A seq with its key: a foreign event may claim a seq the source gave another key.)
    pub applied: BTreeSet<(u64, String)>,
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
}

impl ProbeState {
    /// What `key` holds with the pending batch applied: its seq, if present.
    fn working_seq(&self, key: &str) -> Option<u64> {
        match self.pending.iter().rev().find(|(k, _, _)| k == key) {
            Some((_, seq, Some(_))) => Some(*seq),
            Some((_, _, None)) => None,
            None => self.cache.get(key).map(|(seq, _)| *seq),
        }
    }

    fn pending_applied(&self, key: &str, seq: u64) -> bool {
        self.pending
            .iter()
            .any(|(k, s, v)| v.is_some() && *s == seq && k == key)
    }

    /// Folds the pending batch into the committed cache.
    fn fold(&mut self) {
        for (key, seq, value) in std::mem::take(&mut self.pending) {
            match value {
                Some(v) => {
                    self.applied.insert((seq, key.clone()));
                    self.cache.insert(key, (seq, v));
                }
                None => {
                    self.cache.remove(&key);
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
        }
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
        let pending = std::mem::take(&mut s.pending);
        s.worker_restarts = 0;
        let Some(store) = durable else {
            s.cache.clear();
            s.watermark = 0;
            s.applied.clear();
            return;
        };
        let watermark = store.watermark().unwrap_or(0);
        if watermark < s.watermark {
            let what = format!(
                "the durable store went back from watermark {} to {watermark}",
                s.watermark
            );
            self.violation(&mut s, what);
        }
        if watermark > s.watermark {
            // The interrupted commit landed: its puts count as applied.
            s.applied.extend(
                pending
                    .iter()
                    .filter(|p| p.2.is_some())
                    .map(|p| (p.1, p.0.clone())),
            );
        }
        s.watermark = watermark;
        s.warm_restarts += u32::from(!store.is_empty());
        s.cache = store
            .entries()
            .into_iter()
            .map(|(k, (seq, v))| (k, (seq, String::from_utf8_lossy(&v).into_owned())))
            .collect();
        self.trace.line(format!(
            "{} restarts from its store at {watermark} with {} keys",
            self.name,
            s.cache.len()
        ));
        let diff = self.history.inconsistencies(&s.cache, watermark);
        if !diff.is_empty() {
            let what = format!(
                "restarted from a store that is not the source's state at its watermark {watermark}: {}",
                diff.join("; ")
            );
            self.violation(&mut s, what);
        }
    }

    fn violation(&self, s: &mut ProbeState, what: String) {
        self.trace.line(format!("VIOLATION {}: {what}", self.name));
        s.violations.push(what);
    }
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

    async fn put(&mut self, shared: Arc<str>, seq: u64, value: String) -> Result<()> {
        {
            let key = shared.to_string();
            let p = &self.probe;
            let mut s = lock(&p.state);
            // A foreign event's seq is no real version: replacing it is no regression.
            if let Some(have) = s.working_seq(&key)
                && have >= seq
                && p.history.wrote(&key, have)
            {
                p.violation(
                    &mut s,
                    format!("{key}: put at seq {seq} over newer-or-equal {have}"),
                );
            }
            if s.applied.contains(&(seq, key.clone())) || s.pending_applied(&key, seq) {
                p.violation(&mut s, format!("seq {seq} applied twice"));
            }
            p.trace.line(format!("{} put {key}@{seq}", p.name));
            s.pending.push((key, seq, Some(value.clone())));
        }
        self.inner.put(shared, seq, value).await
    }

    async fn remove(&mut self, shared: Arc<str>, seq: u64) -> Result<()> {
        {
            let key = shared.to_string();
            let p = &self.probe;
            let mut s = lock(&p.state);
            if let Some(have) = s.working_seq(&key)
                && have > seq
                && p.history.wrote(&key, have)
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

    async fn commit(&mut self, watermark: u64) -> Result<()> {
        if let Err(e) = self.inner.commit(watermark).await {
            let p = &self.probe;
            let mut s = lock(&p.state);
            s.failed_commits += 1;
            p.trace
                .line(format!("{} commit at {watermark} failed: {e}", p.name));
            return Err(e);
        }
        let p = &self.probe;
        let mut s = lock(&p.state);
        if watermark < s.watermark {
            let what = format!("watermark fell from {} to {watermark}", s.watermark);
            p.violation(&mut s, what);
        }
        let dirty = !s.pending.is_empty();
        s.fold();
        // The oracle at every step: once ready, every watermark the follower commits must
        // describe its committed cache — the source's state at that seq.
        if s.ready && (dirty || watermark != s.watermark) {
            let diff = p.history.inconsistencies(&s.cache, watermark);
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
        let dropped = std::mem::take(&mut s.pending).len();
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
        let diff = p.history.inconsistencies(&s.cache, watermark);
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

/// The sink of a follower whose cache lives only in its process: nothing to make durable,
/// nothing to resume, never fails.
#[derive(Clone, Copy, Debug, Default)]
pub struct Volatile;

impl<V: Send> Sink<V> for Volatile {
    const FALLIBLE: bool = false;

    async fn put(&mut self, _key: Arc<str>, _seq: u64, _value: V) -> Result<()> {
        Ok(())
    }

    async fn remove(&mut self, _key: Arc<str>, _seq: u64) -> Result<()> {
        Ok(())
    }
}

impl Probe {
    /// A supervised worker's handler saw `key` put at `seq`. Delivery is at least once (a
    /// failed batch is delivered again after the restart), so the same seq again is fine;
    /// an older one is not.
    pub fn handler_put(&self, key: &str, seq: u64, value: &str) {
        let mut s = self.state();
        match s.cache.get(key) {
            Some((have, _)) if *have > seq => {
                let have = *have;
                self.violation(
                    &mut s,
                    format!("{key}: handler saw put at seq {seq} over newer {have}"),
                );
            }
            Some((have, v)) if *have == seq && v != value => {
                self.violation(
                    &mut s,
                    format!("{key}: handler saw seq {seq} again with another value"),
                );
            }
            _ => {}
        }
        self.trace.line(format!("{} on_put {key}@{seq}", self.name));
        s.applied.insert((seq, key.to_owned()));
        s.cache.insert(key.to_owned(), (seq, value.to_owned()));
    }

    /// A supervised worker's handler saw `key` removed at `seq`.
    pub fn handler_delete(&self, key: &str, seq: u64) {
        let mut s = self.state();
        if let Some((have, _)) = s.cache.get(key)
            && *have > seq
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
        if watermark < s.watermark {
            let what = format!("watermark fell from {} to {watermark}", s.watermark);
            self.violation(&mut s, what);
        }
        if live && (watermark != s.watermark || !s.ready) {
            let diff = self.history.inconsistencies(&s.cache, watermark);
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
                (Some(theirs), Some(m))
                    if m.at < theirs.at + theirs.lease && theirs.at < m.at + m.lease =>
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
