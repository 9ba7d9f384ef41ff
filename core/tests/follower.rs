//! The follower's decisions, one SPEC.md line at a time (§2–4, §10, §12).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use tidemark_core::*;

// ---- §4 starting ----

#[test]
fn ready_only_after_the_initial_sync_reaches_the_head() {
    let mut h = H::new();
    let outs = h.open(gapless(3));
    assert!(
        !is_ready(&outs),
        "a follower with 3 entries to load must not be ready yet"
    );
    assert!(!is_ready(&h.put(1, "a", "1")));
    assert!(!is_ready(&h.put(2, "b", "2")));
    assert_eq!(h.f.phase(), Phase::Syncing);
    let outs = h.put(3, "c", "3");
    assert!(is_ready(&outs), "ready once the watermark reaches the head");
    assert_eq!(
        outs.last(),
        Some(&Output::Notice(Notice::Ready { watermark: 3 }))
    );
    assert_eq!(h.f.phase(), Phase::Live);
}

#[test]
fn a_raised_head_keeps_the_initial_sync_going_until_it_is_reached() {
    let mut h = H::new();
    h.open(FeedInfo::kv(1, 3));
    assert!(!is_ready(&h.put(1, "a", "1")));
    // A read that cannot race found the source past the head the feed opened at: a key
    // overwritten during the sync is only above it.
    let token = h.feed.expect("a feed is open");
    let outs = h.input(Input::FeedHead { token, head: 5 });
    assert!(!is_ready(&outs));
    assert!(
        !is_ready(&h.put(3, "c", "3")),
        "the old head is not complete: a key overwritten meanwhile is above it"
    );
    let outs = h.put(5, "b", "2");
    assert!(is_ready(&outs), "ready once the raised head is reached");
    assert_eq!(
        outs.last(),
        Some(&Output::Notice(Notice::Ready { watermark: 5 }))
    );
    let token = h.feed.expect("a feed is open");
    let outs = h.input(Input::FeedHead { token, head: 9 });
    assert!(outs.is_empty(), "a head raised after ready changes nothing");
    assert_eq!(h.f.phase(), Phase::Live);
}

#[test]
fn an_empty_source_becomes_ready_without_any_entry() {
    let mut h = H::new();
    let outs = h.open(gapless(0));
    assert!(
        is_ready(&outs),
        "no entry will ever arrive: readiness must come from the head"
    );
}

#[test]
fn ready_is_reported_once() {
    let mut h = H::new();
    h.open(gapless(1));
    let mut n = h
        .put(1, "a", "1")
        .iter()
        .filter(|o| matches!(o, Output::Notice(Notice::Ready { .. })))
        .count();
    n += h
        .put(2, "a", "2")
        .iter()
        .filter(|o| matches!(o, Output::Notice(Notice::Ready { .. })))
        .count();
    assert_eq!(n, 1);
}

#[test]
fn the_first_output_is_a_lookup_and_the_feed_opens_from_one() {
    let mut h = H::new();
    let outs = h.drain();
    assert!(matches!(
        outs[..],
        [Output::Request(Request::LookupSource { .. })]
    ));
    assert_eq!(opened_from(&h.found()), Some(1));
}

#[test]
fn a_sparse_replay_into_an_empty_cache_needs_no_resync() {
    // A KV bucket with history 1: seqs 1..=9 were overwritten, the oldest live entry is 10.
    let mut h = H::new();
    let outs = h.open(sparse(10, 12));
    assert!(diagnostics(&outs).is_empty(), "{outs:?}");
    h.put(10, "a", "x");
    let outs = h.put(12, "b", "y");
    assert!(
        is_ready(&outs),
        "a sparse feed may skip seqs: 12 reaches the head"
    );
    assert_eq!(h.f.counters().gaps, 0);
}

#[test]
fn a_pending_count_is_a_hint_that_cannot_reserve_without_limit() {
    // A KV feed tells how many entries are still to come; the follower makes room for
    // them. A wrong count (here the largest there is) must neither panic nor change what
    // the follower decides.
    let mut h = H::new();
    h.open(sparse(1, 3));
    h.entry(Entry::put(1, "a", "1").with_pending(u64::MAX));
    h.entry(Entry::put(2, "b", "2").with_pending(u64::MAX - 1));
    let outs = h.entry(Entry::put(3, "c", "3").with_pending(0));
    assert!(is_ready(&outs), "{outs:?}");
    assert_eq!((h.f.len(), h.f.watermark()), (3, 3));
}

#[test]
fn an_initial_sync_grows_its_room_by_the_pending_count_bounded_by_the_keys_it_holds() {
    // The first count makes room for 10 keys; once that room is full, a count that says
    // far more follow (a stream's history, say) grows it by at most four times the keys
    // held (and the first bound), once, not entry by entry; a ready follower stops.
    let mut h = H::new();
    h.open(sparse(1, 400));
    h.entry(Entry::put(1, "k0001", "1").with_pending(9));
    assert_eq!(h.f.presized(), tidemark_core::presize_for(9));
    let mut grown = None;
    for seq in 2..400u64 {
        let (held, room) = (h.f.len(), h.f.presized());
        h.entry(Entry::put(seq, format!("k{seq:04}"), "1").with_pending(u64::MAX));
        if h.f.presized() != room {
            assert!(grown.is_none(), "it grew twice");
            assert!(
                held >= 10,
                "it grew at {held} keys, before its room of 10 was full"
            );
            assert_eq!(
                h.f.presized(),
                held + tidemark_core::presize_more(u64::MAX, held)
            );
            grown = Some(held);
        }
    }
    assert!(grown.is_some(), "it never grew past its first room");
    let room = h.f.presized();
    let outs = h.entry(Entry::put(400, "k0400", "1").with_pending(0));
    assert!(is_ready(&outs), "{outs:?}");
    assert_eq!(h.f.presized(), room);
    assert_eq!(
        h.f.len(),
        400,
        "the room changes nothing the follower decides"
    );
}

