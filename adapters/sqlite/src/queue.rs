//! The job queue on SQLite: leases with a visibility timeout, retries after a delay, and a
//! dead letter that keeps the last error. Times are unix milliseconds, the clock every
//! process on the machine shares.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use tidemark::tidemark_core::{Job, JobId};
use tidemark::{
    Error, JobCounts, JobRecord, JobRetention, JobState, Leased, Queue, ReadySignal, Result,
    TickKey,
};

use crate::db::{SqliteDb, begin_write, ms, now_ms, to_i64, to_u64};
use crate::error::unavailable;

const READY: i64 = 0;
const LEASED: i64 = 1;
const DONE: i64 = 2;
const DEAD: i64 = 3;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("queue", &e)
}

fn state_of(code: i64) -> JobState {
    match code {
        LEASED => JobState::Leased,
        DONE => JobState::Done,
        DEAD => JobState::DeadLettered,
        _ => JobState::Ready,
    }
}

/// A durable job queue in the database file, shared by every process that opens it.
///
/// A leased job whose visibility timeout passes is delivered again (its last error reads
/// "lease expired"); after [`Options::max_attempts`](crate::Options::max_attempts) leases
/// it is dead-lettered instead. A receipt is the job's lease count (the `leases` column,
/// which a requeue does not reset as it does attempts), so it names one lease for ever:
/// renewing, acking, failing or dead-lettering with any other lease's receipt, one from
/// before a requeue included, is [`Error::LeaseLost`]. Those writes match the attempt as
/// well: a process still running a build from before the count (schema version 7) leases
/// by bumping attempts alone, and a receipt of this build must not name its lease. And
/// they hold only until the lease's end (`lease_until`, by this machine's clock): a lease
/// that ran out acks, fails and dead-letters nothing, though nobody has taken its job yet.
///
/// A requeued dead letter keeps its coalesce key: it has not run since, so it absorbs later
/// enqueues for its key, unless the key has another pending job, which keeps absorbing.
///
/// A `pack_housekeeping` job still ready and never leased absorbs later enqueues for its
/// key (a unique partial index on `dedupe` decides, across processes), and sweeps are
/// leased before other ready jobs (`priority`). [`Queue::ready_signal`] fires on every
/// commit to the file.
///
/// For a done or dead-lettered job, `lease_until` holds when it finished: retention
/// ([`Queue::remove_finished`]) measures ages from it.
#[derive(Clone, Debug)]
pub struct SqliteQueue {
    db: SqliteDb,
}

/// Enqueues `job` on `conn` (inside the caller's transaction, if any). A job with a
/// coalesce key that a ready, never-leased job already has is that job: its id comes back
/// and nothing is written (the unique index on pending keys decides, across processes).
pub(crate) fn enqueue_on(conn: &Connection, job: &Job) -> Result<JobId> {
    let bytes = job
        .encode()
        .map_err(|e| Error::unavailable("queue", format!("job could not be encoded: {e}")))?;
    let dedupe = job.coalesce_key();
    let pending = |conn: &Connection, key: &str| {
        conn.prepare_cached("SELECT id FROM jobs WHERE dedupe = ?1 AND state = 0 AND attempts = 0")
            .and_then(|mut s| s.query_row([key], |r| r.get::<_, i64>(0)).optional())
            .map_err(sql)
    };
    if let Some(key) = &dedupe
        && let Some(id) = pending(conn, key)?
    {
        return Ok(JobId(to_u64(id)));
    }
    let inserted = conn
        .prepare_cached(
            "INSERT INTO jobs (job, dedupe, priority) VALUES (?1, ?2, ?3)
             ON CONFLICT DO NOTHING RETURNING id",
        )
        .and_then(|mut s| {
            s.query_row(params![bytes, dedupe, job.is_priority()], |r| {
                r.get::<_, i64>(0)
            })
            .optional()
        })
        .map_err(sql)?;
    match (inserted, &dedupe) {
        (Some(id), _) => Ok(JobId(to_u64(id))),
        // Another process enqueued the same key between the look and the insert.
        (None, Some(key)) => pending(conn, key)?
            .map(|id| JobId(to_u64(id)))
            .ok_or_else(|| Error::unavailable("queue", "coalesced job vanished; retry")),
        (None, None) => Err(Error::unavailable("queue", "job insert ignored; retry")),
    }
}

