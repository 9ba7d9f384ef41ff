//! The outbox on SQLite: announcements written in each mutation's own transaction (by an
//! announcing [`SqliteSource`](crate::SqliteSource)), handed to relays as the runtime's
//! [`Outbox`] port. Rows are claimed in one `IMMEDIATE` transaction under a wall-clock
//! lease shared by every process on the file, so relays in several processes publish
//! each row once. The relay itself is the runtime's [`Relay`](tidemark::Relay).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rusqlite::params;
use tidemark::tidemark_core::{AnnouncePlan, AnnounceReport, Job, JobId};
use tidemark::{
    Announcer, Claimed, Error, Outbox, OutboxRow, OutboxUpdate, OutboxWatch, Publish, Queue, Relay,
    Result, Wake,
};
use tokio::sync::watch;

use crate::db::{SqliteDb, begin_write, ms, now_ms, to_i64, to_u64};
use crate::error::unavailable;

const PORT: &str = "outbox";

fn sql(e: rusqlite::Error) -> Error {
    unavailable(PORT, &e)
}

/// The outbox of one database file, as the runtime's [`Outbox`] port. Claims are leases in
/// wall-clock unix milliseconds (like the file's locks and job leases), so they hold
/// across processes.
#[derive(Clone, Debug)]
pub struct SqliteOutbox {
    db: SqliteDb,
}

/// Reads one outbox row. A job this version cannot read can never be enqueued: its leg is
/// dropped from the plan (logged), so the row can still finish.
fn read_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxRow> {
    let id = to_u64(r.get(0)?);
    let seq = to_u64(r.get(1)?);
    let key = match r.get_ref(2)? {
        rusqlite::types::ValueRef::Text(b) | rusqlite::types::ValueRef::Blob(b) => {
            String::from_utf8_lossy(b).into_owned()
        }
        _ => String::new(),
    };
    let job = r.get::<_, Option<Vec<u8>>>(6)?.and_then(|bytes| {
        Job::decode(&bytes)
            .inspect_err(|e| {
                tracing::warn!(key, seq, error = %e, "outbox job unreadable; its leg is skipped");
            })
            .ok()
    });
    Ok(OutboxRow {
        id,
        seq,
        plan: AnnouncePlan {
            key,
            payload: r.get(3)?,
            publish: r.get(4)?,
            notify: r.get(5)?,
            job,
            // The payload is what the legs carry either way; whether it stands in for a
            // value too large to carry matters only to the writer's report.
            as_marker: false,
        },
        landed: AnnounceReport {
            published: r.get(7)?,
            notified: r.get(8)?,
            enqueued: r.get::<_, Option<i64>>(9)?.map(|id| JobId(to_u64(id))),
            as_marker: false,
        },
    })
}

impl SqliteOutbox {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteOutbox { db }
    }

    /// The database this outbox lives in.
    #[must_use]
    pub fn db(&self) -> &SqliteDb {
        &self.db
    }
}

impl Outbox for SqliteOutbox {
    type Watch = SqliteOutboxWatch;

