//! One history across restarts: a follower keeps what its source says of its history
//! (the history, and the stamp of the entry at its watermark) and takes a new history
//! when a read contradicts it — a source recreated, or restored from a backup and written
//! past the watermark — even when it was down while it happened.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use tidemark_core::*;

/// A follower resumed warm at watermark 8 holding `a`@2, `b`@5, `c`@8 (`c`'s entry
/// stamped 80), on history 1.
fn resumed() -> H {
    let keys = [("a".into(), 2), ("b".into(), 5), ("c".into(), 8)];
    let mut f = Follower::resume(config().build().unwrap(), Utf8, 8, keys);
    f.remember_lineage(Lineage::new(Some(1), Some(80)));
    H::with(f)
}

/// What the cache holds after `outs`, starting from `held`.
fn cache_after(held: &[(&str, u64)], outs: &[Output<String>]) -> BTreeMap<String, u64> {
    let mut cache: BTreeMap<String, u64> = held.iter().map(|(k, s)| ((*k).into(), *s)).collect();
    for o in outs {
        match o {
            Output::Apply(Apply::Put { key, seq, .. }) => {
                cache.insert(key.to_string(), *seq);
            }
            Output::Apply(Apply::Remove { key, .. }) => {
                cache.remove(&**key);
            }
            _ => {}
        }
    }
    cache
}

fn asks_snapshot(outs: &[Output<String>]) -> bool {
    outs.iter()
        .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
}

/// Answers the snapshot asked for with `entries` at `watermark`, reporting `lineage`.
fn snapshot(
    h: &mut H,
    lineage: Lineage,
    watermark: u64,
    entries: &[(&str, u64)],
) -> Vec<Output<String>> {
    let token = h.request.unwrap();
    let mut outs = h.input(Input::Lineage { token, lineage });
    outs.extend(
        h.input(Input::Snapshot {
            token,
            entries: entries
                .iter()
                .map(|(k, s)| Entry::put(*s, *k, format!("new-{k}")))
                .collect(),
            source_watermark: watermark,
        }),
    );
    outs
}

#[test]
fn a_feed_reporting_another_stamp_at_the_watermark_is_another_history() {
    let mut h = resumed();
    let outs = h.open(FeedInfo::change_log(1, 12).with_lineage(Lineage::new(Some(1), Some(99))));
    assert!(
        diagnostics(&outs)
            .iter()
            .any(|d| matches!(d, Diagnostic::HistoryChanged { watermark: 8, .. })),
        "{outs:?}"
    );
    assert!(asks_snapshot(&outs), "the new history is read whole");
    // The restored source was written past the old watermark: its snapshot is above it,
    // holds `a` at the same seq with another value, and `b` and `c` no more; `d` is new.
    let outs = snapshot(
        &mut h,
        Lineage::new(Some(1), Some(120)),
        12,
        &[("a", 2), ("d", 11)],
    );
    let held = [("a", 2), ("b", 5), ("c", 8)];
    assert_eq!(
        cache_after(&held, &outs),
        BTreeMap::from([("a".into(), 2), ("d".into(), 11)])
    );
    assert!(
        puts(&outs).iter().any(|(k, _, v)| k == "a" && v == "new-a"),
        "a key at the same seq in the new history is put again: {outs:?}"
    );
    assert_eq!(h.f.counters().resets, 1);
    assert_eq!(h.f.watermark(), 12);
    assert_eq!(h.f.lineage(), Lineage::new(Some(1), Some(120)));
}

#[test]
fn a_feed_from_another_history_is_another_history_whatever_its_head() {
    let mut h = resumed();
    let outs = h.open(FeedInfo::kv(1, 30).with_lineage(Lineage::new(Some(2), None)));
    assert!(asks_snapshot(&outs));
    // A key held at a seq past the new history's snapshot is the old history's too.
    let outs = snapshot(&mut h, Lineage::new(Some(2), None), 6, &[("b", 5)]);
    assert_eq!(
        cache_after(&[("a", 2), ("b", 5), ("c", 8)], &outs),
        BTreeMap::from([("b".into(), 5)])
    );
    assert_eq!(h.f.watermark(), 6);
    assert_eq!(h.f.lineage().history, Some(2));
}