/// Enqueues the job of a schedule's tick on `conn` (inside the caller's transaction) once
/// per [`TickKey`]: `None` if this tick, or a later one of the schedule, was enqueued
/// already. Each schedule's newest enqueued tick is kept in `tidemark_meta`
/// (`tick:<name>` and `tick_anchor:<name>`, the anchor in unix ms), beside the job it
/// enqueued in the same transaction, and never removed by retention.
pub(crate) fn enqueue_tick_on(
    conn: &Connection,
    tick: &TickKey,
    job: &Job,
) -> Result<Option<JobId>> {
    let (tick_name, anchor_name) = (
        format!("tick:{}", tick.schedule),
        format!("tick_anchor:{}", tick.schedule),
    );
    let read = |name: &str| {
        conn.prepare_cached("SELECT value FROM tidemark_meta WHERE name = ?1")
            .and_then(|mut s| s.query_row([name], |r| r.get::<_, i64>(0)).optional())
            .map_err(sql)
    };
    let enqueued = match (read(&anchor_name)?, read(&tick_name)?) {
        (Some(anchor), Some(last)) => Some((Duration::from_millis(to_u64(anchor)), to_u64(last))),
        _ => None,
    };
    if !tick.is_due_after(enqueued) {
        return Ok(None);
    }
    let id = enqueue_on(conn, job)?;
    let anchor = i64::try_from(tick.anchor.as_millis()).unwrap_or(i64::MAX);
    for (name, value) in [(anchor_name, anchor), (tick_name, to_i64(tick.tick))] {
        conn.prepare_cached(
            "INSERT INTO tidemark_meta (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        )
        .and_then(|mut s| s.execute(params![name, value]))
        .map_err(sql)?;
    }
    Ok(Some(id))
}

impl SqliteQueue {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteQueue { db }
    }

    /// A write to a job this lease still holds (`?1` id, `?2` receipt, `?3` now, `?4` attempt,
    /// then the statement's own parameters); [`Error::LeaseLost`] if it holds it no longer.
    async fn on_held(
        &self,
        lease: &Leased,
        statement: &'static str,
        extra: Vec<rusqlite::types::Value>,
    ) -> Result<()> {
        let (id, receipt, attempt) = (lease.id, lease.receipt, lease.attempt);
        self.db
            .write("queue", move |conn| {
                let mut values: Vec<rusqlite::types::Value> = vec![
                    to_i64(id.0).into(),
                    to_i64(receipt).into(),
                    now_ms().into(),
                    i64::from(attempt).into(),
                ];
                values.extend(extra);
                // A receipt's statement is this build's: checked against the file's schema
                // under the write lock.
                let tx = begin_write(conn, sql)?;
                let n = tx
                    .prepare_cached(statement)
                    .and_then(|mut s| s.execute(rusqlite::params_from_iter(values)))
                    .map_err(sql)?;
                if n == 0 {
                    return Err(lease_lost(id, receipt, attempt));
                }
                tx.commit().map_err(sql)
            })
            .await
    }
}

/// The error for a lease that is not the job's current one.
fn lease_lost(id: JobId, receipt: u64, attempt: u32) -> Error {
    Error::LeaseLost(format!("{id} attempt {attempt} (receipt {receipt})"))
}

/// A record from a row; bytes that are no job read as [`Job::undecodable`].
fn record_of(
    id: i64,
    bytes: &[u8],
    state: i64,
    attempts: i64,
    last_error: Option<String>,
) -> JobRecord {
    JobRecord {
        id: JobId(to_u64(id)),
        job: Job::decode(bytes).unwrap_or_else(|_| Job::undecodable(bytes)),
        state: state_of(state),
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        last_error,
    }
}