// ---- §4 resume ----

#[test]
fn after_a_feed_failure_it_reopens_from_watermark_plus_one() {
    let mut h = H::new();
    h.open(gapless(2));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    let token = h.feed.unwrap();
    let outs = h.input(Input::FeedFailed {
        token,
        error: "connection reset".into(),
    });
    assert!(outs.contains(&Output::Request(Request::CloseFeed { token })));
    assert_eq!(h.f.phase(), Phase::BackingOff);
    let outs = h.run_to_timeout();
    assert_eq!(
        opened_from(&outs),
        Some(3),
        "nothing written while closed may be lost"
    );
    assert_eq!(h.f.counters().reopens, 1);
}

#[test]
fn after_a_clean_end_it_reopens_quickly_from_watermark_plus_one() {
    let mut h = H::new();
    h.open(gapless(1));
    h.put(1, "a", "1");
    let token = h.feed.unwrap();
    let outs = h.input(Input::FeedEnded { token });
    let delay = diagnostics(&outs)
        .into_iter()
        .find_map(|d| match d {
            Diagnostic::BackingOff {
                cause: Cause::FeedEnded,
                delay,
                ..
            } => Some(delay),
            _ => None,
        })
        .expect("a clean end schedules a reopen");
    assert!(
        delay <= Duration::from_millis(50),
        "a server restart should be followed quickly: {delay:?}"
    );
    assert_eq!(opened_from(&h.run_to_timeout()), Some(2));
}

#[test]
fn entries_from_a_closed_feed_are_ignored() {
    let mut h = H::new();
    h.open(gapless(5));
    let old = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token: old,
        error: "x".into(),
    });
    h.run_to_timeout();
    let outs = h.input(Input::Entry {
        token: old,
        entry: Entry::put(1, "a", "late"),
    });
    assert!(
        puts(&outs).is_empty(),
        "an entry from a feed we closed must not be applied"
    );
    assert_eq!(h.f.counters().ignored, 1);
}

#[test]
fn a_warm_restart_resumes_from_the_persisted_watermark() {
    let keys = vec![("a".to_string(), 40), ("b".to_string(), 41)];
    let f = Follower::resume(config().build().unwrap(), Utf8, 41, keys);
    let mut h = H::with(f);
    assert_eq!(opened_from(&h.found()), Some(42), "only the delta is read");
    h.reopen(gapless(42));
    let outs = h.put(42, "a", "new");
    assert_eq!(puts(&outs), [("a".into(), 42, "new".into())]);
    assert!(is_ready(&outs));
    assert_eq!(h.f.len(), 2);
}

#[test]
fn a_resumed_follower_removes_a_key_it_was_told_about_later() {
    // A warm restart loaded only the keys its delta touched; a later change removes a
    // key the cache has held all along. Told about it, the follower removes it.
    let remove_b = |remember: bool| {
        let f = Follower::resume(config().build().unwrap(), Utf8, 10, [("a".into(), 4)]);
        let mut h = H::with(f);
        h.open(gapless(10));
        if remember {
            h.f.remember([("b".to_owned(), 7)]);
        }
        let token = h.feed.unwrap();
        h.input(Input::Entry {
            token,
            entry: Entry::new(11, 11, "b", Op::Delete, Vec::new()),
        })
    };
    assert_eq!(
        removes(&remove_b(false)),
        [],
        "without being told, the follower cannot know the cache holds b"
    );
    assert_eq!(removes(&remove_b(true)), [("b".to_owned(), 11)]);
}

#[test]
fn remembering_never_lowers_what_the_follower_knows() {
    // The follower knows a at 9; being told a at 3 must not make it re-apply a@9 from a
    // snapshot as if the cache held something older.
    let f = Follower::resume(config().build().unwrap(), Utf8, 10, [("a".into(), 9)]);
    let mut h = H::with(f);
    h.f.remember([("a".to_owned(), 3)]);
    h.found();
    let token = h.feed.unwrap();
    // History below 20 is gone: only a snapshot can help.
    h.input(Input::FeedOpened {
        token,
        info: FeedInfo {
            first_available: 20,
            head: 25,
            continuity: Continuity::Gapless,
            checkpoints: false,
            follow: Follow::Replay,
            lineage: Default::default(),
        },
    });
    let token = h.request.expect("a snapshot was asked for");
    let outs = h.input(Input::Snapshot {
        token,
        entries: vec![Entry::put(9, "a", "same")],
        source_watermark: 25,
    });
    assert_eq!(puts(&outs), [], "a@9 is already in the cache: {outs:?}");
    assert_eq!(h.f.watermark(), 25);
}

// ---- §4 resync ----

#[test]
fn compaction_past_the_watermark_resyncs_and_removes_vanished_keys() {
    let mut h = H::new();
    h.open(gapless(3));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    h.put(3, "c", "3");
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "x".into(),
    });
    h.run_to_timeout();
    // History up to 9 is gone; the follower wants 4.
    let outs = h.reopen(FeedInfo {
        first_available: 10,
        ..gapless(12)
    });
    assert!(diagnostics(&outs).contains(&Diagnostic::Compacted {
        wanted: 4,
        first_available: 10
    }));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    assert_eq!(h.f.phase(), Phase::Resyncing);
    let snapshot = vec![
        Entry::put(2, "b", "2"),
        Entry::put(11, "c", "3'"),
        Entry::put(12, "d", "4"),
    ];
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: snapshot,
        source_watermark: 12,
    });
    assert_eq!(
        removes(&outs),
        [("a".into(), 12)],
        "a key the source no longer has must go"
    );
    assert_eq!(
        puts(&outs),
        [("c".into(), 11, "3'".into()), ("d".into(), 12, "4".into())],
        "unchanged keys are not re-applied"
    );
    assert_eq!(h.f.watermark(), 12);
    assert_eq!(
        opened_from(&outs),
        Some(13),
        "then it follows again from the snapshot"
    );
    assert_eq!(h.f.counters().resyncs, 1);
}

