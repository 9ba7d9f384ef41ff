//! The schema, its version and its migrations; and the checks that refuse a file that is
//! not ours (not a database, truncated, corrupt, foreign, newer) with a typed error.

use std::io::Read;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::error::{Error, Result};

/// `PRAGMA application_id` of a tidemark database ("TDMK").
pub const APPLICATION_ID: i32 = 0x5444_4D4B;

/// The newest schema version this build reads and writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 9;

/// Migration `i` takes a file from version `i` to `i + 1`. Each runs in the transaction that
/// bumps the version, so a crash mid-migration leaves the old version intact.
const MIGRATIONS: &[&str] = &[
    // 0 → 1
    "
    CREATE TABLE tidemark_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO tidemark_meta (name, value) VALUES ('watermark', 0), ('first_available', 1);

    -- The registry: one row per key; a removal keeps the row as a tombstone with its seq.
    CREATE TABLE registry (
        key TEXT PRIMARY KEY NOT NULL,
        value BLOB,
        seq INTEGER NOT NULL,
        deleted INTEGER NOT NULL DEFAULT 0
    );
    -- Changes since N walk this index: the cost is what changed, not the registry's size.
    CREATE UNIQUE INDEX registry_seq ON registry (seq);

    -- Every mutation in seq order: the gapless change-log feed. Trimmed by compaction.
    CREATE TABLE changelog (
        seq INTEGER PRIMARY KEY,
        key TEXT NOT NULL,
        deleted INTEGER NOT NULL,
        value BLOB
    );

    -- Announcements written in the mutation's own transaction; the relay drains them.
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        seq INTEGER NOT NULL,
        key TEXT NOT NULL,
        payload BLOB NOT NULL,
        publish INTEGER NOT NULL,
        notify INTEGER NOT NULL,
        job BLOB,
        published INTEGER NOT NULL DEFAULT 0,
        notified INTEGER NOT NULL DEFAULT 0,
        job_id INTEGER,
        done INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX outbox_pending ON outbox (id) WHERE done = 0;

    -- The durable events stream and its named cursors.
    CREATE TABLE events (
        position INTEGER PRIMARY KEY AUTOINCREMENT,
        key TEXT NOT NULL,
        payload BLOB NOT NULL,
        seq INTEGER
    );
    CREATE TABLE cursors (name TEXT PRIMARY KEY, position INTEGER NOT NULL) WITHOUT ROWID;

    -- Wake payloads, read by listeners in every process in id order; pruned as they age.
    CREATE TABLE wakes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        channel TEXT NOT NULL,
        payload BLOB NOT NULL
    );
    CREATE INDEX wakes_channel ON wakes (channel, id);

    -- The job queue. state: 0 ready, 1 leased, 2 done, 3 dead-lettered. Times in unix ms.
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job BLOB NOT NULL,
        state INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT,
        not_before INTEGER NOT NULL DEFAULT 0,
        lease_until INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_open ON jobs (state, id) WHERE state < 2;

    -- Named locks; a released lock keeps its row so its fencing token keeps growing.
    CREATE TABLE locks (
        name TEXT PRIMARY KEY,
        owner TEXT,
        expires INTEGER NOT NULL,
        fencing INTEGER NOT NULL
    ) WITHOUT ROWID;

    CREATE TABLE schedules (
        name TEXT PRIMARY KEY,
        interval_ns INTEGER NOT NULL,
        job BLOB NOT NULL,
        anchor INTEGER NOT NULL,
        last_fired INTEGER
    ) WITHOUT ROWID;

    -- Persisted follower caches: each follower's watermark and entries.
    CREATE TABLE follower_state (name TEXT PRIMARY KEY, watermark INTEGER NOT NULL) WITHOUT ROWID;
    CREATE TABLE follower_cache (
        name TEXT NOT NULL,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        value BLOB NOT NULL,
        PRIMARY KEY (name, key)
    ) WITHOUT ROWID;
    ",
    // 1 → 2: outbox rows are claimed by one relay at a time (owner and lease end, wall-clock
    // unix ms shared by every process on the file), so relays in several processes publish
    // each row once.
    "
    ALTER TABLE outbox ADD COLUMN claimed_by TEXT;
    ALTER TABLE outbox ADD COLUMN claim_until INTEGER;
    ",
    // 2 → 3: a persisted follower's key count, kept with its watermark, so a warm restart
    // does not count a million rows to say how many it holds (NULL: count once).
    "
    ALTER TABLE follower_state ADD COLUMN keys INTEGER;
    ",
    // 3 → 4: how each persisted follower started, so an operator can see whether a
    // restart was warm (resumed from its persisted watermark) or cold.
    "
    CREATE TABLE follower_starts (
        name TEXT PRIMARY KEY,
        starts INTEGER NOT NULL,
        warm_starts INTEGER NOT NULL,
        last_warm INTEGER NOT NULL,
        resumed_watermark INTEGER
    ) WITHOUT ROWID;
    ",
    // 4 → 5: cron schedules (interval_ns 0, the expression here); and retention marks:
    // the watermark and the events stream's last position at each sweep, by unix ms, which
    // is how a sweep tells the age of history without a timestamp on every row.
    "
    ALTER TABLE schedules ADD COLUMN cron TEXT;
    CREATE TABLE retention_marks (
        at INTEGER PRIMARY KEY,
        seq INTEGER NOT NULL,
        position INTEGER NOT NULL
    ) WITHOUT ROWID;
    ",
    // 5 → 6: a ready job never leased absorbs later enqueues with its coalesce key (one
    // pending housekeeping job per key, however many writes), and priority jobs (sweeps)
    // are leased before the rest, so a housekeeping backlog never delays retention.
    "
    ALTER TABLE jobs ADD COLUMN dedupe TEXT;
    ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
    CREATE UNIQUE INDEX jobs_dedupe ON jobs (dedupe) WHERE state = 0 AND attempts = 0;
    CREATE INDEX jobs_priority ON jobs (id) WHERE state = 0 AND priority = 1;
    UPDATE jobs SET priority = 1 WHERE state < 2 AND json_valid(job)
        AND json_extract(job, '$.kind') = 'sweep';
    ",
    // 6 → 7: what each persisted follower committed ahead of its watermark and still holds
    // (announcements no read of the source has confirmed yet): puts, whose bytes are in
    // follower_cache, and removals, which leave no row. A warm restart gives them back to
    // be checked by the first read, in the list's size, not the cache's.
    "
    CREATE TABLE follower_ahead (
        name TEXT NOT NULL,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        removed INTEGER NOT NULL,
        PRIMARY KEY (name, key)
    ) WITHOUT ROWID;
    ",
    // 7 → 8: how many leases each job has had, never reset (a requeue starts its attempts
    // over, not this): the current lease's receipt. Receipts were attempt numbers, so a
    // lease from before a requeue named the next lease of the same attempt too. Seeded
    // from attempts, so a job leased when the file is migrated keeps the receipt its holder
    // was given; every later lease of it counts on from there.
    "
    ALTER TABLE jobs ADD COLUMN leases INTEGER NOT NULL DEFAULT 0;
    UPDATE jobs SET leases = attempts;
    ",
    // 8 → 9: one history across restarts. The registry's history, made at random with the
    // file (a file deleted and made again has another; a copy restored from a backup keeps
    // it), and a random stamp per mutation on its change-log row and its registry row:
    // a copy restored from a backup and written past a follower's watermark has another
    // stamp at that seq than the follower applied. Each persisted follower keeps both with
    // its watermark. Rows written before this step have no stamp (NULL: a follower cannot
    // tell from them, until its watermark passes them).
    "
    INSERT OR IGNORE INTO tidemark_meta (name, value) VALUES ('history', random());
    ALTER TABLE changelog ADD COLUMN stamp INTEGER;
    ALTER TABLE registry ADD COLUMN stamp INTEGER;
    ALTER TABLE follower_state ADD COLUMN history INTEGER;
    ALTER TABLE follower_state ADD COLUMN stamp INTEGER;
    -- The seq and stamp of the newest change-log row compaction removed: a follower whose
    -- watermark is the horizon still reads from the log, and its watermark's stamp must
    -- still tell its history.
    CREATE TRIGGER changelog_floor AFTER DELETE ON changelog
    WHEN OLD.stamp IS NOT NULL
        AND OLD.seq > coalesce((SELECT value FROM tidemark_meta WHERE name = 'floor_seq'), 0)
    BEGIN
        INSERT OR REPLACE INTO tidemark_meta (name, value)
            VALUES ('floor_seq', OLD.seq), ('floor_stamp', OLD.stamp);
    END;
    ",
];

