//! A follower resuming over a bucket that keeps only a history per key, driven against the
//! JetStream model: writes, deletes and purges after the follower's watermark, which move
//! the stream's first sequence past it.
//!
//! The promise of `Continuity::PerKey` (the core lists the source's keys once and resumes,
//! instead of a full resync): the cache then equals the bucket. A resume without the
//! listing keeps a purged key for good, and the search below must catch that.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use tidemark_jetstream::first_available;
use tidemark_jetstream::model::{Start, Stream};

#[derive(Clone, Debug)]
enum Op {
    Put(u8),
    Delete(u8),
    Purge(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..6).prop_map(Op::Put),
        2 => (0u8..6).prop_map(Op::Delete),
        1 => (0u8..6).prop_map(Op::Purge),
    ]
}

type Cache = BTreeMap<String, u64>;

/// What the bucket holds: every key whose latest message is a put, at its seq.
fn truth(stream: &Stream) -> Cache {
    stream
        .latest()
        .into_iter()
        .filter(|(_, m)| m.value.is_some())
        .map(|(k, m)| (k, m.seq))
        .collect()
}

/// Applies a replay from `from`: every message present, in order.
fn replay(stream: &mut Stream, from: u64, cache: &mut Cache) {
    let c = stream.consumer(Start::Seq(from));
    while let Some(d) = stream.deliver(c) {
        let m = d.message;
        if m.value.is_some() {
            cache.insert(m.subject, m.seq);
        } else {
            cache.remove(&m.subject);
        }
    }
}

/// Fills the bucket with `before`, takes the follower's cache at its watermark, plays
/// `after` while it is away, then resumes as the core does: a listing first when the first
/// sequence moved past watermark + 1 (`list` false: never). Returns (resumed, truth,
/// whether the first sequence moved, whether a purge happened).
fn resume(before: &[Op], after: &[Op], list: bool) -> (Cache, Cache, bool, bool) {
    let mut stream = Stream::new(1, 1);
    let play = |stream: &mut Stream, ops: &[Op]| {
        let mut purged = false;
        for op in ops {
            match op {
                Op::Put(k) => {
                    stream.write(&format!("k{k}"), Some(vec![*k]));
                }
                Op::Delete(k) => {
                    stream.write(&format!("k{k}"), None);
                }
                Op::Purge(k) => {
                    stream.purge_subject(&format!("k{k}"));
                    purged = true;
                }
            }
        }
        purged
    };
    play(&mut stream, before);
    let mut cache = truth(&stream);
    let watermark = stream.state().last_seq;
    let purged = play(&mut stream, after);
    let moved = first_available(&stream.state()) > watermark + 1 && stream.state().messages > 0;
    if moved && list {
        // The listing: a cached key the bucket no longer holds goes.
        let present = truth(&stream);
        cache.retain(|k, _| present.contains_key(k));
    }
    replay(&mut stream, watermark + 1, &mut cache);
    (cache, truth(&stream), moved, purged)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn a_listing_then_a_resume_equals_the_bucket_when_its_first_sequence_moved(
        before in proptest::collection::vec(op(), 0..20),
        after in proptest::collection::vec(op(), 0..30),
    ) {
        let (resumed, truth, moved, purged) = resume(&before, &after, true);
        // Without a move and with a purge, only the opt-in presence check can tell (a
        // purge that leaves the first sequence low); everything else must be exact.
        if moved || !purged {
            prop_assert_eq!(resumed, truth);
        }
    }
}

#[test]
fn a_resume_without_the_listing_keeps_purged_keys() {
    let mut caught = 0;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..2_000 {
        let ops = |n: usize, next: &mut dyn FnMut() -> u64| -> Vec<Op> {
            (0..n)
                .map(|_| {
                    let k = (next() % 6) as u8;
                    match next() % 9 {
                        0..=5 => Op::Put(k),
                        6 | 7 => Op::Delete(k),
                        _ => Op::Purge(k),
                    }
                })
                .collect()
        };
        let before = ops(12, &mut next);
        let after = ops(20, &mut next);
        let (resumed, truth, moved, _) = resume(&before, &after, false);
        if moved && resumed != truth {
            caught += 1;
        }
    }
    assert!(
        caught > 0,
        "a resume past a moved first sequence without a listing must be caught"
    );
    eprintln!("resume without a listing caught on {caught} of 2000 runs");
}
