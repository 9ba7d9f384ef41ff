//! How a follower follows is the feed's to say; holding items while a request is out;
//! a reconnect ends the backoff; a poison entry at the head of a change log.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use tidemark_core::*;

// ---- SPEC §13: the mode follows the feed ----

/// The reproduction of the review: a follower left in the default (replay) mode over an
/// announcements stream took the stream's head for the source's, resynced on every
/// reopen, and dropped announcements that came out of order.
#[test]
fn a_replay_follower_given_an_announcements_feed_follows_it_as_announcements() {
    let mut h = H::new();
    let outs = h.open(FeedInfo::announcements(5));
    assert!(
        diagnostics(&outs).contains(&Diagnostic::FollowChanged {
            from: Follow::Replay,
            to: Follow::Announcements
        }),
        "the feed's way of following wins: {outs:?}"
    );
    assert_eq!(h.f.follow(), Follow::Announcements);
    // It reads the source before it calls itself ready, as an announcements follower does.
    let token = h.request.expect("a reconcile was asked for");
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { .. })))
    );
    let outs = h.input(Input::Changes {
        token,
        changes: vec![Entry::put(5, "a", "5")],
        source_watermark: 5,
    });
    assert!(is_ready(&outs));
    h.put(7, "b", "7");
    let outs = h.put(6, "c", "6");
    assert_eq!(
        puts(&outs),
        [("c".into(), 6, "6".into())],
        "an announcement that came out of order is still applied"
    );
    // Announcements are confirmed by a read of the source, which moves the watermark.
    let outs = h.run_to_timeout();
    assert!(asks_reconcile(&outs), "{outs:?}");
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "c", "6"), Entry::put(7, "b", "7")],
        source_watermark: 7,
    });
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "gone".into(),
    });
    let outs = h.run_to_timeout();
    assert_eq!(opened_from(&outs), Some(8), "reopens from watermark+1");
    let outs = h.reopen(FeedInfo::announcements(0));
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "a stream's own head below the watermark is no reason to resync: {outs:?}"
    );
    assert_eq!(h.f.counters().resyncs, 0);
}

#[test]
fn a_feed_that_says_replay_is_replayed_even_by_a_follower_told_otherwise() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 0,
    });
    let outs = h.reopen(FeedInfo::change_log(1, 2));
    assert!(diagnostics(&outs).contains(&Diagnostic::FollowChanged {
        from: Follow::Announcements,
        to: Follow::Replay
    }));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    assert_eq!(
        h.f.watermark(),
        2,
        "a change log's entries move the watermark"
    );
}

// ---- Issue: a poison entry at the head of a gapless feed ----

#[test]
fn an_undecodable_entry_at_the_head_of_a_change_log_still_makes_the_follower_ready() {
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 2));
    h.put(1, "a", "1");
    let token = h.feed.unwrap();
    let outs = h.input(Input::Undecodable {
        token,
        position: 2,
        seq: Some(2),
        reason: "key is not UTF-8".into(),
    });
    assert!(
        is_ready(&outs),
        "the skipped head completes the sync: {outs:?}"
    );
    assert_eq!(h.f.watermark(), 2);
    assert_eq!(h.f.counters().invalid, 1);
}

#[test]
fn an_undecodable_entry_past_a_gap_on_a_change_log_reconciles_first() {
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 5));
    h.put(1, "a", "1");
    let token = h.feed.unwrap();
    let outs = h.input(Input::Undecodable {
        token,
        position: 4,
        seq: Some(4),
        reason: "junk".into(),
    });
    assert!(diagnostics(&outs).contains(&Diagnostic::Gap {
        expected: 2,
        got: 4
    }));
    assert_eq!(h.f.watermark(), 1, "nothing is skipped over a gap");
}

// ---- Issue: one request at a time ----

/// A marker's fetch failed and waits for its retry; a second marker arrives meanwhile.
/// Before, the second fetch went out at once and the retry then replaced it in flight:
/// the second marker's answer was ignored and the marker lost.
#[test]
fn a_marker_that_arrives_while_a_fetch_waits_for_its_retry_is_not_lost() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, 0));
    let feed = h.feed.unwrap();
    h.input(Input::Entry {
        token: feed,
        entry: Entry::mutation(1, "a"),
    });
    let first = h.request.unwrap();
    h.input(Input::RequestFailed {
        token: first,
        error: "timeout".into(),
    });
    let outs = h.input(Input::Entry {
        token: feed,
        entry: Entry::mutation(2, "b"),
    });
    assert!(
        !outs.iter().any(|o| matches!(o, Output::Request(_))),
        "nothing is sent while a retry is pending: {outs:?}"
    );
    let outs = h.run_to_timeout();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Fetch { key, .. }) if key == "a"))
    );
    let outs = h.fetched(Some((1, "A")), None);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Fetch { key, .. }) if key == "b")),
        "the held marker is fetched next: {outs:?}"
    );
    let outs = h.fetched(Some((2, "B")), None);
    assert_eq!(puts(&outs), [("b".into(), 2, "B".into())]);
    assert_eq!(h.f.watermark(), 2);
}

#[test]
fn feed_items_wait_behind_a_reconcile_and_are_applied_after_it() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, 0));
    h.input(Input::Wake);
    let reconcile = h.request.unwrap();
    let outs = h.put(3, "a", "3");
    assert!(puts(&outs).is_empty(), "held while the reconcile is out");
    let outs = h.input(Input::Changes {
        token: reconcile,
        changes: vec![Entry::put(1, "x", "1")],
        source_watermark: 1,
    });
    assert_eq!(
        puts(&outs),
        [("x".into(), 1, "1".into()), ("a".into(), 3, "3".into())],
        "the reconcile's answer is not replaced, and the held entry follows it"
    );
}

// ---- SPEC §15: a reconnect ends the backoff ----

