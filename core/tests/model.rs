//! Model test: random interleavings of writes, feed faults, failures, compaction and
//! timeouts against a small reference source. After healing and a final reconcile the
//! follower's cache equals the source's map and its watermark the source's; never-older
//! per key holds at every step.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use proptest::prelude::*;
use tidemark_core::*;

#[derive(Clone, Debug)]
enum Step {
    /// Put key `k`; poison values are invalid UTF-8; `marker` announces it as a mutation.
    Put {
        k: u8,
        poison: bool,
        marker: bool,
    },
    Delete {
        k: u8,
        purge: bool,
    },
    Deliver,
    Duplicate,
    Skip,
    Swap,
    FailFeed,
    EndFeed,
    FailNextRequest,
    Compact {
        all: bool,
    },
    Wake,
    Tick(u16),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u8..6, prop::bool::weighted(0.1), prop::bool::weighted(0.15))
            .prop_map(|(k, poison, marker)| Step::Put { k, poison, marker }),
        2 => (0u8..6, any::<bool>()).prop_map(|(k, purge)| Step::Delete { k, purge }),
        8 => Just(Step::Deliver),
        1 => Just(Step::Duplicate),
        1 => Just(Step::Skip),
        1 => Just(Step::Swap),
        1 => Just(Step::FailFeed),
        1 => Just(Step::EndFeed),
        1 => Just(Step::FailNextRequest),
        2 => any::<bool>().prop_map(|all| Step::Compact { all }),
        1 => Just(Step::Wake),
        2 => (0u16..5000).prop_map(Step::Tick),
    ]
}

/// The reference source: a registry with tombstones, a gapless change log and a
/// compaction horizon below which neither tombstones nor log entries are kept.
#[derive(Default)]
struct Source {
    seq: u64,
    live: BTreeMap<String, (u64, Vec<u8>)>,
    tombstones: BTreeMap<String, u64>,
    log: Vec<Entry>, // log[i] has seq i + 1
    horizon: u64,    // first seq still served; 0 = nothing compacted
}

impl Source {
    fn first_available(&self) -> u64 {
        self.horizon.max(1)
    }

    fn changes_since(&self, since: u64) -> Result<Vec<Entry>, u64> {
        if since + 1 < self.horizon {
            return Err(self.horizon);
        }
        let mut rows: Vec<Entry> = self
            .live
            .iter()
            .filter(|(_, (s, _))| *s > since)
            .map(|(k, (s, v))| Entry::put(*s, k.clone(), v.clone()))
            .chain(
                self.tombstones
                    .iter()
                    .filter(|(_, s)| **s > since)
                    .map(|(k, s)| Entry::delete(*s, k.clone())),
            )
            .collect();
        rows.sort_by_key(|e| e.seq);
        Ok(rows)
    }
}

struct World {
    f: Follower<Utf8>,
    now: Time,
    src: Source,
    cache: BTreeMap<String, (u64, String)>,
    feed: Option<(Token, u64)>, // token, next seq to deliver
    pending: VecDeque<Input>,   // answers the driver owes the follower
    fail_next: bool,
    last_watermark: u64,
}

impl World {
    fn new(seed: u64) -> Self {
        let config = FollowerConfig::builder("model").seed(seed).build().unwrap();
        let mut w = World {
            f: Follower::new(config, Utf8),
            now: Time::ZERO,
            src: Source::default(),
            cache: BTreeMap::new(),
            feed: None,
            pending: VecDeque::new(),
            fail_next: false,
            last_watermark: 0,
        };
        w.settle();
        w
    }

    fn request_result(&mut self, token: Token, ok: Input) -> Input {
        if std::mem::take(&mut self.fail_next) {
            Input::RequestFailed {
                token,
                error: "injected".into(),
            }
        } else {
            ok
        }
    }

    /// Drains outputs, carries them out against the model, and feeds answers back until
    /// nothing is left to do.
    fn settle(&mut self) {
        loop {
            while let Some(out) = self.f.poll_output() {
                self.perform(out);
            }
            self.check();
            match self.pending.pop_front() {
                Some(input) => self.f.handle_input(input, self.now),
                None => break,
            }
        }
    }