#[test]
fn a_reconcile_that_finds_tombstones_compacted_resyncs() {
    let mut h = H::new();
    h.open(gapless(1));
    h.put(1, "a", "1");
    let outs = h.entry(Entry::put(5, "b", "x")); // a gap: reconcile since 1
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 1, .. })))
    );
    let outs = h.input(Input::ChangesUnavailable {
        token: h.request.unwrap(),
        first_available: 4,
    });
    assert!(
        diagnostics(&outs).contains(&Diagnostic::Compacted {
            wanted: 2,
            first_available: 4
        }),
        "an operator sees why the follower resyncs: {outs:?}"
    );
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(5, "b", "x")],
        source_watermark: 5,
    });
    assert_eq!(removes(&outs), [("a".into(), 5)]);
    assert_eq!(h.f.watermark(), 5);
}

/// Fails the feed, reopens it compacted past what the cache holds (head 40), and answers
/// the snapshot that asks for with `entries` at 40: the resync's outputs.
fn resync_at_40(h: &mut H, entries: Vec<Entry>) -> Vec<Output<String>> {
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "x".into(),
    });
    h.run_to_timeout();
    h.reopen(FeedInfo {
        first_available: 30,
        ..gapless(40)
    });
    h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries,
        source_watermark: 40,
    })
}

/// The removals and puts (sorted) a resync decides.
type Resynced = (Vec<(String, u64)>, Vec<(String, u64, String)>);

/// What a resync of twenty cached keys decides from `snapshot`.
fn resync_from(snapshot: Vec<Entry>) -> Resynced {
    let mut h = H::new();
    h.open(gapless(20));
    for i in 1..=20u64 {
        h.put(i, &format!("k{i:02}"), "v");
    }
    let outs = resync_at_40(&mut h, snapshot);
    let mut puts = puts(&outs);
    puts.sort();
    (removes(&outs), puts)
}

#[test]
fn a_snapshot_in_key_order_or_not_removes_exactly_the_keys_it_does_not_name() {
    // Every third key is gone, every fifth changed, and two keys are new (one sorts
    // before every cached key, one after).
    let mut snapshot: Vec<Entry> = (1..=20u64)
        .filter(|i| i % 3 != 0)
        .map(|i| match i % 5 {
            0 => Entry::put(20 + i, format!("k{i:02}"), "w"),
            _ => Entry::put(i, format!("k{i:02}"), "v"),
        })
        .chain([Entry::put(39, "a", "new"), Entry::put(38, "z", "new")])
        .collect();
    snapshot.sort_by(|a, b| a.key.cmp(&b.key));
    let gone: Vec<(String, u64)> = (1..=20u64)
        .filter(|i| i % 3 == 0)
        .map(|i| (format!("k{i:02}"), 40))
        .collect();
    let changed: Vec<(String, u64, String)> = [
        ("a".to_owned(), 39, "new".to_owned()),
        ("k05".into(), 25, "w".into()),
        ("k10".into(), 30, "w".into()),
        ("k20".into(), 40, "w".into()),
        ("z".into(), 38, "new".into()),
    ]
    .into();
    let in_order = resync_from(snapshot.clone());
    assert_eq!(in_order, (gone.clone(), changed.clone()), "in key order");
    snapshot.reverse();
    snapshot.swap(0, 7);
    assert_eq!(resync_from(snapshot), (gone, changed), "in another order");
}

#[test]
fn resync_removals_come_in_key_order() {
    let mut h = H::new();
    h.open(gapless(40));
    for (i, k) in ["q", "b", "z", "a", "m"].iter().enumerate() {
        h.put(i as u64 + 1, k, "v");
    }
    let outs = resync_at_40(&mut h, vec![]);
    let keys: Vec<_> = removes(&outs).into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        ["a", "b", "m", "q", "z"],
        "outputs must not depend on hash order"
    );
}

// ---- §3 applying and the watermark ----

#[test]
fn an_entry_at_or_below_the_watermark_is_not_applied_again_but_is_checkpointed() {
    let mut h = H::new();
    h.open(gapless(2));
    h.put(1, "a", "1");
    h.put(2, "a", "2");
    let outs = h.entry(Entry::new(3, 1, "a", Op::Put, b"1".to_vec()));
    assert!(
        puts(&outs).is_empty(),
        "a replayed seq must not be applied twice"
    );
    assert!(
        outs.contains(&Output::Request(Request::Checkpoint { position: 3 })),
        "but its position is recorded"
    );
    assert!(diagnostics(&outs).contains(&Diagnostic::SeqRegressed {
        previous: 2,
        got: 1
    }));
    assert_eq!(h.f.counters().stale, 1);
    assert_eq!(h.f.watermark(), 2);
}

#[test]
fn checkpoints_are_monotone() {
    let mut h = H::new();
    h.open(gapless(9));
    assert!(
        h.entry(Entry::new(5, 1, "a", Op::Put, b"1".to_vec()))
            .contains(&Output::Request(Request::Checkpoint { position: 5 }))
    );
    let outs = h.entry(Entry::new(4, 2, "a", Op::Put, b"2".to_vec()));
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Checkpoint { .. }))),
        "a lower position must not move the cursor back: {outs:?}"
    );
}

fn checkpoint_asked(outs: &[Output<String>]) -> Option<u64> {
    outs.iter().find_map(|o| match o {
        Output::Request(Request::Checkpoint { position }) => Some(*position),
        _ => None,
    })
}

