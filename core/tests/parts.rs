//! A snapshot read in parts ([`Input::SnapshotPart`]): any split of a snapshot, with
//! nothing between the parts, gives the very outputs, counters and state the whole
//! snapshot gives; a part keeps only what differs from the cache; and the token and
//! watermark rules leave no wrong cache.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use tidemark_core::*;

/// What the cache holds at the resync and how the follower got there.
#[derive(Clone, Debug)]
struct Start {
    announcements: bool,
    watermark: u64,
    /// (key index, seq) held.
    cache: Vec<(u8, u64)>,
    /// Announcements the sink committed ahead: (key index, seq, value, removed).
    ahead: Vec<(u8, u64, u8, bool)>,
}

fn key(k: u8) -> String {
    format!("k{k}")
}

fn value(v: u8) -> Vec<u8> {
    match v {
        0 => vec![0xff, 0xfe], // poison: not UTF-8
        v => format!("v{v}").into_bytes(),
    }
}

fn start() -> impl Strategy<Value = Start> {
    (
        any::<bool>(),
        5u64..30,
        prop::collection::btree_map(0u8..10, 1u64..30, 0..8),
        prop::collection::vec((0u8..10, 1u64..40, 0u8..3, prop::bool::weighted(0.3)), 0..4),
    )
        .prop_map(|(announcements, watermark, cache, ahead)| Start {
            announcements,
            watermark,
            cache: cache
                .into_iter()
                .map(|(k, s)| (k, s.min(watermark)))
                .collect(),
            ahead: ahead
                .into_iter()
                .map(|(k, s, v, r)| (k, watermark + s, v, r))
                .collect(),
        })
}

/// A follower at `start`, with its snapshot asked for (the token returned).
fn resyncing(start: &Start) -> (H, Token) {
    let cache = start.cache.iter().map(|(k, s)| (key(*k), *s));
    let f = Follower::resume(config().build().unwrap(), Utf8, start.watermark, cache);
    let mut h = if start.announcements {
        H::with(f.following(Follow::Announcements))
    } else {
        H::with(f)
    };
    h.f.remember_ahead(start.ahead.iter().map(|(k, seq, v, removed)| {
        if *removed {
            Ahead::Removed {
                key: key(*k),
                seq: *seq,
            }
        } else {
            Ahead::Put {
                key: key(*k),
                seq: *seq,
                value: value(*v),
            }
        }
    }));
    if start.announcements {
        h.found();
        let token = h.request.unwrap();
        h.input(Input::ChangesUnavailable {
            token,
            first_available: start.watermark + 5,
        });
    } else {
        let from = start.watermark + 1;
        h.open(sparse(from + 5, from + 10));
    }
    let token = h.request.unwrap();
    let asked = h.f.phase();
    assert_eq!(asked, Phase::Resyncing, "the follower must be resyncing");
    (h, token)
}

/// A snapshot entry: (key index, seq, value, expires, op is a delete).
type RawEntry = (u8, u64, u8, bool, bool);

/// A snapshot's entries, whether they come in key order, and its watermark.
fn snapshot() -> impl Strategy<Value = (Vec<RawEntry>, bool, u64)> {
    (
        prop::collection::vec(
            (
                0u8..10,
                prop_oneof![1 => Just(0u64), 12 => 1u64..70],
                0u8..3,
                prop::bool::weighted(0.1),
                prop::bool::weighted(0.05),
            ),
            0..14,
        ),
        prop::bool::weighted(0.8),
        0u64..70,
    )
}

fn entries(start: &Start, raw: &[(u8, u64, u8, bool, bool)], sorted: bool) -> Vec<Entry> {
    let mut out: Vec<Entry> = raw
        .iter()
        .map(|(k, seq, v, expires, delete)| {
            // Often the seq the cache already holds, so that unchanged entries are common.
            let seq = match start.cache.iter().find(|(c, _)| c == k) {
                Some((_, held)) if seq % 3 != 0 => *held,
                _ => *seq,
            };
            let mut e = if *delete {
                Entry::new(seq, seq, key(*k), Op::Delete, Vec::new())
            } else {
                Entry::new(seq, seq, key(*k), Op::Put, value(*v))
            };
            e.expires_in = expires.then(|| Duration::from_secs(u64::from(*k) + 1));
            e
        })
        .collect();
    if sorted {
        out.sort_by(|a, b| a.key.cmp(&b.key));
    }
    out
}

