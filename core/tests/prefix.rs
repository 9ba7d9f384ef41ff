//! A follower over a key prefix: keys outside it never reach the cache, whatever brings
//! them, and the watermark still moves past them.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use tidemark_core::*;

fn within(prefix: &str) -> H {
    let f = Follower::new(config().build().unwrap(), Utf8).within(KeyPrefix::new(prefix).unwrap());
    H::with(f)
}

#[test]
fn entries_outside_the_prefix_are_passed_and_the_watermark_moves_past_them() {
    let mut h = within("orders/");
    h.open(gapless(4));
    let mut outs = h.put(1, "orders/1", "a");
    outs.extend(h.put(2, "users/1", "b"));
    outs.extend(h.entry(Entry::delete(3, "users/2")));
    outs.extend(h.put(4, "orders/2", "c"));
    assert_eq!(
        puts(&outs),
        [
            ("orders/1".into(), 1, "a".into()),
            ("orders/2".into(), 4, "c".into())
        ],
        "only the prefix's keys reach the cache"
    );
    assert!(removes(&outs).is_empty());
    assert!(
        diagnostics(&outs)
            .iter()
            .all(|d| !matches!(d, Diagnostic::Gap { .. })),
        "a gapless feed carrying other keys has no gap: {outs:?}"
    );
    assert!(
        is_ready(&outs),
        "the head (an outside key's seq) was reached"
    );
    assert_eq!(h.f.watermark(), 4);
    assert_eq!(h.f.counters().outside, 2);
    assert_eq!(h.f.len(), 2);
}

#[test]
fn a_snapshot_or_reconcile_that_names_other_keys_does_not_bring_them_in() {
    let mut h = within("orders/");
    // A change log over the prefix whose start was compacted: a replay from 10 would miss
    // keys written before it, so even an empty follower resyncs from a snapshot.
    h.open(FeedInfo::filtered_log(10, 12));
    let token = h.request.expect("a snapshot was asked for");
    let outs = h.input(Input::Snapshot {
        token,
        entries: vec![
            Entry::put(11, "orders/1", "a"),
            Entry::put(12, "users/1", "b"),
        ],
        source_watermark: 12,
    });
    assert_eq!(puts(&outs), [("orders/1".into(), 11, "a".into())]);
    assert_eq!(h.f.watermark(), 12);
    assert_eq!(h.f.counters().resyncs, 1);
    // A wake: the reconcile answers with another key too.
    h.input(Input::Wake);
    let token = h.request.expect("a reconcile was asked for");
    let outs = h.input(Input::Changes {
        token,
        changes: vec![
            Entry::put(13, "users/2", "x"),
            Entry::delete(14, "orders/1"),
        ],
        source_watermark: 14,
    });
    assert!(puts(&outs).is_empty(), "{outs:?}");
    assert_eq!(removes(&outs), [("orders/1".into(), 14)]);
    assert_eq!(h.f.watermark(), 14);
    assert!(h.f.is_empty());
    assert_eq!(h.f.counters().outside, 2);
}

#[test]
fn announcements_of_other_keys_are_neither_applied_nor_awaited() {
    let mut h = within("orders/");
    h.open(FeedInfo::announcements(0));
    let token = h.request.expect("a reconcile was asked for");
    h.input(Input::Changes {
        token,
        changes: vec![],
        source_watermark: 0,
    });
    assert!(h.f.is_ready());
    let outs = h.put(1, "users/1", "b");
    assert!(
        puts(&outs).is_empty(),
        "an announcement of another key: {outs:?}"
    );
    let outs = h.entry(Entry::mutation(2, "users/2"));
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Fetch { .. }))),
        "a marker of another key is not fetched: {outs:?}"
    );
    // The source's own read (filtered, so it names neither) confirms nothing was
    // pending: no resync over an announcement it could never confirm.
    h.input(Input::Wake);
    let token = h.request.expect("a reconcile was asked for");
    let outs = h.input(Input::Changes {
        token,
        changes: vec![],
        source_watermark: 2,
    });
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    assert_eq!(h.f.counters().resyncs, 0);
    assert_eq!(h.f.counters().outside, 2);
    assert!(h.f.is_empty());
}

