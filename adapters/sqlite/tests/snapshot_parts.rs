//! The registry's snapshot read part by part: one read transaction held across parts on a
//! connection of its own, which writers run beside and which ends when the read is dropped.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use tidemark::tidemark_core::Entry;
use tidemark::{SnapshotParts, Source};
use tidemark_sqlite::{SqliteSource, Write};

/// Puts `k0000`..`k{n-1}` (value `v{i}`) in one transaction.
async fn fill(src: &SqliteSource, n: usize) {
    let writes = (0..n)
        .map(|i| Write::Put(format!("k{i:04}"), format!("v{i}").into_bytes()))
        .collect();
    src.write_batch(writes).await.unwrap();
}

/// Every part that is left, each checked to hold 1..=`max` entries.
async fn rest(read: &mut SnapshotParts<'_>, max: usize) -> Vec<Vec<Entry>> {
    let mut parts = Vec::new();
    while let Some(part) = read.parts.next().await {
        let part = part.unwrap();
        assert!(
            !part.is_empty() && part.len() <= max,
            "a part holds 1..={max} entries, got {}",
            part.len()
        );
        parts.push(part);
    }
    parts
}

/// `PRAGMA wal_checkpoint(TRUNCATE)` from a connection of the test's own that does not
/// wait: whether a reader still held an old point in time of the file (busy).
fn checkpoint_blocked(path: &Path) -> bool {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.busy_timeout(Duration::ZERO).unwrap();
    let (busy, _log, _done): (i64, i64, i64) = conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    busy != 0
}

/// A follower that stops reading halfway (a resync cancelled, a task stopped) must not
/// hold the file's old point in time: that would keep the WAL from being checkpointed and
/// let it grow without bound under a steady writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_halfway_releases_its_transaction() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    fill(&src, 100).await;
    let mut read = src.snapshot_parts(10).await.unwrap();
    let first = read.parts.next().await.unwrap().unwrap();
    assert_eq!(first.len(), 10);
    let late = tokio::time::timeout(Duration::from_secs(2), src.put("late", b"x".to_vec()))
        .await
        .expect("a writer is not held back by a read in progress")
        .unwrap();
    assert_eq!(late, 101);
    assert!(
        checkpoint_blocked(&path),
        "while the read is held, its point in time keeps the WAL from being reset"
    );
    drop(read);
    common::eventually("the dropped read ends its transaction", || async {
        !checkpoint_blocked(&path)
    })
    .await;
    assert_eq!(
        src.snapshot().await.unwrap().entries.len(),
        101,
        "the file is whole after the checkpoint"
    );
}

/// A part holds at most the entries asked for (at least one), so a reader's memory is a
/// part's, whatever the registry's size; the parts together are the snapshot, in key
/// order, however many writes land between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_is_at_most_part_len_entries_and_the_parts_are_the_snapshot() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    fill(&src, 1000).await;
    src.remove("k0500").await.unwrap();
    for (part_len, max, count) in [
        (1, 1, 999),
        (7, 7, 143),
        (999, 999, 1),
        (0, 1, 999),
        (usize::MAX, usize::MAX, 1),
    ] {
        src.write_batch(vec![Write::Remove("k9999".into())])
            .await
            .unwrap();
        let whole = src.snapshot().await.unwrap();
        assert_eq!(whole.entries.len(), 999);
        let mut read = src.snapshot_parts(part_len).await.unwrap();
        assert_eq!(read.watermark, whole.watermark);
        let mut parts = vec![read.parts.next().await.unwrap().unwrap()];
        // Between the first part and the rest: every key rewritten, one removed, one new.
        let rewrite = (0..1000)
            .map(|i| Write::Put(format!("k{i:04}"), b"later".to_vec()))
            .chain([
                Write::Remove("k0500".into()),
                Write::Put("k9999".into(), vec![]),
            ])
            .collect();
        src.write_batch(rewrite).await.unwrap();
        parts.extend(rest(&mut read, max).await);
        assert_eq!(parts.len(), count, "parts of {part_len}");
        assert!(parts[0].len() <= max);
        let got: Vec<Entry> = parts.into_iter().flatten().collect();
        assert!(
            got == whole.entries,
            "parts of {part_len}: every part is read at the watermark's point in time"
        );
    }
}