#[test]
fn a_checkpoint_whose_save_failed_is_asked_for_again_after_a_backoff() {
    let mut h = H::new();
    h.open(gapless(9));
    let outs = h.entry(Entry::new(5, 1, "a", Op::Put, b"1".to_vec()));
    assert_eq!(checkpoint_asked(&outs), Some(5));
    let outs = h.input(Input::CheckpointFailed {
        position: 5,
        error: "timed out".into(),
    });
    assert!(
        diagnostics(&outs).iter().any(|d| matches!(
            d,
            Diagnostic::BackingOff {
                cause: Cause::Checkpoint,
                ..
            }
        )),
        "the retry is logged: {outs:?}"
    );
    assert_eq!(h.f.timeout_cause(), Some(Cause::Checkpoint));
    assert_ne!(
        h.f.phase(),
        Phase::BackingOff,
        "a cursor store away is not the source's path: the follower is not backing off"
    );
    // Nothing else is coming: the quiet stream's last entry is saved all the same.
    assert_eq!(checkpoint_asked(&h.run_to_timeout()), Some(5));
    assert_eq!(h.f.poll_timeout(), None, "one save asked again, once");
}

#[test]
fn a_later_checkpoint_stands_for_one_whose_save_failed() {
    let mut h = H::new();
    h.open(gapless(9));
    h.entry(Entry::new(5, 1, "a", Op::Put, b"1".to_vec()));
    h.input(Input::CheckpointFailed {
        position: 5,
        error: "timed out".into(),
    });
    let outs = h.entry(Entry::new(6, 2, "a", Op::Put, b"2".to_vec()));
    assert_eq!(checkpoint_asked(&outs), Some(6));
    assert_eq!(
        h.f.poll_timeout(),
        None,
        "saves are monotone: 6 saved stands for 5, so 5 is not asked again"
    );
    // A failure reported late, of a position a later checkpoint covers, changes nothing.
    h.input(Input::CheckpointFailed {
        position: 5,
        error: "timed out".into(),
    });
    assert_eq!(h.f.poll_timeout(), None);
}

#[test]
fn a_checkpoint_whose_save_failed_is_asked_for_at_once_when_the_path_is_back() {
    let mut h = H::new();
    h.open(gapless(9));
    h.entry(Entry::new(5, 1, "a", Op::Put, b"1".to_vec()));
    for _ in 0..6 {
        // An outage grows its backoff.
        h.input(Input::CheckpointFailed {
            position: 5,
            error: "timed out".into(),
        });
        assert_eq!(checkpoint_asked(&h.run_to_timeout()), Some(5));
    }
    h.input(Input::CheckpointFailed {
        position: 5,
        error: "timed out".into(),
    });
    assert_eq!(
        checkpoint_asked(&h.input(Input::Reconnected)),
        Some(5),
        "the path is back: the owed save is asked for at once, not after the backoff"
    );
}

#[test]
fn the_watermark_only_grows_and_regressions_are_reported() {
    let mut h = H::new();
    h.open(sparse(1, 10));
    h.put(10, "a", "1");
    let outs = h.put(4, "b", "old");
    assert_eq!(
        h.f.watermark(),
        10,
        "a lower seq must not lower the watermark"
    );
    assert!(puts(&outs).is_empty());
    assert!(diagnostics(&outs).contains(&Diagnostic::SeqRegressed {
        previous: 10,
        got: 4
    }));
}

#[test]
fn a_gap_on_a_gapless_feed_reconciles_from_the_watermark() {
    let mut h = H::new();
    h.open(gapless(2));
    h.put(1, "a", "1");
    let outs = h.put(4, "d", "4");
    assert!(
        puts(&outs).is_empty(),
        "the entry past the gap is not applied blindly"
    );
    assert!(diagnostics(&outs).contains(&Diagnostic::Gap {
        expected: 2,
        got: 4
    }));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 1, .. }))),
        "{outs:?}"
    );
    let changes = vec![
        Entry::put(2, "b", "2"),
        Entry::delete(3, "a"),
        Entry::put(4, "d", "4"),
    ];
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes,
        source_watermark: 4,
    });
    assert_eq!(
        puts(&outs),
        [("b".into(), 2, "2".into()), ("d".into(), 4, "4".into())]
    );
    assert_eq!(removes(&outs), [("a".into(), 3)]);
    assert!(outs.contains(&Output::Notice(Notice::CaughtUp(CaughtUp {
        applied: 2,
        removed: 1,
        watermark: 4,
        resynced: false,
    }))));
    assert_eq!(
        opened_from(&outs),
        Some(5),
        "it resumes the feed after what it caught up"
    );
    assert_eq!(h.f.counters().gaps, 1);
}

#[test]
fn a_sparse_feed_never_reports_gaps() {
    let mut h = H::new();
    h.open(sparse(1, 100));
    h.put(3, "a", "1");
    let outs = h.put(50, "b", "2");
    assert_eq!(puts(&outs).len(), 1);
    assert_eq!(h.f.counters().gaps, 0);
}

#[test]
fn a_fetched_value_newer_than_its_marker_is_never_replaced_by_an_older_entry() {
    let mut h = H::new();
    h.open(sparse(1, 20));
    let outs = h.entry(Entry::new(5, 5, "a", Op::Mutation, vec![]));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Fetch { seq: 5, .. }))),
        "{outs:?}"
    );
    // The source already holds the value written at 9.
    let outs = h.fetched(Some((9, "nine")), None);
    assert_eq!(puts(&outs), [("a".into(), 9, "nine".into())]);
    assert_eq!(h.f.watermark(), 5, "seqs 6..=8 are not in the cache yet");
    let outs = h.put(7, "a", "seven");
    assert!(
        puts(&outs).is_empty(),
        "7 is older than the 9 the cache holds"
    );
    assert_eq!(h.f.seq_of("a"), Some(9));
    assert_eq!(h.f.watermark(), 7, "but its position is past");
}

