//! A follower's cache and watermark persisted in the database file: a [`Sink`] that
//! commits each applied batch with its watermark in one transaction, so any follower —
//! over a SQLite registry, a NATS bucket, anything — restarts warm from it.

use std::sync::Arc;

use rusqlite::{OptionalExtension, params};
use tidemark::{Ahead, CacheOp, Error, Held, Lineage, Result, Sink};

use crate::db::{SqliteDb, begin_write, bits, stored, to_i64, to_u64};
use crate::error::unavailable;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("cache", &e)
}

/// A named follower's cache (key → seq, value) and watermark, kept in the database file,
/// and the [`Sink`] that writes it.
///
/// As a sink it buffers a batch and, at the batch boundary, writes it and the watermark it
/// reaches in one transaction, so after a crash the cache and its watermark always agree;
/// on start it tells the follower its watermark and key count, and the seqs of only the
/// keys the delta names, so a warm restart costs the delta, not the cache's size. Run it
/// under any follower:
///
/// ```no_run
/// # async fn f(db: tidemark_sqlite::SqliteDb) -> Result<(), Box<dyn std::error::Error>> {
/// use tidemark::{FollowerConfig, FollowerTask, RawBytes};
/// let source = db.source();
/// let task = FollowerTask::new(
///     FollowerConfig::new("mirror")?,
///     RawBytes,
///     source.clone(),
///     source,
///     db.follower_cache("mirror"),
/// );
/// let follower = task.spawn();
/// # Ok(()) }
/// ```
///
/// Reads ([`get`](Self::get), [`entries`](Self::entries), …) see what was committed.
/// Clones share the store; each has its own uncommitted batch. One name is one follower:
/// do not run two followers of the same cache at once.
#[derive(Debug)]
pub struct PersistedCache {
    db: SqliteDb,
    name: String,
    batch: Vec<CacheOp>,
}

impl Clone for PersistedCache {
    fn clone(&self) -> Self {
        PersistedCache::new(self.db.clone(), self.name.clone())
    }
}

impl PersistedCache {
    pub(crate) fn new(db: SqliteDb, name: String) -> Self {
        PersistedCache {
            db,
            name,
            batch: Vec::new(),
        }
    }

