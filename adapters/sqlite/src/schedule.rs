//! Durable schedules: the compare-and-set of each schedule's last fired tick, and a tick
//! that fires its job in the same transaction, so a due tick enqueues exactly one job
//! however many processes run the scheduler.

use std::time::Duration;

use rusqlite::params;
use tidemark::tidemark_core::{Job, JobId, Schedule, ScheduleClock};
use tidemark::{DueSchedule, Error, Result, ScheduleStore, TickKey};

use crate::db::{SqliteDb, begin_write, now_ms, to_i64, to_u64};
use crate::error::unavailable;
use crate::queue::enqueue_tick_on;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("schedule", &e)
}

/// Durable named schedules (intervals and cron expressions) in the database file. The
/// store's clock is the machine's unix time, shared by every process on the file.
#[derive(Clone, Debug)]
pub struct SqliteSchedules {
    db: SqliteDb,
}

impl SqliteSchedules {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteSchedules { db }
    }

    /// Fires every due schedule's latest tick once: the compare-and-set of its last fired
    /// tick and the enqueue of its job commit together, so racing schedulers in any number
    /// of processes enqueue each tick's job exactly once. Returns the jobs this call
    /// enqueued, by schedule name.
    pub async fn fire_due(&self) -> Result<Vec<(String, JobId)>> {
        // Reading the schedules inside the write transaction matters: read before it, a
        // schedule replaced meanwhile by another process (last fired reset) would still
        // pass the compare-and-set and fire the old job with the old anchor's tick.
        self.db
            .write("schedule", |conn| {
                let tx = begin_write(conn, sql)?;
                let mut fired = Vec::new();
                for due in read_due(&tx)? {
                    let name = due.schedule.name();
                    let key = |tick| TickKey {
                        schedule: name.to_owned(),
                        anchor: due.clock.anchor,
                        tick,
                    };
                    // A tick a runner over the port claimed and did not settle.
                    if let Some(tick) = due.pending {
                        if let Some(id) = enqueue_tick_on(&tx, &key(tick), due.schedule.job())? {
                            fired.push((name.to_owned(), id));
                        }
                        settle(&tx, name, tick)?;
                    }
                    let Some(tick) = due.schedule.tick_to_fire(due.last_fired, due.clock) else {
                        continue;
                    };
                    if cas(&tx, &due, tick, false)? {
                        // Under the tick's key, as a scheduler over the port enqueues.
                        if let Some(id) = enqueue_tick_on(&tx, &key(tick), due.schedule.job())? {
                            fired.push((name.to_owned(), id));
                        }
                    }
                }
                tx.commit().map_err(sql)?;
                Ok(fired)
            })
            .await
    }
}

/// Records `tick` as the last fired tick of the schedule `read` names, only if its row is
/// still the one read: its last fired tick, its anchor (a replacement restarts it) and its
/// interval, cron expression and job.
fn cas(conn: &rusqlite::Connection, read: &DueSchedule, tick: u64, for_job: bool) -> Result<bool> {
    let job = read
        .schedule
        .job()
        .encode()
        .map_err(|e| Error::unavailable("schedule", e.to_string()))?;
    let n = conn
        .execute(
            "UPDATE schedules SET last_fired = ?3 WHERE name = ?1 AND last_fired IS ?2
             AND anchor = ?4 AND interval_ns = ?5 AND cron IS ?6 AND job = ?7",
            params![
                read.schedule.name(),
                read.last_fired.map(to_i64),
                to_i64(tick),
                i64::try_from(read.clock.anchor.as_millis()).unwrap_or(i64::MAX),
                interval_ns(&read.schedule),
                read.schedule.cron_expr(),
                job
            ],
        )
        .map_err(sql)?;
    if n == 1 && for_job {
        // Pending (its job still to be enqueued) until settled; a claim by a runner that
        // does the work itself leaves an older pending tick as it is.
        conn.execute(
            "INSERT INTO tidemark_meta (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            params![pending_name(read.schedule.name()), to_i64(tick)],
        )
        .map_err(sql)?;
    }
    Ok(n == 1)
}

/// The `tidemark_meta` row holding a schedule's pending tick (claimed for a job not yet
/// known to be enqueued): no schema change, and absent for every schedule stored before.
fn pending_name(schedule: &str) -> String {
    format!("pending_tick:{schedule}")
}

/// Clears the schedule's pending tick if it is still `tick`.
fn settle(conn: &rusqlite::Connection, schedule: &str, tick: u64) -> Result<()> {
    conn.execute(
        "DELETE FROM tidemark_meta WHERE name = ?1 AND value = ?2",
        params![pending_name(schedule), to_i64(tick)],
    )
    .map_err(sql)?;
    Ok(())
}