#[test]
fn a_marker_for_an_absent_key_removes_it() {
    let mut h = H::new();
    h.open(gapless(2));
    h.put(1, "a", "1");
    h.entry(Entry::new(2, 2, "a", Op::Mutation, vec![]));
    let outs = h.fetched(None, None);
    assert_eq!(removes(&outs), [("a".into(), 2)]);
    assert!(is_ready(&outs));
}

#[test]
fn entries_arriving_during_a_fetch_wait_for_it() {
    let mut h = H::new();
    h.open(gapless(3));
    h.entry(Entry::new(1, 1, "a", Op::Mutation, vec![]));
    let outs = h.put(2, "b", "2");
    assert!(
        puts(&outs).is_empty(),
        "held until the fetch answers, to keep seq order"
    );
    let outs = h.fetched(Some((1, "1")), None);
    assert_eq!(
        puts(&outs),
        [("a".into(), 1, "1".into()), ("b".into(), 2, "2".into())]
    );
    assert_eq!(h.f.watermark(), 2);
}

#[test]
fn removals_and_purges_remove_and_absent_keys_are_no_ops() {
    let mut h = H::new();
    h.open(gapless(4));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    assert_eq!(removes(&h.entry(Entry::delete(3, "a"))), [("a".into(), 3)]);
    assert_eq!(
        removes(&h.entry(Entry::new(4, 4, "b", Op::Purge, vec![]))),
        [("b".into(), 4)]
    );
    assert!(removes(&h.entry(Entry::delete(5, "zz"))).is_empty());
    assert_eq!(h.f.watermark(), 5);
    assert!(h.f.is_empty());
}

// ---- §2 decoding ----

#[test]
fn a_decode_failure_is_logged_counted_skipped_and_passed() {
    let mut h = H::new();
    h.open(gapless(2));
    let outs = h.entry(Entry::new(1, 1, "a", Op::Put, vec![0xff, 0xfe]));
    assert!(puts(&outs).is_empty(), "no handler fires for poison");
    match &diagnostics(&outs)[..] {
        [Diagnostic::DecodeFailed { key, seq: 1, error }] => {
            assert_eq!(key, "a");
            assert!(
                error.contains("utf-8"),
                "the decoder's own error is kept: {error}"
            );
        }
        other => panic!("expected one decode failure, got {other:?}"),
    }
    assert_eq!(
        h.f.watermark(),
        1,
        "a poison entry must not wedge the follower"
    );
    assert!(outs.contains(&Output::Request(Request::Checkpoint { position: 1 })));
    assert_eq!(
        h.f.seq_of("a"),
        None,
        "a poison value takes no place in the index"
    );
    assert!(h.f.is_empty());
    assert_eq!(puts(&h.put(2, "a", "ok")), [("a".into(), 2, "ok".into())]);
    assert_eq!(h.f.counters().poison, 1);
}

// ---- §12 bad input ----

#[test]
fn invalid_entries_are_counted_skips_never_panics() {
    let config = config()
        .max_value_bytes(4)
        .max_key_bytes(8)
        .build()
        .unwrap();
    let mut h = H::with(Follower::new(config, Utf8));
    h.open(sparse(1, 100));
    let bad = [
        (Entry::put(0, "a", "v"), InvalidReason::ZeroSeq),
        (Entry::put(1, "", "v"), InvalidReason::EmptyKey),
        (
            Entry::put(2, "k".repeat(9), "v"),
            InvalidReason::KeyTooLong { len: 9 },
        ),
        (
            Entry::put(3, "a\nb", "v"),
            InvalidReason::ControlCharacterInKey,
        ),
        (
            Entry::put(4, "a", "12345"),
            InvalidReason::ValueTooLarge { len: 5 },
        ),
        (
            Entry::new(5, 5, "a", Op::Unknown("ROLLUP".into()), vec![]),
            InvalidReason::UnknownOperation("ROLLUP".into()),
        ),
    ];
    for (entry, reason) in bad {
        let outs = h.entry(entry);
        assert!(puts(&outs).is_empty() && removes(&outs).is_empty());
        assert!(
            diagnostics(&outs)
                .iter()
                .any(|d| matches!(d, Diagnostic::InvalidEntry { reason: r, .. } if *r == reason)),
            "expected {reason:?} in {outs:?}"
        );
    }
    assert_eq!(h.f.counters().invalid, 6);
    assert_eq!(
        h.f.watermark(),
        5,
        "deliberately skipped entries move the watermark past them"
    );
    assert!(h.f.is_empty(), "the cache is untouched");
}

#[test]
fn undecodable_feed_payloads_are_counted_and_checkpointed_past() {
    let mut h = H::new();
    h.open(gapless(5));
    let token = h.feed.unwrap();
    let outs = h.input(Input::Undecodable {
        token,
        position: 7,
        seq: None,
        reason: "not an event".into(),
    });
    assert!(
        outs.contains(&Output::Request(Request::Checkpoint { position: 7 })),
        "poison must not wedge the cursor"
    );
    assert_eq!(h.f.counters().invalid, 1);
    assert_eq!(
        h.f.watermark(),
        0,
        "with no seq there is nothing to move past"
    );
}

// ---- §6 reconcile, §7 wake ----

#[test]
fn a_wake_only_follower_reconciles_on_start_and_on_each_wake_and_never_polls() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::WakeOnly));
    let outs = h.found();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 0, .. })))
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(1, "a", "1")],
        source_watermark: 1,
    });
    assert!(is_ready(&outs));
    assert_eq!(
        h.f.poll_timeout(),
        None,
        "no commits, no refreshes: nothing is scheduled"
    );
    assert!(
        h.advance(Duration::from_secs(3600)).is_empty(),
        "an hour of quiet asks nothing"
    );
    let outs = h.input(Input::Wake);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 1, .. })))
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 1,
    });
    assert!(outs.contains(&Output::Notice(Notice::CaughtUp(CaughtUp {
        applied: 0,
        removed: 0,
        watermark: 1,
        resynced: false,
    }))));
}

