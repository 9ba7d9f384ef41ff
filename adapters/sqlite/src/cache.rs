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
    batch: Batch,
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
            batch: Batch::default(),
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
        let mut batch = Batch::default();
        for op in ops {
            match op {
                CacheOp::Put { key, seq, value } => batch.push(key.into(), seq, Some(&value)),
                CacheOp::Remove { key, seq } => batch.push(key.into(), seq, None),
            }
        }
        self.write(batch, watermark, lineage).await
    }

    /// Writes `batch` and records `watermark` with `lineage`, in one transaction.
    async fn write(&self, mut batch: Batch, watermark: u64, lineage: Lineage) -> Result<()> {
        let name = self.name.clone();
        self.db
            .write("cache", move |conn| {
                batch.settle();
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
                    for row in &batch.rows {
                        let key: &str = &row.key;
                        if row.seq > watermark {
                            let removed = row.value.is_none();
                            mark.execute(params![name, key, to_i64(row.seq), removed])
                                .map_err(sql)?;
                            ahead_held = true;
                        } else if ahead_held {
                            unmark.execute(params![name, key]).map_err(sql)?;
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
                delta += write_rows(&tx, &name, &batch)?;
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

/// Writes a settled batch's rows for follower `name`; how many keys it added (negative:
/// removed). The name is bound once per statement and each row binds only its own
/// columns: SQLite copies every bound text, so a name bound per row was an allocation
/// per row.
fn write_rows(tx: &rusqlite::Transaction<'_>, name: &str, batch: &Batch) -> Result<i64> {
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
    for stmt in [&mut insert, &mut update, &mut del] {
        stmt.raw_bind_parameter(1, name).map_err(sql)?;
    }
    let mut delta: i64 = 0;
    for row in &batch.rows {
        let key: &str = &row.key;
        match batch.value(row) {
            Some(value) => {
                let seq = to_i64(row.seq);
                let put = |stmt: &mut rusqlite::CachedStatement<'_>| {
                    stmt.raw_bind_parameter(2, key)?;
                    stmt.raw_bind_parameter(3, seq)?;
                    stmt.raw_bind_parameter(4, value)?;
                    stmt.raw_execute()
                };
                if put(&mut insert).map_err(sql)? == 1 {
                    delta += 1;
                } else {
                    put(&mut update).map_err(sql)?;
                }
            }
            None => {
                del.raw_bind_parameter(2, key).map_err(sql)?;
                let gone = del.raw_execute().map_err(sql)?;
                delta -= i64::try_from(gone).unwrap_or(0);
            }
        }
    }
    Ok(delta)
}

/// One change a batch holds until its commit: the key as the follower shares it, and
/// where the value's bytes are in the batch's buffer (`None`: a removal).
#[derive(Debug)]
struct Row {
    key: Arc<str>,
    seq: u64,
    value: Option<std::ops::Range<usize>>,
}

/// What a sink buffers until its commit. It keeps the follower's keys (a clone is a count)
/// and copies every value into one buffer, so a row allocates nothing of its own: a copy
/// of each key and value, and a map to coalesce them, were about a third of a cold
/// start's CPU, most of it malloc and free.
#[derive(Debug)]
struct Batch {
    rows: Vec<Row>,
    bytes: Vec<u8>,
    /// Whether each key is above the one before (an initial sync read in key order): then
    /// the keys are distinct and in the table's order, and the batch is settled as it is.
    ascending: bool,
}

impl Default for Batch {
    fn default() -> Self {
        Batch {
            rows: Vec::new(),
            bytes: Vec::new(),
            ascending: true,
        }
    }
}

impl Batch {
    fn push(&mut self, key: Arc<str>, seq: u64, value: Option<&[u8]>) {
        self.ascending &= self.rows.last().is_none_or(|last| *last.key < *key);
        let value = value.map(|v| {
            let start = self.bytes.len();
            self.bytes.extend_from_slice(v);
            start..self.bytes.len()
        });
        self.rows.push(Row { key, seq, value });
    }

    /// Leaves one row per key, its last, in key order: what the batch leaves behind, in
    /// the order the table keeps (inserts in key order append to its pages rather than
    /// land across them).
    fn settle(&mut self) {
        if self.ascending {
            return;
        }
        // Stable: a key's rows stay in the order they came.
        self.rows.sort_by(|a, b| a.key.cmp(&b.key));
        // `dedup_by` keeps the first of a run of one key: the later row takes its place.
        self.rows.dedup_by(|later, kept| {
            let same = later.key == kept.key;
            if same {
                std::mem::swap(later, kept);
            }
            same
        });
        self.ascending = true;
    }

    /// The bytes `row` puts (`None`: it removes its key).
    fn value(&self, row: &Row) -> Option<&[u8]> {
        row.value.clone().map(|range| &self.bytes[range])
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
        self.batch.push(key, seq, Some(value.as_ref()));
        Ok(())
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        self.batch.push(key, seq, None);
        Ok(())
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        let batch = std::mem::take(&mut self.batch);
        self.write(batch, watermark, lineage).await
    }

    async fn rollback(&mut self) {
        self.batch = Batch::default();
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
