//! What must hold, judged from what the followers showed and what the writers know landed
//! (the ledger): every value shown was written at the revision shown; never an older
//! value per key than one already shown; a key dropped only after a delete or purge; a
//! view at watermark W shows every key as the bucket held it at W unless the key's next
//! change was already sent when the view was read (a history-1 bucket may have replaced
//! the message at W before the follower read it); a follower's first ready view holds
//! every key present at its watermark; and, after the round heals, every follower equals
//! a fresh read of the bucket.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use crate::ledger::{Kind, Ledger};

/// One entry as a follower showed it: key, revision, the value's token.
pub type Shown = (String, u64, String);

/// A key's drop or return, judged against the ledger once it is complete.
#[derive(Debug)]
enum Flip {
    /// Shown at `after`, then not at all.
    Vanished { key: String, after: u64 },
    /// Shown at `before`, dropped, then shown at `at`.
    Back { key: String, before: u64, at: u64 },
}

/// A view read whole at one watermark, and when the read ended.
#[derive(Debug)]
struct View {
    watermark: u64,
    read: Instant,
    held: HashMap<String, u64>,
}

/// What one follower (one start of the cache, or the mirror's file across its restarts)
/// showed, sample after sample.
#[derive(Debug)]
pub struct Watcher {
    pub name: String,
    last: HashMap<String, (u64, bool)>,
    shown: BTreeSet<Shown>,
    flips: Vec<Flip>,
    views: Vec<View>,
    watermark: u64,
    /// The entries of the last sample, and when a sample last showed other entries than
    /// the one before it: what the follower holds since then.
    previous: Vec<Shown>,
    changed: Option<Instant>,
    pub samples: u64,
    /// Broken at once (an older value, a watermark that went back); the rest waits for
    /// the ledger.
    pub violations: Vec<String>,
}

impl Watcher {
    pub fn new(name: impl Into<String>) -> Watcher {
        Watcher {
            name: name.into(),
            last: HashMap::new(),
            shown: BTreeSet::new(),
            flips: Vec::new(),
            views: Vec::new(),
            watermark: 0,
            previous: Vec::new(),
            changed: None,
            samples: 0,
            violations: Vec::new(),
        }
    }

    /// One sample: every entry the follower holds; with `at`, the watermark they are
    /// exactly at (one read of the mirror's file; the cache's, read with its watermark
    /// unmoved around it) and when the read ended.
    pub fn observe(&mut self, at: Option<(u64, Instant)>, entries: &[Shown]) {
        self.samples += 1;
        if self.changed.is_none() || self.previous != entries {
            self.changed = Some(Instant::now());
            self.previous = entries.to_vec();
        }
        let watermark = at.map(|(w, _)| w);
        if let Some((w, read)) = at {
            let held = entries.iter().map(|(k, s, _)| (k.clone(), *s)).collect();
            self.views.push(View {
                watermark: w,
                read,
                held,
            });
            if w < self.watermark {
                self.violations.push(format!(
                    "{}: committed watermark went back from {} to {w}",
                    self.name, self.watermark
                ));
            }
            self.watermark = self.watermark.max(w);
        }
        let mut present = BTreeSet::new();
        for (key, seq, token) in entries {
            present.insert(key.as_str());
            if watermark.is_some_and(|w| *seq > w) {
                self.violations.push(format!(
                    "{}: {key} at {seq} committed above its watermark {watermark:?}",
                    self.name
                ));
            }
            match self.last.get(key) {
                Some((prev, _)) if seq < prev => self.violations.push(format!(
                    "{}: {key} went back from revision {prev} to {seq} (never-older)",
                    self.name
                )),
                Some((prev, false)) => self.flips.push(Flip::Back {
                    key: key.clone(),
                    before: *prev,
                    at: *seq,
                }),
                _ => {}
            }
            self.shown.insert((key.clone(), *seq, token.clone()));
            self.last.insert(key.clone(), (*seq, true));
        }
        for (key, (seq, shown)) in &mut self.last {
            if *shown && !present.contains(key.as_str()) {
                *shown = false;
                self.flips.push(Flip::Vanished {
                    key: key.clone(),
                    after: *seq,
                });
            }
        }
    }
}

impl Watcher {
    /// When the follower came to hold what it holds now (its entries unchanged in every
    /// sample since), if it was sampled at all.
    pub fn holding_since(&self) -> Option<Instant> {
        self.changed
    }
}