#[test]
fn a_wake_during_a_reconcile_causes_one_more() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::WakeOnly));
    h.found();
    let first = h.request.unwrap();
    assert!(
        h.input(Input::Wake).is_empty(),
        "no second reconcile while one is in flight"
    );
    assert!(h.input(Input::Wake).is_empty());
    let outs = h.input(Input::Changes {
        token: first,
        changes: vec![],
        source_watermark: 0,
    });
    let n = outs
        .iter()
        .filter(|o| matches!(o, Output::Request(Request::Reconcile { .. })))
        .count();
    assert_eq!(
        n, 1,
        "wakes during a reconcile coalesce into exactly one more"
    );
}

#[test]
fn reconcile_skips_changes_older_than_the_cache() {
    let mut h = H::new();
    h.open(sparse(1, 10));
    h.put(10, "a", "new");
    let outs = h.input(Input::Wake);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 10, .. })))
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(3, "a", "old"), Entry::put(11, "b", "b")],
        source_watermark: 11,
    });
    assert_eq!(puts(&outs), [("b".into(), 11, "b".into())]);
    assert_eq!(h.f.watermark(), 11);
}

// ---- §10 failure handling ----

#[test]
fn the_next_timeout_says_which_backoff_it_ends() {
    let mut h = H::new();
    h.drain();
    assert_eq!(h.f.timeout_cause(), None, "nothing waits yet");
    h.input(Input::RequestFailed {
        token: h.request.unwrap(),
        error: "bucket not found".into(),
    });
    assert_eq!(h.f.timeout_cause(), Some(Cause::Lookup));
    h.run_to_timeout();
    h.found();
    let token = h.feed.unwrap();
    h.input(Input::FeedOpened {
        token,
        info: gapless(1),
    });
    h.put(1, "a", "1");
    h.input(Input::FeedFailed {
        token,
        error: "reset".into(),
    });
    assert_eq!(h.f.timeout_cause(), Some(Cause::FeedFailed));
    h.run_to_timeout();
    let token = h.feed.unwrap();
    h.input(Input::FeedOpened {
        token,
        info: gapless(1),
    });
    h.input(Input::FeedEnded { token });
    assert_eq!(h.f.timeout_cause(), Some(Cause::FeedEnded));
    h.run_to_timeout();
    assert_eq!(
        (h.f.timeout_cause(), h.f.poll_timeout()),
        (None, None),
        "the reopen is under way: nothing to wait for"
    );
}

/// SPEC §15: followers seeded differently (a fleet whose members each draw a seed) choose
/// different delays for the same failures, so they never retry in lockstep; the same seed
/// chooses the same ones, so a run replays.
#[test]
fn followers_with_different_seeds_back_off_out_of_step() {
    let delays = |seed: u64| {
        let config = FollowerConfig::builder("fleet").seed(seed).build().unwrap();
        let mut h = H::with(Follower::new(config, Utf8));
        h.drain();
        let mut delays = Vec::new();
        for _ in 0..4 {
            let outs = h.input(Input::RequestFailed {
                token: h.request.unwrap(),
                error: "unreachable".into(),
            });
            delays.extend(diagnostics(&outs).into_iter().filter_map(|d| match d {
                Diagnostic::BackingOff { delay, .. } => Some(delay),
                _ => None,
            }));
            h.run_to_timeout();
        }
        delays
    };
    let fleet: Vec<Vec<Duration>> = (1..=8).map(delays).collect();
    for (i, a) in fleet.iter().enumerate() {
        assert_eq!(a.len(), 4);
        for b in &fleet[i + 1..] {
            assert!(
                a.iter().zip(b).all(|(x, y)| x != y),
                "two seeds must never pick the same delay for the same attempt: {a:?} {b:?}"
            );
        }
    }
    assert_eq!(delays(3), fleet[2], "the same seed replays the same delays");
}

#[test]
fn lookup_failure_retries_with_growing_backoff_and_keeps_trying() {
    let mut h = H::new();
    h.drain();
    let mut delays = Vec::new();
    for _ in 0..12 {
        let outs = h.input(Input::RequestFailed {
            token: h.request.unwrap(),
            error: "bucket not found".into(),
        });
        let d = diagnostics(&outs)
            .into_iter()
            .find_map(|d| match d {
                Diagnostic::BackingOff {
                    cause: Cause::Lookup,
                    delay,
                    ..
                } => Some(delay),
                _ => None,
            })
            .expect("a lookup failure backs off");
        delays.push(d);
        let outs = h.run_to_timeout();
        assert!(
            outs.iter()
                .any(|o| matches!(o, Output::Request(Request::LookupSource { .. }))),
            "it never gives up"
        );
    }
    assert!(delays[4] > delays[0] * 4, "delays grow: {delays:?}");
    assert!(
        delays.iter().all(|d| *d <= Duration::from_secs(30)),
        "and are capped: {delays:?}"
    );
    assert_eq!(
        opened_from(&h.found()),
        Some(1),
        "once the bucket appears it proceeds"
    );
}

#[test]
fn repeated_feed_failures_back_off_instead_of_looping() {
    let mut h = H::new();
    h.open(gapless(0));
    let mut opens = 0;
    let start = h.now;
    for _ in 0..10 {
        let token = h.feed.unwrap();
        h.input(Input::FeedFailed {
            token,
            error: "permission denied".into(),
        });
        if opened_from(&h.run_to_timeout()).is_some() {
            opens += 1;
        }
    }
    assert_eq!(opens, 10);
    let elapsed = h.now.saturating_since(start);
    assert!(
        elapsed > Duration::from_secs(60),
        "10 failures must take time, not a tight loop: {elapsed:?}"
    );
}