#[test]
fn a_reconnect_ends_the_backoff_at_once_and_keeps_its_attempt_count() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, 0));
    for _ in 0..6 {
        let token = h.feed.unwrap();
        h.input(Input::FeedFailed {
            token,
            error: "down".into(),
        });
        h.run_to_timeout();
    }
    let token = h.feed.unwrap();
    let outs = h.input(Input::FeedFailed {
        token,
        error: "down".into(),
    });
    let Some(Diagnostic::BackingOff { delay, attempt, .. }) = diagnostics(&outs).pop() else {
        panic!("backs off: {outs:?}");
    };
    assert!(
        delay >= Duration::from_secs(10),
        "the backoff grew: {delay:?}"
    );
    let outs = h.input(Input::Reconnected);
    assert_eq!(
        opened_from(&outs),
        Some(1),
        "the feed reopens now, not in {delay:?}"
    );
    assert_eq!(h.f.poll_timeout(), None);
    let token = h.feed.unwrap();
    let outs = h.input(Input::FeedFailed {
        token,
        error: "still down".into(),
    });
    let Some(Diagnostic::BackingOff {
        attempt: next,
        delay: again,
        ..
    }) = diagnostics(&outs).pop()
    else {
        panic!("backs off again: {outs:?}");
    };
    assert!(
        again >= Duration::from_secs(10),
        "a source still away is not hammered: the attempt the reconnect hastened failed, \
         and the next waits the backoff the outage grew ({again:?})"
    );
    assert_eq!(
        next, attempt,
        "but that one failure does not grow it: a source that flaps (an election) is not \
         left a backoff grown by each return"
    );
    h.run_to_timeout();
    let token = h.feed.unwrap();
    let outs = h.input(Input::FeedFailed {
        token,
        error: "still down".into(),
    });
    let Some(Diagnostic::BackingOff { attempt: grown, .. }) = diagnostics(&outs).pop() else {
        panic!("backs off again: {outs:?}");
    };
    assert_eq!(
        grown,
        attempt + 1,
        "a failure with no return before it counts"
    );
}

/// Campaign seed 9063: a follower whose backoff grew over two server kills reopened
/// after the last reconnect, then its feed failed once more as the server came back from a
/// pause (what was open across the stall); that failure waited out 16 s. The first
/// success after the path came back forgets the outage's failures.
#[test]
fn after_a_reconnect_the_first_success_forgets_the_outages_failures() {
    for back in [Input::Reconnected, Input::Resumed] {
        let mut h = H::new();
        h.open(FeedInfo::kv(0, 0));
        for _ in 0..7 {
            let token = h.feed.unwrap();
            h.input(Input::FeedFailed {
                token,
                error: "down".into(),
            });
            h.run_to_timeout();
        }
        let token = h.feed.unwrap();
        h.input(Input::FeedFailed {
            token,
            error: "down".into(),
        });
        let outs = h.input(back.clone());
        assert_eq!(opened_from(&outs), Some(1), "{back:?} retries at once");
        h.reopen(FeedInfo::kv(0, 0));
        h.advance(Duration::from_secs(2));
        let token = h.feed.unwrap();
        let outs = h.input(Input::FeedFailed {
            token,
            error: "what was open across the stall".into(),
        });
        let Some(Diagnostic::BackingOff { delay, attempt, .. }) = diagnostics(&outs).pop() else {
            panic!("backs off: {outs:?}");
        };
        assert_eq!(
            attempt, 1,
            "after {back:?} and a feed that opened, a failure starts the backoff over"
        );
        assert!(
            delay <= Duration::from_secs(1),
            "a failure 2 s after the source came back must not wait out the outage's              backoff (SPEC §15), not {delay:?}"
        );
    }
}

#[test]
fn a_reconnect_with_nothing_waiting_decides_nothing() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, 0));
    assert!(h.input(Input::Reconnected).is_empty());
}

// ---- SPEC §15: the seed is visible ----

#[test]
fn the_status_shows_the_seed_that_drives_the_jitter() {
    let f = Follower::new(config().seed(42).build().unwrap(), Utf8);
    assert_eq!(f.status().seed, 42);
}

// ---- Issue: announcements that lie, lag or come from elsewhere ----

/// Whether `outs` ask for a snapshot of the source.
fn asks_snapshot<V>(outs: &[Output<V>]) -> bool {
    outs.iter()
        .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
}

/// Whether `outs` ask for a reconcile.
fn asks_reconcile<V>(outs: &[Output<V>]) -> bool {
    outs.iter()
        .any(|o| matches!(o, Output::Request(Request::Reconcile { .. })))
}

/// A wake whose reconcile finds no change up to `source_watermark`: what the core does.
fn wake_and_read_nothing(h: &mut H, source_watermark: u64) -> Vec<Output<String>> {
    h.input(Input::Wake);
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark,
    })
}

/// An announcements follower that read the source up to `w` and opened its stream.
fn announcements_at(w: u64, changes: Vec<Entry>) -> H {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes,
        source_watermark: w,
    });
    h.reopen(FeedInfo::announcements(w));
    h
}

/// A marker's fetch answered by a replica that has not seen the write yet: storing the
/// old value under the marker's seq made the real value look stale for good. The read of
/// the whole source it asks for instead (the leader's) brings the change, and settles the
/// marker: no fetch again.
#[test]
fn a_fetch_older_than_its_marker_is_settled_by_a_read_of_the_source_not_stored_under_its_seq() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::mutation(6, "a"));
    let outs = h.fetched(Some((5, "old")), Some(6));
    assert!(
        puts(&outs).is_empty(),
        "nothing stored from a stale read: {outs:?}"
    );
    assert_eq!(h.f.seq_of("a"), Some(5));
    assert!(
        asks_reconcile(&outs),
        "the source is read whole at once, not fetched again after a backoff: {outs:?}"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "a", "new")],
        source_watermark: 6,
    });
    assert_eq!(puts(&outs), [("a".into(), 6, "new".into())]);
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Fetch { .. }))),
        "the read covered the marker: {outs:?}"
    );
    assert!(
        outs.contains(&Output::Request(Request::Checkpoint { position: 6 })),
        "the marker is passed: {outs:?}"
    );
    assert_eq!(h.f.counters().invalid, 0, "a real marker is no invalid one");
}