/// A follower's view at the moment it became ready.
#[derive(Debug, Clone)]
pub struct ReadyView {
    pub follower: String,
    pub watermark: u64,
    pub entries: Vec<Shown>,
}

/// How many checks passed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checks {
    /// Samples taken of the followers (each checked for never-older at once).
    pub samples: u64,
    /// Distinct (key, revision, value) a follower showed, each found in the ledger.
    pub values: u64,
    /// Drops and returns of a key, each matched to a delete or purge.
    pub flips: u64,
    /// Keys in views at a watermark found as the bucket held them there.
    pub current: u64,
    /// First ready views checked, and the keys they were checked for.
    pub ready_views: u64,
    pub ready_keys: u64,
    /// The bucket read after healing matched the ledger.
    pub ledger_matches: u64,
    /// Followers found equal to the bucket after healing.
    pub converged: u64,
    /// Followers that came to hold it within the liveness bound.
    pub live: u64,
    /// Durable consumers whose saved cursor reached the stream's last event.
    pub cursors: u64,
}

impl Checks {
    pub fn add(&mut self, o: &Checks) {
        self.samples += o.samples;
        self.values += o.values;
        self.flips += o.flips;
        self.current += o.current;
        self.ready_views += o.ready_views;
        self.ready_keys += o.ready_keys;
        self.ledger_matches += o.ledger_matches;
        self.converged += o.converged;
        self.live += o.live;
        self.cursors += o.cursors;
    }
}

/// Judges what the watchers saw against the complete ledger; returns what broke.
pub fn judge(ledger: &Ledger, watcher: &Watcher, checks: &mut Checks) -> Vec<String> {
    let name = &watcher.name;
    let mut failures = watcher.violations.clone();
    checks.samples += watcher.samples;
    for (key, seq, token) in &watcher.shown {
        match ledger.at(key, *seq) {
            Some(Kind::Put(t)) if t == token => checks.values += 1,
            found => failures.push(format!(
                "{name}: showed {key} = {token:?} at revision {seq}, but what landed there \
                 is {found:?}"
            )),
        }
    }
    for flip in &watcher.flips {
        match flip {
            Flip::Vanished { key, after } if !ledger.removed_between(key, *after, None) => failures
                .push(format!(
                    "{name}: dropped {key} after showing revision {after}, but no delete or \
                     purge of it landed after that"
                )),
            Flip::Back { key, before, at } if !ledger.removed_between(key, *before, Some(*at)) => {
                failures.push(format!(
                    "{name}: showed {key} at {before}, dropped it, then showed it at {at}: \
                     every removal it could have shown is newer than {at} (never-older)"
                ))
            }
            _ => checks.flips += 1,
        }
    }
    let mut stale = Vec::new();
    for view in &watcher.views {
        let w = view.watermark;
        for key in ledger.keys() {
            // The bucket may have replaced the message at W before the follower read it
            // only if the key's next change was sent before the view was read.
            if ledger
                .next_sent_after(key, w)
                .is_some_and(|sent| sent < view.read)
            {
                continue;
            }
            let expected = ledger.state_at(key, w).map(|(seq, _)| seq);
            match view.held.get(key).copied() {
                got if got == expected => checks.current += 1,
                got => stale.push(format!(
                    "{name}: at watermark {w} showed {key} at {got:?}, but the bucket held it \
                     at {expected:?} then and its next change was sent after this view was read"
                )),
            }
        }
    }
    if stale.len() > 8 {
        let more = stale.len() - 8;
        stale.truncate(8);
        stale.push(format!(
            "{name}: and {more} more views out of date like these"
        ));
    }
    failures.extend(stale);
    failures
}

