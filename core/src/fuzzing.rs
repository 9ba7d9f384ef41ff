//! The bodies of the cargo-fuzz targets, as library functions.
//!
//! `fuzz/` calls these from its libFuzzer targets; plain tests replay them over a checked-in
//! corpus so that CI exercises them on the stable toolchain. Each panics on a violated
//! invariant, which is what a fuzzer looks for.

use std::collections::BTreeMap;

use crate::config::FollowerConfig;
use crate::decode::Utf8;
use crate::entry::{Entry, Op};
use crate::event::Event;
use crate::follower::{
    Apply, Continuity, Diagnostic, FeedInfo, Follow, Follower, Input, InvalidReason, Notice,
    Output, Request, Token,
};
use crate::lineage::Lineage;
use crate::time::Time;

/// Decodes arbitrary bytes as a value with each built-in decoder: never panics; `Utf8`
/// accepts exactly the valid UTF-8 inputs and gives them back unchanged, `RawBytes` gives
/// every input back, and what `Json` accepts re-encodes to JSON that decodes again.
pub fn decode_value(data: &[u8]) {
    use crate::decode::{Decode, Json, RawBytes};
    let text = Utf8.decode("k", data.to_vec());
    match std::str::from_utf8(data) {
        Ok(s) => assert_eq!(
            text.ok().as_deref(),
            Some(s),
            "valid UTF-8 decodes as itself"
        ),
        Err(_) => assert!(text.is_err(), "invalid UTF-8 is a decode error"),
    }
    assert_eq!(
        RawBytes.decode("k", data.to_vec()).ok().as_deref(),
        Some(data),
        "raw bytes are the bytes"
    );
    if let Ok(value) = Json::<serde_json::Value>::new().decode("k", data.to_vec()) {
        // What was accepted encodes and decodes again. Not to the same value: serde_json
        // parses floats to the nearest few ulps (1.2e-30 comes back as 1.2000000000000001e-30).
        let again = serde_json::to_vec(&value).expect("a decoded JSON value encodes");
        Json::<serde_json::Value>::new()
            .decode("k", again)
            .expect("and decodes again");
    }
}

/// Decodes arbitrary bytes as an event: never panics, and a valid event re-encodes to bytes
/// that decode to the same event.
pub fn decode_event(data: &[u8]) {
    if let Ok(event) = Event::decode(data) {
        let bytes = event.encode().expect("a decoded event always encodes");
        assert_eq!(
            Event::decode(&bytes).as_ref(),
            Ok(&event),
            "round trip changed the event"
        );
    }
}

/// Reads fuzz bytes as a little program of follower inputs.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn small(&mut self, below: u8) -> u64 {
        u64::from(self.byte().unwrap_or(0) % below)
    }

    /// A seq: mostly small (so entries meet each other), sometimes anywhere in the whole
    /// `u64` range, near its top included (a foreign or corrupt producer's seq).
    fn seq(&mut self, small_below: u8) -> u64 {
        match self.small(16) {
            0 => u64::MAX - self.small(4),
            1 => {
                let mut n = 0u64;
                for _ in 0..8 {
                    n = (n << 8) | u64::from(self.byte().unwrap_or(0));
                }
                n
            }
            _ => self.small(small_below),
        }
    }
}

const KEYS: [&str; 6] = ["a", "b", "c", "d", "", "bad\u{1}key"];

fn key(b: &mut Bytes<'_>) -> String {
    KEYS[b.small(KEYS.len() as u8) as usize].to_owned()
}

fn value(b: &mut Bytes<'_>) -> Vec<u8> {
    match b.small(4) {
        0 => vec![0xff, 0xfe], // poison for the UTF-8 decoder
        n => vec![b'a' + n as u8],
    }
}

fn entry(b: &mut Bytes<'_>) -> Entry {
    let seq = b.seq(48);
    let position = b.small(64);
    let op = match b.small(6) {
        0 | 1 => Op::Put,
        2 => Op::Delete,
        3 => Op::Purge,
        4 => Op::Mutation,
        _ => Op::Unknown("ROLLUP".into()),
    };
    let value = if op == Op::Put { value(b) } else { Vec::new() };
    let entry = Entry::new(position, seq, key(b), op, value);
    if b.small(4) == 0 {
        entry.expiring_in(std::time::Duration::from_millis(b.small(8) * 100))
    } else {
        entry
    }
}

/// What the harness observed of the follower's outputs, to check invariants against.
#[derive(Default)]
struct Observed {
    cache: BTreeMap<String, u64>,
    watermark: u64,
    ready: u32,
    checkpoint: Option<u64>,
    /// The last checkpoint reported failed: the one position that may be asked again.
    failed: Option<u64>,
    feed: Option<Token>,
    request: Option<Token>,
    stopped: bool,
}

