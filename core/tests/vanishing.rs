//! What a source drops without a message: values that age out (a NATS bucket with
//! `max_age` and no limit markers) and keys whose last message was purged. The follower
//! expires the first itself, on the caller's clock, and finds the second by listing the
//! source's keys (opt-in).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use tidemark_core::*;

#[test]
fn a_value_that_ages_out_silently_is_removed_on_the_followers_clock() {
    let mut h = H::new();
    h.open(FeedInfo::kv(1, 2));
    h.entry(Entry::put(1, "a", "1").expiring_in(Duration::from_secs(10)));
    h.entry(Entry::put(2, "b", "2"));
    assert_eq!(
        h.f.poll_timeout(),
        Some(Time::ZERO.saturating_add(Duration::from_secs(10)))
    );
    assert_eq!(h.f.timeout_cause(), Some(Cause::Expiry));
    assert!(removes(&h.advance(Duration::from_secs(9))).is_empty());
    let outs = h.advance(Duration::from_secs(1));
    assert_eq!(removes(&outs), [("a".into(), 1)], "gone at its age limit");
    assert_eq!(h.f.counters().expired, 1);
    assert_eq!(h.f.seq_of("b"), Some(2), "a value without a limit stays");
    assert_eq!(h.f.watermark(), 2, "an expiry moves no watermark");
    assert_eq!(h.f.poll_timeout(), None);
}

#[test]
fn a_newer_value_cancels_the_expiry_of_the_old_one() {
    let mut h = H::new();
    h.open(FeedInfo::kv(1, 1));
    h.entry(Entry::put(1, "a", "1").expiring_in(Duration::from_secs(10)));
    h.advance(Duration::from_secs(5));
    h.entry(Entry::put(2, "a", "2").expiring_in(Duration::from_secs(10)));
    let outs = h.advance(Duration::from_secs(5));
    assert!(
        removes(&outs).is_empty(),
        "the old revision's limit is not the new one's"
    );
    let outs = h.advance(Duration::from_secs(5));
    assert_eq!(removes(&outs), [("a".into(), 2)]);
}

#[test]
fn an_expiry_undone_by_a_failed_batch_comes_due_again() {
    let mut h = H::new();
    h.f.track_commits(true);
    h.open(FeedInfo::kv(1, 1));
    h.entry(Entry::put(1, "a", "1").expiring_in(Duration::from_secs(1)));
    h.f.commit();
    let outs = h.advance(Duration::from_secs(1));
    assert_eq!(removes(&outs), [("a".into(), 1)]);
    h.input(Input::SinkFailed { error: "x".into() });
    assert_eq!(h.f.seq_of("a"), Some(1), "the removal is undone");
    assert_eq!(
        h.f.poll_timeout(),
        Some(h.now),
        "and its expiry is due again, not lost"
    );
}

fn checking(every: Duration) -> H {
    let config = config().presence_check(every).build().unwrap();
    H::with(Follower::new(config, Utf8))
}

#[test]
fn a_live_follower_lists_the_sources_keys_and_drops_what_it_no_longer_has() {
    let mut h = checking(Duration::from_secs(30));
    h.open(FeedInfo::kv(1, 3));
    h.put(1, "a", "1");
    h.put(2, "gone", "2");
    h.put(3, "b", "3");
    assert_eq!(h.f.timeout_cause(), Some(Cause::PresenceCheck));
    let outs = h.advance(Duration::from_secs(30));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::ListKeys { .. }))),
        "{outs:?}"
    );
    assert_eq!(h.f.phase(), Phase::Live, "a periodic check is no backoff");
    // A key written after the listing's watermark is not the listing's to judge.
    h.put(4, "late", "4");
    let outs = h.input(Input::Keys {
        token: h.request.unwrap(),
        keys: vec!["a".into(), "b".into()],
        source_watermark: 3,
    });
    assert_eq!(removes(&outs), [("gone".into(), 3)]);
    assert_eq!(h.f.counters().vanished, 1);
    assert_eq!(h.f.seq_of("late"), Some(4));
    assert_eq!(
        h.f.poll_timeout(),
        Some(h.now.saturating_add(Duration::from_secs(30))),
        "the next check is scheduled"
    );
}