/// The read of the whole source a stale fetch asks for may itself fall short of the
/// marker (a source whose reads are not all of one point): the key is then fetched again,
/// on the stale reads' own backoff.
#[test]
fn a_marker_a_read_of_the_source_falls_short_of_is_fetched_again() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::mutation(6, "a"));
    let outs = h.fetched(Some((5, "old")), None);
    assert!(asks_reconcile(&outs), "{outs:?}");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 5,
    });
    assert!(
        outs.iter().any(
            |o| matches!(o, Output::Request(Request::Fetch { key, seq: 6, .. }) if key == "a")
        ),
        "the marker is fetched again behind the read: {outs:?}"
    );
    let outs = h.fetched(Some((6, "new")), Some(6));
    assert_eq!(puts(&outs), [("a".into(), 6, "new".into())]);
}

/// The NATS campaign (seeds 20002, 20016, 20035, ...): a bucket deleted and made again
/// while an announcements follower was away. It takes the new history, then meets the
/// old history's markers still on the events stream; the new history has passed their
/// seqs, so each fetch finds its key at a lower revision. Each marker cost three fetches
/// on a backoff, and the follower was 3-53 s late. One read of the whole source settles
/// every old marker it covers: one read for the lot, no fetch again.
#[test]
fn markers_of_a_replaced_history_cost_one_read_of_the_source_not_three_fetches_each() {
    // The new history, read whole at 25 when the follower took it.
    let mut h = announcements_at(25, vec![Entry::put(12, "a", "a"), Entry::put(20, "b", "b")]);
    // The old history's markers, at seqs the new history has passed since (its head is at
    // 40) without writing their keys there.
    for (seq, key) in [(30, "a"), (31, "b"), (32, "a"), (33, "c")] {
        h.entry(Entry::new(seq, seq, key, Op::Mutation, Vec::new()));
    }
    let mut fetches = 0;
    let mut outs = h.fetched(Some((40, "a")), Some(40));
    fetches += 1;
    // The first marker's key was written since (at 40): its read is newer, and applied.
    assert_eq!(puts(&outs), [("a".into(), 40, "a".into())], "{outs:?}");
    // The second's key is older than its marker.
    assert!(
        outs.iter().any(
            |o| matches!(o, Output::Request(Request::Fetch { key, seq: 31, .. }) if key == "b")
        ),
        "{outs:?}"
    );
    outs = h.fetched(Some((20, "b")), Some(41));
    fetches += 1;
    assert!(asks_reconcile(&outs), "one read of the source: {outs:?}");
    outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(40, "a", "a"), Entry::put(41, "d", "d")],
        source_watermark: 41,
    });
    fetches += outs
        .iter()
        .filter(|o| matches!(o, Output::Request(Request::Fetch { .. })))
        .count();
    assert_eq!(
        fetches, 2,
        "the markers the read covered are settled: {outs:?}"
    );
    assert!(
        outs.contains(&Output::Request(Request::Checkpoint { position: 33 })),
        "every old marker is passed: {outs:?}"
    );
    let soon = h.now.saturating_add(Duration::from_secs(1));
    assert!(
        h.f.poll_timeout().is_none_or(|at| at > soon),
        "no fetch waits out a backoff"
    );
    assert_eq!(h.f.seq_of("b"), Some(20), "b keeps the new history's value");
    assert_eq!(
        h.f.seq_of("c"),
        None,
        "c is in no history the source serves"
    );
    assert_eq!(h.f.watermark(), 41);
}

/// A marker past the source's head: the history the source serves never made it (a writer
/// announces after it commits), whatever a replica would say. It is settled by a read of
/// the whole source at once, not fetched three times on a backoff.
#[test]
fn a_marker_past_the_sources_head_is_settled_by_a_read_of_the_source_at_once() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::mutation(18, "a"));
    let outs = h.fetched(Some((5, "old")), Some(10));
    assert!(puts(&outs).is_empty(), "{outs:?}");
    assert_eq!(
        h.f.counters().invalid,
        1,
        "the marker is counted as unconfirmed"
    );
    assert!(matches!(
        diagnostics(&outs).as_slice(),
        [Diagnostic::InvalidEntry {
            reason: InvalidReason::Unconfirmed,
            ..
        }]
    ));
    assert!(
        outs.contains(&Output::Request(Request::Checkpoint { position: 18 })),
        "the marker is passed at once, not fetched again: {outs:?}"
    );
    // Another like it: the one read of the source soon settles both.
    h.entry(Entry::mutation(19, "a"));
    let outs = h.fetched(Some((5, "old")), Some(10));
    assert_eq!(h.f.counters().invalid, 2, "{outs:?}");
    let outs = h.run_to_timeout();
    assert!(asks_reconcile(&outs), "one read of the source: {outs:?}");
    assert!(
        h.f.poll_timeout().is_none_or(|at| at > h.now),
        "one read for both"
    );
}

/// An announcement the source never made, over a key whose value in the source is poison:
/// the read replaces the claim, the poison is skipped, and the announcement's value stayed
/// for good (the simulator found replaced histories' announcements left this way).
#[test]
fn a_claim_replaced_by_a_poison_value_does_not_stay() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::put(9, "a", "claimed"));
    assert_eq!(h.f.seq_of("a"), Some(9));
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", vec![0xff, 0xfe])],
        source_watermark: 10,
    });
    assert_eq!(
        h.f.counters().poison,
        1,
        "the poison is counted and skipped"
    );
    assert_eq!(
        removes(&outs),
        [("a".into(), 10)],
        "the claim's value is no value the source held: {outs:?}"
    );
    assert_eq!(h.f.seq_of("a"), None);
}

