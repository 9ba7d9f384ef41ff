//! The registry: seqs, tombstones, changes since N, compaction with a horizon, and its
//! change log as a gapless feed.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::{Continuity, Entry};
use tidemark::{Changes, Error, Feed, FeedItem, FeedStream, Source};
use tidemark_sqlite::{SqliteDb, Write};

#[tokio::test]
async fn every_mutation_gets_the_next_seq_and_removals_keep_tombstones() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    assert_eq!(
        src.watermark().await.unwrap(),
        0,
        "a new source has watermark 0"
    );
    assert_eq!(src.put("a", b"1".to_vec()).await.unwrap(), 1);
    assert_eq!(src.put("b", b"2".to_vec()).await.unwrap(), 2);
    assert_eq!(src.remove("a").await.unwrap(), Some(3));
    assert_eq!(
        src.remove("a").await.unwrap(),
        None,
        "removing an absent key uses no seq"
    );
    assert_eq!(src.watermark().await.unwrap(), 3);
    assert_eq!(
        src.get("a").await.unwrap(),
        None,
        "a tombstone reads as absent"
    );
    let Changes::Since { entries, watermark } = src.changes_since(1).await.unwrap() else {
        panic!("nothing was compacted");
    };
    assert_eq!(watermark, 3);
    assert!(
        entries.iter().all(|e| e.stamp.is_some()),
        "every change carries its stamp: {entries:?}"
    );
    assert_eq!(
        unstamped(entries),
        vec![Entry::put(2, "b", "2"), Entry::delete(3, "a")],
        "changes since 1 must include the removal with its seq"
    );
    let snap = src.snapshot().await.unwrap();
    assert_eq!(snap.entries, vec![Entry::put(2, "b", "2")]);
    assert_eq!(snap.watermark, 3);
}

#[tokio::test]
async fn update_is_a_compare_and_set_on_the_keys_seq() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    assert_eq!(src.update("k", b"v1".to_vec(), 0).await.unwrap(), 1);
    let err = src.update("k", b"v2".to_vec(), 0).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Conflict {
                current: Some(1),
                expected: 0,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(src.update("k", b"v2".to_vec(), 1).await.unwrap(), 2);
    assert_eq!(src.get("k").await.unwrap().unwrap().value, b"v2");
}

#[tokio::test]
async fn bad_keys_and_values_are_typed_errors_and_change_nothing() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    for key in ["", "a\nb", &"k".repeat(2000)] {
        assert!(matches!(
            src.put(key, b"x".to_vec()).await,
            Err(Error::InvalidKey { .. })
        ));
    }
    assert!(matches!(
        src.put("big", vec![0; tidemark_sqlite::MAX_VALUE_BYTES + 1])
            .await,
        Err(Error::ValueTooLarge { .. })
    ));
    let batch = vec![
        Write::Put("ok".into(), b"1".to_vec()),
        Write::Put(String::new(), vec![]),
    ];
    assert!(src.write_batch(batch).await.is_err());
    assert_eq!(
        src.watermark().await.unwrap(),
        0,
        "refused writes use no seq"
    );
}

#[tokio::test]
async fn compaction_records_a_horizon_below_which_readers_must_resync() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    for i in 0..10 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    for i in 0..5 {
        src.remove(&format!("k{i}")).await.unwrap();
    }
    // Tombstones have seqs 11..=15.
    let c = src.compact_below(14).await.unwrap();
    assert_eq!(
        c.tombstones, 3,
        "tombstones 11, 12, 13 are below the horizon"
    );
    assert_eq!(c.first_available, 14);
    assert_eq!(src.first_available().await.unwrap(), 14);
    assert_eq!(
        src.changes_since(5).await.unwrap(),
        Changes::Compacted {
            first_available: 14
        },
        "a reader below the horizon would miss removals: it must be told to resync"
    );
    let Changes::Since { entries, .. } = src.changes_since(13).await.unwrap() else {
        panic!("13 + 1 is at the horizon: still served");
    };
    assert_eq!(
        unstamped(entries),
        vec![Entry::delete(14, "k3"), Entry::delete(15, "k4")]
    );
    let opened = src.open(1, None).await.unwrap();
    assert_eq!(
        opened.info.first_available, 14,
        "the feed reports the horizon"
    );
}