    fn perform(&mut self, out: Output<String>) {
        match out {
            Output::Request(Request::LookupSource { token }) => {
                let input = self.request_result(token, Input::SourceFound { token });
                self.pending.push_back(input);
            }
            Output::Request(Request::OpenFeed { token, from, .. }) => {
                assert_eq!(from, self.f.watermark() + 1);
                self.feed = Some((token, from));
                let info = FeedInfo {
                    first_available: self.src.first_available(),
                    head: self.src.seq,
                    continuity: Continuity::Gapless,
                    checkpoints: true,
                    follow: Follow::Replay,
                    lineage: Default::default(),
                };
                self.pending.push_back(Input::FeedOpened { token, info });
            }
            Output::Request(Request::CloseFeed { token })
                if self.feed.is_some_and(|(t, _)| t == token) =>
            {
                self.feed = None;
            }
            Output::Request(Request::CloseFeed { .. }) => {}
            Output::Request(Request::Reconcile { token, since }) => {
                let ok = match self.src.changes_since(since) {
                    Ok(changes) => Input::Changes {
                        token,
                        changes,
                        source_watermark: self.src.seq,
                    },
                    Err(first_available) => Input::ChangesUnavailable {
                        token,
                        first_available,
                    },
                };
                let input = self.request_result(token, ok);
                self.pending.push_back(input);
            }
            Output::Request(Request::Snapshot { token }) => {
                let entries = self
                    .src
                    .live
                    .iter()
                    .map(|(k, (s, v))| Entry::put(*s, k.clone(), v.clone()))
                    .collect();
                let ok = Input::Snapshot {
                    token,
                    entries,
                    source_watermark: self.src.seq,
                };
                let input = self.request_result(token, ok);
                self.pending.push_back(input);
            }
            Output::Request(Request::Fetch { token, key, .. }) => {
                let value = self.src.live.get(&key).cloned();
                let source_watermark = Some(self.src.seq);
                let input = self.request_result(
                    token,
                    Input::Fetched {
                        token,
                        value,
                        source_watermark,
                    },
                );
                self.pending.push_back(input);
            }
            Output::Apply(Apply::Put { key, seq, value }) => {
                if let Some((have, _)) = self.cache.get(&*key) {
                    assert!(
                        seq > *have,
                        "{key}: {seq} replaced the newer-or-equal {have}"
                    );
                }
                self.cache.insert(key.to_string(), (seq, value));
            }
            Output::Apply(Apply::Remove { key, .. }) => {
                self.cache.remove(&*key);
            }
            Output::Request(Request::Checkpoint { .. })
            | Output::Notice(Notice::Ready { .. })
            | Output::Diagnostic(_) => {}
            Output::Notice(Notice::Stopped) => panic!("nobody asked it to stop"),
            _ => {}
        }
    }

    fn check(&mut self) {
        let wm = self.f.watermark();
        assert!(
            wm >= self.last_watermark,
            "watermark fell from {} to {wm}",
            self.last_watermark
        );
        self.last_watermark = wm;
    }

    fn write(&mut self, key: String, entry_op: Op, value: Option<Vec<u8>>) {
        self.src.seq += 1;
        let seq = self.src.seq;
        match value {
            Some(v) => {
                self.src.tombstones.remove(&key);
                self.src.live.insert(key.clone(), (seq, v.clone()));
                let payload = if entry_op == Op::Put { v } else { Vec::new() };
                self.src
                    .log
                    .push(Entry::new(seq, seq, key, entry_op, payload));
            }
            None => {
                self.src.live.remove(&key);
                self.src.tombstones.insert(key.clone(), seq);
                self.src
                    .log
                    .push(Entry::new(seq, seq, key, entry_op, Vec::new()));
            }
        }
    }

    fn deliver(&mut self, seq: u64) {
        let Some((token, _)) = self.feed else { return };
        if seq == 0 || seq < self.src.first_available() {
            return;
        }
        if let Some(entry) = self.src.log.get(seq as usize - 1).cloned() {
            self.f.handle_input(Input::Entry { token, entry }, self.now);
            self.settle();
        }
    }

    fn run(&mut self, step: Step) {
        match step {
            Step::Put { k, poison, marker } => {
                let value = if poison {
                    vec![0xff, 0xfe]
                } else {
                    format!("v{}", self.src.seq + 1).into_bytes()
                };
                let op = if marker { Op::Mutation } else { Op::Put };
                self.write(format!("k{k}"), op, Some(value));
            }
            Step::Delete { k, purge } => {
                let key = format!("k{k}");
                if self.src.live.contains_key(&key) {
                    self.write(key, if purge { Op::Purge } else { Op::Delete }, None);
                }
            }
            Step::Deliver | Step::Duplicate | Step::Skip | Step::Swap => {
                let Some((token, next)) = self.feed else {
                    return;
                };
                if next > self.src.seq {
                    return;
                }
                match step {
                    Step::Deliver => {
                        self.feed = Some((token, next + 1));
                        self.deliver(next);
                    }
                    Step::Duplicate => self.deliver(next.saturating_sub(1)),
                    Step::Skip => self.feed = Some((token, next + 1)),
                    _ => {
                        self.feed = Some((token, next + 2));
                        self.deliver(next + 1);
                        self.deliver(next);
                    }
                }
            }
            Step::FailFeed | Step::EndFeed => {
                if let Some((token, _)) = self.feed.take() {
                    let input = if matches!(step, Step::FailFeed) {
                        Input::FeedFailed {
                            token,
                            error: "injected".into(),
                        }
                    } else {
                        Input::FeedEnded { token }
                    };
                    self.f.handle_input(input, self.now);
                    self.settle();
                }
            }
            Step::FailNextRequest => self.fail_next = true,
            Step::Compact { all } => {
                let step = if all { self.src.seq } else { 3 };
                self.src.horizon = (self.src.horizon.max(1) + step).min(self.src.seq + 1);
                let h = self.src.horizon;
                self.src.tombstones.retain(|_, s| *s >= h);
            }
            Step::Wake => {
                self.f.handle_input(Input::Wake, self.now);
                self.settle();
            }
            Step::Tick(ms) => {
                self.now = self
                    .now
                    .saturating_add(Duration::from_millis(u64::from(ms)));
                self.f.handle_timeout(self.now);
                self.settle();
            }
        }
    }

