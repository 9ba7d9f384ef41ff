//! Files that are not ours are refused with a typed error, never a panic.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Seek, SeekFrom, Write as _};

use tidemark::tidemark_core::{Job, Legs};
use tidemark::{JobState, Leased, Outbox, Queue, Source};
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
    // without cron, no retention marks, jobs without coalesce keys, priorities or lease
    // counts, nothing kept of what followers committed ahead of their watermarks.
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
             ALTER TABLE jobs DROP COLUMN leases;
             DROP TRIGGER changelog_floor;
             ALTER TABLE changelog DROP COLUMN stamp;
             ALTER TABLE registry DROP COLUMN stamp;
             ALTER TABLE follower_state DROP COLUMN history;
             ALTER TABLE follower_state DROP COLUMN stamp;
             DELETE FROM tidemark_meta WHERE name IN ('history', 'floor_seq', 'floor_stamp');
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

/// A job row but its lease count: id, job, state, attempts, last error, not before, lease
/// until.
type JobRow = (i64, Vec<u8>, i64, i64, Option<String>, i64, i64);

/// Every job row but its lease count: what a migration must keep as it was.
fn job_rows(path: &std::path::Path) -> Vec<JobRow> {
    let c = rusqlite::Connection::open(path).unwrap();
    let mut stmt = c
        .prepare(
            "SELECT id, job, state, attempts, last_error, not_before, lease_until
             FROM jobs ORDER BY id",
        )
        .unwrap();
    stmt.query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
        ))
    })
    .unwrap()
    .collect::<rusqlite::Result<_>>()
    .unwrap()
}

/// A version 7 file's receipts were attempt numbers. Migrated, every job is as it was, a
/// job leased across the migration keeps the receipt its holder was given, and every later
/// lease counts on from it, so the lease from before a requeue names nothing after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_7_file_keeps_its_jobs_and_its_leases_receipts() {
    let (_dir, path, db) = common::fresh().await;
    let q = db.queue();
    let visibility = std::time::Duration::from_secs(30);
    let keys = ["done", "dead", "held", "ready"];
    for key in keys {
        q.enqueue(Job::PackHousekeeping { key: key.into() })
            .await
            .unwrap();
    }
    let done = q.lease(visibility).await.unwrap().unwrap();
    q.ack(&done).await.unwrap();
    let dead = q.lease(visibility).await.unwrap().unwrap();
    q.dead_letter(&dead, "no hope").await.unwrap();
    let held = q.lease(visibility).await.unwrap().unwrap();
    drop((q, db));
    // Back to the version 7 shape: no lease counts.
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "ALTER TABLE jobs DROP COLUMN leases;
             DROP TRIGGER changelog_floor;
             ALTER TABLE changelog DROP COLUMN stamp;
             ALTER TABLE registry DROP COLUMN stamp;
             ALTER TABLE follower_state DROP COLUMN history;
             ALTER TABLE follower_state DROP COLUMN stamp;
             DELETE FROM tidemark_meta WHERE name IN ('history', 'floor_seq', 'floor_stamp');
             PRAGMA user_version = 7;",
        )
        .unwrap();
    }
    let before = job_rows(&path);
    let db = SqliteDb::open(&path).await.unwrap();
    let q = db.queue();
    assert_eq!(job_rows(&path), before, "the migration changes no job");
    let c = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = c
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(
        version, SCHEMA_VERSION,
        "a version 7 file is migrated on open"
    );
    let unseeded: i64 = c
        .query_row(
            "SELECT count(*) FROM jobs WHERE leases != attempts",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(unseeded, 0, "lease counts start from the attempts");
    // The lease taken before the migration, with the receipt version 7 gave it (its
    // attempt), is still the job's lease.
    let old = Leased {
        receipt: u64::from(held.attempt),
        ..held.clone()
    };
    q.renew(&old, visibility)
        .await
        .expect("a lease held across the migration renews");
    q.ack(&old)
        .await
        .expect("a lease held across the migration acks");
    // The dead letter from before the migration, requeued: its next lease is a new
    // receipt, and the one it had before is lost.
    q.requeue(dead.id).await.unwrap();
    let fresh = q.lease(visibility).await.unwrap().unwrap();
    assert_eq!((fresh.id, fresh.attempt), (dead.id, 1));
    assert_ne!(fresh.receipt, dead.receipt, "a new lease, a new receipt");
    assert!(matches!(
        q.ack(&dead).await,
        Err(tidemark::Error::LeaseLost(_))
    ));
    q.ack(&fresh).await.unwrap();
    for id in [done.id, dead.id, held.id] {
        assert_eq!(q.get(id).await.unwrap().unwrap().state, JobState::Done);
    }
    assert_eq!(
        q.lease(visibility).await.unwrap().map(|l| l.job),
        Some(Job::PackHousekeeping {
            key: keys[3].into()
        }),
        "the ready job is still there"
    );
}