#[tokio::test]
async fn changes_since_reads_only_what_changed() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    let writes = (0..5000)
        .map(|i| Write::Put(format!("k{i}"), b"v".to_vec()))
        .collect();
    src.write_batch(writes).await.unwrap();
    src.put("k7", b"new".to_vec()).await.unwrap();
    let Changes::Since { entries, watermark } = src.changes_since(5000).await.unwrap() else {
        panic!("not compacted");
    };
    assert_eq!(watermark, 5001);
    assert_eq!(unstamped(entries), vec![Entry::put(5001, "k7", "new")]);
    let plan: String = {
        let conn = rusqlite::Connection::open(db.path()).unwrap();
        conn.query_row(
            "EXPLAIN QUERY PLAN SELECT key, value, seq, deleted FROM registry WHERE seq > 5000 ORDER BY seq",
            [],
            |r| r.get(3),
        )
        .unwrap()
    };
    assert!(
        plan.contains("registry_seq"),
        "changes since N must walk the seq index, not scan the registry: {plan}"
    );
}

#[tokio::test]
async fn the_change_log_is_a_gapless_feed_that_follows_new_commits() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("a", b"2".to_vec()).await.unwrap();
    src.remove("a").await.unwrap();
    let mut opened = src.open(2, None).await.unwrap();
    assert_eq!(opened.info.head, 3);
    assert_eq!(opened.info.continuity, Continuity::Gapless);
    assert_eq!(
        unstamped_item(opened.stream.next().await.unwrap().unwrap()),
        FeedItem::Entry(Entry::put(2, "a", "2")),
        "an overwritten value still appears: every seq is on the feed"
    );
    assert_eq!(
        unstamped_item(opened.stream.next().await.unwrap().unwrap()),
        FeedItem::Entry(Entry::delete(3, "a"))
    );
    let writer = db.source();
    let later = tokio::spawn(async move { writer.put("b", b"3".to_vec()).await });
    let next = tokio::time::timeout(Duration::from_secs(5), opened.stream.next())
        .await
        .expect("an open feed must deliver a later commit");
    assert_eq!(
        unstamped_item(next.unwrap().unwrap()),
        FeedItem::Entry(Entry::put(4, "b", "3"))
    );
    later.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_feed_opened_on_another_handle_sees_commits_from_this_one() {
    let (_dir, path, db) = common::fresh().await;
    let other = SqliteDb::open(&path).await.unwrap();
    let mut opened = other.source().open(1, None).await.unwrap();
    db.source().put("x", b"1".to_vec()).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), opened.stream.next())
        .await
        .expect("a commit on another connection must reach the feed through the watcher");
    assert_eq!(
        unstamped_item(next.unwrap().unwrap()),
        FeedItem::Entry(Entry::put(1, "x", "1"))
    );
}

#[tokio::test]
async fn data_survives_reopening_the_file() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    drop(db);
    let db = SqliteDb::open(&path).await.unwrap();
    assert_eq!(db.source().watermark().await.unwrap(), 1);
    assert_eq!(db.source().get("a").await.unwrap().unwrap().seq, 1);
}

/// A row whose key is not UTF-8 (written by a foreign process straight into the file) is
/// a counted skip on the feed and a logged skip in changes and snapshots: it never wedges
/// a follower, and the valid rows around it still arrive.
#[tokio::test]
async fn a_row_with_a_key_that_is_not_utf8_is_skipped_not_a_wedge() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "BEGIN IMMEDIATE;
             INSERT INTO registry (key, value, seq, deleted) VALUES (X'FFFE', X'00', 2, 0);
             INSERT INTO changelog (seq, key, deleted, value) VALUES (2, X'FFFE', 0, X'00');
             UPDATE tidemark_meta SET value = 2 WHERE name = 'watermark';
             COMMIT;",
        )
        .unwrap();
    }
    src.put("b", b"3".to_vec()).await.unwrap();

    let mut feed = Feed::open(&src, 1, None).await.unwrap().stream;
    let mut items = Vec::new();
    for _ in 0..3 {
        let item = tokio::time::timeout(Duration::from_secs(5), feed.next())
            .await
            .expect("the feed must not stall on a bad row")
            .unwrap()
            .unwrap();
        items.push(item);
    }
    assert!(matches!(&items[0], FeedItem::Entry(e) if &*e.key == "a"));
    assert!(
        matches!(&items[1], FeedItem::Undecodable { seq: Some(2), .. }),
        "the bad row is delivered as undecodable, with its seq so a follower moves past it: {:?}",
        items[1]
    );
    assert!(matches!(&items[2], FeedItem::Entry(e) if &*e.key == "b" && e.seq == 3));

    let Changes::Since { entries, watermark } = src.changes_since(0).await.unwrap() else {
        panic!("nothing was compacted");
    };
    let keys: Vec<&str> = entries.iter().map(|e| &*e.key).collect();
    assert_eq!(
        (keys, watermark),
        (vec!["a", "b"], 3),
        "reconcile skips it and still reaches the watermark"
    );
    let snapshot = src.snapshot().await.unwrap();
    assert_eq!(snapshot.entries.len(), 2);
}

