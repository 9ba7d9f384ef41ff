//! Durable sinks: a failed batch takes the follower back to the last commit; a lazily
//! resumed follower learns its cached keys as it needs them.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use tidemark_core::*;

fn committing() -> H {
    let mut h = H::new();
    h.f.track_commits(true);
    h
}

/// SPEC §13: what a sink lost is decided again, not skipped as "at or below the
/// watermark".
#[test]
fn a_failed_batch_is_decided_again_from_the_last_commit() {
    let mut h = committing();
    h.open(FeedInfo::change_log(1, 2));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    h.f.commit();
    // The next batch: a put, an overwrite and a removal, then the sink fails.
    h.put(3, "c", "3");
    h.put(4, "a", "4");
    h.entry(Entry::delete(5, "b"));
    assert_eq!(h.f.watermark(), 5);
    let outs = h.input(Input::SinkFailed {
        error: "disk full".into(),
    });
    assert!(diagnostics(&outs).contains(&Diagnostic::Rewound {
        watermark: 2,
        error: "disk full".into()
    }));
    assert_eq!(h.f.watermark(), 2, "back to the last commit");
    assert_eq!(h.f.seq_of("a"), Some(1));
    assert_eq!(h.f.seq_of("b"), Some(2), "the removal is undone");
    assert_eq!(h.f.seq_of("c"), None);
    assert_eq!(h.f.counters().rewinds, 1);
    assert!(h.f.is_ready(), "readiness reached before the commit stays");
    let outs = h.run_to_timeout();
    assert_eq!(
        opened_from(&outs),
        Some(3),
        "the feed reopens after the commit"
    );
    h.reopen(FeedInfo::change_log(1, 5));
    let mut outs = h.put(3, "c", "3");
    outs.extend(h.put(4, "a", "4"));
    outs.extend(h.entry(Entry::delete(5, "b")));
    assert_eq!(
        puts(&outs),
        [("c".into(), 3, "3".into()), ("a".into(), 4, "4".into())],
        "nothing is skipped as stale"
    );
    assert_eq!(removes(&outs), [("b".into(), 5)]);
}

#[test]
fn readiness_that_was_not_committed_is_taken_back_and_given_again() {
    let mut h = committing();
    h.open(FeedInfo::change_log(1, 1));
    let outs = h.put(1, "a", "1");
    assert!(is_ready(&outs));
    h.input(Input::SinkFailed {
        error: "busy".into(),
    });
    assert!(!h.f.is_ready());
    h.run_to_timeout();
    h.reopen(FeedInfo::change_log(1, 1));
    let outs = h.put(1, "a", "1");
    assert!(
        is_ready(&outs),
        "ready again once the sink holds it: {outs:?}"
    );
}

#[test]
fn a_rewind_reopens_a_durable_cursor_after_its_last_committed_checkpoint() {
    let mut h = committing();
    h.open(FeedInfo::change_log(1, 0).with_checkpoints());
    h.put(1, "a", "1");
    h.f.commit();
    h.put(2, "b", "2");
    h.input(Input::SinkFailed { error: "x".into() });
    let outs = h.run_to_timeout();
    assert!(
        outs.iter().any(|o| matches!(
            o,
            Output::Request(Request::OpenFeed {
                from: 2,
                after_position: Some(1),
                ..
            })
        )),
        "the cursor saved after the commit is where the feed resumes: {outs:?}"
    );
}

#[test]
fn a_wake_only_follower_reconciles_again_after_a_failed_batch() {
    let config = config().build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::WakeOnly));
    h.f.track_commits(true);
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(1, "a", "1")],
        source_watermark: 1,
    });
    h.input(Input::SinkFailed { error: "x".into() });
    assert_eq!(h.f.watermark(), 0);
    let outs = h.run_to_timeout();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { since: 0, .. }))),
        "{outs:?}"
    );
}

