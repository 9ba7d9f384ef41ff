//! Retention on the database file: relayed outbox rows, change-log history and tombstones
//! no known reader needs, old events, all removed in small transactions.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use tidemark::tidemark_core::{Mark, RetentionPolicy};
use tidemark::{Error, LockLease, Result, Sweep, Swept};

use crate::db::{SqliteDb, begin_write, now_ms, to_i64, to_u64};
use crate::error::unavailable;
use crate::source::meta;

const PORT: &str = "sweep";

fn sql(e: rusqlite::Error) -> Error {
    unavailable(PORT, &e)
}

/// The file's [`Sweep`]: what [`Options::retention`](crate::Options::retention) allows to
/// go, removed in transactions of at most [`Options::sweep_batch`](crate::Options::sweep_batch)
/// rows.
///
/// - **Outbox**: rows the relay finished (every leg landed); a pending row is never
///   removed.
/// - **Change log and tombstones**: history below the lowest position a known reader
///   still needs (every persisted follower's watermark + 1, and every durable cursor's
///   position + 1: the file cannot tell which log a cursor follows, so it keeps both for
///   it), once it is older than `keep`; below `max_age` whatever readers need. The new
///   horizon is recorded first, so a reader below it resyncs (from a snapshot) rather
///   than missing a row.
/// - **Events**: records below every durable cursor, once older than `keep`; below
///   `max_age` whatever cursors need.
///
/// Ages come from marks: each sweep records the watermark and the events stream's last
/// position with the time, by the machine's unix clock (the clock every process on the
/// file shares), so rows carry no timestamp.
#[derive(Clone, Debug)]
pub struct SqliteSweep {
    db: SqliteDb,
    policy: RetentionPolicy,
    batch: usize,
}

/// What the first transaction of a sweep decided.
struct Plan {
    horizon: u64,
    first_event: u64,
}

impl SqliteSweep {
    pub(crate) fn new(db: SqliteDb) -> Self {
        let (policy, batch) = (db.options().retention, db.options().sweep_batch.max(1));
        SqliteSweep { db, policy, batch }
    }

    /// The same sweep with another policy.
    #[must_use]
    pub fn with_policy(mut self, policy: RetentionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Records a mark, decides the horizons and records the change log's new horizon.
    async fn plan(&self, fence: &LockLease) -> Result<Plan> {
        let policy = self.policy;
        let fence = fence.clone();
        self.db
            .write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                fenced(&tx, &fence)?;
                let now = now_ms();
                let watermark = meta(&tx, "watermark").map_err(sql)?;
                let first = meta(&tx, "first_available").map_err(sql)?;
                let events_head: u64 = tx
                    .query_row("SELECT COALESCE(MAX(position), 0) FROM events", [], |r| {
                        r.get::<_, i64>(0)
                    })
                    .map(to_u64)
                    .map_err(sql)?;
                tx.execute(
                    "INSERT INTO retention_marks (at, seq, position) VALUES (?1, ?2, ?3)
                     ON CONFLICT (at) DO UPDATE SET seq = excluded.seq,
                     position = excluded.position",
                    params![now, to_i64(watermark), to_i64(events_head)],
                )
                .map_err(sql)?;
                let marks = read_marks(&tx)?;
                let now_d = Duration::from_millis(to_u64(now));
                let (log_marks, event_marks): (Vec<Mark>, Vec<Mark>) = marks
                    .iter()
                    .map(|&(at, seq, position)| {
                        (Mark { at, head: seq }, Mark { at, head: position })
                    })
                    .unzip();
                let cursor_floor = min_plus_one(&tx, "SELECT MIN(position) FROM cursors")?;
                let follower_floor =
                    min_plus_one(&tx, "SELECT MIN(watermark) FROM follower_state")?;
                let needed_log = match (cursor_floor, follower_floor) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let horizon = policy
                    .horizon(&log_marks, needed_log, now_d)
                    .min(watermark.saturating_add(1))
                    .max(first);
                let first_event = policy.horizon(&event_marks, cursor_floor, now_d);
                if horizon > first {
                    tx.execute(
                        "UPDATE tidemark_meta SET value = ?1 WHERE name = 'first_available'",
                        [to_i64(horizon)],
                    )
                    .map_err(sql)?;
                }
                let keep = policy.marks_to_keep(&log_marks, now_d);
                if let Some(oldest) = keep.first() {
                    tx.execute(
                        "DELETE FROM retention_marks WHERE at < ?1",
                        [i64::try_from(oldest.at.as_millis()).unwrap_or(i64::MAX)],
                    )
                    .map_err(sql)?;
                }
                tx.commit().map_err(sql)?;
                Ok(Plan {
                    horizon,
                    first_event,
                })
            })
            .await
    }

    /// Runs `delete` (which takes the batch size and returns the rows it removed) in
    /// transactions of its own until it removes fewer than a batch.
    async fn drain(
        &self,
        fence: &LockLease,
        delete: &'static str,
        bound: Option<u64>,
    ) -> Result<u64> {
        let mut total = 0;
        let batch = i64::try_from(self.batch).unwrap_or(i64::MAX);
        loop {
            let fence = fence.clone();
            let n = self
                .db
                .write(PORT, move |conn| {
                    let tx = begin_write(conn, sql)?;
                    fenced(&tx, &fence)?;
                    let n = match bound {
                        Some(b) => tx.execute(delete, params![to_i64(b), batch]),
                        None => tx.execute(delete, params![batch]),
                    }
                    .map_err(sql)?;
                    tx.commit().map_err(sql)?;
                    Ok(n)
                })
                .await?;
            total += n as u64;
            if (n as u64) < self.batch as u64 {
                return Ok(total);
            }
        }
    }
}