/// A view reads only its prefix, part by part as whole; an empty registry (or an empty
/// view) has no parts and its watermark.
#[tokio::test]
async fn a_view_reads_only_its_prefix_and_an_empty_read_has_no_parts() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    let mut empty = src.snapshot_parts(4).await.unwrap();
    assert_eq!(empty.watermark, 0);
    assert!(empty.parts.next().await.is_none(), "no parts, and no error");
    let keys = ["a", "a.1", "a.2", "a.3", "ab", "b.1"];
    let writes = keys
        .iter()
        .map(|k| Write::Put((*k).into(), b"v".to_vec()))
        .collect();
    src.write_batch(writes).await.unwrap();
    let view = src.with_prefix("a.").unwrap();
    let mut read = view.snapshot_parts(2).await.unwrap();
    assert_eq!(read.watermark, 6);
    let parts: Vec<Vec<String>> = rest(&mut read, 2)
        .await
        .into_iter()
        .map(|p| p.into_iter().map(|e| e.key.to_string()).collect())
        .collect();
    assert_eq!(parts, [vec!["a.1", "a.2"], vec!["a.3"]]);
    let none = src.with_prefix("c.").unwrap();
    let mut read = none.snapshot_parts(2).await.unwrap();
    assert_eq!(read.watermark, 6, "an empty view still reads the watermark");
    assert!(read.parts.next().await.is_none());
}

/// A key a foreign writer stored as a blob sorts after every text key in SQLite: handed
/// out, it would break the key order a reader of parts merges by. It is skipped, from the
/// snapshot and from its parts alike.
#[tokio::test]
async fn a_row_out_of_key_order_is_skipped_from_snapshots() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("b", b"2".to_vec()).await.unwrap();
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "BEGIN IMMEDIATE;
             INSERT INTO registry (key, value, seq, deleted) VALUES (X'6130', X'00', 3, 0);
             UPDATE tidemark_meta SET value = 3 WHERE name = 'watermark';
             COMMIT;",
        )
        .unwrap();
    }
    let whole: Vec<String> = src
        .snapshot()
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.key.to_string())
        .collect();
    assert_eq!(whole, ["a", "b"], "the blob key \"a0\" came after \"b\"");
    let mut read = src.snapshot_parts(1).await.unwrap();
    let parts: Vec<String> = rest(&mut read, 1)
        .await
        .into_iter()
        .flatten()
        .map(|e| e.key.to_string())
        .collect();
    assert_eq!(parts, ["a", "b"]);
}

/// A read that fails halfway (here, pages of the file damaged under it) ends with a typed
/// error, never as a shorter snapshot: a reader that took the parts it got for the whole
/// would remove every key it did not see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_fails_halfway_ends_with_an_error_not_a_short_snapshot() {
    use std::io::{Seek, SeekFrom, Write as _};
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    fill(&src, 20_000).await;
    assert!(!checkpoint_blocked(&path), "every row is in the main file");
    let mut read = src.snapshot_parts(10).await.unwrap();
    let first = read.parts.next().await.unwrap().unwrap();
    assert_eq!(first.len(), 10);
    {
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        file.seek(SeekFrom::Start(len / 4)).unwrap();
        file.write_all(&vec![0xA5; usize::try_from(len / 2).unwrap()])
            .unwrap();
        file.sync_all().unwrap();
    }
    let mut got = first.len();
    let mut failed = None;
    while let Some(part) = read.parts.next().await {
        match part {
            Ok(part) => got += part.len(),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let Some(e) = failed else {
        panic!("a read over damaged pages ended as if whole, with {got} of 20000 entries");
    };
    assert!(
        matches!(e, tidemark::Error::Unavailable { .. }),
        "a typed, retryable error: {e:?}"
    );
    assert!(got < 20_000);
    assert!(
        read.parts.next().await.is_none(),
        "nothing follows the error"
    );
}