/// Issue 30: a process kept writing with this build's statements to a file that a newer
/// build (another process sharing it) had migrated since this one opened it, its queue
/// receipts included. Every port now refuses, with an error naming both versions, and
/// writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_a_newer_build_migrated_while_it_was_open_is_neither_written_nor_read() {
    use tidemark::{Lineage, Lock, Publish, Wake};
    let (_dir, path, db) = common::fresh().await;
    let source = db.source();
    source.put("a", b"1".to_vec()).await.unwrap();
    let queue = db.queue();
    queue
        .enqueue(Job::PackHousekeeping { key: "a".into() })
        .await
        .unwrap();
    let leased = queue
        .lease(std::time::Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a job");
    let cache = db.follower_cache("mirror");
    // The newer build's migration, from another connection (another process).
    let newer = rusqlite::Connection::open(&path).unwrap();
    newer
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let changed = |what: &str, err: tidemark::Error| {
        assert!(
            matches!(
                err,
                tidemark::Error::SchemaChanged { opened, found, .. }
                    if opened == SCHEMA_VERSION && found == SCHEMA_VERSION + 1
            ),
            "{what}: {err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&SCHEMA_VERSION.to_string())
                && text.contains(&(SCHEMA_VERSION + 1).to_string()),
            "{what}: the error names both versions: {text}"
        );
        assert!(!err.is_retryable(), "{what}: no retry can help");
    };
    changed("put", source.put("b", b"2".to_vec()).await.unwrap_err());
    changed("ack", queue.ack(&leased).await.unwrap_err());
    changed(
        "enqueue",
        queue
            .enqueue(Job::PackHousekeeping { key: "b".into() })
            .await
            .unwrap_err(),
    );
    changed(
        "cache commit",
        cache
            .apply(
                vec![tidemark::CacheOp::Put {
                    key: "a".into(),
                    seq: 1,
                    value: b"1".to_vec(),
                }],
                1,
                Lineage::default(),
            )
            .await
            .unwrap_err(),
    );
    changed(
        "lock",
        db.lock()
            .try_lock("sweep", "me", std::time::Duration::from_secs(5))
            .await
            .unwrap_err(),
    );
    changed(
        "publish",
        db.events().publish("a", b"x".to_vec()).await.unwrap_err(),
    );
    changed(
        "notify",
        db.wake().notify("c", b"x".to_vec()).await.unwrap_err(),
    );
    changed(
        "outbox claim",
        db.outbox()
            .claim("relay", 0, 10, std::time::Duration::from_secs(5))
            .await
            .unwrap_err(),
    );
    changed("read", source.get("a").await.unwrap_err());
    let (rows, jobs_done): (i64, i64) = newer
        .query_row(
            "SELECT (SELECT count(*) FROM registry), (SELECT count(*) FROM jobs WHERE state = 2)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((rows, jobs_done), (1, 0), "nothing was written");
}