/// A marker the source never made (an announcement of a history a restore replaced, a
/// forged one): every read of its key is older than it. Fetching it again and again, with
/// a backoff that grows each time, wedged the follower behind it for good (the simulator
/// found one still fetching a minute later, its watermark never moving again).
#[test]
fn a_marker_the_source_never_reaches_is_settled_by_a_read_not_fetched_forever() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::mutation(18, "a"));
    // The source's head is not known with the reads: the first stale read asks a read of
    // the whole source, which falls short of the marker.
    let outs = h.fetched(Some((5, "old")), None);
    assert!(asks_reconcile(&outs), "{outs:?}");
    let mut outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 10,
    });
    for read in 1..3 {
        if read > 1 {
            outs = h.run_to_timeout();
        }
        assert!(
            outs.iter().any(|o| matches!(
                o,
                Output::Request(Request::Fetch { key, seq: 18, .. }) if key == "a"
            )),
            "a stale read is read again (a replica may be behind): {outs:?}"
        );
        outs = h.fetched(Some((5, "old")), None);
        assert!(
            puts(&outs).is_empty(),
            "nothing stored from a stale read: {outs:?}"
        );
    }
    assert!(
        asks_reconcile(&outs),
        "after three stale reads the follower reads the source instead: {outs:?}"
    );
    assert_eq!(
        h.f.counters().invalid,
        1,
        "the marker is counted as unconfirmed"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(15, "b", "b")],
        source_watermark: 20,
    });
    assert_eq!(puts(&outs), [("b".into(), 15, "b".into())]);
    assert_eq!(h.f.watermark(), 20, "and it follows the source again");
    assert_eq!(h.f.seq_of("a"), Some(5));
}

/// A fetch that finds nothing (a replica not yet at the write) must not leave a
/// tombstone that then blocks the real put made at the marker's seq.
#[test]
fn a_fetch_that_finds_nothing_does_not_block_the_put_at_the_markers_seq() {
    let mut h = announcements_at(5, vec![]);
    h.entry(Entry::mutation(6, "a"));
    h.fetched(None, None);
    assert_eq!(h.f.seq_of("a"), None);
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "a", "real")],
        source_watermark: 6,
    });
    assert_eq!(
        puts(&outs),
        [("a".into(), 6, "real".into())],
        "the put at the marker's seq lands: {outs:?}"
    );
}

/// A key absent from a source whose watermark is below the marker's seq was read before
/// the marker's change: it must not be held as a removal at the marker's seq. The source
/// is read whole at once; a read past the marker that finds the key absent dates the
/// removal after it.
#[test]
fn a_key_absent_from_a_source_behind_its_marker_is_not_removed_but_read_again() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    h.entry(Entry::mutation(6, "a"));
    let outs = h.fetched(None, Some(5));
    assert!(
        removes(&outs).is_empty(),
        "nothing removed on a read from before the marker: {outs:?}"
    );
    assert_eq!(h.f.seq_of("a"), Some(5));
    let outs = h.run_to_timeout();
    assert!(asks_reconcile(&outs), "the source is read whole: {outs:?}");
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 5,
    });
    h.entry(Entry::mutation(7, "a"));
    let outs = h.fetched(None, Some(7));
    assert_eq!(
        removes(&outs),
        [("a".into(), 7)],
        "absent from a source past the marker, the key was removed after it: {outs:?}"
    );
}

/// The NATS campaign with markers (seeds 7001, 7032, 7047, ...): a marker's key is
/// overwritten, then purged, while its fetch is out; the fetch finds it absent. That read
/// dates the removal only as somewhere after the marker, yet it was applied at the
/// marker's seq, so the announcements of the overwrites, held behind the fetch, were
/// newer than that removal and brought the key back with values the source had already
/// removed (the cache showed the key, dropped it, and showed it again at an older seq).
/// A read of the source settles such a removal before anything held behind it is applied.
#[test]
fn a_key_a_fetch_finds_removed_is_not_brought_back_by_older_announcements_behind_it() {
    let mut h = announcements_at(5, vec![Entry::put(5, "k", "5")]);
    h.entry(Entry::mutation(6, "k"));
    // The source: k put at 6 (the marker), put at 7, removed at 8. The announcement of 7
    // arrives while the fetch is out, and waits for it.
    let mut outs = h.put(7, "k", "7");
    assert!(puts(&outs).is_empty(), "held behind the fetch: {outs:?}");
    // The watermark is read before the key (the runtime's `get_at`): 7; the removal at 8
    // landed between the two reads.
    outs.extend(h.fetched(None, Some(7)));
    assert_eq!(removes(&outs), [("k".into(), 6)], "{outs:?}");
    if asks_reconcile(&outs) {
        outs.extend(h.input(Input::Changes {
            token: h.request.unwrap(),
            changes: vec![Entry::delete(8, "k")],
            source_watermark: 8,
        }));
    }
    let shown_after_removal: Vec<_> = outs
        .iter()
        .skip_while(|o| !matches!(o, Output::Apply(Apply::Remove { .. })))
        .filter_map(|o| match o {
            Output::Apply(Apply::Put { key, seq, .. }) if &**key == "k" => Some(*seq),
            _ => None,
        })
        .collect();
    assert!(
        shown_after_removal.is_empty(),
        "k was shown again at {shown_after_removal:?} after it was removed, \
         though the source removed it at 8 (never-older): {outs:?}"
    );
    assert_eq!(h.f.seq_of("k"), None);
    assert_eq!(h.f.watermark(), 8);
}

/// Seed 93041109: a marker of a history a restore replaced, fetched from the restored
/// source (its watermark below both the marker and the follower's own), was held as a
/// removal no history made. Seed 2282: read again and again under a backoff an outage had
/// grown, it kept the follower from converging for over a minute. A source behind the
/// follower's own watermark is no replica catching up: the first such read settles the
/// marker by a read of the whole source, which finds the source behind and resyncs.
#[test]
fn a_marker_fetched_from_a_source_restored_below_it_ends_in_a_resync_not_a_removal() {
    let mut h = announcements_at(10, vec![Entry::put(10, "a", "old")]);
    h.entry(Entry::mutation(12, "a"));
    let outs = h.fetched(None, Some(8));
    assert!(
        removes(&outs).is_empty(),
        "no removal from a source behind the marker: {outs:?}"
    );
    assert_eq!(h.f.seq_of("a"), Some(10));
    assert!(
        asks_reconcile(&outs),
        "a source behind the follower's watermark is read whole at once: {outs:?}"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 8,
    });
    assert!(
        asks_snapshot(&outs),
        "a source behind the follower's watermark is read whole: {outs:?}"
    );
}

