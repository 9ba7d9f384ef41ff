//! What an operator sees of a database file: its registry, persisted followers, outbox,
//! queue, schedules, locks and cursors, read in one transaction.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};
use tidemark::Result;

use crate::db::{SqliteDb, to_u64};
use crate::error::unavailable;

fn sql(e: rusqlite::Error) -> tidemark::Error {
    unavailable("report", &e)
}

/// The registry (source) a file holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryReport {
    /// The seq of its last mutation (0: never written).
    pub watermark: u64,
    /// Keys holding a value.
    pub keys: u64,
    /// Removed keys kept as tombstones.
    pub tombstones: u64,
    /// The first seq its changes can still be read from.
    pub first_available: u64,
}

/// How a persisted follower last started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// From nothing: an initial sync.
    Cold,
    /// From its persisted watermark: only the delta was read.
    Warm {
        /// The watermark it resumed from.
        resumed: u64,
    },
}

/// A follower whose cache the file keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FollowerReport {
    /// Its name.
    pub name: String,
    /// Its committed watermark.
    pub watermark: u64,
    /// Keys in its cache.
    pub keys: u64,
    /// How many times it started on this file.
    pub starts: u64,
    /// How many of those were warm.
    pub warm_starts: u64,
    /// How it last started (`None`: a file from before starts were recorded).
    pub last_start: Option<Start>,
    /// The history of its source it follows, as its source states it (see
    /// [`tidemark::Lineage`]); `None` when the source does not say, or before its first
    /// commit on this schema.
    pub history: Option<u64>,
}

/// The job queue's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueReport {
    /// Waiting to be leased.
    pub ready: u64,
    /// Leased to a runner.
    pub leased: u64,
    /// Done (kept until retention removes them).
    pub done: u64,
    /// Dead-lettered after their last attempt.
    pub dead: u64,
}

/// A schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleReport {
    /// Its name.
    pub name: String,
    /// How often it fires.
    pub interval: Duration,
    /// The job it enqueues, as stored (JSON).
    pub job: String,
}

/// A named lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockReport {
    /// Its name.
    pub name: String,
    /// Who holds it (`None`: released).
    pub owner: Option<String>,
    /// When the hold ends, in unix milliseconds.
    pub expires_ms: i64,
}

/// Everything [`SqliteDb::report`] reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The registry.
    pub registry: RegistryReport,
    /// Persisted followers, by name.
    pub followers: Vec<FollowerReport>,
    /// Outbox rows not yet relayed.
    pub outbox_pending: u64,
    /// The job queue.
    pub queue: QueueReport,
    /// Schedules, by name.
    pub schedules: Vec<ScheduleReport>,
    /// Locks, by name.
    pub locks: Vec<LockReport>,
    /// Durable cursors on the events stream: name and position, by name.
    pub cursors: Vec<(String, u64)>,
    /// The events stream's last position (0: empty).
    pub events_head: u64,
}

fn count(conn: &Connection, query: &str) -> rusqlite::Result<u64> {
    conn.query_row(query, [], |r| r.get::<_, i64>(0))
        .map(to_u64)
}

fn meta(conn: &Connection, name: &str) -> rusqlite::Result<u64> {
    conn.query_row(
        "SELECT value FROM tidemark_meta WHERE name = ?1",
        [name],
        |r| r.get::<_, i64>(0),
    )
    .optional()
    .map(|v| v.map_or(0, to_u64))
}