#[test]
fn a_warm_start_drops_cached_keys_outside_the_prefix() {
    let config = config().build().unwrap();
    let keys = [("orders/1".to_owned(), 1), ("users/1".to_owned(), 2)];
    let f = Follower::resume(config, Utf8, 2, keys).within(KeyPrefix::new("orders/").unwrap());
    let mut h = H::with(f);
    let outs = h.drain();
    assert_eq!(
        removes(&outs),
        [("users/1".into(), 2)],
        "a cache persisted over the whole source keeps only the prefix's keys"
    );
    assert_eq!(h.f.len(), 1);
    assert_eq!(h.f.seq_of("orders/1"), Some(1));
}

#[test]
fn a_filtered_head_is_the_last_entry_delivered_or_the_position_already_reached() {
    assert_eq!(
        FeedInfo::filtered_head(7, 20, 1),
        7,
        "a first sync waits for 7"
    );
    assert_eq!(
        FeedInfo::filtered_head(0, 20, 16),
        15,
        "nothing of the prefix past 15: caught up at 15"
    );
    assert_eq!(
        FeedInfo::filtered_head(0, 3, 16),
        3,
        "a source behind the watermark shows as a head behind it"
    );
}

/// Issue 30: what a sink committed ahead of its watermark was held unconfirmed whatever its
/// key, so a change an earlier, wider follower committed to a key outside the prefix
/// became a claim no read of the (filtered) source would ever name: every read went on to
/// a snapshot and counted the key invalid. It is passed, like every other outside key.
#[test]
fn a_claim_a_sink_holds_ahead_outside_the_prefix_is_passed() {
    let config = config().max_ahead(1000).build().unwrap();
    let f = Follower::resume_lazily(config, Utf8, 5, 2)
        .following(Follow::Announcements)
        .within(KeyPrefix::new("orders/").unwrap());
    let mut h = H::with(f);
    h.f.remember_ahead(vec![
        Ahead::Put {
            key: "orders/1".into(),
            seq: 7,
            value: b"a".to_vec(),
        },
        Ahead::Put {
            key: "users/1".into(),
            seq: 8,
            value: b"x".to_vec(),
        },
        Ahead::Removed {
            key: "users/2".into(),
            seq: 9,
        },
    ]);
    h.found();
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "orders/1", "a")],
        source_watermark: 9,
    });
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "a read of the prefix cannot name another key, so it must not wait on one: {outs:?}"
    );
    assert_eq!(h.f.counters().resyncs, 0);
    assert_eq!(h.f.counters().invalid, 0, "nothing was refuted: {outs:?}");
    assert_eq!(h.f.counters().outside, 2, "both outside changes are passed");
    assert_eq!(h.f.watermark(), 9, "the read covers the watermark at once");
    assert_eq!(
        h.f.seq_of("orders/1"),
        Some(7),
        "the prefix's claim is confirmed"
    );
}

/// The same for a sink that does not say what it holds ahead: the seqs a driver gives
/// with `remember` for keys outside the prefix are learned, not awaited.
#[test]
fn a_key_held_past_the_watermark_outside_the_prefix_is_no_claim() {
    let config = config().max_ahead(1000).build().unwrap();
    let f = Follower::resume_lazily(config, Utf8, 5, 2)
        .following(Follow::Announcements)
        .within(KeyPrefix::new("orders/").unwrap());
    let mut h = H::with(f);
    h.f.remember([("orders/1".to_owned(), 3), ("users/1".to_owned(), 8)]);
    h.f.index_complete();
    h.found();
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 9,
    });
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    assert_eq!(h.f.counters().invalid, 0, "{outs:?}");
    assert_eq!(h.f.watermark(), 9);
}