    /// The follower's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The persisted watermark (0 for a follower never persisted).
    pub async fn watermark(&self) -> Result<u64> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                conn.query_row(
                    "SELECT watermark FROM follower_state WHERE name = ?1",
                    [name],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .map(|w| w.map_or(0, to_u64))
                .map_err(sql)
            })
            .await
    }

    /// `key`'s cached value and seq.
    pub async fn get(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>> {
        let (name, key) = (self.name.clone(), key.to_owned());
        self.db
            .call("cache", move |conn| {
                conn.prepare_cached(
                    "SELECT seq, value FROM follower_cache WHERE name = ?1 AND key = ?2",
                )
                .and_then(|mut s| {
                    s.query_row(params![name, key], |r| {
                        Ok((to_u64(r.get(0)?), r.get::<_, Vec<u8>>(1)?))
                    })
                    .optional()
                })
                .map_err(sql)
            })
            .await
    }

    /// Keys cached.
    pub async fn len(&self) -> Result<u64> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                conn.query_row(
                    "SELECT count(*) FROM follower_cache WHERE name = ?1",
                    [name],
                    |r| r.get::<_, i64>(0),
                )
                .map(to_u64)
                .map_err(sql)
            })
            .await
    }

    /// Whether nothing is cached.
    pub async fn is_empty(&self) -> Result<bool> {
        Ok(self.len().await? == 0)
    }

    /// Every cached entry, in key order.
    pub async fn entries(&self) -> Result<Vec<(String, u64, Vec<u8>)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT key, seq, value FROM follower_cache WHERE name = ?1 ORDER BY key",
                    )
                    .map_err(sql)?;
                let rows = stmt
                    .query_map([name], |r| Ok((r.get(0)?, to_u64(r.get(1)?), r.get(2)?)))
                    .map_err(sql)?;
                rows.collect::<rusqlite::Result<_>>().map_err(sql)
            })
            .await
    }

    /// The seq of each of `keys` that is cached.
    pub async fn seqs_of(&self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                // One read transaction for every lookup (each statement on its own would
                // take and release the WAL read lock: ~100 µs a key), in key order.
                let mut keys = keys;
                keys.sort_unstable();
                let tx = conn.transaction().map_err(sql)?;
                let mut out = Vec::new();
                {
                    let mut stmt = tx
                        .prepare_cached(
                            "SELECT seq FROM follower_cache WHERE name = ?1 AND key = ?2",
                        )
                        .map_err(sql)?;
                    for key in keys {
                        let seq = stmt
                            .query_row(params![name, key], |r| r.get::<_, i64>(0))
                            .optional()
                            .map_err(sql)?;
                        if let Some(seq) = seq {
                            out.push((key, to_u64(seq)));
                        }
                    }
                }
                tx.finish().map_err(sql)?;
                Ok(out)
            })
            .await
    }

    /// The seq of every cached key.
    pub async fn all_seqs(&self) -> Result<Vec<(String, u64)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let mut stmt = conn
                    .prepare_cached("SELECT key, seq FROM follower_cache WHERE name = ?1")
                    .map_err(sql)?;
                let rows = stmt
                    .query_map([name], |r| Ok((r.get(0)?, to_u64(r.get(1)?))))
                    .map_err(sql)?;
                rows.collect::<rusqlite::Result<_>>().map_err(sql)
            })
            .await
    }

    /// What is persisted: the watermark and how many keys, or `None` for a follower never
    /// persisted. Read once every write this process has in flight on the file has
    /// landed, through any handle: a follower aborted mid-commit (`stop_within` past its
    /// budget) leaves its commit running on the blocking pool, and a warm start that read
    /// before it would resume from a watermark and rows the commit then moves on.
    pub async fn held(&self) -> Result<Option<Held>> {
        self.db.settled().await;
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let state = conn
                    .query_row(
                        "SELECT watermark, keys, history, stamp FROM follower_state WHERE name = ?1",
                        [&name],
                        |r| {
                            Ok((
                                r.get::<_, i64>(0)?,
                                r.get::<_, Option<i64>>(1)?,
                                Lineage::new(
                                    r.get::<_, Option<i64>>(2)?.map(bits),
                                    r.get::<_, Option<i64>>(3)?.map(bits),
                                ),
                            ))
                        },
                    )
                    .optional()
                    .map_err(sql)?;
                let Some((watermark, keys, lineage)) = state else {
                    return Ok(None);
                };
                let ahead = ahead_of(conn, &name)?;
                let keys = match keys {
                    Some(keys) => keys,
                    // A file from before the count was kept: count once.
                    None => conn
                        .query_row(
                            "SELECT count(*) FROM follower_cache WHERE name = ?1",
                            [&name],
                            |r| r.get(0),
                        )
                        .map_err(sql)?,
                };
                let keys = usize::try_from(keys).unwrap_or(0);
                Ok(Some(
                    Held::new(to_u64(watermark), keys)
                        .with_ahead(ahead)
                        .with_lineage(lineage),
                ))
            })
            .await
    }

    /// Records that the follower started, warm from `resumed` (its persisted watermark)
    /// or cold (`None`): what [`SqliteDb::report`] shows an operator.
    async fn record_start(&self, resumed: Option<u64>) -> Result<()> {
        let name = self.name.clone();
        let warm = i64::from(resumed.is_some());
        self.db
            .write("cache", move |conn| {
                conn.execute(
                    "INSERT INTO follower_starts (name, starts, warm_starts, last_warm, resumed_watermark)
                     VALUES (?1, 1, ?2, ?2, ?3)
                     ON CONFLICT (name) DO UPDATE SET starts = starts + 1,
                     warm_starts = warm_starts + excluded.warm_starts,
                     last_warm = excluded.last_warm, resumed_watermark = excluded.resumed_watermark",
                    params![name, warm, resumed.map(to_i64)],
                )
                .map(drop)
                .map_err(sql)
            })
            .await
    }

    /// Applies `ops` and records `watermark` with the `lineage` the follower knew there,
    /// in one transaction. The follower decides what is newer: the watermark is set as
    /// given (a resync after the source was restored from an older backup lowers it) and
    /// each op lands as it is.
    pub async fn apply(&self, ops: Vec<CacheOp>, watermark: u64, lineage: Lineage) -> Result<()> {
        let name = self.name.clone();
        self.db
            .write("cache", move |conn| {
                let tx = begin_write(conn, sql)?;
                // How many keys the batch adds (negative: removes), for the kept count.
                let mut delta: i64 = 0;
                // The watermark and key count before this batch.
                let state: Option<(i64, Option<i64>)> = tx
                    .query_row(
                        "SELECT watermark, keys FROM follower_state WHERE name = ?1",
                        [&name],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .optional()
                    .map_err(sql)?;
                let before = state.map(|(w, _)| w);
                // What is held ahead of the watermark: kept beside the rows, so a batch
                // whose every change is at or below it (a sync, a replayed feed) touches
                // that table only when it holds something.
                let mut ahead_held: bool = tx
                    .query_row(
                        "SELECT EXISTS (SELECT 1 FROM follower_ahead WHERE name = ?1)",
                        [&name],
                        |r| r.get(0),
                    )
                    .map_err(sql)?;
                if ahead_held && before.is_some_and(|b| to_i64(watermark) < b) {
                    // A watermark that goes back is a new history (a restored source): what
                    // was held ahead of the old one is the old one's.
                    tx.execute("DELETE FROM follower_ahead WHERE name = ?1", [&name])
                        .map_err(sql)?;
                    ahead_held = false;
                }
                {
                    let mut mark = tx
                        .prepare_cached(
                            "INSERT INTO follower_ahead (name, key, seq, removed) VALUES (?1, ?2, ?3, ?4)
                             ON CONFLICT (name, key) DO UPDATE SET seq = excluded.seq,
                             removed = excluded.removed",
                        )
                        .map_err(sql)?;
                    let mut unmark = tx
                        .prepare_cached("DELETE FROM follower_ahead WHERE name = ?1 AND key = ?2")
                        .map_err(sql)?;
                    for op in &ops {
                        let removed = matches!(op, CacheOp::Remove { .. });
                        if op.seq() > watermark {
                            mark.execute(params![name, op.key(), to_i64(op.seq()), removed])
                                .map_err(sql)?;
                            ahead_held = true;
                        } else if ahead_held {
                            unmark.execute(params![name, op.key()]).map_err(sql)?;
                        }
                    }
                }
                if ahead_held {
                    tx.execute(
                        "DELETE FROM follower_ahead WHERE name = ?1 AND seq <= ?2",
                        params![name, to_i64(watermark)],
                    )
                    .map_err(sql)?;
                }
                {
                    let mut insert = tx
                        .prepare_cached(
                            "INSERT INTO follower_cache (name, key, seq, value) VALUES (?1, ?2, ?3, ?4)
                             ON CONFLICT (name, key) DO NOTHING",
                        )
                        .map_err(sql)?;
                    let mut update = tx
                        .prepare_cached(
                            "UPDATE follower_cache SET seq = ?3, value = ?4 WHERE name = ?1 AND key = ?2",
                        )
                        .map_err(sql)?;
                    let mut del = tx
                        .prepare_cached("DELETE FROM follower_cache WHERE name = ?1 AND key = ?2")
                        .map_err(sql)?;
                    for op in &ops {
                        match op {
                            CacheOp::Put { key, seq, value } => {
                                let args = params![name, key, to_i64(*seq), value];
                                if insert.execute(args).map_err(sql)? == 1 {
                                    delta += 1;
                                } else {
                                    update.execute(args).map_err(sql)?;
                                }
                            }
                            CacheOp::Remove { key, .. } => {
                                let gone = del.execute(params![name, key]).map_err(sql)?;
                                delta -= i64::try_from(gone).unwrap_or(0);
                            }
                        }
                    }
                }
                // The count before this batch: kept with the watermark, or (a follower new
                // to this file, or one from before the count was kept) counted once.
                let keys = match state.map(|(_, keys)| keys) {
                    Some(Some(keys)) => keys + delta,
                    Some(None) => tx
                        .query_row(
                            "SELECT count(*) FROM follower_cache WHERE name = ?1",
                            [&name],
                            |r| r.get(0),
                        )
                        .map_err(sql)?,
                    None => delta,
                };
                tx.execute(
                    "INSERT INTO follower_state (name, watermark, keys, history, stamp)
                     VALUES (?1, ?2, ?3, ?4, ?5)
                     ON CONFLICT (name) DO UPDATE SET watermark = excluded.watermark,
                     keys = excluded.keys, history = excluded.history, stamp = excluded.stamp",
                    params![
                        name,
                        to_i64(watermark),
                        keys,
                        lineage.history.map(stored),
                        lineage.stamp.map(stored)
                    ],
                )
                .map_err(sql)?;
                tx.commit().map_err(sql)
            })
            .await
    }
}