#[test]
fn a_source_that_cannot_list_is_asked_again_at_the_next_interval_not_in_a_loop() {
    let mut h = checking(Duration::from_secs(30));
    h.open(FeedInfo::kv(0, 0));
    h.advance(Duration::from_secs(30));
    let outs = h.input(Input::RequestFailed {
        token: h.request.unwrap(),
        error: "cannot list".into(),
    });
    assert!(
        diagnostics(&outs)
            .iter()
            .any(|d| matches!(d, Diagnostic::ListingFailed { .. }))
    );
    assert_eq!(h.f.phase(), Phase::Live);
    assert_eq!(
        h.f.poll_timeout(),
        Some(h.now.saturating_add(Duration::from_secs(30)))
    );
}

#[test]
fn without_the_option_nothing_is_listed() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, 0));
    assert_eq!(h.f.poll_timeout(), None);
}

/// A follower resumed at watermark 3 over a per-key feed whose first seq moved to 5.
fn resumed_past_a_moved_first(info: FeedInfo) -> (H, Vec<Output<String>>) {
    let config = config().build().unwrap();
    let keys = [
        ("a".to_string(), 1),
        ("b".to_string(), 2),
        ("c".to_string(), 3),
    ];
    let mut h = H::with(Follower::resume(config, Utf8, 3, keys));
    let outs = h.open(info);
    (h, outs)
}

#[test]
fn a_per_key_feed_past_a_moved_first_seq_lists_the_keys_and_resumes_instead_of_resyncing() {
    let (mut h, outs) = resumed_past_a_moved_first(FeedInfo::kv_per_key(5, 7));
    assert!(
        diagnostics(&outs).iter().any(|d| matches!(
            d,
            Diagnostic::Rewritten {
                wanted: 4,
                first_available: 5
            }
        )),
        "{outs:?}"
    );
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::ListKeys { .. }))),
        "a listing, not a snapshot: {outs:?}"
    );
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "no full resync: {outs:?}"
    );
    // The feed's entries wait for the listing: c was written again at 5, d is new.
    assert!(
        puts(&h.put(5, "c", "again")).is_empty(),
        "held while listing"
    );
    assert!(puts(&h.put(7, "d", "new")).is_empty());
    // b's delete marker was purged: only the listing tells.
    let outs = h.input(Input::Keys {
        token: h.request.unwrap(),
        keys: vec!["a".into(), "c".into(), "d".into()],
        source_watermark: 7,
    });
    assert_eq!(removes(&outs), [("b".into(), 7)]);
    assert_eq!(
        puts(&outs),
        [
            ("c".into(), 5, "again".into()),
            ("d".into(), 7, "new".into())
        ]
    );
    assert!(
        is_ready(&outs),
        "ready at the head once listed and caught up"
    );
    assert_eq!(h.f.counters().resyncs, 0);
}

/// The bucket made again between a feed's open (of the history followed) and the listing
/// it asked for: the listing, of the new history, lacks keys of the old one. Read with it,
/// the source's lineage at the watermark names the new history: nothing is dropped, the
/// held entries are not applied, and the follower takes the new history (a snapshot).
/// Before, the listing dropped every key the new bucket had not written yet and the
/// follower said ready at its old watermark (the NATS campaign: a warm-started mirror
/// ready at 88 without 8 keys of its history, right after a recreation).
#[test]
fn a_listing_of_another_history_drops_nothing_and_the_follower_takes_that_history() {
    let config = config().build().unwrap();
    let keys = [
        ("a".to_string(), 1),
        ("b".to_string(), 2),
        ("c".to_string(), 3),
    ];
    let mut follower = Follower::resume(config, Utf8, 3, keys);
    follower.remember_lineage(Lineage::new(Some(10), None));
    let mut h = H::with(follower);
    let outs = h.open(FeedInfo::kv_per_key(5, 7).with_lineage(Lineage::new(Some(10), None)));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::ListKeys { .. }))),
        "{outs:?}"
    );
    assert!(
        puts(&h.put(5, "c", "again")).is_empty(),
        "held while listing"
    );
    let token = h.request.unwrap();
    let outs = h.input(Input::Lineage {
        token,
        lineage: Lineage::new(Some(11), None),
    });
    assert!(outs.is_empty(), "{outs:?}");
    let outs = h.input(Input::Keys {
        token,
        keys: vec!["c".into()],
        source_watermark: 2,
    });
    assert!(
        removes(&outs).is_empty(),
        "no key of the followed history is dropped by another's listing: {outs:?}"
    );
    assert!(
        puts(&outs).is_empty(),
        "the held entries are not applied: {outs:?}"
    );
    assert!(
        !is_ready(&outs),
        "not ready on another history's listing: {outs:?}"
    );
    assert!(
        diagnostics(&outs)
            .iter()
            .any(|d| matches!(d, Diagnostic::HistoryChanged { .. })),
        "{outs:?}"
    );
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "the new history is read whole: {outs:?}"
    );
}