impl Queue for SqliteQueue {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        self.db
            .write("queue", move |conn| enqueue_on(conn, &job))
            .await
    }

    async fn enqueue_tick(&self, tick: &TickKey, job: Job) -> Result<Option<JobId>> {
        let tick = tick.clone();
        // Not a `write`: a tick already enqueued changes nothing, and must not wake the
        // runners that wait on commits.
        let id = self
            .db
            .call_write("queue", move |conn| {
                let tx = begin_write(conn, sql)?;
                let id = enqueue_tick_on(&tx, &tick, &job)?;
                tx.commit().map_err(sql)?;
                Ok(id)
            })
            .await?;
        if id.is_some() {
            self.db.committed();
        }
        Ok(id)
    }

    /// One transaction for the whole batch: all enqueued, or all failed with its error.
    async fn enqueue_batch(&self, jobs: Vec<Job>) -> Vec<Result<JobId>> {
        let n = jobs.len();
        if n == 0 {
            return Vec::new();
        }
        let done = self
            .db
            .write("queue", move |conn| {
                let tx = begin_write(conn, sql)?;
                let ids = jobs
                    .iter()
                    .map(|job| enqueue_on(&tx, job))
                    .collect::<Result<Vec<_>>>()?;
                tx.commit().map_err(sql)?;
                Ok(ids)
            })
            .await;
        match done {
            Ok(ids) => ids.into_iter().map(Ok).collect(),
            Err(e) => e.for_each_of(n),
        }
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        self.db
            .call("queue", move |conn| {
                let row = conn
                    .prepare_cached(
                        "SELECT job, state, attempts, last_error FROM jobs WHERE id = ?1",
                    )
                    .and_then(|mut s| {
                        s.query_row([to_i64(id.0)], |r| {
                            Ok((
                                r.get::<_, Vec<u8>>(0)?,
                                r.get::<_, i64>(1)?,
                                r.get::<_, i64>(2)?,
                                r.get::<_, Option<String>>(3)?,
                            ))
                        })
                        .optional()
                    })
                    .map_err(sql)?;
                Ok(row.map(|(bytes, state, attempts, last_error)| {
                    record_of(to_i64(id.0), &bytes, state, attempts, last_error)
                }))
            })
            .await
    }

    fn ready_signal(&self) -> Option<ReadySignal> {
        Some(ReadySignal::new(self.db.commits()))
    }

    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        let max_attempts = i64::from(self.db.options().max_attempts);
        // Not a `write`: an empty lease changes nothing, and must not wake the runners
        // that wait on commits (the one asking among them).
        let (leased, changed) = self
            .db
            .call_write("queue", move |conn| {
                let tx = begin_write(conn, sql)?;
                let now = now_ms();
                let next = |query: &str| {
                    tx.prepare_cached(query)
                        .and_then(|mut s| {
                            s.query_row([now], |r| {
                                Ok((
                                    r.get::<_, i64>(0)?,
                                    r.get::<_, Vec<u8>>(1)?,
                                    r.get::<_, i64>(2)?,
                                    r.get::<_, i64>(3)?,
                                ))
                            })
                            .optional()
                        })
                        .map_err(sql)
                };
                let mut changed = false;
                let leased = loop {
                    // Priority jobs (sweeps) first, then the oldest ready or expired job.
                    let row = match next(
                        "SELECT id, job, state, attempts FROM jobs
                         WHERE state = 0 AND priority = 1 AND not_before <= ?1
                         ORDER BY id LIMIT 1",
                    )? {
                        Some(row) => Some(row),
                        None => next(
                            "SELECT id, job, state, attempts FROM jobs
                             WHERE (state = 0 AND not_before <= ?1)
                                OR (state = 1 AND lease_until <= ?1)
                             ORDER BY id LIMIT 1",
                        )?,
                    };
                    let Some((id, bytes, state, attempts)) = row else {
                        break None;
                    };
                    let expired = state == LEASED;
                    let job = match Job::decode(&bytes) {
                        Ok(job) if attempts < max_attempts => job,
                        decoded => {
                            // Attempts used up, or a job no one can run: dead letter.
                            let error = match decoded {
                                Err(e) => Some(format!("unreadable job: {e}")),
                                Ok(_) if expired => Some("lease expired".to_owned()),
                                Ok(_) => None,
                            };
                            tx.execute(
                                "UPDATE jobs SET state = ?2, last_error = COALESCE(?3, last_error),
                                 lease_until = ?4 WHERE id = ?1",
                                params![id, DEAD, error, now],
                            )
                            .map_err(sql)?;
                            changed = true;
                            continue;
                        }
                    };
                    let attempt = attempts + 1;
                    let receipt: i64 = tx
                        .query_row(
                            "UPDATE jobs SET state = ?2, attempts = ?3, lease_until = ?4,
                             leases = leases + 1,
                             last_error = CASE WHEN ?5 THEN 'lease expired' ELSE last_error END
                             WHERE id = ?1 RETURNING leases",
                            params![
                                id,
                                LEASED,
                                attempt,
                                now.saturating_add(ms(visibility)),
                                expired
                            ],
                            |r| r.get(0),
                        )
                        .map_err(sql)?;
                    changed = true;
                    break Some(Leased {
                        id: JobId(to_u64(id)),
                        job,
                        attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
                        receipt: to_u64(receipt),
                    });
                };
                tx.commit().map_err(sql)?;
                Ok((leased, changed))
            })
            .await?;
        if changed {
            self.db.committed();
        }
        Ok(leased)
    }

    async fn ack(&self, lease: &Leased) -> Result<()> {
        self.on_held(
            lease,
            "UPDATE jobs SET state = 2, lease_until = ?3
             WHERE id = ?1 AND state = 1 AND leases = ?2 AND attempts = ?4
                AND lease_until > ?3",
            Vec::new(),
        )
        .await
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        let (id, receipt, attempt) = (lease.id, lease.receipt, lease.attempt);
        let error = error.to_owned();
        let max_attempts = self.db.options().max_attempts;
        self.db
            .write("queue", move |conn| {
                let now = now_ms();
                let state = if attempt >= max_attempts { DEAD } else { READY };
                let tx = begin_write(conn, sql)?;
                let n = tx
                    .prepare_cached(
                        "UPDATE jobs SET state = ?2, last_error = ?4, not_before = ?5,
                         lease_until = CASE WHEN ?2 = 3 THEN ?6 ELSE lease_until END
                         WHERE id = ?1 AND state = 1 AND leases = ?3 AND attempts = ?7
                            AND lease_until > ?6",
                    )
                    .and_then(|mut s| {
                        s.execute(params![
                            to_i64(id.0),
                            state,
                            to_i64(receipt),
                            error,
                            now.saturating_add(ms(retry_after)),
                            now,
                            attempt
                        ])
                    })
                    .map_err(sql)?;
                if n == 0 {
                    return Err(lease_lost(id, receipt, attempt));
                }
                tx.commit().map_err(sql)?;
                Ok(state_of(state))
            })
            .await
    }

    async fn renew(&self, lease: &Leased, visibility: Duration) -> Result<()> {
        self.on_held(
            lease,
            "UPDATE jobs SET lease_until = ?3 + ?5
             WHERE id = ?1 AND state = 1 AND leases = ?2 AND attempts = ?4
                AND lease_until > ?3",
            vec![ms(visibility).into()],
        )
        .await
    }

    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        self.on_held(
            lease,
            "UPDATE jobs SET state = 3, last_error = ?5, lease_until = ?3
             WHERE id = ?1 AND state = 1 AND leases = ?2 AND attempts = ?4
                AND lease_until > ?3",
            vec![error.to_owned().into()],
        )
        .await
    }

    async fn dead_letters(&self, after: Option<JobId>, limit: usize) -> Result<Vec<JobRecord>> {
        let after = after.map_or(0, |id| to_i64(id.0));
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.db
            .call("queue", move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT id, job, state, attempts, last_error FROM jobs
                         WHERE state = 3 AND id > ?1 ORDER BY id LIMIT ?2",
                    )
                    .map_err(sql)?;
                let rows = stmt
                    .query_map(params![after, limit], |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            r.get::<_, Vec<u8>>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, Option<String>>(4)?,
                        ))
                    })
                    .map_err(sql)?;
                let mut out = Vec::new();
                for row in rows {
                    let (id, bytes, state, attempts, last_error) = row.map_err(sql)?;
                    out.push(record_of(id, &bytes, state, attempts, last_error));
                }
                Ok(out)
            })
            .await
    }

    async fn requeue(&self, id: JobId) -> Result<JobId> {
        self.db
            .write("queue", move |conn| {
                let n = conn
                    .prepare_cached(
                        "UPDATE jobs SET state = 0, attempts = 0, not_before = 0, lease_until = 0,
                         dedupe = CASE WHEN EXISTS (SELECT 1 FROM jobs AS other
                             WHERE other.dedupe = jobs.dedupe AND other.state = 0
                               AND other.attempts = 0) THEN NULL ELSE dedupe END
                         WHERE id = ?1 AND state = 3",
                    )
                    .and_then(|mut s| s.execute([to_i64(id.0)]))
                    .map_err(sql)?;
                if n == 0 {
                    return Err(Error::NotFound(format!("dead letter {id}")));
                }
                Ok(id)
            })
            .await
    }

    async fn counts(&self) -> Result<JobCounts> {
        self.db
            .call("queue", |conn| {
                let mut out = JobCounts::default();
                let mut stmt = conn
                    .prepare_cached("SELECT state, count(*) FROM jobs GROUP BY state")
                    .map_err(sql)?;
                let rows = stmt
                    .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))
                    .map_err(sql)?;
                for row in rows {
                    let (state, n) = row.map_err(sql)?;
                    *match state {
                        READY => &mut out.ready,
                        LEASED => &mut out.leased,
                        DONE => &mut out.done,
                        DEAD => &mut out.dead,
                        _ => continue,
                    } += to_u64(n);
                }
                Ok(out)
            })
            .await
    }

    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        let done = ms(retention.done);
        let dead = retention.dead.map(ms);
        self.db
            .write("queue", move |conn| {
                let now = now_ms();
                let n = conn
                    .prepare_cached(
                        "DELETE FROM jobs WHERE (state = 2 AND lease_until <= ?1)
                            OR (state = 3 AND ?2 IS NOT NULL AND lease_until <= ?2)",
                    )
                    .and_then(|mut s| {
                        s.execute(params![
                            now.saturating_sub(done),
                            dead.map(|d| now.saturating_sub(d))
                        ])
                    })
                    .map_err(sql)?;
                Ok(n as u64)
            })
            .await
    }
}