    async fn claim(&self, owner: &str, after: u64, max: usize, lease: Duration) -> Result<Claimed> {
        let owner = owner.to_owned();
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        // Not a `write`: an empty claim changes nothing, and a claim wakes no one here.
        self.db
            .call_write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                let now = now_ms();
                let until = now.saturating_add(ms(lease));
                let mut rows = {
                    let mut stmt = tx
                        .prepare_cached(
                            "UPDATE outbox SET claimed_by = ?1, claim_until = ?2
                             WHERE id IN (
                                SELECT id FROM outbox
                                WHERE done = 0 AND id > ?3
                                  AND (claimed_by IS NULL OR claimed_by = ?1 OR claim_until <= ?4)
                                ORDER BY id LIMIT ?5)
                             RETURNING id, seq, key, payload, publish, notify, job, published,
                                       notified, job_id",
                        )
                        .map_err(sql)?;
                    let rows = stmt
                        .query_map(params![owner, until, to_i64(after), now, max], read_row)
                        .map_err(sql)?;
                    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(sql)?
                };
                rows.sort_by_key(|row| row.id);
                // Only the claim that ends a pass needs it: a full batch skips the scan.
                let held_until: Option<i64> = if (rows.len() as u64) < to_u64(max) {
                    tx.prepare_cached(
                        "SELECT min(claim_until) FROM outbox
                         WHERE done = 0 AND claimed_by IS NOT NULL AND claimed_by <> ?1
                           AND claim_until > ?2",
                    )
                    .and_then(|mut s| s.query_row(params![owner, now], |r| r.get(0)))
                    .map_err(sql)?
                } else {
                    None
                };
                tx.commit().map_err(sql)?;
                Ok(Claimed {
                    rows,
                    held_by_others: held_until
                        .map(|until| Duration::from_millis(to_u64(until.saturating_sub(now)))),
                })
            })
            .await
    }

    async fn complete(&self, owner: &str, updates: Vec<OutboxUpdate>) -> Result<u64> {
        if updates.is_empty() {
            return Ok(0);
        }
        let owner = owner.to_owned();
        self.db
            .write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                let mut recorded = 0;
                {
                    // Legs only ever land: a stale report cannot unset one.
                    let mut stmt = tx
                        .prepare_cached(
                            "UPDATE outbox SET published = published OR ?2,
                             notified = notified OR ?3, job_id = COALESCE(job_id, ?4),
                             done = done OR ?5, claimed_by = NULL, claim_until = NULL
                             WHERE id = ?1 AND claimed_by = ?6",
                        )
                        .map_err(sql)?;
                    for u in &updates {
                        recorded += stmt
                            .execute(params![
                                to_i64(u.id),
                                u.landed.published,
                                u.landed.notified,
                                u.landed.enqueued.map(|id| to_i64(id.0)),
                                u.done,
                                owner
                            ])
                            .map_err(sql)? as u64;
                    }
                }
                tx.commit().map_err(sql)?;
                Ok(recorded)
            })
            .await
    }

    async fn pending(&self) -> Result<u64> {
        self.db
            .call(PORT, |conn| {
                conn.query_row("SELECT count(*) FROM outbox WHERE done = 0", [], |r| {
                    r.get::<_, i64>(0)
                })
                .map(to_u64)
                .map_err(sql)
            })
            .await
    }

    fn watch(&self) -> SqliteOutboxWatch {
        SqliteOutboxWatch {
            commits: self.db.commits(),
        }
    }
}

/// Resolves after a commit to the file by any process (the commit watcher's signal).
#[derive(Debug)]
pub struct SqliteOutboxWatch {
    commits: watch::Receiver<u64>,
}

impl OutboxWatch for SqliteOutboxWatch {
    async fn changed(&mut self) {
        if self.commits.changed().await.is_err() {
            // The database is gone: nothing will change again.
            std::future::pending::<()>().await;
        }
    }
}

/// An owner name no other relay on this machine uses: process id, start time and a
/// counter, so relays in several processes on one file never share claims.
fn fresh_owner() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "relay-{}-{}-{}",
        std::process::id(),
        now_ms(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl SqliteDb {
    /// This file's outbox, as the runtime's [`Outbox`] port.
    #[must_use]
    pub fn outbox(&self) -> SqliteOutbox {
        SqliteOutbox::new(self.clone())
    }

    /// A [`Relay`] of this file's outbox into `events`, `channel` on `wake` and `queue`,
    /// under an owner name of its own (so relays in several processes share the outbox,
    /// each row published once). [`drain`](Relay::drain) it once, or
    /// [`spawn`](Relay::spawn) it to relay every commit until stopped.
    pub fn relay<P: Publish, W: Wake, Q: Queue>(
        &self,
        events: P,
        wake: W,
        queue: Q,
        channel: impl Into<String>,
    ) -> Relay<SqliteOutbox, P, W, Q> {
        Relay::new(
            self.outbox(),
            Announcer::new(events, wake, queue, channel),
            fresh_owner(),
        )
    }
}
