//! The outbox relay: announcements written in each mutation's own transaction (by an
//! announcing [`SqliteSource`](crate::SqliteSource)) are drained into the events stream,
//! the wake channel and the job queue, at least once, and marked done. A crash between a
//! commit and its announcement loses nothing: the row waits for the next relay.

use std::future::Future;
use std::time::Duration;

use rusqlite::params;
use tidemark::tidemark_core::Job;
use tidemark::{Error, Publish, Queue, Result, Wake};

use crate::db::{SqliteDb, to_i64, to_u64};
use crate::error::unavailable;

const BATCH: i64 = 256;
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(5);

fn sql(e: rusqlite::Error) -> Error {
    unavailable("outbox", &e)
}

/// What one [`Relay::drain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayReport {
    /// Outbox rows completed (every planned leg done) and marked done.
    pub done: u64,
    /// Events published to the stream.
    pub published: u64,
    /// Wakes notified.
    pub notified: u64,
    /// Jobs enqueued.
    pub enqueued: u64,
    /// Leg failures; their rows stay pending and are retried.
    pub failures: u64,
}

struct Row {
    id: i64,
    key: String,
    payload: Vec<u8>,
    publish: bool,
    notify: bool,
    job: Option<Vec<u8>>,
    published: bool,
    notified: bool,
    job_id: Option<i64>,
}

/// Drains the outbox of one database file into the three announcement legs.
///
/// Each leg of a row is done at most once per success: a row records which legs
/// succeeded, so a retry redoes only the failed ones. A crash after a leg succeeded but
/// before its row was marked repeats that leg: delivery is at least once, and readers are
/// idempotent per seq. A failing publish stops the pass, so the stream keeps seq order;
/// the other legs fail soft, row by row.
#[derive(Debug)]
pub struct Relay<P, W, Q> {
    db: SqliteDb,
    events: P,
    wake: W,
    queue: Q,
    channel: String,
}

impl<P: Publish, W: Wake, Q: Queue> Relay<P, W, Q> {
    /// A relay of `db`'s outbox publishing to `events`, notifying `channel` on `wake` and
    /// enqueueing on `queue`.
    pub fn new(db: SqliteDb, events: P, wake: W, queue: Q, channel: impl Into<String>) -> Self {
        Relay {
            db,
            events,
            wake,
            queue,
            channel: channel.into(),
        }
    }

    /// Outbox rows not yet done.
    pub async fn pending(&self) -> Result<u64> {
        self.db
            .call("outbox", |conn| {
                conn.query_row("SELECT count(*) FROM outbox WHERE done = 0", [], |r| {
                    r.get::<_, i64>(0)
                })
                .map(to_u64)
                .map_err(sql)
            })
            .await
    }

    /// Relays every pending row once, in outbox order; rows whose legs fail stay pending.
    pub async fn drain(&self) -> Result<RelayReport> {
        let mut report = RelayReport::default();
        let mut after = 0i64;
        loop {
            let rows = self
                .db
                .call("outbox", move |conn| {
                    let mut stmt = conn
                        .prepare_cached(
                            "SELECT id, key, payload, publish, notify, job, published, notified,
                             job_id FROM outbox WHERE done = 0 AND id > ?1 ORDER BY id LIMIT ?2",
                        )
                        .map_err(sql)?;
                    let rows = stmt
                        .query_map(params![after, BATCH], |r| {
                            Ok(Row {
                                id: r.get(0)?,
                                key: r.get(1)?,
                                payload: r.get(2)?,
                                publish: r.get(3)?,
                                notify: r.get(4)?,
                                job: r.get(5)?,
                                published: r.get(6)?,
                                notified: r.get(7)?,
                                job_id: r.get(8)?,
                            })
                        })
                        .map_err(sql)?;
                    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(sql)
                })
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.id;
            let full = rows.len() as i64 == BATCH;
            let (updates, stop) = self.relay_rows(rows, &mut report).await;
            self.db
                .write("outbox", move |conn| {
                    let tx = conn.transaction().map_err(sql)?;
                    for u in &updates {
                        tx.prepare_cached(
                            "UPDATE outbox SET published = ?2, notified = ?3, job_id = ?4,
                             done = ?5 WHERE id = ?1",
                        )
                        .and_then(|mut s| {
                            s.execute(params![u.id, u.published, u.notified, u.job_id, u.done])
                        })
                        .map_err(sql)?;
                    }
                    tx.commit().map_err(sql)
                })
                .await?;
            if stop || !full {
                break;
            }
        }
        Ok(report)
    }

    async fn relay_rows(&self, rows: Vec<Row>, report: &mut RelayReport) -> (Vec<Update>, bool) {
        let mut updates = Vec::with_capacity(rows.len());
        for mut row in rows {
            if row.publish && !row.published {
                match self.events.publish(&row.key, row.payload.clone()).await {
                    Ok(_) => {
                        row.published = true;
                        report.published += 1;
                    }
                    Err(e) => {
                        report.failures += 1;
                        tracing::warn!(key = row.key, error = %e, "outbox publish failed; will retry");
                        return (updates, true);
                    }
                }
            }
            if row.notify && !row.notified {
                match self.wake.notify(&self.channel, row.payload.clone()).await {
                    Ok(()) => {
                        row.notified = true;
                        report.notified += 1;
                    }
                    Err(e) => {
                        report.failures += 1;
                        tracing::warn!(key = row.key, error = %e, "outbox notify failed; will retry");
                    }
                }
            }
            if let (Some(bytes), None) = (&row.job, row.job_id) {
                match Job::decode(bytes) {
                    Ok(job) => match self.queue.enqueue(job).await {
                        Ok(id) => {
                            row.job_id = Some(to_i64(id.0));
                            report.enqueued += 1;
                        }
                        Err(e) => {
                            report.failures += 1;
                            tracing::warn!(key = row.key, error = %e, "outbox enqueue failed; will retry");
                        }
                    },
                    Err(e) => {
                        // A job this version cannot read can never be enqueued: drop the leg.
                        tracing::warn!(key = row.key, error = %e, "outbox job unreadable; skipped");
                        row.job_id = Some(0);
                    }
                }
            }
            let done = (!row.publish || row.published)
                && (!row.notify || row.notified)
                && (row.job.is_none() || row.job_id.is_some());
            if done {
                report.done += 1;
            }
            updates.push(Update {
                id: row.id,
                published: row.published,
                notified: row.notified,
                job_id: row.job_id,
                done,
            });
        }
        (updates, false)
    }

    /// Drains on every commit to the file (by any process) until `stop` resolves; after a
    /// failed leg it retries with a capped exponential delay.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<()> {
        let mut commits = self.db.commits();
        let mut delay = RETRY_MIN;
        tokio::pin!(stop);
        loop {
            commits.borrow_and_update();
            let report = match self.drain().await {
                Ok(r) => r,
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %e, "outbox relay failed; will retry");
                    RelayReport {
                        failures: 1,
                        ..RelayReport::default()
                    }
                }
                Err(e) => return Err(e),
            };
            if report.failures == 0 {
                delay = RETRY_MIN;
                tokio::select! {
                    () = &mut stop => return Ok(()),
                    changed = commits.changed() => if changed.is_err() { return Ok(()) },
                }
            } else {
                tokio::select! {
                    () = &mut stop => return Ok(()),
                    () = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}

struct Update {
    id: i64,
    published: bool,
    notified: bool,
    job_id: Option<i64>,
    done: bool,
}