impl Observed {
    fn check(&mut self, f: &mut Follower<Utf8>) {
        while let Some(output) = f.poll_output() {
            assert!(!self.stopped, "output after Stopped: {output:?}");
            match output {
                Output::Apply(Apply::Put { key, seq, .. }) => {
                    if let Some(&have) = self.cache.get(&*key) {
                        assert!(seq > have, "{key}: put at {seq} over newer or equal {have}");
                    }
                    self.cache.insert(key.to_string(), seq);
                }
                Output::Apply(Apply::Remove { key, .. }) => {
                    assert!(
                        self.cache.remove(&*key).is_some(),
                        "removed absent key {key}"
                    );
                }
                Output::Apply(Apply::Restamp { keys }) => {
                    for (key, seq) in keys {
                        let have = self.cache.get_mut(&*key);
                        assert!(
                            have.as_ref().is_some_and(|have| seq > **have),
                            "{key}: restamped at {seq}, absent or over newer or equal {have:?}"
                        );
                        self.cache.insert(key.to_string(), seq);
                    }
                }
                Output::Request(Request::Checkpoint { position }) => {
                    let again = self.failed == Some(position);
                    assert!(
                        self.checkpoint.is_none_or(|c| position > c || again),
                        "checkpoint went back (or was asked again with no failure)"
                    );
                    self.checkpoint = self.checkpoint.max(Some(position));
                }
                Output::Notice(Notice::Ready { .. }) => self.ready += 1,
                Output::Request(Request::OpenFeed { token, from, .. }) => {
                    assert_eq!(
                        from,
                        f.watermark().saturating_add(1),
                        "a feed must open at watermark+1"
                    );
                    self.feed = Some(token);
                }
                Output::Request(Request::LookupSource { token })
                | Output::Request(Request::Reconcile { token, .. })
                | Output::Request(Request::Snapshot { token })
                | Output::Request(Request::Fetch { token, .. })
                | Output::Request(Request::ListKeys { token }) => self.request = Some(token),
                Output::Notice(Notice::Stopped) => self.stopped = true,
                Output::Diagnostic(Diagnostic::InvalidEntry {
                    key,
                    seq: claimed,
                    reason: InvalidReason::Unconfirmed,
                }) => {
                    // An announcement the source did not confirm. One the cache took (it
                    // holds the key at the announcement's seq): that seq is void, and the
                    // source's answer replaces the value. A marker given up after reads
                    // older than it was never applied: the cache keeps its older value.
                    if let Some(seq) = self.cache.get_mut(&key)
                        && *seq == claimed
                    {
                        *seq = 0;
                    }
                }
                Output::Diagnostic(Diagnostic::SourceReset { .. }) => {
                    // A new history: the old seqs and watermark are void.
                    self.watermark = 0;
                    for seq in self.cache.values_mut() {
                        *seq = 0;
                    }
                }
                Output::Request(Request::CloseFeed { .. })
                | Output::Notice(Notice::CaughtUp(_))
                | Output::Diagnostic(_) => {}
            }
        }
        assert!(f.watermark() >= self.watermark, "watermark went backwards");
        self.watermark = f.watermark();
        assert!(self.ready <= 1, "ready reported twice");
        assert_eq!(
            f.is_ready(),
            self.ready == 1,
            "is_ready disagrees with outputs"
        );
        assert_eq!(
            f.len(),
            self.cache.len(),
            "index and applied outputs disagree"
        );
        for (k, &seq) in &self.cache {
            assert_eq!(
                f.seq_of(k),
                Some(seq),
                "index and applied outputs disagree on {k}"
            );
        }
    }
}

/// A lineage from a few histories and stamps, each sometimes unknown.
fn lineage(b: &mut Bytes<'_>) -> Lineage {
    Lineage::new(
        (b.small(3) > 0).then(|| b.small(2)),
        (b.small(2) == 0).then(|| b.small(3)),
    )
}

/// Runs arbitrary input sequences through a follower: never panics, and the invariants
/// hold after every step (watermark monotone, never-older per key, no double apply, ready
/// at most once, checkpoints monotone, feeds open at watermark+1).
pub fn follower_inputs(data: &[u8]) {
    let mut b = Bytes { data };
    let Some((mut f, follow)) = fuzzed_follower(&mut b) else {
        return;
    };
    let mut seen = Observed::default();
    let mut now = Time::ZERO;
    seen.check(&mut f);
    while let Some(op) = b.byte() {
        // Mostly answer the latest request or feed; sometimes use a stale token.
        let stale = b.small(8) == 0;
        let feed = if stale {
            Token(b.small(8))
        } else {
            seen.feed.unwrap_or(Token(0))
        };
        let req = if stale {
            Token(b.small(8))
        } else {
            seen.request.unwrap_or(Token(0))
        };
        if op % 17 == 15 {
            now = now.saturating_add(std::time::Duration::from_millis(b.small(255) * 200));
            f.handle_timeout(now);
        } else {
            let asked = seen.checkpoint.unwrap_or(0);
            let input = fuzzed_input(&mut b, op, follow, (feed, req), asked);
            if let Input::CheckpointFailed { position, .. } = &input {
                seen.failed = Some(*position);
            }
            f.handle_input(input, now);
        }
        seen.check(&mut f);
    }
}