#[test]
fn what_a_source_cannot_tell_keeps_the_follower_on_its_history() {
    for lineage in [
        Lineage::default(),
        Lineage::new(Some(1), None),
        Lineage::new(None, Some(80)),
        Lineage::new(Some(1), Some(80)),
    ] {
        let mut h = resumed();
        let outs = h.open(FeedInfo::change_log(1, 9).with_lineage(lineage));
        assert!(!asks_snapshot(&outs), "{lineage:?}: {outs:?}");
        let outs = h.put(9, "e", "5");
        assert!(is_ready(&outs));
        assert_eq!(h.f.counters().resets, 0);
    }
}

#[test]
fn a_reconcile_from_another_history_is_not_applied() {
    let keys = [("a".into(), 2), ("b".into(), 5)];
    let mut f =
        Follower::resume(config().build().unwrap(), Utf8, 5, keys).following(Follow::WakeOnly);
    f.remember_lineage(Lineage::new(Some(1), Some(50)));
    let mut h = H::with(f);
    h.found();
    let token = h.request.unwrap();
    h.input(Input::Lineage {
        token,
        lineage: Lineage::new(Some(1), Some(51)),
    });
    let outs = h.input(Input::Changes {
        token,
        changes: vec![Entry::put(7, "z", "x")],
        source_watermark: 7,
    });
    assert!(puts(&outs).is_empty(), "{outs:?}");
    assert!(asks_snapshot(&outs));
    let outs = snapshot(&mut h, Lineage::new(Some(1), Some(70)), 7, &[("z", 7)]);
    assert_eq!(
        cache_after(&[("a", 2), ("b", 5)], &outs),
        BTreeMap::from([("z".into(), 7)])
    );
}

#[test]
fn a_lineage_for_another_request_is_ignored() {
    let mut h = resumed();
    h.found();
    let before = h.f.counters().ignored;
    h.input(Input::Lineage {
        token: Token(999),
        lineage: Lineage::new(Some(7), Some(7)),
    });
    assert_eq!(h.f.counters().ignored, before + 1);
    let outs = h.reopen(FeedInfo::change_log(1, 8).with_lineage(Lineage::new(Some(1), Some(80))));
    assert!(is_ready(&outs), "{outs:?}");
}

#[test]
fn the_stamp_kept_is_the_one_at_the_watermark_and_a_rewind_takes_back_its_own() {
    let mut h = H::new();
    h.f.track_commits(true);
    h.open(FeedInfo::change_log(1, 3).with_lineage(Lineage::new(Some(4), None)));
    h.entry(Entry::put(1, "a", "1").stamped(Some(10)));
    h.entry(Entry::put(2, "b", "2").stamped(Some(20)));
    assert_eq!(h.f.lineage(), Lineage::new(Some(4), Some(20)));
    h.f.commit();
    h.entry(Entry::put(3, "c", "3").stamped(Some(30)));
    assert_eq!(h.f.lineage(), Lineage::new(Some(4), Some(30)));
    h.input(Input::SinkFailed { error: "x".into() });
    assert_eq!(h.f.watermark(), 2);
    assert_eq!(
        h.f.lineage(),
        Lineage::new(Some(4), Some(20)),
        "the commit's own"
    );
}

#[test]
fn a_snapshot_reported_at_the_watermark_with_another_stamp_replaces_the_cache() {
    let mut h = resumed();
    // A feed that cannot tell, a compacted history: the resync's snapshot names the
    // watermark itself, with another stamp.
    h.open(FeedInfo::change_log(20, 30));
    let outs = snapshot(&mut h, Lineage::new(Some(1), Some(81)), 8, &[("b", 5)]);
    assert_eq!(
        cache_after(&[("a", 2), ("b", 5), ("c", 8)], &outs),
        BTreeMap::from([("b".into(), 5)])
    );
    assert!(
        puts(&outs).iter().any(|(k, _, _)| k == "b"),
        "b is put again"
    );
    assert_eq!(h.f.counters().resets, 1);
}