#[test]
fn a_listing_of_the_same_history_drops_what_it_lacks() {
    let config = config().build().unwrap();
    let keys = [("a".to_string(), 1), ("b".to_string(), 2)];
    let mut follower = Follower::resume(config, Utf8, 3, keys);
    follower.remember_lineage(Lineage::new(Some(10), None));
    let mut h = H::with(follower);
    h.open(FeedInfo::kv_per_key(5, 7).with_lineage(Lineage::new(Some(10), None)));
    let token = h.request.unwrap();
    h.input(Input::Lineage {
        token,
        lineage: Lineage::new(Some(10), None),
    });
    let outs = h.input(Input::Keys {
        token,
        keys: vec!["a".into()],
        source_watermark: 7,
    });
    assert_eq!(removes(&outs), [("b".into(), 7)]);
}

#[test]
fn a_sparse_feed_past_a_moved_first_seq_still_resyncs() {
    let (_, outs) = resumed_past_a_moved_first(FeedInfo::kv(5, 7));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "a bucket with other limits may have lost what the follower needs: {outs:?}"
    );
}

#[test]
fn a_listing_the_feed_waits_for_that_fails_fails_the_feed_and_is_asked_again_on_reopen() {
    let (mut h, _) = resumed_past_a_moved_first(FeedInfo::kv_per_key(5, 7));
    h.put(5, "c", "again");
    let outs = h.input(Input::RequestFailed {
        token: h.request.unwrap(),
        error: "cannot list".into(),
    });
    assert!(puts(&outs).is_empty(), "nothing held is applied unlisted");
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::CloseFeed { .. }))),
        "{outs:?}"
    );
    let outs = h.run_to_timeout();
    assert_eq!(
        opened_from(&outs),
        Some(4),
        "reopened from watermark+1 after a backoff"
    );
    let outs = h.reopen(FeedInfo::kv_per_key(5, 7));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::ListKeys { .. }))),
        "asked again: {outs:?}"
    );
}

/// Issue 30: the removal of a key a listing found gone carried the listing's watermark,
/// above the follower's on an events stream (whose watermark trails until the next
/// reconcile), so a durable sink kept it as an announcement's claim committed ahead, and a
/// warm start held it unconfirmed: a spurious claim the first read refuted or sent on to
/// a snapshot.
#[test]
fn a_key_a_listing_finds_gone_on_an_events_stream_is_removed_at_no_seq_past_the_watermark() {
    let config = config()
        .presence_check(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(1, "gone", "1"), Entry::put(2, "b", "2")],
        source_watermark: 2,
    });
    h.reopen(FeedInfo::announcements(2));
    assert!(h.f.is_ready());
    h.advance(Duration::from_secs(30));
    let outs = h.input(Input::Keys {
        token: h.request.unwrap(),
        keys: vec!["b".into(), "c".into()],
        source_watermark: 9,
    });
    assert_eq!(
        removes(&outs),
        [("gone".into(), 2)],
        "removed as of the watermark the cache is at, not the listing's 9"
    );
    assert_eq!(h.f.watermark(), 2);
    assert_eq!(h.f.counters().vanished, 1);
}