/// A schedule's interval as stored (0 for a cron schedule).
fn interval_ns(schedule: &Schedule) -> i64 {
    schedule
        .interval()
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl SqliteSchedules {
    /// The compare-and-set of a tick, and its pending row, in one transaction.
    async fn claim(&self, read: &DueSchedule, tick: u64, for_job: bool) -> Result<bool> {
        let read = read.clone();
        self.db
            .write("schedule", move |conn| {
                let tx = begin_write(conn, sql)?;
                let won = cas(&tx, &read, tick, for_job)?;
                tx.commit().map_err(sql)?;
                Ok(won)
            })
            .await
    }
}

impl ScheduleStore for SqliteSchedules {
    async fn put_schedule(&self, schedule: Schedule) -> Result<()> {
        let job = schedule
            .job()
            .encode()
            .map_err(|e| Error::unavailable("schedule", e.to_string()))?;
        self.db
            .write("schedule", move |conn| {
                conn.execute(
                    "INSERT INTO schedules (name, interval_ns, cron, job, anchor, last_fired)
                     VALUES (?1, ?2, ?3, ?4, ?5, NULL)
                     ON CONFLICT (name) DO UPDATE SET interval_ns = excluded.interval_ns,
                     cron = excluded.cron, job = excluded.job, anchor = excluded.anchor,
                     last_fired = NULL",
                    params![
                        schedule.name(),
                        interval_ns(&schedule),
                        schedule.cron_expr(),
                        job,
                        now_ms()
                    ],
                )
                .map_err(sql)?;
                conn.execute(
                    "DELETE FROM tidemark_meta WHERE name = ?1",
                    [pending_name(schedule.name())],
                )
                .map_err(sql)?;
                Ok(())
            })
            .await
    }

    async fn remove_schedule(&self, name: &str) -> Result<bool> {
        let name = name.to_owned();
        self.db
            .write("schedule", move |conn| {
                conn.execute(
                    "DELETE FROM tidemark_meta WHERE name = ?1",
                    [pending_name(&name)],
                )
                .map_err(sql)?;
                conn.execute("DELETE FROM schedules WHERE name = ?1", [name])
                    .map(|n| n > 0)
                    .map_err(sql)
            })
            .await
    }

    async fn schedules(&self) -> Result<Vec<DueSchedule>> {
        self.db.call("schedule", |conn| read_due(conn)).await
    }

    async fn mark_fired(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.claim(read, tick, false).await
    }

    async fn claim_for_job(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.claim(read, tick, true).await
    }

    async fn job_enqueued(&self, name: &str, tick: u64) -> Result<()> {
        let name = name.to_owned();
        self.db
            .write("schedule", move |conn| settle(conn, &name, tick))
            .await
    }
}

/// Every schedule with its last fired tick and the time since its anchor, now. Schedules
/// that cannot be read are logged and skipped.
fn read_due(conn: &rusqlite::Connection) -> Result<Vec<DueSchedule>> {
    let now = now_ms();
    let mut stmt = conn
        .prepare_cached(
            "SELECT s.name, s.interval_ns, s.job, s.anchor, s.last_fired, s.cron, m.value
             FROM schedules AS s LEFT JOIN tidemark_meta AS m
               ON m.name = 'pending_tick:' || s.name
             ORDER BY s.name",
        )
        .map_err(sql)?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Vec<u8>>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, Option<i64>>(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, Option<i64>>(6)?,
            ))
        })
        .map_err(sql)?;
    let mut out = Vec::new();
    for row in rows {
        let (name, interval, job, anchor, last_fired, cron, pending) = row.map_err(sql)?;
        let parsed = Job::decode(&job)
            .map_err(|e| e.to_string())
            .and_then(|job| {
                match &cron {
                    Some(expr) => Schedule::cron(name.clone(), expr, job),
                    None => {
                        Schedule::new(name.clone(), Duration::from_nanos(to_u64(interval)), job)
                    }
                }
                .map_err(|e| e.to_string())
            });
        match parsed {
            Ok(schedule) => out.push(DueSchedule {
                schedule,
                last_fired: last_fired.map(to_u64),
                pending: pending.map(to_u64),
                clock: ScheduleClock {
                    anchor: Duration::from_millis(to_u64(anchor)),
                    now: Duration::from_millis(to_u64(now)),
                },
            }),
            Err(reason) => {
                tracing::warn!(schedule = name, reason, "skipping an unreadable schedule");
            }
        }
    }
    Ok(out)
}