/// Answers the snapshot asked for in two parts at `watermark`, reporting `lineage`.
fn snapshot_in_parts(
    h: &mut H,
    lineage: Lineage,
    watermark: u64,
    first: &[(&str, u64)],
    last: &[(&str, u64)],
) -> Vec<Output<String>> {
    let token = h.request.unwrap();
    let entries = |part: &[(&str, u64)]| -> Vec<Entry> {
        part.iter()
            .map(|(k, s)| Entry::put(*s, *k, format!("new-{k}")))
            .collect()
    };
    let mut outs = h.input(Input::Lineage { token, lineage });
    outs.extend(h.input(Input::SnapshotPart {
        token,
        entries: entries(first),
        source_watermark: watermark,
    }));
    outs.extend(h.input(Input::Snapshot {
        token,
        entries: entries(last),
        source_watermark: watermark,
    }));
    outs
}

/// The keys `outs` puts, in order.
fn keys_put(outs: &[Output<String>]) -> Vec<String> {
    puts(outs).into_iter().map(|(k, _, _)| k).collect()
}

#[test]
fn a_compaction_that_took_the_stamp_at_the_watermark_puts_every_entry_again() {
    // The source compacted past the watermark (first available 11): nothing tells this
    // history from a copy restored from a backup and written past it, which may hold `a`
    // at seq 2 with another value. The resync puts every entry again, whole or in parts,
    // and is no reset: nothing proved another history.
    for in_parts in [false, true] {
        let mut h = resumed();
        let outs = h.open(FeedInfo::change_log(11, 14).with_lineage(Lineage::new(Some(1), None)));
        assert!(asks_snapshot(&outs), "{outs:?}");
        let entries = [("a", 2), ("b", 5), ("d", 13)];
        let outs = if in_parts {
            snapshot_in_parts(
                &mut h,
                Lineage::new(Some(1), Some(130)),
                14,
                &entries[..2],
                &entries[2..],
            )
        } else {
            snapshot(&mut h, Lineage::new(Some(1), Some(130)), 14, &entries)
        };
        assert_eq!(keys_put(&outs), ["a", "b", "d"], "in parts: {in_parts}");
        assert!(puts(&outs).iter().all(|(k, _, v)| *v == format!("new-{k}")));
        assert_eq!(
            cache_after(&[("a", 2), ("b", 5), ("c", 8)], &outs),
            BTreeMap::from([("a".into(), 2), ("b".into(), 5), ("d".into(), 13)])
        );
        assert_eq!(h.f.counters().resets, 0);
        assert_eq!(h.f.watermark(), 14);
        // Once applied, the next compaction resync that confirms its stamp is cheap again.
        assert_eq!(h.f.lineage(), Lineage::new(Some(1), Some(130)));
    }
}

#[test]
fn a_compaction_that_kept_the_stamp_at_the_watermark_passes_unchanged_entries_over() {
    // The source still states the stamp of the entry at the watermark (its last compacted
    // entry's), and it is the one held: the same history, so entries at the seqs the
    // cache holds are unchanged.
    let mut h = resumed();
    let outs = h.open(FeedInfo::change_log(11, 14).with_lineage(Lineage::new(Some(1), Some(80))));
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = snapshot(
        &mut h,
        Lineage::new(Some(1), Some(130)),
        14,
        &[("a", 2), ("b", 5), ("d", 13)],
    );
    assert_eq!(keys_put(&outs), ["d"]);
}

#[test]
fn a_source_that_states_no_lineage_keeps_the_cheap_compaction_resync() {
    // Nothing known of the source's lineage: it could not tell a restore anyway, and its
    // compaction resync passes unchanged entries over as before.
    let keys = [("a".into(), 2), ("b".into(), 5), ("c".into(), 8)];
    let mut h = H::with(Follower::resume(config().build().unwrap(), Utf8, 8, keys));
    let outs = h.open(FeedInfo::change_log(11, 14));
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = snapshot(
        &mut h,
        Lineage::default(),
        14,
        &[("a", 2), ("b", 5), ("d", 13)],
    );
    assert_eq!(keys_put(&outs), ["d"]);
}