/// What follower `name` committed ahead of its watermark and still holds, in key order:
/// a put with the bytes its row holds, a removal with its seq.
fn ahead_of(conn: &rusqlite::Connection, name: &str) -> Result<Vec<Ahead>> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT a.key, a.seq, a.removed, c.value FROM follower_ahead a
             LEFT JOIN follower_cache c ON c.name = a.name AND c.key = a.key AND c.seq = a.seq
             WHERE a.name = ?1 ORDER BY a.key",
        )
        .map_err(sql)?;
    let rows = stmt
        .query_map([name], |r| {
            let (key, seq): (String, u64) = (r.get(0)?, to_u64(r.get(1)?));
            Ok(if r.get::<_, bool>(2)? {
                Some(Ahead::Removed { key, seq })
            } else {
                // A put whose row is gone or moved on is no longer held ahead.
                r.get::<_, Option<Vec<u8>>>(3)?
                    .map(|value| Ahead::Put { key, seq, value })
            })
        })
        .map_err(sql)?;
    let mut ahead = Vec::new();
    for row in rows {
        ahead.extend(row.map_err(sql)?);
    }
    Ok(ahead)
}

impl<V: AsRef<[u8]> + Send> Sink<V> for PersistedCache {
    async fn put(&mut self, key: Arc<str>, seq: u64, value: V) -> Result<()> {
        self.batch.push(CacheOp::Put {
            key: key.to_string(),
            seq,
            value: value.as_ref().to_vec(),
        });
        Ok(())
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        self.batch.push(CacheOp::Remove {
            key: key.to_string(),
            seq,
        });
        Ok(())
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        let ops = CacheOp::coalesce(std::mem::take(&mut self.batch));
        self.apply(ops, watermark, lineage).await
    }

    async fn rollback(&mut self) {
        self.batch.clear();
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        let held = self.held().await?;
        self.record_start(held.as_ref().map(|h| h.watermark))
            .await?;
        Ok(held)
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        PersistedCache::seqs_of(self, keys).await
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        PersistedCache::all_seqs(self).await
    }
}