/// A batch can carry typed values (stored as JSON) and, through a view over a prefix,
/// refuses as a whole a write outside it.
#[tokio::test]
async fn a_batch_carries_typed_values_and_a_view_refuses_a_batch_reaching_outside_it() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    let seqs = src
        .write_batch(vec![
            Write::put_json("orders.1", &serde_json::json!({"qty": 2})).unwrap(),
            Write::Put("orders.2".into(), b"raw".to_vec()),
        ])
        .await
        .unwrap();
    assert_eq!(seqs, [Some(1), Some(2)]);
    assert_eq!(
        src.get("orders.1").await.unwrap().unwrap().value,
        br#"{"qty":2}"#
    );
    let unencodable = std::collections::BTreeMap::from([((1u8, 2u8), 3u8)]);
    assert!(matches!(
        Write::put_json("orders.3", &unencodable),
        Err(Error::Encode { .. })
    ));
    let view = src.with_prefix("orders.").unwrap();
    let refused = view
        .write_batch(vec![
            Write::Put("orders.3".into(), b"c".to_vec()),
            Write::Remove("users.1".into()),
        ])
        .await;
    assert!(
        matches!(refused, Err(Error::InvalidKey { .. })),
        "{refused:?}"
    );
    assert_eq!(
        src.get("orders.3").await.unwrap(),
        None,
        "all or nothing: the batch's write inside the prefix is not made either"
    );
    assert!(
        matches!(src.with_prefix(""), Err(Error::InvalidKey { .. })),
        "an empty prefix is no view"
    );
}

/// A foreign writer's row whose value is text is read as its bytes; one whose value is a
/// number is no value a reader can carry: skipped from snapshots (whole or in parts) and
/// changes, undecodable on the feed, absent to `get`. Before, either failed every
/// snapshot and reconcile of the registry, which wedged a resync.
#[tokio::test]
async fn a_row_whose_value_is_text_or_a_number_is_read_or_skipped_not_a_wedge() {
    use futures::StreamExt;
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "BEGIN IMMEDIATE;
             INSERT INTO registry (key, value, seq, deleted) VALUES ('b', 'text', 2, 0);
             INSERT INTO changelog (seq, key, deleted, value) VALUES (2, 'b', 0, 'text');
             INSERT INTO registry (key, value, seq, deleted) VALUES ('c', 42, 3, 0);
             INSERT INTO changelog (seq, key, deleted, value) VALUES (3, 'c', 0, 42);
             UPDATE tidemark_meta SET value = 3 WHERE name = 'watermark';
             COMMIT;",
        )
        .unwrap();
    }
    let read = |entries: Vec<Entry>| -> Vec<(String, Vec<u8>)> {
        entries
            .into_iter()
            .map(|e| (e.key.to_string(), e.value))
            .collect()
    };
    let expected = vec![
        ("a".to_owned(), b"1".to_vec()),
        ("b".into(), b"text".to_vec()),
    ];
    let snap = src.snapshot().await.unwrap();
    assert_eq!((read(snap.entries), snap.watermark), (expected.clone(), 3));
    let parts = src.snapshot_parts(1).await.unwrap().parts;
    let parts: Vec<Entry> = parts
        .flat_map(|p| futures::stream::iter(p.unwrap()))
        .collect()
        .await;
    assert_eq!(read(parts), expected);
    let Changes::Since { entries, watermark } = src.changes_since(0).await.unwrap() else {
        panic!("nothing was compacted");
    };
    assert_eq!((read(entries), watermark), (expected, 3));
    assert_eq!(src.get("b").await.unwrap().unwrap().value, b"text");
    assert_eq!(src.get("c").await.unwrap(), None);
    let mut feed = Feed::open(&src, 1, None).await.unwrap().stream;
    let mut items = Vec::new();
    for _ in 0..3 {
        items.push(feed.next().await.unwrap().unwrap());
    }
    assert!(
        matches!(&items[2], FeedItem::Undecodable { seq: Some(3), .. }),
        "the number is undecodable, with its seq: {:?}",
        items[2]
    );
}

/// The entries without their stamps (random per mutation), to compare with expected ones.
fn unstamped(entries: Vec<Entry>) -> Vec<Entry> {
    entries.into_iter().map(|e| e.stamped(None)).collect()
}

/// A feed item without its entry's stamp.
fn unstamped_item(item: FeedItem) -> FeedItem {
    match item {
        FeedItem::Entry(e) => FeedItem::Entry(e.stamped(None)),
        other => other,
    }
}
