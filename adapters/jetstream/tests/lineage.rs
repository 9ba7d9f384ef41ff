//! The history a stream says it serves ([`Stream::lineage_at`]), driven through writes,
//! overwrites, purges, backups, restores and recreates of the JetStream model.
//!
//! What a follower relies on: a read whose lineage at a seq does not contradict the one it
//! kept there names the same mutation (same history, same stamp ⇒ same write), and a
//! follower whose watermark a restored or recreated stream wrote past is told, as long as
//! the stream still holds the message at the watermark (a recreated one: always).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use tidemark_jetstream::StreamLineage;
use tidemark_jetstream::model::Stream;

#[derive(Clone, Debug)]
enum Op {
    Put(u8),
    Delete(u8),
    Purge(u8),
    /// Moves the server's clock to this many nanoseconds (it never goes back).
    Clock(u64),
    Backup,
    Restore,
    /// A restore that gives the stream a new creation time (nats-server 2.15, a cluster).
    RestoreAnew,
    Recreate,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..6).prop_map(Op::Put),
        2 => (0u8..6).prop_map(Op::Delete),
        1 => (0u8..6).prop_map(Op::Purge),
        2 => (0u64..50).prop_map(Op::Clock),
        1 => Just(Op::Backup),
        1 => Just(Op::Restore),
        1 => Just(Op::RestoreAnew),
        1 => Just(Op::Recreate),
    ]
}

/// Whether two reads naming the same seq prove different histories, as tidemark's core
/// judges it (`Lineage::contradicts`): a fact either cannot tell proves nothing.
fn contradicts(a: StreamLineage, b: StreamLineage) -> bool {
    let differ = |x: Option<u64>, y: Option<u64>| matches!((x, y), (Some(x), Some(y)) if x != y);
    differ(a.history, b.history) || differ(a.stamp, b.stamp)
}

/// A write as the stream stored it: what a follower applied at its seq.
type Write = (String, Option<Vec<u8>>);

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Same history and same stamp at a seq are the same write, whatever restores and
    /// recreates came between; and every message present reports its own stored time.
    #[test]
    fn one_lineage_at_a_seq_is_one_write(
        history in 1usize..3,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut s = Stream::new(1_000, history);
        let mut backup: Option<Stream> = None;
        let mut seen: BTreeMap<(u64, Option<u64>, Option<u64>), Write> = BTreeMap::new();
        let mut histories = vec![s.created()];
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Put(k) => {
                    s.write(&format!("k{k}"), Some(vec![u8::try_from(i % 256).unwrap()]));
                }
                Op::Delete(k) => {
                    s.write(&format!("k{k}"), None);
                }
                Op::Purge(k) => s.purge_subject(&format!("k{k}")),
                Op::Clock(ns) => s.set_now(1_000 + ns * 3),
                Op::Backup => backup = Some(s.clone()),
                Op::Restore => {
                    if let Some(b) = &backup {
                        let created = b.created();
                        s.restore(b);
                        prop_assert_eq!(s.created(), created, "a restore keeps the backup's history");
                    }
                }
                Op::RestoreAnew => {
                    if let Some(b) = &backup {
                        let created = s.restore_anew(b);
                        prop_assert!(!histories.contains(&created), "a new history");
                        histories.push(created);
                    }
                }
                Op::Recreate => {
                    let created = s.recreate();
                    prop_assert!(
                        !histories.contains(&created),
                        "a recreated stream has a history no stream had before"
                    );
                    histories.push(created);
                }
            }
            for seq in 0..=s.state().last_seq + 1 {
                let lineage = s.lineage_at(seq);
                prop_assert_eq!(lineage.history, tidemark_jetstream::history(s.created()));
                let present: Option<Write> =
                    s.message(seq).map(|m| (m.subject.clone(), m.value.clone()));
                prop_assert_eq!(
                    lineage.stamp.is_some(),
                    present.is_some(),
                    "a stamp exactly where the stream holds a message (seq {})", seq
                );
                if let Some(write) = present {
                    if let Some(before) = seen.insert((seq, lineage.history, lineage.stamp), write.clone()) {
                        prop_assert_eq!(
                            before, write,
                            "two writes at seq {} read with one lineage {:?}", seq, lineage
                        );
                    }
                }
            }
        }
    }

    /// A follower that applied the stream up to its watermark, then was away while the
    /// stream was restored from an older backup (or recreated) and written past the
    /// watermark, is told by the read of the lineage at its watermark — unless the
    /// restored stream no longer holds that message (overwritten in a history-1 bucket).
    #[test]
    fn a_restore_or_recreate_written_past_the_watermark_is_told(
        before in 1u8..20,
        kept in 0u8..20,
        after in 1u8..40,
        recreate in any::<bool>(),
        keys in 1u8..8,
    ) {
        let kept = kept.min(before - 1);
        let mut s = Stream::new(5, 1);
        let mut backup = s.clone();
        for i in 0..before {
            if i == kept {
                backup = s.clone();
            }
            s.write(&format!("k{}", i % keys), Some(vec![i]));
        }
        let watermark = s.state().last_seq;
        let held = s.lineage_at(watermark);
        prop_assert!(held.stamp.is_some(), "the follower's last write is present");
        if recreate {
            s.recreate();
        } else {
            s.restore(&backup);
        }
        for i in 0..after {
            s.write(&format!("k{}", (i + 3) % keys), Some(vec![100 + i]));
        }
        let read = s.lineage_at(watermark);
        if s.state().last_seq < watermark {
            // Behind the watermark: the follower sees that by seqs alone.
            return Ok(());
        }
        if recreate || read.stamp.is_some() {
            prop_assert!(
                contradicts(held, read),
                "another history at the watermark is told: held {:?}, read {:?}", held, read
            );
        } else {
            prop_assert!(!contradicts(held, read), "what the stream cannot tell proves nothing");
        }
    }
}

#[test]
fn a_message_stored_after_a_restore_is_stamped_later_than_the_one_it_lost() {
    let mut s = Stream::new(10, 1);
    s.set_now(100);
    s.write("a", Some(b"1".to_vec()));
    let backup = s.clone();
    let lost = s.write("b", Some(b"1".to_vec()));
    let lost_at = s.stored_at(lost).unwrap();
    s.restore(&backup);
    assert_eq!(s.stored_at(lost), None, "the restore took seq 2 back");
    assert_eq!(s.write("c", Some(b"1".to_vec())), lost, "the seq is reused");
    let now_at = s.stored_at(lost).unwrap();
    assert!(
        now_at > lost_at,
        "the server's clock is not restored: {now_at} after {lost_at}"
    );
    assert_eq!(
        s.lineage_at(1).stamp,
        Some(100),
        "the kept message keeps its time"
    );
    assert_eq!(s.lineage_at(1).history, Some(10));
}

#[test]
fn an_overwritten_or_purged_message_has_no_stamp() {
    let mut s = Stream::new(10, 1);
    let first = s.write("a", Some(b"1".to_vec()));
    let b = s.write("b", Some(b"1".to_vec()));
    assert!(s.lineage_at(first).stamp.is_some());
    s.write("a", Some(b"2".to_vec()));
    assert_eq!(
        s.lineage_at(first).stamp,
        None,
        "overwritten in a history-1 stream"
    );
    s.purge_subject("b");
    assert_eq!(s.lineage_at(b).stamp, None, "purged");
    assert_eq!(s.lineage_at(0).stamp, None, "no seq named");
}