    /// Heals every fault, lets timers run out, delivers everything and reconciles once.
    fn heal(&mut self) {
        self.fail_next = false;
        for _ in 0..64 {
            if let Some(at) = self.f.poll_timeout() {
                self.now = at;
                self.f.handle_timeout(at);
                self.settle();
            }
            while let Some((token, next)) = self.feed {
                if next > self.src.seq {
                    break;
                }
                self.feed = Some((token, next + 1));
                self.deliver(next);
            }
            if self.f.poll_timeout().is_none() && self.feed.is_some() {
                break;
            }
        }
        self.f.handle_input(Input::Wake, self.now);
        self.settle();
    }

    fn assert_converged(&self) {
        assert!(self.f.is_ready(), "a healed follower must be ready");
        assert_eq!(
            self.f.watermark(),
            self.src.seq,
            "watermark must equal the source's"
        );
        for (key, (seq, bytes)) in &self.src.live {
            match (std::str::from_utf8(bytes), self.cache.get(key)) {
                (Ok(text), Some((s, v))) => {
                    assert_eq!(
                        (s, v.as_str()),
                        (seq, text),
                        "{key} differs from the source"
                    )
                }
                (Ok(_), None) => panic!("{key} is missing from the cache"),
                // Poison: skipped, so the cache keeps an older value or none.
                (Err(_), Some((s, _))) => assert!(s < seq, "{key}: poison was applied"),
                (Err(_), None) => {}
            }
        }
        for key in self.cache.keys() {
            assert!(
                self.src.live.contains_key(key),
                "{key} was removed from the source but not the cache"
            );
        }
    }
}

/// 512 cases unless `PROPTEST_CASES` asks for more (a campaign does).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn follower_converges_with_the_reference_source(seed in any::<u64>(), steps in prop::collection::vec(step(), 0..160)) {
        let mut w = World::new(seed);
        for s in steps {
            w.run(s);
        }
        w.heal();
        w.assert_converged();
    }
}

/// The same seed and inputs produce the identical output sequence.
#[test]
fn same_seed_and_inputs_give_identical_outputs() {
    fn run(seed: u64) -> Vec<String> {
        let config = FollowerConfig::builder("det").seed(seed).build().unwrap();
        let mut f = Follower::new(config, Utf8);
        let mut trace = Vec::new();
        let mut now = Time::ZERO;
        let drain = |f: &mut Follower<Utf8>, trace: &mut Vec<String>| {
            let mut tokens = Vec::new();
            while let Some(o) = f.poll_output() {
                if let Output::Request(Request::LookupSource { token })
                | Output::Request(Request::OpenFeed { token, .. }) = &o
                {
                    tokens.push(*token);
                }
                trace.push(format!("{o:?}"));
            }
            tokens
        };
        let mut token = drain(&mut f, &mut trace)[0];
        for round in 0..20u64 {
            f.handle_input(
                Input::RequestFailed {
                    token,
                    error: "lookup".into(),
                },
                now,
            );
            drain(&mut f, &mut trace);
            now = f.poll_timeout().unwrap();
            f.handle_timeout(now);
            token = drain(&mut f, &mut trace)[0];
            trace.push(format!("round {round} at {now}"));
        }
        f.handle_input(Input::SourceFound { token }, now);
        let feed = drain(&mut f, &mut trace)[0];
        let info = FeedInfo {
            first_available: 1,
            head: 3,
            continuity: Continuity::Gapless,
            checkpoints: true,
            follow: Follow::Replay,
            lineage: Default::default(),
        };
        f.handle_input(Input::FeedOpened { token: feed, info }, now);
        for (i, k) in ["x", "y", "x"].iter().enumerate() {
            f.handle_input(
                Input::Entry {
                    token: feed,
                    entry: Entry::put(i as u64 + 1, *k, "v"),
                },
                now,
            );
        }
        f.handle_input(
            Input::FeedFailed {
                token: feed,
                error: "cut".into(),
            },
            now,
        );
        drain(&mut f, &mut trace);
        trace
    }
    let a = run(11);
    assert_eq!(
        a,
        run(11),
        "a replay with the same seed must match output for output"
    );
    assert_ne!(
        a,
        run(12),
        "the seed must reach the jitter, or the test proves nothing"
    );
}