pub(crate) fn read(conn: &mut Connection) -> rusqlite::Result<Report> {
    // One read transaction: the counts agree with each other.
    let tx = conn.transaction()?;
    let registry = RegistryReport {
        watermark: meta(&tx, "watermark")?,
        keys: count(&tx, "SELECT count(*) FROM registry WHERE deleted = 0")?,
        tombstones: count(&tx, "SELECT count(*) FROM registry WHERE deleted != 0")?,
        first_available: meta(&tx, "first_available")?.max(1),
    };
    let followers = {
        let mut stmt = tx.prepare(
            "SELECT s.name, s.watermark, s.keys, f.starts, f.warm_starts, f.last_warm,
                    f.resumed_watermark,
                    (SELECT count(*) FROM follower_cache c WHERE c.name = s.name),
                    s.history
             FROM follower_state s LEFT JOIN follower_starts f ON f.name = s.name
             ORDER BY s.name",
        )?;
        let rows = stmt.query_map([], |r| {
            let keys: Option<i64> = r.get(2)?;
            let counted: i64 = r.get(7)?;
            let starts: Option<i64> = r.get(3)?;
            let last_start = match (starts, r.get::<_, Option<i64>>(5)?) {
                (Some(_), Some(0)) => Some(Start::Cold),
                (Some(_), Some(_)) => Some(Start::Warm {
                    resumed: to_u64(r.get::<_, Option<i64>>(6)?.unwrap_or(0)),
                }),
                _ => None,
            };
            Ok(FollowerReport {
                name: r.get(0)?,
                watermark: to_u64(r.get(1)?),
                keys: to_u64(keys.unwrap_or(counted)),
                starts: to_u64(starts.unwrap_or(0)),
                warm_starts: to_u64(r.get::<_, Option<i64>>(4)?.unwrap_or(0)),
                last_start,
                history: r.get::<_, Option<i64>>(8)?.map(crate::db::bits),
            })
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    let queue = {
        let mut q = QueueReport::default();
        let mut stmt = tx.prepare("SELECT state, count(*) FROM jobs GROUP BY state")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (state, n) = row?;
            let n = to_u64(n);
            match state {
                0 => q.ready += n,
                1 => q.leased += n,
                2 => q.done += n,
                _ => q.dead += n,
            }
        }
        q
    };
    let schedules = {
        let mut stmt =
            tx.prepare("SELECT name, interval_ns, CAST(job AS TEXT) FROM schedules ORDER BY name")?;
        let rows = stmt.query_map([], |r| {
            Ok(ScheduleReport {
                name: r.get(0)?,
                interval: Duration::from_nanos(to_u64(r.get(1)?)),
                job: r.get::<_, Option<String>>(2)?.unwrap_or_default(),
            })
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    let locks = {
        let mut stmt = tx.prepare("SELECT name, owner, expires FROM locks ORDER BY name")?;
        let rows = stmt.query_map([], |r| {
            Ok(LockReport {
                name: r.get(0)?,
                owner: r.get(1)?,
                expires_ms: r.get(2)?,
            })
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    let cursors = {
        let mut stmt = tx.prepare("SELECT name, position FROM cursors ORDER BY name")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, to_u64(r.get(1)?))))?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    let report = Report {
        registry,
        followers,
        outbox_pending: count(&tx, "SELECT count(*) FROM outbox WHERE done = 0")?,
        queue,
        schedules,
        locks,
        cursors,
        events_head: count(&tx, "SELECT coalesce(max(position), 0) FROM events")?,
    };
    tx.finish()?;
    Ok(report)
}

/// Reads the [`Report`] of the tidemark file at `path` without writing to it: the file is
/// opened read-only ([`ReadOnlyDb`](crate::ReadOnlyDb)), so it is neither created,
/// migrated nor switched to WAL, and a process using it is not disturbed (`tidemark
/// status` uses this).
///
/// A missing file is [`Error::Io`](crate::Error::Io); a file that is not a tidemark
/// database, is damaged or newer is refused as [`SqliteDb::open`] refuses it; a file with an
/// older schema is [`Error::OlderSchema`](crate::Error::OlderSchema), since its tables are
/// not yet in the shape this build reads. Blocks: call it from a blocking context, or use
/// `tokio::task::spawn_blocking`.
pub fn read_report(path: impl AsRef<Path>) -> crate::Result<Report> {
    crate::ReadOnlyDb::open(path)?.report()
}

impl SqliteDb {
    /// Reads what an operator wants to see of the file (`tidemark status`): the registry,
    /// each persisted follower (watermark, keys, how it last started), the outbox, the
    /// queue, schedules, locks and cursors, in one read transaction.
    pub async fn report(&self) -> Result<Report> {
        self.call("report", |conn| read(conn).map_err(sql)).await
    }
}