/// Everything observable of a follower: its state, as it prints.
fn state(h: &H) -> String {
    format!(
        "{:?} {:?} {:?} {:?} {:?}",
        h.f.status(),
        h.f.counters(),
        h.f.poll_timeout(),
        h.f.watermark(),
        h.f
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_split_of_a_snapshot_gives_what_the_whole_gives(
        start in start(),
        (raw, sorted, source_watermark) in snapshot(),
        cuts in prop::collection::vec(0usize..16, 0..5),
    ) {
        let entries = entries(&start, &raw, sorted);

        let (mut whole, token) = resyncing(&start);
        let whole_out = last(&mut whole, token, entries.clone(), source_watermark);

        let (mut split, token) = resyncing(&start);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(entries.len())).collect();
        cuts.sort_unstable();
        let mut rest = entries;
        let mut parts = Vec::new();
        for cut in cuts.iter().rev() {
            parts.push(rest.split_off(*cut));
        }
        parts.push(rest);
        parts.reverse();
        let rest = parts.pop().unwrap();
        for entries in parts {
            let out = part(&mut split, token, entries, source_watermark);
            prop_assert!(out.is_empty(), "a part decides nothing: {out:?}");
            prop_assert_eq!(split.f.phase(), Phase::Resyncing);
        }
        let split_out = last(&mut split, token, rest, source_watermark);

        prop_assert_eq!(&split_out, &whole_out);
        prop_assert_eq!(split.f.counters(), whole.f.counters());
        prop_assert_eq!(state(&split), state(&whole));
        for k in 0..10 {
            prop_assert_eq!(split.f.seq_of(&key(k)), whole.f.seq_of(&key(k)));
        }
    }
}

/// Hands `h` a part of the snapshot asked for under `token`.
fn part(
    h: &mut H,
    token: Token,
    entries: Vec<Entry>,
    source_watermark: u64,
) -> Vec<Output<String>> {
    h.input(Input::SnapshotPart {
        token,
        entries,
        source_watermark,
    })
}

/// Hands `h` the last part (or the whole) of the snapshot asked for under `token`.
fn last(
    h: &mut H,
    token: Token,
    entries: Vec<Entry>,
    source_watermark: u64,
) -> Vec<Output<String>> {
    h.input(Input::Snapshot {
        token,
        entries,
        source_watermark,
    })
}

/// A cache of `n` keys `k0..` at seqs 1..=n, watermark `n`, resyncing.
fn cache_of(n: u64) -> (H, Token) {
    let start = Start {
        announcements: false,
        watermark: n,
        cache: (0..n as u8).map(|k| (k, u64::from(k) + 1)).collect(),
        ahead: Vec::new(),
    };
    resyncing(&start)
}

/// The feed fails and reopens on a log compacted past the watermark: a snapshot is asked
/// again. Its token.
fn resync_again(h: &mut H) -> Token {
    let feed = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token: feed,
        error: "x".into(),
    });
    h.run_to_timeout();
    h.reopen(sparse(20, 30));
    h.request.unwrap()
}

fn held(k: u8, seq: u64) -> Entry {
    Entry::put(seq, key(k).as_str(), "v1")
}

#[test]
fn a_part_keeps_only_the_entries_that_differ_from_the_cache() {
    let (mut h, token) = cache_of(4);
    let entries = vec![held(0, 1), held(1, 9), held(2, 3), held(3, 4)];
    let keys: Vec<Arc<str>> = entries.iter().map(|e| Arc::clone(&e.key)).collect();
    part(&mut h, token, entries, 9);
    // The unchanged entries were dropped whole (their keys are recorded with the index's
    // own allocation); the changed one is held for the last part.
    assert_eq!(Arc::strong_count(&keys[0]), 1);
    assert!(Arc::strong_count(&keys[1]) > 1, "the changed entry is kept");
    assert_eq!(Arc::strong_count(&keys[2]), 1);
    assert_eq!(Arc::strong_count(&keys[3]), 1);
    let out = last(&mut h, token, Vec::new(), 9);
    assert_eq!(puts(&out), vec![(key(1), 9, "v1".to_owned())]);
    assert!(removes(&out).is_empty());
    assert_eq!(h.f.watermark(), 9);
}

