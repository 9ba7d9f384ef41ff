//! Wake channels across processes. A notify is a row in the `wakes` table, committed like
//! any write. Every commit to the file, by any process, is seen by the commit watcher
//! (`PRAGMA data_version` on its own connection); each listener then reads the `wakes`
//! rows of its channel and the source's watermark (one meta row), never the registry.
//! A payload wakes its channel's listeners in order; a source write that nobody announced
//! wakes every listener with an empty payload (the backstop).

use std::collections::VecDeque;

use rusqlite::params;
use tidemark::{Error, Received, Result, Wake, WakeListener};
use tokio::sync::watch;

use crate::db::{SqliteDb, begin_write};
use crate::error::unavailable;
use crate::source::meta;

/// Wake rows kept per file; older ones are pruned by each notify. A listener that falls
/// further behind still wakes, it just misses old payloads (wakes are not data).
const KEEP: i64 = 10_000;
const READ_BATCH: i64 = 1024;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("wake", &e)
}

/// Wake channels on one database file, across processes.
///
/// A listener wakes with each payload notified on its channel, in notify order, and with
/// an empty payload after any commit that moved the source's watermark without a payload
/// for its channel (the backstop: a writer that never announces, in any process, still
/// wakes every reader). Commits that change no source data (another channel's notify, a
/// cursor save, a job lease) wake no one. Several commits inside one watcher interval may
/// give one wake. Latency is about the watcher interval
/// ([`Options::watch_interval`](crate::Options::watch_interval)).
#[derive(Clone, Debug)]
pub struct SqliteWake {
    db: SqliteDb,
}

impl SqliteWake {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteWake { db }
    }
}

/// A listener on one channel of one database file.
#[derive(Debug)]
pub struct SqliteListener {
    db: SqliteDb,
    channel: String,
    seen: watch::Receiver<u64>,
    last_id: i64,
    watermark: u64,
    pending: VecDeque<Vec<u8>>,
    more: bool,
}

impl WakeListener for SqliteListener {
    async fn recv(&mut self) -> Result<Received> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Ok(Received::Wake(p));
            }
            if !self.more && self.seen.changed().await.is_err() {
                return Ok(Received::Closed);
            }
            self.seen.borrow_and_update();
            let (channel, last) = (self.channel.clone(), self.last_id);
            let (rows, watermark) = self
                .db
                .call("wake", move |conn| {
                    let tx = conn.transaction().map_err(sql)?;
                    let rows = {
                        let mut stmt = tx
                            .prepare_cached(
                                "SELECT id, payload FROM wakes WHERE channel = ?1 AND id > ?2
                                 ORDER BY id LIMIT ?3",
                            )
                            .map_err(sql)?;
                        let rows = stmt
                            .query_map(params![channel, last, READ_BATCH], |r| {
                                Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?))
                            })
                            .map_err(sql)?;
                        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(sql)?
                    };
                    let watermark = meta(&tx, "watermark").map_err(sql)?;
                    tx.finish().map_err(sql)?;
                    Ok((rows, watermark))
                })
                .await?;
            let moved = watermark != self.watermark;
            self.watermark = watermark;
            self.more = rows.len() as i64 == READ_BATCH;
            if let Some((id, _)) = rows.last() {
                self.last_id = *id;
            } else if moved {
                // The source changed and nobody announced it on this channel: the
                // backstop wake.
                return Ok(Received::Wake(Vec::new()));
            }
            self.pending.extend(rows.into_iter().map(|(_, p)| p));
        }
    }
}

/// Writes one wake row on `conn` (inside the caller's transaction, if any), pruning old
/// rows now and then.
fn notify_on(conn: &rusqlite::Connection, channel: &str, payload: &[u8]) -> Result<()> {
    let id: i64 = conn
        .prepare_cached("INSERT INTO wakes (channel, payload) VALUES (?1, ?2) RETURNING id")
        .and_then(|mut s| s.query_row(params![channel, payload], |r| r.get(0)))
        .map_err(sql)?;
    if id % 256 == 0 {
        conn.prepare_cached("DELETE FROM wakes WHERE id <= ?1")
            .and_then(|mut s| s.execute([id - KEEP]))
            .map_err(sql)?;
    }
    Ok(())
}

impl Wake for SqliteWake {
    type Listener = SqliteListener;

    async fn notify(&self, channel: &str, payload: Vec<u8>) -> Result<()> {
        let channel = channel.to_owned();
        self.db
            .write("wake", move |conn| notify_on(conn, &channel, &payload))
            .await
    }

    /// One transaction for the whole batch: all notified, or all failed.
    async fn notify_batch(&self, channel: &str, payloads: Vec<Vec<u8>>) -> Vec<Result<()>> {
        let n = payloads.len();
        if n == 0 {
            return Vec::new();
        }
        let channel = channel.to_owned();
        let done = self
            .db
            .write("wake", move |conn| {
                let tx = begin_write(conn, sql)?;
                for payload in &payloads {
                    notify_on(&tx, &channel, payload)?;
                }
                tx.commit().map_err(sql)
            })
            .await;
        match done {
            Ok(()) => (0..n).map(|_| Ok(())).collect(),
            Err(e) => e.for_each_of(n),
        }
    }

    async fn listen(&self, channel: &str) -> Result<SqliteListener> {
        let mut seen = self.db.seen();
        seen.borrow_and_update();
        let (last_id, watermark) = self
            .db
            .call("wake", |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let last = tx
                    .query_row("SELECT COALESCE(MAX(id), 0) FROM wakes", [], |r| r.get(0))
                    .map_err(sql)?;
                let watermark = meta(&tx, "watermark").map_err(sql)?;
                tx.finish().map_err(sql)?;
                Ok((last, watermark))
            })
            .await?;
        Ok(SqliteListener {
            db: self.db.clone(),
            channel: channel.to_owned(),
            seen,
            last_id,
            watermark,
            pending: VecDeque::new(),
            more: false,
        })
    }
}