// One migration per version step, or a file would be stamped with a version it lacks.
const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION);

const MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Looks at an existing file's header before SQLite does: a cut-off file is refused here,
/// where SQLite might otherwise treat the missing pages as absent data.
pub(crate) fn check_header(path: &Path) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    let len = file.metadata().map_err(io)?.len();
    if len == 0 {
        return Ok(());
    }
    let mut header = [0u8; 100];
    let mut read = 0;
    while read < header.len() {
        match file.read(&mut header[read..]).map_err(io)? {
            0 => break,
            n => read += n,
        }
    }
    if read >= MAGIC.len() && &header[..16] != MAGIC {
        return Err(Error::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    if read < header.len() {
        if header[..read.min(16)] == MAGIC[..read.min(16)] {
            return Err(Error::Truncated {
                path: path.to_path_buf(),
                len,
                expected: 100,
            });
        }
        return Err(Error::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    let be32 = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let page_size = match u16::from_be_bytes([header[16], header[17]]) {
        1 => 65_536u64,
        n => u64::from(n),
    };
    let pages = u64::from(be32(28));
    // A checkpoint copies pages from the WAL in page order, page 1 (with the new size)
    // first, so a process killed mid-checkpoint leaves a file shorter than its header says
    // while the WAL still holds every page: SQLite's recovery finishes the job. Only
    // without a WAL is a short file really cut off.
    let wal_holds_pages = {
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0)
    };
    // The in-header size is valid only when the change counter matches "version valid for".
    if pages > 0 && be32(24) == be32(92) && !wal_holds_pages {
        let expected = pages.saturating_mul(page_size);
        if len < expected {
            return Err(Error::Truncated {
                path: path.to_path_buf(),
                len,
                expected,
            });
        }
    }
    Ok(())
}

/// Refuses a file that is not ours (another application's, or tables without our id) or
/// that carries a newer schema. Reads only: run before anything is written to the file,
/// even a journal mode, and again under the write lock before migrating.
pub(crate) fn refuse_foreign(conn: &Connection, path: &Path) -> Result<()> {
    let sql = |e| Error::from_sqlite(path, e);
    let app: i32 = conn
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .map_err(sql)?;
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql)?;
    if app != APPLICATION_ID {
        if app != 0 {
            return Err(Error::Foreign {
                path: path.to_path_buf(),
                reason: format!("application id {app:#x}"),
            });
        }
        let tables: Vec<String> = {
            let mut stmt = conn
                .prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name LIMIT 5",
                )
                .map_err(sql)?;
            let rows = stmt.query_map([], |r| r.get(0)).map_err(sql)?;
            rows.collect::<rusqlite::Result<_>>().map_err(sql)?
        };
        if !tables.is_empty() || version != 0 {
            return Err(Error::Foreign {
                path: path.to_path_buf(),
                reason: format!(
                    "holds tables not created by tidemark: {}",
                    tables.join(", ")
                ),
            });
        }
    }
    if version > SCHEMA_VERSION {
        return Err(Error::NewerSchema {
            path: path.to_path_buf(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if version < 0 {
        return Err(Error::Foreign {
            path: path.to_path_buf(),
            reason: format!("negative schema version {version}"),
        });
    }
    Ok(())
}

/// Brings the schema to [`SCHEMA_VERSION`], or refuses the file. Idempotent and safe when
/// several processes open the same file at once: the version is re-read under the write
/// lock.
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<()> {
    let sql = |e| Error::from_sqlite(path, e);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql)?;
    refuse_foreign(&tx, path)?;
    let version: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql)?;
    for (from, step) in MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(version).unwrap_or(0))
    {
        tx.execute_batch(step).map_err(sql)?;
        tracing::info!(path = %path.display(), from, "migrated tidemark schema");
    }
    tx.pragma_update(None, "application_id", APPLICATION_ID)
        .map_err(sql)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(sql)?;
    tx.commit().map_err(sql)?;
    // Touch every table once: a damaged schema or root page shows up now, typed.
    for table in [
        "tidemark_meta",
        "registry",
        "changelog",
        "outbox",
        "events",
        "jobs",
    ] {
        conn.query_row(&format!("SELECT 1 FROM {table} LIMIT 1"), [], |_| Ok(()))
            .optional()
            .map_err(sql)?;
    }
    Ok(())
}