#[test]
fn a_new_history_in_parts_keeps_every_entry_and_replaces_the_cache() {
    let (mut h, token) = cache_of(4);
    let entries = vec![held(0, 1), held(1, 2)];
    let keys: Vec<Arc<str>> = entries.iter().map(|e| Arc::clone(&e.key)).collect();
    part(&mut h, token, entries, 2);
    assert!(
        keys.iter().all(|k| Arc::strong_count(k) > 1),
        "a new history keeps all"
    );
    let out = last(&mut h, token, Vec::new(), 2);
    assert_eq!(h.f.counters().resets, 1);
    assert_eq!(puts(&out).len(), 2);
    assert_eq!(removes(&out), vec![(key(2), 2), (key(3), 2)]);
    assert_eq!(h.f.watermark(), 2);
}

#[test]
fn a_part_for_another_token_is_ignored() {
    let (mut h, token) = cache_of(2);
    let stale = Token(token.0 + 100);
    let out = part(&mut h, stale, vec![held(0, 7)], 7);
    assert!(out.is_empty());
    assert_eq!(h.f.counters().ignored, 1);
    // The stale part kept nothing: the real answer decides alone.
    let out = last(&mut h, token, vec![held(0, 1), held(1, 2)], 7);
    assert!(puts(&out).is_empty());
    assert_eq!(h.f.seq_of("k0"), Some(1));
    assert_eq!(h.f.watermark(), 7);
}

#[test]
fn parts_from_different_points_in_time_fail_the_read_and_it_is_read_again() {
    let (mut h, token) = cache_of(2);
    part(&mut h, token, vec![held(0, 8)], 8);
    let out = last(&mut h, token, vec![held(1, 2)], 9);
    assert!(
        puts(&out).is_empty() && removes(&out).is_empty(),
        "nothing applied: {out:?}"
    );
    assert!(
        diagnostics(&out)
            .iter()
            .any(|d| matches!(d, Diagnostic::BackingOff { .. })),
        "{out:?}"
    );
    assert_eq!(h.f.seq_of("k0"), Some(1));
    assert_eq!(h.f.watermark(), 2);
    let out = h.run_to_timeout();
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
    );
    let again = h.request.unwrap();
    assert_ne!(again, token);
    // The late rest of the failed read is ignored; the new read decides.
    last(&mut h, token, vec![held(1, 9)], 9);
    assert_eq!(h.f.seq_of("k1"), Some(2));
    let out = last(&mut h, again, vec![held(0, 8), held(1, 9)], 9);
    assert_eq!(puts(&out).len(), 2);
    assert_eq!(h.f.watermark(), 9);
}

#[test]
fn a_read_that_fails_midway_drops_its_parts() {
    let (mut h, token) = cache_of(2);
    part(&mut h, token, vec![held(0, 8)], 8);
    h.input(Input::RequestFailed {
        token,
        error: "gone".into(),
    });
    h.run_to_timeout();
    let again = h.request.unwrap();
    assert_ne!(again, token);
    // Only the new read counts: k0 unchanged there, k1 gone.
    let out = last(&mut h, again, vec![held(0, 1)], 8);
    assert!(puts(&out).is_empty());
    assert_eq!(removes(&out), vec![(key(1), 8)]);
}

#[test]
fn a_value_that_expires_after_its_part_passed_has_the_snapshot_read_again() {
    // A key cached with an expiry, then a snapshot whose part names it unchanged without
    // one (so it is dropped), then the expiry: the last part could no longer put it back.
    let (mut h, token) = cache_of(1);
    let mut e = Entry::put(5, "k9", "v1");
    e.expires_in = Some(Duration::from_secs(1));
    part(&mut h, token, vec![held(0, 1)], 5);
    last(&mut h, token, vec![e], 5);
    assert_eq!(h.f.seq_of("k9"), Some(5));
    // A second resync (a compaction again), the part passes, then the value expires.
    let token = resync_again(&mut h);
    part(
        &mut h,
        token,
        vec![held(0, 1), Entry::put(5, "k9", "v1")],
        5,
    );
    let out = h.advance(Duration::from_secs(2));
    assert_eq!(removes(&out), vec![("k9".to_owned(), 5)]);
    let again = h.request.unwrap();
    assert_ne!(again, token, "the snapshot is asked for again");
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
    );
    let out = last(
        &mut h,
        again,
        vec![held(0, 1), Entry::put(5, "k9", "v1")],
        5,
    );
    assert_eq!(puts(&out), vec![("k9".to_owned(), 5, "v1".to_owned())]);
}