/// `MIN(column) + 1` of a query, if it found any row.
/// Refuses the transaction's work if the lock `fence` names has a newer fencing token in
/// the file: a sweeper stalled past its lease, whose lock another took since.
fn fenced(conn: &Connection, fence: &LockLease) -> Result<()> {
    let current = conn
        .prepare_cached("SELECT fencing FROM locks WHERE name = ?1")
        .and_then(|mut s| {
            s.query_row([&fence.name], |r| r.get::<_, i64>(0))
                .optional()
        })
        .map_err(sql)?;
    fence.check_fence(current.map(to_u64))
}

fn min_plus_one(conn: &Connection, query: &str) -> Result<Option<u64>> {
    conn.query_row(query, [], |r| r.get::<_, Option<i64>>(0))
        .optional()
        .map(|v| v.flatten().map(|m| to_u64(m).saturating_add(1)))
        .map_err(sql)
}

fn read_marks(conn: &Connection) -> Result<Vec<(Duration, u64, u64)>> {
    let mut stmt = conn
        .prepare_cached("SELECT at, seq, position FROM retention_marks ORDER BY at")
        .map_err(sql)?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                Duration::from_millis(to_u64(r.get(0)?)),
                to_u64(r.get(1)?),
                to_u64(r.get(2)?),
            ))
        })
        .map_err(sql)?;
    rows.collect::<rusqlite::Result<_>>().map_err(sql)
}

impl Sweep for SqliteSweep {
    /// The fence is checked against the `locks` table in every transaction of the sweep
    /// (its plan and each batch it deletes), so a sweeper whose lock was taken since stops
    /// at its next batch.
    async fn sweep(&self, fence: &LockLease) -> Result<Swept> {
        let plan = self.plan(fence).await?;
        let outbox_rows = self
            .drain(
                fence,
                "DELETE FROM outbox WHERE id IN
                 (SELECT id FROM outbox WHERE done = 1 ORDER BY id LIMIT ?1)",
                None,
            )
            .await?;
        let log_rows = self
            .drain(
                fence,
                "DELETE FROM changelog WHERE seq IN
                 (SELECT seq FROM changelog WHERE seq < ?1 ORDER BY seq LIMIT ?2)",
                Some(plan.horizon),
            )
            .await?;
        let tombstones = self
            .drain(
                fence,
                "DELETE FROM registry WHERE key IN
                 (SELECT key FROM registry WHERE deleted = 1 AND seq < ?1 LIMIT ?2)",
                Some(plan.horizon),
            )
            .await?;
        let events = self
            .drain(
                fence,
                "DELETE FROM events WHERE position IN
                 (SELECT position FROM events WHERE position < ?1 ORDER BY position LIMIT ?2)",
                Some(plan.first_event),
            )
            .await?;
        Ok(Swept {
            outbox_rows,
            events,
            log_rows,
            tombstones,
            jobs: 0,
            first_available: plan.horizon,
            first_event: plan.first_event,
        })
    }
}

impl SqliteDb {
    /// The file's [`Sweep`], with the retention limits it was opened with. Run it with
    /// [`tidemark::run_retention`] (a schedule, under the lock) rather than by hand.
    #[must_use]
    pub fn sweeper(&self) -> SqliteSweep {
        SqliteSweep::new(self.clone())
    }
}