#[test]
fn failed_requests_are_retried_after_a_backoff() {
    let mut h = H::new();
    h.open(gapless(1));
    h.put(3, "a", "1"); // gap
    let outs = h.input(Input::RequestFailed {
        token: h.request.unwrap(),
        error: "timeout".into(),
    });
    assert!(diagnostics(&outs).iter().any(|d| matches!(
        d,
        Diagnostic::BackingOff {
            cause: Cause::RequestFailed,
            ..
        }
    )));
    assert_eq!(h.f.phase(), Phase::BackingOff);
    let outs = h.run_to_timeout();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 0, .. }))),
        "{outs:?}"
    );
}

#[test]
fn backoff_resets_after_a_healthy_period() {
    let mut h = H::new();
    h.open(gapless(0));
    let fail = |h: &mut H| {
        let token = h.feed.unwrap();
        let outs = h.input(Input::FeedFailed {
            token,
            error: "x".into(),
        });
        let attempt = diagnostics(&outs)
            .into_iter()
            .find_map(|d| match d {
                Diagnostic::BackingOff { attempt, .. } => Some(attempt),
                _ => None,
            })
            .unwrap();
        h.run_to_timeout();
        let token = h.feed.unwrap();
        h.input(Input::FeedOpened {
            token,
            info: gapless(0),
        });
        attempt
    };
    assert_eq!([fail(&mut h), fail(&mut h), fail(&mut h)], [1, 2, 3]);
    h.advance(Duration::from_secs(121));
    assert_eq!(
        fail(&mut h),
        1,
        "two healthy minutes forget earlier failures"
    );
}

#[test]
fn stop_closes_the_feed_and_decides_nothing_more() {
    let mut h = H::new();
    h.open(gapless(3));
    let token = h.feed.unwrap();
    let outs = h.input(Input::Stop);
    assert_eq!(
        outs,
        [
            Output::Request(Request::CloseFeed { token }),
            Output::Notice(Notice::Stopped)
        ]
    );
    assert_eq!(h.f.phase(), Phase::Stopped);
    assert!(h.put(1, "a", "1").is_empty());
    assert_eq!(h.f.poll_timeout(), None);
}

#[test]
fn status_lists_name_phase_watermark_and_counters() {
    let mut h = H::new();
    h.open(gapless(1));
    h.put(1, "a", "1");
    let s = h.f.status();
    assert_eq!(
        (s.name.as_str(), s.phase, s.watermark, s.ready, s.keys),
        ("test", Phase::Live, 1, true, 1)
    );
    assert_eq!(s.counters.applied, 1);
}

#[test]
fn an_announcements_follower_reconciles_before_ready_then_follows_the_stream() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    let outs = h.found();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 0, .. }))),
        "announcements may have been lost: the initial sync reads the source"
    );
    assert!(
        opened_from(&outs).is_none(),
        "the stream opens after the reconcile"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(1, "a", "1"), Entry::put(2, "b", "2")],
        source_watermark: 2,
    });
    assert!(is_ready(&outs));
    assert_eq!(opened_from(&outs), Some(3));
    // The stream replays announcements from its beginning: old ones are stale.
    let info = FeedInfo {
        first_available: 0,
        head: 9,
        continuity: Continuity::Sparse,
        checkpoints: true,
        follow: Follow::Announcements,
        lineage: Default::default(),
    };
    h.reopen(info);
    assert!(puts(&h.put(1, "a", "1")).is_empty());
    assert_eq!(puts(&h.put(3, "c", "3")), [("c".into(), 3, "3".into())]);
    // Seq 4 was never announced (the writer crashed); a wake closes the window.
    let outs = h.input(Input::Wake);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 2, .. }))),
        "announcements do not move the watermark: only what a reconcile read does"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(3, "c", "3"), Entry::put(4, "d", "4")],
        source_watermark: 4,
    });
    assert_eq!(puts(&outs), [("d".into(), 4, "4".into())]);
}

fn announcements_follower() -> H {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 0,
    });
    let info = FeedInfo {
        first_available: 0,
        head: 0,
        continuity: Continuity::Sparse,
        checkpoints: true,
        follow: Follow::Announcements,
        lineage: Default::default(),
    };
    h.reopen(info);
    h
}

#[test]
fn a_reordered_announcement_is_applied_when_newer_than_its_key() {
    let mut h = announcements_follower();
    h.put(1, "k", "1");
    h.put(3, "other", "3");
    let outs = h.put(2, "k", "2");
    assert_eq!(
        puts(&outs),
        [("k".into(), 2, "2".into())],
        "a late announcement newer than the cached value must not be lost"
    );
    let outs = h.put(1, "k", "1");
    assert!(
        puts(&outs).is_empty(),
        "and an older one must not replace it"
    );
}

#[test]
fn a_late_put_never_resurrects_a_key_removed_after_it() {
    let mut h = announcements_follower();
    h.put(1, "k", "1");
    assert_eq!(removes(&h.entry(Entry::delete(5, "k"))), [("k".into(), 5)]);
    let outs = h.put(3, "k", "3");
    assert!(
        puts(&outs).is_empty(),
        "the put at 3 is older than the removal at 5"
    );
    assert_eq!(h.f.seq_of("k"), None);
    // A reconcile past the removal prunes the tombstone; the watermark covers it.
    let outs = h.input(Input::Wake);
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 0, .. })))
    );
    let changes = vec![Entry::delete(5, "k")];
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes,
        source_watermark: 5,
    });
    assert_eq!(h.f.watermark(), 5);
    assert!(
        puts(&h.put(4, "k", "4")).is_empty(),
        "at or below the watermark: stale"
    );
}