#[test]
fn an_expiring_value_is_kept_so_its_expiry_between_parts_needs_no_second_read() {
    let expiring = || {
        let mut e = Entry::put(5, "k9", "v1");
        e.expires_in = Some(Duration::from_secs(1));
        e
    };
    let (mut h, token) = cache_of(1);
    last(&mut h, token, vec![held(0, 1), expiring()], 5);
    let token = resync_again(&mut h);
    part(&mut h, token, vec![held(0, 1), expiring()], 5);
    let out = h.advance(Duration::from_secs(2));
    assert_eq!(removes(&out), vec![("k9".to_owned(), 5)]);
    assert_eq!(h.request, Some(token), "the same read goes on");
    // As the whole snapshot read before the expiry would: the source still held it.
    let out = last(&mut h, token, Vec::new(), 5);
    assert_eq!(puts(&out), vec![("k9".to_owned(), 5, "v1".to_owned())]);
}

#[test]
fn a_sink_that_fails_between_parts_drops_them_and_the_rest_is_ignored() {
    let (mut h, token) = cache_of(2);
    part(&mut h, token, vec![held(0, 8)], 8);
    let out = h.input(Input::SinkFailed {
        error: "disk full".into(),
    });
    assert!(puts(&out).is_empty() && removes(&out).is_empty());
    let ignored = h.f.counters().ignored;
    let out = last(&mut h, token, vec![held(1, 2)], 8);
    assert!(puts(&out).is_empty(), "the old read's last part is ignored");
    assert_eq!(h.f.counters().ignored, ignored + 1);
    assert_eq!(h.f.watermark(), 2);
    // The read asked for again after the backoff decides alone.
    h.run_to_timeout();
    let again = h.request.unwrap();
    assert_ne!(again, token);
    let out = last(&mut h, again, vec![held(0, 8)], 8);
    assert_eq!(puts(&out), vec![(key(0), 8, "v1".to_owned())]);
    assert_eq!(removes(&out), vec![(key(1), 8)]);
}

#[test]
fn keys_remembered_between_parts_have_the_snapshot_read_again() {
    let (mut h, token) = cache_of(2);
    part(&mut h, token, vec![held(0, 1)], 8);
    h.f.remember([(key(5), 4)]);
    let out = h.drain();
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "the snapshot is asked for again: {out:?}"
    );
    let again = h.request.unwrap();
    assert_ne!(again, token);
    last(&mut h, token, vec![held(1, 2)], 8);
    assert_eq!(h.f.watermark(), 2, "the old read's last part is ignored");
    let out = last(&mut h, again, vec![held(0, 1), held(1, 2)], 8);
    assert_eq!(
        removes(&out),
        vec![(key(5), 8)],
        "the remembered key is judged too"
    );
    assert_eq!(h.f.watermark(), 8);
}

/// What a sink holds (key → value), as a new history's parts compare with it.
struct Holds(std::collections::BTreeMap<String, String>);

impl Cached<String> for Holds {
    fn holds(&self, key: &str, new: &String, same: &dyn Fn(&String, &String) -> bool) -> bool {
        self.0.get(key).is_some_and(|held| same(held, new))
    }
}

fn holding(values: &[(u8, &str)]) -> Holds {
    Holds(
        values
            .iter()
            .map(|(k, v)| (key(*k), (*v).to_owned()))
            .collect(),
    )
}

/// Hands `h` a part, or with `last` the last part, of the snapshot asked for under
/// `token`, the sink holding `cached`.
fn part_with(
    h: &mut H,
    token: Token,
    (entries, source_watermark, last): (Vec<Entry>, u64, bool),
    cached: &Holds,
) -> Vec<Output<String>> {
    let input = if last {
        Input::Snapshot {
            token,
            entries,
            source_watermark,
        }
    } else {
        Input::SnapshotPart {
            token,
            entries,
            source_watermark,
        }
    };
    h.f.handle_input_with(input, h.now, cached);
    h.drain()
}

fn restamps(outs: &[Output<String>]) -> Vec<(String, u64)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Apply(Apply::Restamp { keys }) => Some(keys),
            _ => None,
        })
        .flatten()
        .map(|(k, s)| (k.to_string(), *s))
        .collect()
}