/// A stale read is a replica catching up, not a failed connection: it is read again on a
/// backoff of its own, so an outage's grown backoff does not space the few reads that
/// tell a lagging replica from a marker no history made (seed 8592: 20 s between reads).
#[test]
fn a_stale_fetch_is_read_again_on_its_own_backoff_not_the_outages() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "old")]);
    for _ in 0..6 {
        let token = h.feed.unwrap();
        h.input(Input::FeedFailed {
            token,
            error: "down".into(),
        });
        h.run_to_timeout();
    }
    h.reopen(FeedInfo::announcements(5));
    h.entry(Entry::mutation(9, "a"));
    // A stale read, and the read of the whole source it asks falls short of the marker.
    h.fetched(Some((5, "old")), None);
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 7,
    });
    let outs = h.fetched(Some((5, "old")), None);
    let Some(Diagnostic::BackingOff { attempt, delay, .. }) = diagnostics(&outs).pop() else {
        panic!("a stale read is read again after a backoff: {outs:?}");
    };
    assert_eq!(attempt, 1, "the stale reads' own first attempt");
    assert!(
        delay < Duration::from_secs(2),
        "not the outage's grown delay: {delay:?}"
    );
}

/// A foreign announcement with a huge seq pinned its key for good: every real write
/// looked older, and resyncs neither removed nor replaced it.
#[test]
fn an_announcement_far_past_the_source_is_skipped_not_pinned() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    let outs = h.put(u64::MAX - 1, "a", "foreign");
    assert!(puts(&outs).is_empty(), "{outs:?}");
    assert!(matches!(
        diagnostics(&outs).as_slice(),
        [Diagnostic::InvalidEntry {
            reason: InvalidReason::SeqAhead { known: 5 },
            ..
        }]
    ));
    let outs = h.put(6, "a", "next");
    assert_eq!(puts(&outs), [("a".into(), 6, "next".into())]);
}

/// A foreign announcement close enough to pass: the next read of the source that covers
/// its seq does not confirm it, and the source's answer replaces it.
#[test]
fn an_announcement_the_source_does_not_confirm_is_replaced_by_its_answer() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    h.put(8, "a", "foreign");
    assert_eq!(h.f.seq_of("a"), Some(8));
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "seven")],
        source_watermark: 9,
    });
    assert!(diagnostics(&outs).iter().any(|d| matches!(
        d,
        Diagnostic::InvalidEntry {
            reason: InvalidReason::Unconfirmed,
            ..
        }
    )));
    assert_eq!(
        puts(&outs),
        [("a".into(), 7, "seven".into())],
        "the source's own change replaces the unconfirmed one"
    );
    // Unconfirmed and not named by the read: only a snapshot says what the key holds.
    h.put(11, "b", "foreign");
    let outs = wake_and_read_nothing(&mut h, 12);
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(7, "a", "seven")],
        source_watermark: 12,
    });
    assert_eq!(
        removes(&outs),
        [("b".into(), 12)],
        "the foreign key is gone"
    );
}

/// Seqs near the top of `u64` (a foreign or corrupt producer) are data, not a panic: a
/// watermark at `u64::MAX` reopens its feed, and a gap check past it does not overflow.
#[test]
fn seqs_at_the_top_of_u64_never_overflow() {
    let mut h = H::new();
    h.open(FeedInfo::kv(0, u64::MAX));
    h.put(u64::MAX, "a", "top");
    assert_eq!(h.f.watermark(), u64::MAX);
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "x".into(),
    });
    let outs = h.run_to_timeout();
    assert_eq!(opened_from(&outs), Some(u64::MAX));
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 1));
    h.put(1, "a", "1");
    let outs = h.put(u64::MAX, "b", "far");
    assert!(
        diagnostics(&outs)
            .iter()
            .any(|d| matches!(d, Diagnostic::Gap { .. }))
    );
}

/// A late, older announcement changes nothing, so it must not stand for the key's
/// unconfirmed change either: the simulator caught the follower replacing the newer,
/// confirmed value with itself (a put at the same seq twice).
#[test]
fn a_late_older_announcement_does_not_displace_the_newer_one_awaiting_confirmation() {
    let mut h = announcements_at(40, vec![]);
    h.put(46, "k", "new");
    let outs = h.put(44, "k", "old");
    assert!(puts(&outs).is_empty(), "stale");
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(46, "k", "new")],
        source_watermark: 46,
    });
    assert!(
        puts(&outs).is_empty(),
        "the reconcile confirms 46; nothing is put again: {outs:?}"
    );
    assert!(!diagnostics(&outs).iter().any(|d| matches!(
        d,
        Diagnostic::InvalidEntry {
            reason: InvalidReason::Unconfirmed,
            ..
        }
    )));
}

/// The simulator's foreign-events fault: a reconcile that could not explain a foreign
/// announcement advanced the watermark past it before asking for its snapshot, so a
/// durable sink committed the forged row under a watermark that claimed to cover it.
#[test]
fn a_read_that_cannot_explain_a_foreign_announcement_leaves_the_watermark_for_its_snapshot() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    h.put(8, "b", "foreign");
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "c", "six")],
        source_watermark: 9,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    assert_eq!(
        h.f.watermark(),
        5,
        "no watermark may cover the forged change before the snapshot replaces it"
    );
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(5, "a", "real"), Entry::put(6, "c", "six")],
        source_watermark: 9,
    });
    assert_eq!(removes(&outs), [("b".into(), 9)], "the foreign key is gone");
    assert_eq!(h.f.watermark(), 9);
}

