//! The oracle: the source's full history, per-follower probes that check safety on every
//! change they see, and the convergence check of the liveness phase.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::{Result, Sink};

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
                let recorded = history.get(seq);
                if recorded.is_none_or(|(k, v)| k != key || v.as_deref() != Some(value.as_bytes()))
                {
                    out.push(format!("{key}: holds seq {seq} above the watermark that the source never wrote for it"));
                }
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

/// What one follower has seen, checked as it goes. Lives outside the follower's host, so
/// a follower with a persisted cache finds it again after a crash.
#[derive(Debug, Default)]
pub struct ProbeState {
    /// The cache: key → (seq, value).
    pub cache: BTreeMap<String, (u64, String)>,
    /// The applied watermark last reported.
    pub watermark: u64,
    /// Whether the current incarnation reported ready.
    pub ready: bool,
    /// Seqs of puts applied to this cache (double-apply detection).
    pub applied: BTreeSet<u64>,
    /// Safety violations seen.
    pub violations: Vec<String>,
    /// Restarts so far.
    pub incarnation: u32,
}

/// A follower's sink that checks, on every change: per-key never-older, no seq applied
/// twice, watermark monotone, and at ready that the cache holds exactly the source's
/// state at the reported watermark.
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

    /// The probe's state.
    pub fn state(&self) -> MutexGuard<'_, ProbeState> {
        lock(&self.state)
    }

    /// A new incarnation of the follower; `persisted` keeps the cache and watermark (a
    /// persisted cache), otherwise they are lost with the crash.
    pub fn restart(&self, persisted: bool) {
        let mut s = self.state();
        s.incarnation += 1;
        s.ready = false;
        if !persisted {
            s.cache.clear();
            s.watermark = 0;
            s.applied.clear();
        }
    }

    fn violation(&self, s: &mut ProbeState, what: String) {
        self.trace.line(format!("VIOLATION {}: {what}", self.name));
        s.violations.push(what);
    }
}

impl Sink<String> for Probe {
    async fn put(&mut self, key: String, seq: u64, value: String) -> Result<()> {
        let mut s = lock(&self.state);
        if let Some((have, _)) = s.cache.get(&key)
            && *have >= seq
        {
            let have = *have;
            self.violation(
                &mut s,
                format!("{key}: put at seq {seq} over newer-or-equal {have}"),
            );
        }
        if !s.applied.insert(seq) {
            self.violation(&mut s, format!("seq {seq} applied twice"));
        }
        self.trace.line(format!("{} put {key}@{seq}", self.name));
        s.cache.insert(key, (seq, value));
        Ok(())
    }

    async fn remove(&mut self, key: String, seq: u64) -> Result<()> {
        let mut s = lock(&self.state);
        if let Some((have, _)) = s.cache.get(&key)
            && *have > seq
        {
            let have = *have;
            self.violation(
                &mut s,
                format!("{key}: removed at seq {seq} over newer {have}"),
            );
        }
        self.trace.line(format!("{} remove {key}@{seq}", self.name));
        s.cache.remove(&key);
        Ok(())
    }

    fn ready(&mut self, watermark: u64) {
        let mut s = lock(&self.state);
        let diff = self.history.inconsistencies(&s.cache, watermark);
        if !diff.is_empty() {
            let what = format!(
                "ready at {watermark} before the initial sync: {}",
                diff.join("; ")
            );
            self.violation(&mut s, what);
        }
        s.ready = true;
        self.trace
            .line(format!("{} ready at {watermark}", self.name));
    }

    async fn commit(&mut self, watermark: u64) -> Result<()> {
        let mut s = lock(&self.state);
        if watermark < s.watermark {
            let what = format!("watermark fell from {} to {watermark}", s.watermark);
            self.violation(&mut s, what);
        }
        // The oracle at every step: once ready, every watermark the follower commits must
        // describe its cache — the source's state at that seq.
        if s.ready && watermark != s.watermark {
            let diff = self.history.inconsistencies(&s.cache, watermark);
            if !diff.is_empty() {
                let what = format!(
                    "cache is not the source's state at watermark {watermark}: {}",
                    diff.join("; ")
                );
                self.violation(&mut s, what);
            }
        }
        s.watermark = watermark;
        Ok(())
    }
}