/// Judges a first ready view at watermark W: nothing above W; every key present at W is
/// held; a key not written after W (its message at W is still in the stream to read) is
/// held exactly as at W, or not at all if it was removed.
pub fn judge_ready(ledger: &Ledger, view: &ReadyView, checks: &mut Checks) -> Vec<String> {
    let (name, w) = (&view.follower, view.watermark);
    let mut failures = Vec::new();
    let held: HashMap<&str, u64> = view
        .entries
        .iter()
        .map(|(k, s, _)| (k.as_str(), *s))
        .collect();
    for (key, seq, _) in &view.entries {
        if *seq > w {
            failures.push(format!(
                "{name}: ready at {w} but holds {key} at {seq}, above it"
            ));
        }
    }
    for key in ledger.keys() {
        let at_w = ledger.state_at(key, w);
        let settled = !ledger.changed_after(key, w);
        match (at_w, held.get(key.as_str())) {
            (Some((seq, _)), None) => failures.push(format!(
                "{name}: ready at {w} without {key}, which the bucket held at {seq} then \
                 (first ready view holds every key present at its head)"
            )),
            (Some((seq, _)), Some(got)) if settled && *got != seq => failures.push(format!(
                "{name}: ready at {w} with {key} at {got}, but the bucket held it at {seq} \
                 and never changed it after"
            )),
            (None, Some(got)) if settled => failures.push(format!(
                "{name}: ready at {w} with {key} at {got}, which was removed by then and \
                 never written again"
            )),
            _ => {}
        }
        checks.ready_keys += 1;
    }
    checks.ready_views += 1;
    failures
}

/// The checker must catch what it is there to catch: judged on a small made-up history,
/// each kind of violation is reported and a correct run is not. Run before every
/// campaign (it takes microseconds), since a checker that cannot fail proves nothing.
pub fn self_check() {
    use crate::ledger::Landed;
    let (early, late) = (
        Instant::now(),
        Instant::now() + std::time::Duration::from_secs(60),
    );
    let mut ledger = Ledger::default();
    let history = [
        ("a", 1, Kind::Put("a#1".into()), early),
        ("b", 2, Kind::Put("b#1".into()), early),
        ("a", 3, Kind::Put("a#2".into()), early),
        ("a", 5, Kind::Delete, early),
        ("b", 6, Kind::Put("b#2".into()), late),
    ];
    for (key, seq, kind, sent) in history {
        let landed = Landed {
            key: key.into(),
            seq,
            kind,
            sent,
        };
        ledger.record(&landed).unwrap_or_else(|e| panic!("{e}"));
    }
    let shown = |key: &str, seq: u64, token: &str| (key.to_owned(), seq, token.to_owned());
    let judged = |samples: &[(Option<u64>, Vec<Shown>)]| {
        let mut watcher = Watcher::new("made-up");
        for (at, entries) in samples {
            watcher.observe(at.map(|w| (w, early)), entries);
        }
        judge(&ledger, &watcher, &mut Checks::default())
    };
    let expect = |what: &str, failures: Vec<String>, needle: &str| {
        assert!(
            failures.iter().any(|f| f.contains(needle)),
            "the checker must report {what} ({needle:?}); it said {failures:?}"
        );
    };

    let good = judged(&[
        (Some(2), vec![shown("a", 1, "a#1"), shown("b", 2, "b#1")]),
        (Some(3), vec![shown("a", 3, "a#2"), shown("b", 2, "b#1")]),
        (Some(5), vec![shown("b", 2, "b#1")]),
    ]);
    assert!(
        good.is_empty(),
        "a correct run must pass the checker: {good:?}"
    );
    let older = judged(&[
        (None, vec![shown("a", 3, "a#2")]),
        (None, vec![shown("a", 1, "a#1")]),
    ]);
    expect("an older value", older, "never-older");
    let invented = judged(&[(None, vec![shown("a", 3, "a#9")])]);
    expect("a value never written there", invented, "what landed there");
    let dropped = judged(&[(None, vec![shown("b", 2, "b#1")]), (None, vec![])]);
    expect(
        "a key dropped without a removal",
        dropped,
        "no delete or purge",
    );
    let stale = judged(&[(Some(5), vec![shown("a", 3, "a#2"), shown("b", 2, "b#1")])]);
    expect(
        "a view behind a change it must hold",
        stale,
        "at watermark 5 showed a",
    );
    let behind = judged(&[(Some(3), vec![shown("a", 3, "a#2")])]);
    expect(
        "a view without a key it must hold",
        behind,
        "at watermark 3 showed b",
    );

    let view = |entries| ReadyView {
        follower: "made-up".into(),
        watermark: 3,
        entries,
    };
    let ready = view(vec![shown("a", 3, "a#2"), shown("b", 2, "b#1")]);
    let fine = judge_ready(&ledger, &ready, &mut Checks::default());
    assert!(fine.is_empty(), "a complete ready view must pass: {fine:?}");
    let lacking = judge_ready(
        &ledger,
        &view(vec![shown("b", 2, "b#1")]),
        &mut Checks::default(),
    );
    expect("a ready view without a present key", lacking, "without a");
}