/// The simulator's foreign-events fault: an announcement of a seq the source never
/// reaches (another history, ahead of the head) waited for a read that covers its seq,
/// and so stayed in the cache for good. A writer announces after it commits, so a read
/// asked for after the announcement was applied must reach it.
#[test]
fn an_announcement_a_later_read_does_not_reach_is_not_kept_for_good() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    h.put(9, "b", "foreign");
    let outs = wake_and_read_nothing(&mut h, 5);
    assert!(
        asks_snapshot(&outs),
        "a read asked for after the announcement does not have it: {outs:?}"
    );
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(5, "a", "real")],
        source_watermark: 5,
    });
    assert_eq!(removes(&outs), [("b".into(), 5)], "the foreign key is gone");
}

/// A read already out when the announcement arrived may not reach it (the writer
/// committed after the read): that is no reason to doubt it.
#[test]
fn an_announcement_newer_than_the_read_in_flight_stays_until_a_later_read() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    h.input(Input::Wake);
    h.put(6, "b", "new");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 5,
    });
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    assert_eq!(h.f.seq_of("b"), Some(6));
}

/// The simulator's foreign-events fault: a durable sink keeps announcements with their
/// batch, and after a restart a key held past the watermark was taken as confirmed, so a
/// forged row survived every later read.
#[test]
fn a_key_a_restarted_sink_holds_past_its_watermark_awaits_confirmation() {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.f.start_from(5, 2);
    h.f.remember([("a".to_owned(), 5), ("b".to_owned(), 9)]);
    h.f.index_complete();
    h.found();
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 7,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(5, "a", "real")],
        source_watermark: 7,
    });
    assert_eq!(removes(&outs), [("b".into(), 7)], "the forged row is gone");
}

// ---- Issue 10: what a restarted sink committed ahead of its watermark ----

/// An announcements follower restarted warm from a sink at watermark `w` that holds
/// `held` keys, told what the sink committed ahead of it, that found its source.
fn restarted_at(w: u64, held: usize, ahead: Vec<Ahead>) -> H {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h =
        H::with(Follower::resume_lazily(config, Utf8, w, held).following(Follow::Announcements));
    h.f.remember_ahead(ahead);
    h.found();
    h
}

fn unconfirmed(outs: &[Output<String>]) -> usize {
    diagnostics(outs)
        .iter()
        .filter(|d| {
            matches!(
                d,
                Diagnostic::InvalidEntry {
                    reason: InvalidReason::Unconfirmed,
                    ..
                }
            )
        })
        .count()
}

/// Seeds 1797 and 2977: a removal applied ahead of the watermark (a replaced history's
/// announcement, a foreign event) was committed, and after a crash nothing said it was
/// only a claim: the key stayed gone for good. Given back by the sink, it is checked by
/// the first read like any other, and the source's value returns.
#[test]
fn a_removal_a_restarted_sink_committed_ahead_is_checked_by_the_first_read() {
    let removed = Ahead::Removed {
        key: "a".into(),
        seq: 8,
    };
    let mut h = restarted_at(5, 1, vec![removed]);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 9,
    });
    assert!(
        asks_snapshot(&outs),
        "a read that does not name the removed key cannot say what it holds: {outs:?}"
    );
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(4, "a", "real"), Entry::put(3, "b", "b")],
        source_watermark: 9,
    });
    assert!(
        puts(&outs).contains(&("a".into(), 4, "real".into())),
        "the source still has the key the claimed removal took: {outs:?}"
    );
    assert_eq!(
        unconfirmed(&outs),
        1,
        "the removal is counted as unconfirmed"
    );
}

/// The ordinary case: the removal the sink gives back is the source's, so the first
/// read confirms it quietly and brings nothing back.
#[test]
fn a_removal_given_back_by_the_sink_that_the_source_made_is_confirmed_quietly() {
    let removed = Ahead::Removed {
        key: "a".into(),
        seq: 8,
    };
    let mut h = restarted_at(5, 0, vec![removed]);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "older"), Entry::delete(8, "a")],
        source_watermark: 8,
    });
    assert!(!asks_snapshot(&outs), "{outs:?}");
    assert!(puts(&outs).is_empty(), "the key stays removed: {outs:?}");
    assert_eq!(
        unconfirmed(&outs),
        0,
        "the source made that removal: {outs:?}"
    );
    assert_eq!(h.f.watermark(), 8);
}

/// Seed 373: after a restart, a key held past the watermark was confirmed by its seq
/// alone, so a restored source whose new history reused the seq kept the replaced value.
/// Given back with its bytes, the claim is compared as before the restart.
#[test]
fn a_value_a_restarted_sink_holds_ahead_is_compared_by_its_bytes() {
    let held = Ahead::Put {
        key: "a".into(),
        seq: 7,
        value: b"replaced".to_vec(),
    };
    let mut h = restarted_at(5, 1, vec![held]);
    assert_eq!(h.f.seq_of("a"), Some(7), "learned without a listing");
    assert!(!h.f.needs_keys(), "the one key held is known");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "new history")],
        source_watermark: 7,
    });
    assert_eq!(
        puts(&outs),
        [("a".into(), 7, "new history".into())],
        "the source's value at that seq replaces the sink's"
    );
    assert_eq!(unconfirmed(&outs), 1);
}

/// The ordinary warm restart: what the sink holds ahead is the source's change, so the
/// read confirms it, puts nothing again and counts nothing.
#[test]
fn a_value_a_restarted_sink_holds_ahead_that_the_source_has_is_confirmed_quietly() {
    let held = Ahead::Put {
        key: "a".into(),
        seq: 7,
        value: b"seven".to_vec(),
    };
    let mut h = restarted_at(5, 1, vec![held]);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "seven")],
        source_watermark: 7,
    });
    assert!(puts(&outs).is_empty(), "{outs:?}");
    assert_eq!(h.f.counters().invalid, 0);
    assert_eq!(h.f.watermark(), 7);
}

