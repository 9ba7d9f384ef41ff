//! Files that are not ours are refused with a typed error, never a panic.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Seek, SeekFrom, Write as _};

use tidemark::tidemark_core::Legs;
use tidemark::{Outbox, Source};
use tidemark_sqlite::{Error, SCHEMA_VERSION, SqliteDb};

/// Moves the whole WAL into the main file and empties it, retrying while the dropped
/// handle's watcher thread still has its connection open (it closes it on its next poll;
/// a loaded machine may take a while).
fn checkpoint_everything(path: &std::path::Path) {
    let started = std::time::Instant::now();
    loop {
        let c = rusqlite::Connection::open(path).unwrap();
        let busy: i64 = c
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
            .unwrap();
        drop(c);
        let wal = path.with_extension("db-wal");
        let wal_empty = std::fs::metadata(&wal).map_or(true, |m| m.len() == 0);
        if busy == 0 && wal_empty {
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the WAL could not be checkpointed (busy {busy})"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[tokio::test]
async fn opening_twice_is_idempotent() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let again = SqliteDb::open(&path).await.unwrap();
    let third = SqliteDb::open(&path).await.unwrap();
    assert_eq!(again.source().watermark().await.unwrap(), 1);
    assert_eq!(third.source().watermark().await.unwrap(), 1);
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "these are my notes, not a database ".repeat(200)).unwrap();
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(matches!(err, Error::NotADatabase { .. }), "{err}");
}

#[tokio::test]
async fn a_truncated_file_is_refused() {
    let (_dir, path, db) = common::fresh().await;
    let writes = (0..2000)
        .map(|i| tidemark_sqlite::Write::Put(format!("key-{i}"), vec![7; 100]))
        .collect();
    db.source().write_batch(writes).await.unwrap();
    drop(db);
    checkpoint_everything(&path);
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(len > 8192, "the test needs a multi-page file, got {len}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");

    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(40)
        .unwrap();
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(
        matches!(err, Error::Truncated { .. }),
        "a cut-off header: {err}"
    );
}

#[tokio::test]
async fn a_corrupt_file_is_refused() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    drop(db);
    checkpoint_everything(&path);
    // Scribble over the schema table's page content (page 1 after the file header).
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(100)).unwrap();
    f.write_all(&[0xA5; 900]).unwrap();
    drop(f);
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
}

#[tokio::test]
async fn a_foreign_database_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);")
            .unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(matches!(err, Error::Foreign { .. }), "{err}");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "refusing a foreign file leaves it byte for byte as it was (not even switched to WAL)"
    );
    let c = rusqlite::Connection::open(&path).unwrap();
    let tables: i64 = c
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type='table'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        tables, 1,
        "tidemark must not write into someone else's database"
    );

    let other_app = dir.path().join("other.db");
    {
        let c = rusqlite::Connection::open(&other_app).unwrap();
        c.pragma_update(None, "application_id", 42).unwrap();
    }
    let err = SqliteDb::open(&other_app).await.unwrap_err();
    assert!(matches!(err, Error::Foreign { .. }), "{err}");
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let (_dir, path, db) = common::fresh().await;
    drop(db);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
    }
    let err = SqliteDb::open(&path).await.unwrap_err();
    assert!(
        matches!(err, Error::NewerSchema { found, supported, .. } if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_file_migrates_and_its_pending_outbox_rows_are_relayed() {
    let (_dir, path, db) = common::fresh().await;
    db.announced_source(Legs::default())
        .put("a", b"1".to_vec())
        .await
        .unwrap();
    drop(db);
    // Back to the version 1 shape: an outbox with no claim columns, one row pending,
    // follower states without their key count, no record of follower starts, schedules
    // without cron, no retention marks, jobs without coalesce keys or priorities, nothing
    // kept of what followers committed ahead of their watermarks.
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "ALTER TABLE outbox DROP COLUMN claimed_by;
             ALTER TABLE outbox DROP COLUMN claim_until;
             ALTER TABLE follower_state DROP COLUMN keys;
             DROP TABLE follower_starts;
             ALTER TABLE schedules DROP COLUMN cron;
             DROP TABLE retention_marks;
             DROP INDEX jobs_dedupe;
             DROP INDEX jobs_priority;
             ALTER TABLE jobs DROP COLUMN dedupe;
             ALTER TABLE jobs DROP COLUMN priority;
             DROP TABLE follower_ahead;
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let db = SqliteDb::open(&path).await.unwrap();
    let c = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = c
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION, "an older file is migrated on open");
    let claim_columns: i64 = c
        .query_row(
            "SELECT count(*) FROM pragma_table_info('outbox')
             WHERE name IN ('claimed_by', 'claim_until')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(claim_columns, 2, "the migration adds the claim columns");
    let ahead_table: i64 = c
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE name = 'follower_ahead'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        ahead_table, 1,
        "the migration adds what followers hold ahead"
    );
    assert_eq!(db.outbox().pending().await.unwrap(), 1);
    let report = db
        .relay(db.events(), db.wake(), db.queue(), "reg")
        .drain()
        .await
        .unwrap();
    assert_eq!(
        (report.published, report.done),
        (1, 1),
        "a row written before the migration is still relayed"
    );
    assert_eq!(
        db.source().watermark().await.unwrap(),
        1,
        "the data survived"
    );
}