/// Without recorded steps the follower cannot know what the sink lost: it forgets every
/// seq and lets a snapshot replace the cache.
#[test]
fn a_failed_batch_without_tracking_resyncs_from_a_snapshot() {
    let mut h = H::new();
    h.open(FeedInfo::change_log(1, 2));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    h.input(Input::SinkFailed { error: "x".into() });
    let outs = h.run_to_timeout();
    let token = h.request.unwrap();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
    );
    let outs = h.input(Input::Snapshot {
        token,
        entries: vec![Entry::put(2, "b", "2")],
        source_watermark: 2,
    });
    assert_eq!(puts(&outs), [("b".into(), 2, "2".into())], "re-applied");
    assert_eq!(removes(&outs), [("a".into(), 2)], "gone from the source");
}

/// A warm start over a large persisted cache: the follower knows how many keys the sink
/// holds, learns their seqs only as entries name them, and counts them all.
#[test]
fn a_lazily_resumed_follower_counts_what_it_was_not_told_and_learns_as_it_goes() {
    let f = Follower::resume_lazily(config().build().unwrap(), Utf8, 10, 1000);
    let mut h = H::with(f);
    assert_eq!(h.f.len(), 1000);
    assert!(h.f.needs_keys());
    assert!(!h.f.knows("k1"));
    h.f.remember([("k1".to_owned(), 7)]);
    assert_eq!(h.f.len(), 1000, "a learnt key was already counted");
    assert!(h.f.knows("k1"));
    let outs = h.open(FeedInfo::kv(1, 11));
    assert_eq!(opened_from(&outs), Some(11));
    let outs = h.entry(Entry::delete(11, "k1"));
    assert_eq!(removes(&outs), [("k1".into(), 11)]);
    assert_eq!(h.f.len(), 999);
    h.f.index_complete();
    assert!(!h.f.needs_keys());
}

/// The simulator's seed 941: a read that did not name a forged key asked for a snapshot;
/// the runtime committed before sending it, and the snapshot's batch failed. The rewind
/// went back to that commit, where the key's claim had already gone with the read, so no
/// later read held it unconfirmed and it stayed in the cache for good.
#[test]
fn a_failed_batch_gives_back_the_unconfirmed_announcements_it_took() {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.f.track_commits(true);
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(5, "a", "real")],
        source_watermark: 5,
    });
    h.reopen(FeedInfo::announcements(5));
    let outs = h.put(7, "x", "forged");
    assert_eq!(puts(&outs), [("x".into(), 7, "forged".into())]);
    h.f.commit();
    // The confirming read does not have x; the batch that applies its answer fails.
    let outs = h.run_to_timeout();
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Reconcile { .. }))),
        "{outs:?}"
    );
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(6, "b", "six")],
        source_watermark: 6,
    });
    assert!(
        outs.iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. }))),
        "only a snapshot says what x holds: {outs:?}"
    );
    // The runtime commits before it performs a request; the snapshot's batch then fails.
    h.f.commit();
    let token = h.request.unwrap();
    h.input(Input::Snapshot {
        token,
        entries: vec![Entry::put(5, "a", "real"), Entry::put(6, "b", "six")],
        source_watermark: 6,
    });
    h.input(Input::SinkFailed { error: "x".into() });
    assert!(
        h.f.seq_of("x").is_some(),
        "the sink still holds the forged key"
    );
    // From here on the follower reads the source (after its backoff) until x is gone.
    let source = [Entry::put(5, "a", "real"), Entry::put(6, "b", "six")];
    let mut outs = h.run_to_timeout();
    let mut removed = false;
    for _ in 0..4 {
        removed |= removes(&outs).iter().any(|(k, _)| k == "x");
        let token = h.request.unwrap();
        outs = if outs
            .iter()
            .any(|o| matches!(o, Output::Request(Request::Snapshot { .. })))
        {
            h.input(Input::Snapshot {
                token,
                entries: source.to_vec(),
                source_watermark: 6,
            })
        } else {
            h.input(Input::Changes {
                token,
                changes: source[1..].to_vec(),
                source_watermark: 6,
            })
        };
    }
    removed |= removes(&outs).iter().any(|(k, _)| k == "x");
    assert!(removed, "a read after the rewind removes the forged key");
    assert_eq!(h.f.seq_of("x"), None);
}