/// A sink that cannot give back what it holds ahead: the keys it names past the
/// watermark are checked by seq, and a read's put at that seq is put again (the sink's
/// bytes may be a replaced history's), without counting the key invalid.
#[test]
fn a_key_held_ahead_by_a_sink_without_its_bytes_takes_the_reads_put_again() {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h =
        H::with(Follower::resume_lazily(config, Utf8, 5, 1).following(Follow::Announcements));
    h.f.remember([("a".to_owned(), 7)]);
    h.found();
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "new history")],
        source_watermark: 7,
    });
    assert_eq!(puts(&outs), [("a".into(), 7, "new history".into())]);
    assert_eq!(h.f.counters().invalid, 0, "nothing says the sink was wrong");
    assert_eq!(h.f.watermark(), 7);
}

/// Found by reading: a lazily resumed follower learns a key's seq only when a change
/// names it, so a forged value the sink held past its watermark that no later change
/// names was never checked. Given back by the sink, it is, with no listing of every key.
#[test]
fn a_forged_key_held_ahead_that_no_change_names_is_removed_by_the_first_read() {
    let forged = Ahead::Put {
        key: "x".into(),
        seq: 8,
        value: b"forged".to_vec(),
    };
    let mut h = restarted_at(5, 2, vec![forged]);
    assert!(
        h.f.needs_keys(),
        "one key at or below the watermark is still unknown"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 9,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    h.f.remember([("b".to_owned(), 2)]);
    h.f.index_complete();
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(2, "b", "b")],
        source_watermark: 9,
    });
    assert_eq!(removes(&outs), [("x".into(), 9)], "the forged key is gone");
}

/// Seed 55 (while this was built): a listing of every key before a snapshot made the
/// keys held past the watermark claims again, though a read had just confirmed them, and
/// the snapshot put them again at their own seq. Once the sink said what it holds ahead,
/// what it lists is what it holds, not a claim.
#[test]
fn a_listing_after_the_sink_said_what_it_holds_ahead_claims_nothing_again() {
    let held = |key: &str, value: &str| Ahead::Put {
        key: key.into(),
        seq: 19,
        value: value.as_bytes().to_vec(),
    };
    let mut h = restarted_at(18, 2, vec![held("hot", "v"), held("foreign", "f")]);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(19, "hot", "v")],
        source_watermark: 20,
    });
    assert!(
        asks_snapshot(&outs),
        "the foreign key is unexplained: {outs:?}"
    );
    h.f.remember([
        ("hot".to_owned(), 19),
        ("foreign".to_owned(), 19),
        ("cold".to_owned(), 3),
    ]);
    h.f.index_complete();
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(19, "hot", "v"), Entry::put(3, "cold", "c")],
        source_watermark: 20,
    });
    assert!(puts(&outs).is_empty(), "nothing is put again: {outs:?}");
    assert_eq!(removes(&outs), [("foreign".into(), 20)]);
}

/// Seed 103 (while this was built): a read replaced a value the sink held ahead (a
/// replaced history's), another key asked for a snapshot, and the listing of every key
/// before it gave the replaced value's seq back as the higher one; the snapshot's older
/// value then looked stale and the replaced one stayed for good.
#[test]
fn a_listing_before_a_snapshot_does_not_bring_back_a_replaced_claims_seq() {
    let held = |key: &str, seq: u64| Ahead::Put {
        key: key.into(),
        seq,
        value: b"replaced".to_vec(),
    };
    let mut h = restarted_at(73, 2, vec![held("hot", 102), held("foreign", 84)]);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(76, "hot", "new")],
        source_watermark: 80,
    });
    assert!(
        asks_snapshot(&outs),
        "the foreign key is unexplained: {outs:?}"
    );
    h.f.remember([
        ("hot".to_owned(), 102),
        ("foreign".to_owned(), 84),
        ("cold".to_owned(), 3),
    ]);
    h.f.index_complete();
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(76, "hot", "new"), Entry::put(3, "cold", "c")],
        source_watermark: 80,
    });
    assert_eq!(puts(&outs), [("hot".into(), 76, "new".into())], "{outs:?}");
    assert_eq!(removes(&outs), [("foreign".into(), 80)]);
    assert_eq!(h.f.seq_of("hot"), Some(76));
}

/// Found by reading: the seqs a lazily resumed follower learns of keys held past the
/// watermark were claimed, but not as committed, so a failed batch dropped the claim
/// while the key stayed known, and the forged value stayed for good.
#[test]
fn a_claim_learned_from_the_sink_survives_a_failed_batch() {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h =
        H::with(Follower::resume_lazily(config, Utf8, 5, 1).following(Follow::Announcements));
    h.f.track_commits(true);
    h.found();
    h.f.commit();
    // The read names the key; the driver learns it from the sink: held at 7, past 5.
    h.f.remember([("a".to_owned(), 7)]);
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "real")],
        source_watermark: 7,
    });
    // That batch never reached the sink.
    h.input(Input::SinkFailed {
        error: "disk full".into(),
    });
    assert_eq!(h.f.watermark(), 5);
    let outs = h.run_to_timeout();
    assert!(asks_reconcile(&outs), "{outs:?}");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "real")],
        source_watermark: 7,
    });
    assert_eq!(
        puts(&outs),
        [("a".into(), 7, "real".into())],
        "the sink still holds an unchecked value at 7: the read's put lands"
    );
}

/// The simulator's foreign-events fault, shape (a): a forged event that copies a real
/// change's key and seq with another value was confirmed by its seq alone, so the forged
/// value survived every read of the source. A read must show the same bytes.
#[test]
fn a_forged_value_at_a_real_seq_is_replaced_by_the_sources_value() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    // The source commits a@6 = "six"; a forger's copy of that seq arrives first.
    h.put(6, "a", "other");
    h.input(Input::Wake);
    // The real announcement is stale after the forged one.
    h.put(6, "a", "six");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "a", "six")],
        source_watermark: 6,
    });
    assert!(diagnostics(&outs).iter().any(|d| matches!(
        d,
        Diagnostic::InvalidEntry {
            reason: InvalidReason::Unconfirmed,
            ..
        }
    )));
    assert_eq!(
        puts(&outs),
        [("a".into(), 6, "six".into())],
        "the source's value replaces the forged one at the same seq"
    );
    // A forged removal at a seq the source gave a put is no removal either.
    let outs = h.entry(Entry::new(7, 7, "a", Op::Delete, Vec::new()));
    assert_eq!(removes(&outs), [("a".into(), 7)]);
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "seven")],
        source_watermark: 7,
    });
    assert_eq!(puts(&outs), [("a".into(), 7, "seven".into())]);
    assert_eq!(h.f.watermark(), 7);
}