#[test]
fn a_reconcile_finding_the_log_compacted_past_the_watermark_puts_every_entry_again() {
    let mut h = resumed();
    h.open(FeedInfo::change_log(1, 8));
    // A gap asks for a reconcile; the log no longer holds the watermark's successor.
    let token = h.feed.unwrap();
    let outs = h.input(Input::Entry {
        token,
        entry: Entry::put(12, "e", "v"),
    });
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { .. }))),
        "a gap asks for a reconcile: {outs:?}"
    );
    let token = h.request.unwrap();
    h.input(Input::Lineage {
        token,
        lineage: Lineage::new(Some(1), None),
    });
    let outs = h.input(Input::ChangesUnavailable {
        token,
        first_available: 11,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = snapshot(
        &mut h,
        Lineage::new(Some(1), Some(130)),
        14,
        &[("a", 2), ("b", 5), ("e", 12)],
    );
    assert_eq!(keys_put(&outs), ["a", "b", "e"]);
}

#[test]
fn a_feed_still_delivering_a_replaced_history_after_a_read_took_the_restored_one_is_reopened() {
    // Following a change log at watermark 3 (stamps 10, 20, 30), history 1.
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 3).with_lineage(Lineage::new(Some(1), None)));
    let feed = h.feed.unwrap();
    for seq in 1..=3 {
        h.input(Input::Entry {
            token: feed,
            entry: Entry::put(seq, format!("k{seq}"), "old").stamped(Some(seq * 10)),
        });
    }
    assert_eq!(h.f.watermark(), 3);
    // The source is restored to 3 and written past it; a wake's reconcile reads the
    // restored history (its 4 and 5) before the feed, opened on the replaced history,
    // ends.
    let outs = h.input(Input::Wake);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { .. }))),
        "{outs:?}"
    );
    let token = h.request.unwrap();
    h.input(Input::Lineage {
        token,
        lineage: Lineage::new(Some(1), Some(30)),
    });
    h.input(Input::Changes {
        token,
        changes: vec![
            Entry::put(4, "k4", "new").stamped(Some(41)),
            Entry::put(5, "k5", "new").stamped(Some(51)),
        ],
        source_watermark: 5,
    });
    assert_eq!(h.f.watermark(), 5);
    // The feed now delivers the replaced history: 4 and 5 are at or below the watermark,
    // and 5's stamp is not the one held there; its 6 must not be applied.
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::put(4, "k4", "old").stamped(Some(40)),
    });
    assert!(puts(&outs).is_empty());
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::put(5, "k5", "old").stamped(Some(50)),
    });
    assert!(
        diagnostics(&outs).iter().any(|d| matches!(
            d,
            Diagnostic::FeedOfAnotherHistory {
                watermark: 5,
                held: 51,
                fed: 50
            }
        )),
        "{outs:?}"
    );
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::CloseFeed { token }) if *token == feed)),
        "{outs:?}"
    );
    assert_eq!(opened_from(&outs), Some(6), "reopened from watermark+1");
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::put(6, "k6", "old").stamped(Some(60)),
    });
    assert!(puts(&outs).is_empty(), "the replaced history's 6: {outs:?}");
    assert_eq!(h.f.watermark(), 5);
}

#[test]
fn a_feed_entry_at_the_watermark_with_the_stamp_held_keeps_the_feed() {
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 2).with_lineage(Lineage::new(Some(1), None)));
    let feed = h.feed.unwrap();
    h.input(Input::Entry {
        token: feed,
        entry: Entry::put(1, "a", "x").stamped(Some(10)),
    });
    // Delivered again (a redelivery): the same stamp, the same history.
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::put(1, "a", "x").stamped(Some(10)),
    });
    assert!(diagnostics(&outs).is_empty(), "{outs:?}");
    assert_eq!(opened_from(&outs), None);
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::put(2, "b", "y").stamped(Some(20)),
    });
    assert_eq!(keys_put(&outs), ["b"]);
}