/// The other half of the rewind: a read that *replaced* a forged value in a batch the sink
/// then failed. The rewind put the forged value back in the index at the real change's
/// seq; without its claim, the same read again looked stale and the forged value stayed.
#[test]
fn a_failed_batch_gives_back_a_replaced_claim_and_the_next_read_replaces_it_again() {
    let config = config().max_ahead(1000).build().unwrap();
    let mut h = H::with(Follower::new(config, Utf8).following(Follow::Announcements));
    h.f.track_commits(true);
    h.found();
    h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: vec![Entry::put(5, "a", "real")],
        source_watermark: 5,
    });
    h.reopen(FeedInfo::announcements(5));
    // A forged copy of the source's a@6 arrives first and is committed.
    h.put(6, "a", "other");
    h.f.commit();
    let source = vec![Entry::put(6, "a", "six")];
    h.run_to_timeout();
    let outs = h.input(Input::Changes {
        token: h.request.unwrap(),
        changes: source.clone(),
        source_watermark: 6,
    });
    assert_eq!(puts(&outs), [("a".into(), 6, "six".into())]);
    // That batch never reaches the sink.
    h.input(Input::SinkFailed { error: "x".into() });
    let mut outs = h.run_to_timeout();
    let mut replaced = Vec::new();
    for _ in 0..3 {
        replaced.extend(puts(&outs));
        let Some(token) = h.request else { break };
        outs = h.input(Input::Changes {
            token,
            changes: source.clone(),
            source_watermark: 6,
        });
    }
    replaced.extend(puts(&outs));
    assert!(
        replaced.contains(&("a".into(), 6, "six".into())),
        "the read after the rewind replaces the forged value again: {replaced:?}"
    );
}

/// An initial sync's batch begins on an empty index and records no step per key: going
/// back empties the index, and the retry decides every change again.
#[test]
fn a_failed_first_batch_goes_back_to_an_empty_index() {
    let mut h = committing();
    h.open(FeedInfo::change_log(1, 3));
    h.put(1, "a", "1");
    h.put(2, "b", "2");
    h.entry(Entry::delete(3, "b"));
    h.input(Input::SinkFailed {
        error: "disk full".into(),
    });
    assert_eq!(
        h.f.len(),
        0,
        "the sink holds nothing: neither does the index"
    );
    assert_eq!(h.f.seq_of("a"), None, "a put the sink lost is not held");
    h.run_to_timeout();
    h.reopen(FeedInfo::change_log(1, 3));
    let mut outs = h.put(1, "a", "1");
    outs.extend(h.put(2, "b", "2"));
    assert_eq!(
        puts(&outs),
        [("a".into(), 1, "1".into()), ("b".into(), 2, "2".into())],
        "nothing is skipped as stale"
    );
}

/// A warm start learns what the sink holds after the driver turned tracking on (the
/// runtime's order): that is no change, and a failed first batch keeps it.
#[test]
fn a_failed_first_batch_of_a_warm_start_keeps_what_the_sink_holds() {
    let mut f = Follower::new(config().build().unwrap(), Utf8);
    f.track_commits(true);
    f.start_from(10, 1000);
    let mut h = H::with(f);
    h.f.remember([("k1".to_owned(), 7)]);
    h.open(FeedInfo::kv(1, 11));
    h.entry(Entry::put(11, "k2", "2"));
    h.input(Input::SinkFailed {
        error: "disk full".into(),
    });
    assert_eq!(h.f.len(), 1000, "the keys the sink holds are still counted");
    assert_eq!(
        h.f.seq_of("k1"),
        Some(7),
        "a learnt seq is what the sink holds"
    );
    assert_eq!(h.f.seq_of("k2"), None, "the failed batch's put is undone");
}