/// A follower configured from the input's first bytes (its way of following, its seed, a
/// presence check or none), or none where that configuration is refused.
fn fuzzed_follower(b: &mut Bytes<'_>) -> Option<(Follower<Utf8>, Follow)> {
    let follow = match b.small(6) {
        0 => Follow::WakeOnly,
        1 => Follow::Announcements,
        _ => Follow::Replay,
    };
    let mut builder = FollowerConfig::builder("fuzz")
        .seed(u64::from(b.small(255) as u8))
        .max_value_bytes(4);
    if b.small(2) == 0 {
        builder = builder.presence_check(std::time::Duration::from_millis(500));
    }
    let config = builder.build().ok()?;
    Some((Follower::new(config, Utf8).following(follow), follow))
}

/// The input `op` draws (any but 15, a timeout), answering the feed `feed` or the request
/// `req`; `asked` is the last checkpoint the follower asked for.
fn fuzzed_input(
    b: &mut Bytes<'_>,
    op: u8,
    follow: Follow,
    (feed, req): (Token, Token),
    asked: u64,
) -> Input {
    match op % 17 {
        0 => Input::SourceFound { token: req },
        1 => Input::FeedOpened {
            token: feed,
            info: feed_info(b, follow),
        },
        2..=5 => Input::Entry {
            token: feed,
            entry: entry(b),
        },
        6 => Input::FeedFailed {
            token: feed,
            error: "boom".into(),
        },
        7 => Input::FeedEnded { token: feed },
        8..=11 => read_answer(b, op % 17, req),
        12 => Input::RequestFailed {
            token: req,
            error: "nope".into(),
        },
        13 => Input::Wake,
        14 => Input::Undecodable {
            token: feed,
            position: b.small(64),
            seq: (b.small(2) == 0).then(|| b.seq(48)),
            reason: "junk".into(),
        },
        _ if b.small(4) == 0 => Input::Stop,
        _ if b.small(3) == 0 => Input::Lineage {
            token: req,
            lineage: lineage(b),
        },
        _ if b.small(3) == 0 => Input::Keys {
            token: req,
            keys: (0..b.small(4)).map(|_| key(b)).collect(),
            source_watermark: b.seq(48),
        },
        _ if b.small(2) == 0 => Input::Reconnected,
        // Mostly the save of the last checkpoint asked, as a driver reports it.
        _ if b.small(2) == 0 => Input::CheckpointFailed {
            position: if b.small(4) == 0 { b.seq(48) } else { asked },
            error: "cursor store away".into(),
        },
        _ => Input::Wake,
    }
}

/// What an opened feed says of itself: mostly the follower's own way of following,
/// sometimes a feed that says otherwise.
fn feed_info(b: &mut Bytes<'_>, follow: Follow) -> FeedInfo {
    let continuity = if b.small(2) == 0 {
        Continuity::Gapless
    } else {
        Continuity::Sparse
    };
    FeedInfo {
        first_available: b.seq(8),
        head: b.seq(32),
        continuity,
        checkpoints: b.small(2) == 0,
        follow: if b.small(4) == 0 {
            Follow::Announcements
        } else {
            follow
        },
        lineage: lineage(b),
    }
}

/// A read's answer to request `req`: changes since (8), the log compacted (9), a snapshot
/// whole or a part of one whose rest may never come (10), one key fetched (11).
fn read_answer(b: &mut Bytes<'_>, kind: u8, req: Token) -> Input {
    match kind {
        8 => {
            let changes = (0..b.small(4)).map(|_| entry(b)).collect();
            Input::Changes {
                token: req,
                changes,
                source_watermark: b.seq(48),
            }
        }
        9 => Input::ChangesUnavailable {
            token: req,
            first_available: b.seq(48),
        },
        10 => {
            let entries = (0..b.small(4)).map(|_| entry(b)).collect();
            let source_watermark = b.seq(48);
            if b.small(3) == 0 {
                Input::SnapshotPart {
                    token: req,
                    entries,
                    source_watermark,
                }
            } else {
                Input::Snapshot {
                    token: req,
                    entries,
                    source_watermark,
                }
            }
        }
        _ => {
            let value = (b.small(3) > 0).then(|| (b.seq(48), value(b)));
            let source_watermark = (b.small(2) > 0).then(|| b.seq(48));
            Input::Fetched {
                token: req,
                value,
                source_watermark,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_empty_programs_do_not_panic() {
        follower_inputs(&[]);
        follower_inputs(&[0]);
        decode_event(&[]);
        for n in 0..=255u8 {
            follower_inputs(&[n, n, n]);
        }
    }
}