/// The simulator's foreign-events fault, shape (b): a forged key announced after a quiet
/// source's last read stayed, since no wake came to read the source again. The follower
/// asks for that read itself.
#[test]
fn an_announcement_after_the_last_read_is_confirmed_without_a_wake() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    let outs = h.put(7, "x", "forged");
    assert_eq!(puts(&outs), [("x".into(), 7, "forged".into())]);
    assert_eq!(
        h.f.timeout_cause(),
        Some(Cause::Confirm),
        "no wake will come from a quiet source: the follower reads it itself"
    );
    assert_eq!(
        h.f.poll_timeout(),
        Some(Time::ZERO.saturating_add(Duration::from_millis(200)))
    );
    let outs = h.run_to_timeout();
    assert!(asks_reconcile(&outs), "{outs:?}");
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 5,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(5, "a", "real")],
        source_watermark: 5,
    });
    assert_eq!(removes(&outs), [("x".into(), 5)], "the forged key is gone");
}

/// A follower fed by a trusted, complete feed (a change log, a KV watch) never reads the
/// source per entry: only announcements, which may lie, are confirmed.
#[test]
fn a_replayed_feed_never_reads_the_source_per_entry() {
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 3));
    let mut outs = Vec::new();
    for seq in 1..=100 {
        outs.extend(h.put(seq, &format!("k{}", seq % 7), "v"));
    }
    assert!(!asks_reconcile(&outs), "{outs:?}");
    assert!(!asks_snapshot(&outs), "{outs:?}");
    assert_eq!(h.f.counters().reconciles, 0);
    assert_eq!(h.f.watermark(), 100);
}

/// Found by the simulator: a marker delivered twice is stale the second time (its fetch
/// already applied the value), and its empty payload was taken for the change it claims,
/// so the fetched value was never confirmed and was put again at the same seq.
#[test]
fn a_repeated_marker_claims_nothing() {
    let mut h = announcements_at(5, vec![]);
    h.entry(Entry::mutation(6, "a"));
    h.fetched(Some((6, "six")), None);
    h.entry(Entry::mutation(6, "a"));
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "a", "six")],
        source_watermark: 6,
    });
    assert!(
        puts(&outs).is_empty(),
        "the fetched value is confirmed, not put again: {outs:?}"
    );
    assert_eq!(h.f.watermark(), 6);
}

/// Found by the simulator (seed 564): the forged copy of a real change arrived first and
/// was applied; the real announcement, stale after it, then stood for the key's claim,
/// so the next read confirmed the forged value.
#[test]
fn the_real_announcement_after_a_forged_copy_does_not_confirm_it() {
    let mut h = announcements_at(5, vec![Entry::put(5, "a", "real")]);
    h.put(6, "a", "other");
    let outs = h.put(6, "a", "six");
    assert!(puts(&outs).is_empty(), "stale after the forged copy");
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "a", "six")],
        source_watermark: 6,
    });
    assert_eq!(
        puts(&outs),
        [("a".into(), 6, "six".into())],
        "the source's value replaces the forged one"
    );
}

/// Seeds 85219625 and 85220732: a read that replaced one claim the sink gave back but could
/// not explain another asked for a snapshot without applying its answers, and the batch
/// was committed with the first claim forgotten while the sink still held its change. The
/// source was then restored to a history that has that change: the snapshot put it again,
/// the same seq applied twice. The claim stays until the snapshot settles it.
#[test]
fn a_claim_a_read_set_aside_for_a_snapshot_is_settled_by_the_snapshot() {
    let held = vec![
        Ahead::Put {
            key: "a".into(),
            seq: 7,
            value: b"seven".to_vec(),
        },
        Ahead::Put {
            key: "b".into(),
            seq: 8,
            value: b"eight".to_vec(),
        },
    ];
    let config = config().max_ahead(1000).build().unwrap();
    let mut h =
        H::with(Follower::resume_lazily(config, Utf8, 5, 2).following(Follow::Announcements));
    h.f.track_commits(true);
    h.f.remember_ahead(held);
    h.found();
    // The read names `a` (removed since) and not `b`: only a snapshot settles `b`.
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::delete(9, "a")],
        source_watermark: 9,
    });
    assert!(asks_snapshot(&outs), "{outs:?}");
    assert!(removes(&outs).is_empty(), "{outs:?}");
    // The driver commits the batch (nothing was written), and the source is restored to
    // a backup that has both changes the sink holds.
    h.f.commit();
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(7, "a", "seven"), Entry::put(8, "b", "eight")],
        source_watermark: 8,
    });
    assert!(
        puts(&outs).is_empty(),
        "the sink holds both changes: {outs:?}"
    );
    assert_eq!(unconfirmed(&outs), 0, "{outs:?}");
    assert_eq!(h.f.watermark(), 8);
}

/// Seed 85220732: a replaced history's removal of a key at a seq, then the restored
/// history's put of it at the same seq. The put lands (a tombstone does not block a put at
/// its own seq), but the removal stayed the claim, so the read that had the put replaced
/// it and put the same change again.
#[test]
fn a_put_over_a_removal_at_its_seq_is_the_claim_a_read_confirms() {
    let mut h = announcements_at(5, vec![Entry::put(3, "a", "three")]);
    h.entry(Entry::delete(7, "a"));
    let outs = h.put(7, "a", "seven");
    assert_eq!(puts(&outs), [("a".into(), 7, "seven".into())], "{outs:?}");
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(7, "a", "seven")],
        source_watermark: 7,
    });
    assert!(puts(&outs).is_empty(), "the cache holds it: {outs:?}");
    assert_eq!(unconfirmed(&outs), 0, "{outs:?}");
    assert_eq!(h.f.watermark(), 7);
}