/// A snapshot asked for after an announcement was applied must reach it (writers
/// announce after they commit, and feed items wait while a read is out): one that does
/// not shows the source never made it, and the foreign value goes (a replica that lags
/// gives it back on the next read). This replaces the rule that a snapshot older than a
/// cached announcement keeps it, which let a foreign event stay for good.
#[test]
fn a_snapshot_asked_after_an_announcement_that_does_not_reach_it_replaces_it() {
    let mut h = announcements_follower();
    h.put(12, "k", "forged");
    h.input(Input::Wake);
    h.input(Input::ChangesUnavailable {
        token: h.request.unwrap(),
        first_available: 9,
    });
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries: vec![Entry::put(4, "a", "a")],
        source_watermark: 10,
    });
    assert_eq!(removes(&outs), [("k".into(), 10)], "{outs:?}");
}

#[test]
fn an_announcements_follower_on_a_gapless_feed_sees_no_gaps() {
    let mut h = announcements_follower();
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "x".into(),
    });
    h.run_to_timeout();
    h.reopen(gapless(0));
    h.put(1, "a", "1");
    let outs = h.put(2, "b", "2");
    assert_eq!(
        puts(&outs).len(),
        1,
        "announcements do not move the watermark, so 2 is no gap"
    );
    assert_eq!(h.f.counters().gaps, 0);
}

fn caught_up_to_10() -> H {
    let mut h = H::new();
    h.open(gapless(10));
    for seq in 1..=10 {
        h.put(seq, &format!("k{}", seq % 4), &seq.to_string());
    }
    assert_eq!(h.f.watermark(), 10);
    let token = h.feed.unwrap();
    h.input(Input::FeedFailed {
        token,
        error: "x".into(),
    });
    h.run_to_timeout();
    h
}

#[test]
fn a_recreated_source_behind_the_watermark_replaces_the_cache() {
    let mut h = caught_up_to_10();
    // The bucket was deleted and recreated: a new history with 3 mutations.
    let outs = h.reopen(gapless(3));
    assert!(diagnostics(&outs).contains(&Diagnostic::HeadBehind {
        head: 3,
        watermark: 10
    }));
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    let entries = vec![Entry::put(2, "k1", "new-1"), Entry::put(3, "z", "z")];
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries,
        source_watermark: 3,
    });
    assert!(diagnostics(&outs).contains(&Diagnostic::SourceReset {
        watermark: 10,
        source_watermark: 3
    }));
    assert_eq!(
        puts(&outs),
        [
            ("k1".into(), 2, "new-1".into()),
            ("z".into(), 3, "z".into())
        ],
        "every value of the new history is applied, though its seqs are lower"
    );
    assert_eq!(
        removes(&outs).len(),
        3,
        "k0, k2 and k3 are not in the new history: {outs:?}"
    );
    assert_eq!(h.f.watermark(), 3);
    assert_eq!(
        opened_from(&outs),
        Some(4),
        "and it follows the new history from there"
    );
    assert_eq!(h.f.counters().resets, 1);
}

#[test]
fn a_new_history_whose_entry_is_poison_removes_the_old_historys_value() {
    let mut h = caught_up_to_10();
    // k1 holds "9" from the old history; the new one's only value for it is poison.
    h.reopen(gapless(3));
    let entries = vec![
        Entry::put(2, "k1", vec![0xff, 0xfe]),
        Entry::put(3, "z", "z"),
    ];
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries,
        source_watermark: 3,
    });
    assert_eq!(h.f.counters().resets, 1);
    assert_eq!(
        h.f.counters().poison,
        1,
        "the poison entry is counted and skipped"
    );
    assert!(
        removes(&outs).iter().any(|(k, _)| k == "k1"),
        "a value of the replaced history must not stay: the source at 3 never held it: {outs:?}"
    );
    assert_eq!(
        removes(&outs).len(),
        4,
        "k0, k1, k2 and k3 all leave: {outs:?}"
    );
    assert_eq!(puts(&outs), [("z".into(), 3, "z".into())]);
}

#[test]
fn a_head_behind_from_purged_tail_entries_resyncs_without_a_reset() {
    let mut h = caught_up_to_10();
    // The newest entry (a delete marker at 10) was purged: head 9, but the source's
    // watermark is still 10.
    h.reopen(gapless(9));
    let entries = vec![Entry::put(9, "k1", "9"), Entry::put(8, "k0", "8")];
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries,
        source_watermark: 10,
    });
    assert!(
        !diagnostics(&outs)
            .iter()
            .any(|d| matches!(d, Diagnostic::SourceReset { .. }))
    );
    assert_eq!(
        h.f.watermark(),
        10,
        "the watermark never goes back within one history"
    );
    assert_eq!(h.f.counters().resets, 0);
}

#[test]
fn a_wake_runner_whose_source_went_back_resyncs_from_a_snapshot() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::WakeOnly));
    h.found();
    let changes = vec![Entry::put(5, "a", "old")];
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes,
        source_watermark: 5,
    });
    h.input(Input::Wake);
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![],
        source_watermark: 2,
    });
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "{outs:?}"
    );
    let entries = vec![Entry::put(2, "b", "new")];
    let outs = h.input(Input::Snapshot {
        token: h.request.unwrap(),
        entries,
        source_watermark: 2,
    });
    assert_eq!(removes(&outs), [("a".into(), 2)]);
    assert_eq!(puts(&outs), [("b".into(), 2, "new".into())]);
    assert_eq!(h.f.watermark(), 2);
}

#[test]
fn an_announcements_stream_behind_the_watermark_is_no_reason_to_resync() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.found();
    let changes = vec![Entry::put(5, "a", "5")];
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes,
        source_watermark: 5,
    });
    // The stream's own head (the announcements still unread) says nothing of the source.
    let info = FeedInfo {
        first_available: 0,
        head: 2,
        continuity: Continuity::Sparse,
        checkpoints: true,
        follow: Follow::Announcements,
        lineage: Default::default(),
    };
    let outs = h.reopen(info);
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "a resync here would loop on every reopen: {outs:?}"
    );
}