#[test]
fn a_new_history_keeps_only_the_key_and_seq_of_an_entry_whose_value_the_sink_holds() {
    let (mut h, token) = cache_of(4);
    let cached = holding(&[(0, "v1"), (1, "v1"), (2, "v1"), (3, "v1")]);
    // Below the watermark: a new history. k0 equal at its seq, k1 differs, k2 equal at
    // another seq (a restore of the same value written at another point), k3 gone.
    let entries = vec![held(0, 1), Entry::put(3, "k1", "v2")];
    let keys: Vec<Arc<str>> = entries.iter().map(|e| Arc::clone(&e.key)).collect();
    part_with(&mut h, token, (entries, 3, false), &cached);
    assert_eq!(
        Arc::strong_count(&keys[0]),
        1,
        "an entry equal to the held value is not kept: its value is the sink's"
    );
    assert!(
        Arc::strong_count(&keys[1]) > 1,
        "a differing entry is kept whole"
    );
    let out = part_with(&mut h, token, (vec![held(2, 2)], 3, true), &cached);
    assert_eq!(h.f.counters().resets, 1);
    assert_eq!(
        restamps(&out),
        vec![(key(0), 1), (key(2), 2)],
        "each equal value stands as of the new history's seq, not the old one's"
    );
    assert_eq!(puts(&out), vec![(key(1), 3, "v2".to_owned())]);
    assert_eq!(removes(&out), vec![(key(3), 3)]);
    let restamp_at = out
        .iter()
        .position(|o| matches!(o, Output::Apply(Apply::Restamp { .. })));
    let put_at = out
        .iter()
        .position(|o| matches!(o, Output::Apply(Apply::Put { .. })));
    assert!(
        restamp_at < put_at,
        "restamps come before the puts: {out:?}"
    );
    assert_eq!(h.f.seq_of("k2"), Some(2));
    assert_eq!(h.f.seq_of("k0"), Some(1));
    assert_eq!(h.f.watermark(), 3);
    assert!(h.f.is_ready());
}

#[test]
fn without_the_sinks_values_a_new_history_puts_every_entry() {
    let (mut h, token) = cache_of(3);
    part(&mut h, token, vec![held(0, 1)], 2);
    let out = last(&mut h, token, vec![held(1, 2)], 2);
    assert!(restamps(&out).is_empty(), "nothing to restamp against");
    assert_eq!(puts(&out).len(), 2);
}

#[test]
fn a_repeated_key_restamped_then_put_ends_at_the_newer_seq() {
    let (mut h, token) = cache_of(4);
    let cached = holding(&[(0, "v1"), (1, "v1"), (2, "v1"), (3, "v1")]);
    // k0 equal at 1 in the first part, then again, differing, at 3 in the last.
    part_with(&mut h, token, (vec![held(0, 1)], 3, false), &cached);
    let entries = vec![held(1, 2), Entry::put(3, "k0", "v9")];
    let out = part_with(&mut h, token, (entries, 3, true), &cached);
    assert_eq!(h.f.seq_of("k0"), Some(3));
    assert_eq!(restamps(&out), vec![(key(0), 1), (key(1), 2)]);
    assert_eq!(puts(&out), vec![(key(0), 3, "v9".to_owned())]);
}

#[test]
fn a_restamped_keys_value_expiring_between_parts_has_the_snapshot_read_again() {
    // k9 cached with an expiry; a new history names it with the same value: its entry is
    // not kept, so its value must still be the sink's at the switch.
    let (mut h, token) = cache_of(1);
    let mut e = Entry::put(5, "k9", "v1");
    e.expires_in = Some(Duration::from_secs(1));
    last(&mut h, token, vec![held(0, 1), e], 5);
    let token = resync_again(&mut h);
    let cached = holding(&[(0, "v1"), (9, "v1")]);
    part_with(
        &mut h,
        token,
        (vec![Entry::put(2, "k9", "v1")], 3, false),
        &cached,
    );
    let out = h.advance(Duration::from_secs(2));
    assert_eq!(removes(&out), vec![("k9".to_owned(), 5)]);
    let again = h.request.unwrap();
    assert_ne!(again, token, "the snapshot is asked for again");
    let cached = holding(&[(0, "v1")]);
    let out = part_with(
        &mut h,
        again,
        (vec![held(0, 1), Entry::put(2, "k9", "v1")], 3, true),
        &cached,
    );
    assert!(
        puts(&out).contains(&("k9".to_owned(), 2, "v1".to_owned())),
        "the expired value is put again from the new history: {out:?}"
    );
    assert_eq!(h.f.seq_of("k9"), Some(2));
}
