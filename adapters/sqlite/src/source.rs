//! The source of truth on SQLite: a registry with tombstones, a watermark, a gapless change
//! log that is itself a [`Feed`], compaction with a recorded horizon, and (optionally) an
//! outbox row written in each mutation's own transaction.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::task::{Poll, ready};

use futures::StreamExt as _;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Transaction, params};
use tidemark::tidemark_core::{AnnouncePlan, Entry, Event, FeedInfo, KeyPrefix, Legs, Lineage};
use tidemark::{
    Changes, Error, Feed, FeedItem, FeedStream, Opened, Result, Snapshot, SnapshotParts, Source,
    Versioned, check_key_within, check_value,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::db::{SqliteDb, begin_write, bits, to_i64, to_u64};
use crate::error::unavailable;

pub use tidemark::tidemark_core::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
/// Change-log rows a feed reads per query.
const READ_BATCH: i64 = 1024;

/// One mutation of a batch written in one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    /// Put a value under a key.
    Put(String, Vec<u8>),
    /// Remove a key (a no-op, using no seq, if it is absent).
    Remove(String),
}

/// What a compaction removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compaction {
    /// Tombstones dropped from the registry.
    pub tombstones: u64,
    /// Change-log rows dropped.
    pub log_rows: u64,
    /// The first seq changes can be served from afterwards.
    pub first_available: u64,
}

/// The registry: a [`Source`], and its change log as a [`Continuity::Gapless`](tidemark::tidemark_core::Continuity::Gapless) [`Feed`].
///
/// Each mutation, its seq, its change-log row and (for an announcing source) its outbox
/// row commit in one transaction. Removals keep a tombstone row carrying their seq, so
/// [`Source::changes_since`] covers them by walking the seq index: its cost is what
/// changed, not the registry's size.
#[derive(Clone, Debug)]
pub struct SqliteSource {
    db: SqliteDb,
    announce: Option<Legs>,
    prefix: Option<KeyPrefix>,
}

fn check_write(w: &Write, prefix: Option<&KeyPrefix>) -> Result<()> {
    match w {
        Write::Put(k, v) => {
            check_key_within(k, prefix)?;
            check_value(v)
        }
        Write::Remove(k) => check_key_within(k, prefix),
    }
}

impl Write {
    /// A put of `value` as JSON (see [`tidemark::to_json`] for what cannot be written).
    ///
    /// # Errors
    /// [`Error::Encode`] if `value` does not serialize, [`Error::ValueTooLarge`] if its JSON
    /// is too large.
    pub fn put_json<T: serde::Serialize + ?Sized>(
        key: impl Into<String>,
        value: &T,
    ) -> Result<Write> {
        let key = key.into();
        let bytes = tidemark::to_json(&key, value)?;
        Ok(Write::Put(key, bytes))
    }
}

/// Whether `key` is under `prefix` (every key is, without one).
fn within(prefix: Option<&KeyPrefix>, key: &str) -> bool {
    prefix.is_none_or(|p| p.matches(key))
}

/// The lowest key under `prefix`, where a walk of the registry in key order starts.
fn lowest(prefix: Option<&KeyPrefix>) -> &str {
    prefix.map_or("", KeyPrefix::as_str)
}

const PORT: &str = "source";

fn sql(e: rusqlite::Error) -> Error {
    unavailable(PORT, &e)
}

pub(crate) fn meta(conn: &Connection, name: &str) -> rusqlite::Result<u64> {
    conn.prepare_cached("SELECT value FROM tidemark_meta WHERE name = ?1")?
        .query_row([name], |r| r.get::<_, i64>(0))
        .map(to_u64)
}

/// The registry's history, with the stamp of its mutation at `seq` (see
/// [`Source::lineage_at`]): the change log's row, or, once compacted, the registry row still
/// current at that seq. `None` where neither holds it, or it was written before stamps were
/// kept.
pub(crate) fn lineage_at(conn: &Connection, seq: u64) -> rusqlite::Result<Lineage> {
    let history = conn
        .prepare_cached("SELECT value FROM tidemark_meta WHERE name = 'history'")?
        .query_row([], |r| r.get::<_, i64>(0))
        .optional()?;
    let stamp = if seq == 0 {
        None
    } else {
        let seq = to_i64(seq);
        let logged = conn
            .prepare_cached("SELECT stamp FROM changelog WHERE seq = ?1")?
            .query_row([seq], |r| r.get::<_, Option<i64>>(0))
            .optional()?
            .flatten();
        let floor = || -> rusqlite::Result<Option<i64>> {
            let at = conn
                .prepare_cached("SELECT value FROM tidemark_meta WHERE name = 'floor_seq'")?
                .query_row([], |r| r.get::<_, i64>(0))
                .optional()?;
            if at != Some(seq) {
                return Ok(None);
            }
            conn.prepare_cached("SELECT value FROM tidemark_meta WHERE name = 'floor_stamp'")?
                .query_row([], |r| r.get::<_, i64>(0))
                .optional()
        };
        match logged {
            Some(stamp) => Some(stamp),
            None => match floor()? {
                Some(stamp) => Some(stamp),
                None => conn
                    .prepare_cached("SELECT stamp FROM registry WHERE seq = ?1")?
                    .query_row([seq], |r| r.get::<_, Option<i64>>(0))
                    .optional()?
                    .flatten(),
            },
        }
    };
    Ok(Lineage::new(history.map(bits), stamp.map(bits)))
}

fn is_live(tx: &Transaction<'_>, key: &str) -> rusqlite::Result<bool> {
    Ok(tx
        .prepare_cached("SELECT deleted FROM registry WHERE key = ?1")?
        .query_row([key], |r| r.get::<_, bool>(0))
        .optional()?
        .is_some_and(|deleted| !deleted))
}

/// Applies one mutation inside `tx`: next seq, registry row (or tombstone), change-log row
/// and, when `announce` says so, the outbox row.
fn mutate(
    tx: &Transaction<'_>,
    key: &str,
    value: Option<&[u8]>,
    announce: Option<Legs>,
) -> rusqlite::Result<u64> {
    let seq: i64 = tx
        .prepare_cached(
            "UPDATE tidemark_meta SET value = value + 1 WHERE name = 'watermark' RETURNING value",
        )?
        .query_row([], |r| r.get(0))?;
    let deleted = value.is_none();
    // A stamp no mutation at this seq had before, in any copy of this file: random.
    let stamp: i64 = tx
        .prepare_cached(
            "INSERT INTO changelog (seq, key, deleted, value, stamp)
             VALUES (?1, ?2, ?3, ?4, random()) RETURNING stamp",
        )?
        .query_row(params![seq, key, deleted, value], |r| r.get(0))?;
    tx.prepare_cached(
        "INSERT INTO registry (key, value, seq, deleted, stamp) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value, seq = excluded.seq,
         deleted = excluded.deleted, stamp = excluded.stamp",
    )?
    .execute(params![key, value, seq, deleted, stamp])?;
    let seq = to_u64(seq);
    if let Some(legs) = announce {
        let event = Event::of_write(seq, key, value);
        // An event that cannot be serialised yields an empty announcement: no row. (A
        // committed write's event always can: its seq is positive and its key checked.)
        match AnnouncePlan::new(&event, legs) {
            Err(e) => tracing::warn!(key, seq, error = %e, "not announced"),
            Ok(plan) => {
                let job = plan.job.as_ref().and_then(|j| j.encode().ok());
                tx.prepare_cached(
                    "INSERT INTO outbox (seq, key, payload, publish, notify, job)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )?
                .execute(params![
                    to_i64(seq),
                    key,
                    plan.payload,
                    plan.publish,
                    plan.notify,
                    job
                ])?;
            }
        }
    }
    Ok(seq)
}

/// A row's value as bytes: a blob, or text (stored by a foreign writer), as they are; no
/// value (`NULL`) as none. A number is no value a reader can carry.
fn value_bytes(value: ValueRef<'_>) -> std::result::Result<Vec<u8>, String> {
    match value {
        ValueRef::Blob(b) | ValueRef::Text(b) => Ok(b.to_vec()),
        ValueRef::Null => Ok(Vec::new()),
        other => Err(format!("value is not bytes: {:?}", other.data_type())),
    }
}

fn read_entry(
    key: ValueRef<'_>,
    value: ValueRef<'_>,
    seq: i64,
    deleted: bool,
) -> std::result::Result<Entry, (u64, String)> {
    let seq = to_u64(seq);
    let key = match key {
        ValueRef::Text(b) | ValueRef::Blob(b) => {
            String::from_utf8(b.to_vec()).map_err(|e| (seq, format!("key is not UTF-8: {e}")))?
        }
        other => return Err((seq, format!("key is not text: {:?}", other.data_type()))),
    };
    Ok(if deleted {
        Entry::delete(seq, key)
    } else {
        Entry::put(seq, key, value_bytes(value).map_err(|e| (seq, e))?)
    })
}

/// Hands each live entry of the registry under `prefix` to `each`, in key order, until it
/// breaks; run on a connection already in a read transaction. A row whose key does not
/// come after the last one handed out (a key stored as a blob by a foreign writer, which
/// SQLite sorts after every text key) is skipped like a row no reader can carry: a reader
/// of parts relies on the order.
fn walk_live(
    conn: &Connection,
    prefix: Option<&KeyPrefix>,
    mut each: impl FnMut(Entry) -> ControlFlow<()>,
) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare_cached(
        "SELECT key, value, seq FROM registry WHERE deleted = 0 AND key >= ?1 ORDER BY key",
    )?;
    let mut rows = stmt.query([lowest(prefix)])?;
    let mut last: Option<std::sync::Arc<str>> = None;
    while let Some(row) = rows.next()? {
        match read_entry(row.get_ref(0)?, row.get_ref(1)?, row.get(2)?, false) {
            Ok(e) if last.as_ref().is_some_and(|l| *l >= e.key) => {
                tracing::warn!(seq = e.seq, key = %e.key, "skipping a registry row out of key order");
            }
            Ok(e) if within(prefix, &e.key) => {
                last = Some(e.key.clone());
                if each(e).is_break() {
                    break;
                }
            }
            // Past the prefix's keys, which come first in key order.
            Ok(_) => break,
            Err((seq, reason)) => tracing::warn!(seq, reason, "skipping a registry row"),
        }
    }
    Ok(())
}

/// What the thread reading a snapshot part by part sends its reader.
enum Read {
    /// The next part.
    Part(Vec<Entry>),
    /// Every part was sent.
    End,
    /// The read failed; nothing follows.
    Failed(Error),
}

/// Entries a part is given room for up front: a caller asking for huge parts (to read
/// the whole snapshot in one) must not make the reader reserve that much.
const PART_ROOM: usize = 4096;

/// The sending end of a snapshot read part by part. It takes room in the channel (of one
/// message) before the next part is read, so a part waits there only while the reader
/// holds the one before it: two parts at most, never a backlog.
struct PartSender<'a> {
    sender: &'a mpsc::Sender<Read>,
    room: Option<mpsc::Permit<'a, Read>>,
}

impl PartSender<'_> {
    /// Waits for room for the next message; `false` once the reader is gone.
    fn reserve(&mut self) -> bool {
        if self.room.is_none() {
            self.room = futures::executor::block_on(self.sender.reserve()).ok();
        }
        self.room.is_some()
    }

    /// Sends `read` once there is room; `false` once the reader is gone.
    fn send(&mut self, read: Read) -> bool {
        self.reserve();
        self.room.take().is_some_and(|room| {
            room.send(read);
            true
        })
    }
}

/// Reads the snapshot [`Source::snapshot_parts`] serves, on the blocking thread it runs
/// on: sends the watermark through `began` once the read transaction holds it, then the
/// parts through `sender`.
fn read_parts(
    db: &SqliteDb,
    prefix: Option<&KeyPrefix>,
    part_len: usize,
    began: oneshot::Sender<Result<(u64, Lineage)>>,
    sender: &mpsc::Sender<Read>,
) {
    let mut conn = match db.reader() {
        Ok(conn) => conn,
        Err(e) => {
            let _ = began.send(Err(e.into()));
            return;
        }
    };
    let opened = conn
        .pragma_query_value(None, "journal_mode", |r| r.get::<_, String>(0))
        .map(|mode| mode.eq_ignore_ascii_case("wal"));
    let (held, tx) = match opened.and_then(|held| Ok((held, conn.transaction()?))) {
        Ok(opened) => opened,
        Err(e) => {
            let _ = began.send(Err(sql(e)));
            return;
        }
    };
    // The read transaction takes its point in time at this first read.
    let watermark = meta(&tx, "watermark")
        .and_then(|w| Ok((w, lineage_at(&tx, w)?)))
        .map_err(sql);
    let failed = watermark.is_err();
    if began.send(watermark).is_err() || failed {
        return;
    }
    let mut out = PartSender { sender, room: None };
    let new_part = || Vec::with_capacity(part_len.min(PART_ROOM));
    let (mut whole, mut part) = (Vec::new(), new_part());
    let walked = walk_live(&tx, prefix, |e| {
        if !held {
            whole.push(e);
            return ControlFlow::Continue(());
        }
        if sender.is_closed() {
            return ControlFlow::Break(());
        }
        part.push(e);
        if part.len() < part_len {
            return ControlFlow::Continue(());
        }
        let full = std::mem::replace(&mut part, new_part());
        if out.send(Read::Part(full)) && out.reserve() {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    });
    // What is left is in hand: the transaction ends before it is handed out.
    drop(tx);
    drop(conn);
    if let Err(e) = walked {
        out.send(Read::Failed(sql(e)));
        return;
    }
    let mut whole = whole.into_iter();
    let rest = std::iter::from_fn(|| {
        let next: Vec<Entry> = whole.by_ref().take(part_len).collect();
        (!next.is_empty()).then_some(next)
    });
    for next in rest.chain((!part.is_empty()).then_some(part)) {
        if !out.send(Read::Part(next)) {
            return;
        }
    }
    out.send(Read::End);
}

impl SqliteSource {
    pub(crate) fn new(db: SqliteDb, announce: Option<Legs>) -> Self {
        SqliteSource {
            db,
            announce,
            prefix: None,
        }
    }

    /// A view of the same registry over the keys that begin with `prefix` (byte for
    /// byte): its reads, listings, changes, snapshots and change-log feed carry only those
    /// keys, and a follower over it keeps only those ([`Source::key_prefix`]). Its feed is
    /// [`Continuity::Filtered`](tidemark::tidemark_core::Continuity::Filtered) (the other
    /// keys' seqs are skipped). Writes outside the prefix are refused, a batch as a whole.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a prefix no key could begin with (empty, too long,
    /// control characters).
    pub fn with_prefix(&self, prefix: &str) -> Result<SqliteSource> {
        Ok(SqliteSource {
            prefix: Some(tidemark::key_prefix(prefix)?),
            ..self.clone()
        })
    }

    /// The database this source lives in.
    #[must_use]
    pub fn db(&self) -> &SqliteDb {
        &self.db
    }

    /// Applies `writes` in one transaction (one fsync); returns each write's seq (`None`
    /// for a removal of an absent key). All or nothing: an invalid key refuses the batch.
    pub async fn write_batch(&self, writes: Vec<Write>) -> Result<Vec<Option<u64>>> {
        for w in &writes {
            check_write(w, self.prefix.as_ref())?;
        }
        let announce = self.announce;
        self.db
            .write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                let mut seqs = Vec::with_capacity(writes.len());
                for w in &writes {
                    seqs.push(match w {
                        Write::Put(k, v) => Some(mutate(&tx, k, Some(v), announce).map_err(sql)?),
                        Write::Remove(k) => {
                            if is_live(&tx, k).map_err(sql)? {
                                Some(mutate(&tx, k, None, announce).map_err(sql)?)
                            } else {
                                None
                            }
                        }
                    });
                }
                tx.commit().map_err(sql)?;
                Ok(seqs)
            })
            .await
    }

    /// Drops tombstones and change-log rows below `horizon` and records it: a reader whose
    /// watermark + 1 is below the horizon gets [`Changes::Compacted`] (and a feed opened
    /// there reports it as `first_available`) and resyncs from a snapshot.
    pub async fn compact_below(&self, horizon: u64) -> Result<Compaction> {
        self.db
            .write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                let watermark = meta(&tx, "watermark").map_err(sql)?;
                let first = meta(&tx, "first_available").map_err(sql)?;
                let horizon = horizon.min(watermark.saturating_add(1)).max(first);
                let h = to_i64(horizon);
                let tombstones = tx
                    .execute("DELETE FROM registry WHERE deleted = 1 AND seq < ?1", [h])
                    .map_err(sql)?;
                let log_rows = tx
                    .execute("DELETE FROM changelog WHERE seq < ?1", [h])
                    .map_err(sql)?;
                tx.execute(
                    "UPDATE tidemark_meta SET value = ?1 WHERE name = 'first_available'",
                    [h],
                )
                .map_err(sql)?;
                tx.commit().map_err(sql)?;
                Ok(Compaction {
                    tombstones: tombstones as u64,
                    log_rows: log_rows as u64,
                    first_available: horizon,
                })
            })
            .await
    }

    /// Entries changed after `since` and the watermark, or `None` when compacted; run on a
    /// connection already in a read transaction.
    pub(crate) fn changes_blocking(
        conn: &Connection,
        since: u64,
        prefix: Option<&KeyPrefix>,
    ) -> rusqlite::Result<Changes> {
        let first_available = meta(conn, "first_available")?;
        if since.saturating_add(1) < first_available {
            return Ok(Changes::Compacted { first_available });
        }
        let watermark = meta(conn, "watermark")?;
        let mut stmt = conn.prepare_cached(
            "SELECT key, value, seq, deleted, stamp FROM registry WHERE seq > ?1 ORDER BY seq",
        )?;
        let mut rows = stmt.query([to_i64(since)])?;
        let mut entries = Vec::new();
        while let Some(row) = rows.next()? {
            match read_entry(row.get_ref(0)?, row.get_ref(1)?, row.get(2)?, row.get(3)?) {
                Ok(e) if within(prefix, &e.key) => {
                    entries.push(e.stamped(row.get::<_, Option<i64>>(4)?.map(bits)));
                }
                Ok(_) => {}
                Err((seq, reason)) => {
                    tracing::warn!(seq, reason, "skipping a registry row no reader can carry");
                }
            }
        }
        Ok(Changes::Since { entries, watermark })
    }
}

impl Source for SqliteSource {
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        let seqs = self
            .write_batch(vec![Write::Put(key.to_owned(), value)])
            .await?;
        seqs.first()
            .copied()
            .flatten()
            .ok_or_else(|| Error::unavailable(PORT, "a put returned no seq"))
    }

    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        check_key_within(key, self.prefix.as_ref())?;
        check_value(&value)?;
        let key = key.to_owned();
        let announce = self.announce;
        self.db
            .write(PORT, move |conn| {
                let tx = begin_write(conn, sql)?;
                let current = tx
                    .query_row(
                        "SELECT seq FROM registry WHERE key = ?1 AND deleted = 0",
                        [&key],
                        |r| r.get::<_, i64>(0),
                    )
                    .optional()
                    .map_err(sql)?
                    .map(to_u64);
                if current.unwrap_or(0) != expected {
                    return Err(Error::Conflict {
                        key,
                        expected,
                        current,
                    });
                }
                let seq = mutate(&tx, &key, Some(&value), announce).map_err(sql)?;
                tx.commit().map_err(sql)?;
                Ok(seq)
            })
            .await
    }

    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        let seqs = self
            .write_batch(vec![Write::Remove(key.to_owned())])
            .await?;
        Ok(seqs.first().copied().flatten())
    }

    async fn watermark(&self) -> Result<u64> {
        self.db
            .call(PORT, |conn| meta(conn, "watermark").map_err(sql))
            .await
    }

    async fn changes_since(&self, since: u64) -> Result<Changes> {
        let prefix = self.prefix.clone();
        self.db
            .call(PORT, move |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let changes =
                    SqliteSource::changes_blocking(&tx, since, prefix.as_ref()).map_err(sql)?;
                tx.finish().map_err(sql)?;
                Ok(changes)
            })
            .await
    }

    async fn present_keys(&self) -> Result<Option<tidemark::PresentKeys>> {
        let prefix = self.prefix.clone();
        self.db
            .call(PORT, move |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let watermark = meta(&tx, "watermark").map_err(sql)?;
                let prefix = prefix.as_ref();
                let keys = {
                    // In key order from the prefix on: its keys are the first ones.
                    let mut stmt = tx
                        .prepare_cached(
                            "SELECT key FROM registry WHERE deleted = 0 AND key >= ?1
                             ORDER BY key",
                        )
                        .map_err(sql)?;
                    let rows = stmt
                        .query_map([lowest(prefix)], |r| r.get::<_, String>(0))
                        .map_err(sql)?;
                    // A key that is not UTF-8 is no key a follower holds: skip it.
                    rows.filter_map(std::result::Result::ok)
                        .take_while(|k| within(prefix, k))
                        .collect()
                };
                tx.finish().map_err(sql)?;
                Ok(Some(tidemark::PresentKeys { keys, watermark }))
            })
            .await
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        let prefix = self.prefix.clone();
        self.db
            .call(PORT, move |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let watermark = meta(&tx, "watermark").map_err(sql)?;
                let mut entries = Vec::new();
                walk_live(&tx, prefix.as_ref(), |e| {
                    entries.push(e);
                    ControlFlow::Continue(())
                })
                .map_err(sql)?;
                let lineage = lineage_at(&tx, watermark).map_err(sql)?;
                tx.finish().map_err(sql)?;
                Ok(Snapshot {
                    entries,
                    watermark,
                    lineage,
                })
            })
            .await
    }

    /// Read in one read transaction held across parts, on a connection and a blocking
    /// thread of its own: WAL snapshot isolation keeps every part at the watermark's point
    /// in time while writers carry on beside it, and the handle's connection stays free.
    /// The thread takes room for a part before it reads it, so at most one part waits
    /// while the caller holds another. Dropping the parts ends the transaction and the
    /// thread at the next row. While a read is held, the WAL cannot be checkpointed past
    /// its point in time: it grows with the writes made meanwhile until the read ends. A
    /// file not in WAL mode (WAL unavailable) is read whole first, since a read held open
    /// there would stop every writer.
    async fn snapshot_parts(&self, part_len: usize) -> Result<SnapshotParts<'_>> {
        let part_len = part_len.max(1);
        let (began, watermark) = oneshot::channel();
        let (sender, mut receiver) = mpsc::channel(1);
        let (db, prefix) = (self.db.clone(), self.prefix.clone());
        tokio::task::spawn_blocking(move || {
            read_parts(&db, prefix.as_ref(), part_len, began, &sender);
        });
        let (watermark, lineage) = watermark
            .await
            .map_err(|_| Error::unavailable(PORT, "the snapshot reader ended before it began"))??;
        // A reader that stops without saying it reached the end fails the read: a snapshot
        // cut short must never pass for a whole one (its missing keys would be removed).
        let mut done = false;
        let parts = futures::stream::poll_fn(move |cx| {
            if done {
                return Poll::Ready(None);
            }
            let last = match ready!(receiver.poll_recv(cx)) {
                Some(Read::Part(part)) => return Poll::Ready(Some(Ok(part))),
                Some(Read::Failed(e)) => Some(Err(e)),
                Some(Read::End) => None,
                None => Some(Err(Error::unavailable(
                    PORT,
                    "the snapshot reader stopped before its last part",
                ))),
            };
            done = true;
            Poll::Ready(last)
        });
        Ok(SnapshotParts {
            watermark,
            lineage,
            parts: parts.boxed(),
        })
    }

    /// Both in one read transaction: a compaction cannot take the entry at `since`
    /// between them.
    async fn changes_and_lineage(&self, since: u64) -> Result<(Changes, Lineage)> {
        let prefix = self.prefix.clone();
        self.db
            .call(PORT, move |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let changes =
                    SqliteSource::changes_blocking(&tx, since, prefix.as_ref()).map_err(sql)?;
                let lineage = lineage_at(&tx, since).map_err(sql)?;
                tx.finish().map_err(sql)?;
                Ok((changes, lineage))
            })
            .await
    }

    async fn lineage_at(&self, seq: u64) -> Result<Lineage> {
        self.db
            .call(PORT, move |conn| lineage_at(conn, seq).map_err(sql))
            .await
    }

    /// `None` for a key outside this view's prefix.
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        if !within(self.prefix.as_ref(), key) {
            return Ok(None);
        }
        let key = key.to_owned();
        self.db
            .call(PORT, move |conn| {
                conn.prepare_cached(
                    "SELECT seq, value FROM registry WHERE key = ?1 AND deleted = 0",
                )
                .and_then(|mut s| {
                    s.query_row([&key], |r| {
                        let seq = to_u64(r.get(0)?);
                        // A row no snapshot hands out is no value here either.
                        Ok(value_bytes(r.get_ref(1)?)
                            .inspect_err(|reason| {
                                tracing::warn!(seq, reason, "reading past a registry row");
                            })
                            .ok()
                            .map(|value| Versioned { seq, value }))
                    })
                    .optional()
                })
                .map(Option::flatten)
                .map_err(sql)
            })
            .await
    }

    async fn first_available(&self) -> Result<u64> {
        self.db
            .call(PORT, |conn| meta(conn, "first_available").map_err(sql))
            .await
    }

    fn key_prefix(&self) -> Option<&KeyPrefix> {
        self.prefix.as_ref()
    }
}

/// The seq of the last mutation of a key under `prefix` at or after `from` (0 if none):
/// the registry's row of each key is its last mutation, walked down the seq index.
fn last_within(conn: &Connection, prefix: &KeyPrefix, from: u64) -> rusqlite::Result<u64> {
    let mut stmt =
        conn.prepare_cached("SELECT key, seq FROM registry WHERE seq >= ?1 ORDER BY seq DESC")?;
    let mut rows = stmt.query([to_i64(from)])?;
    while let Some(row) = rows.next()? {
        if let rusqlite::types::ValueRef::Text(key) = row.get_ref(0)?
            && key.starts_with(prefix.as_str().as_bytes())
        {
            return Ok(to_u64(row.get(1)?));
        }
    }
    Ok(0)
}

/// The change log read from a seq on; waits for commits (by any process) when caught up.
#[derive(Debug)]
pub struct ChangeLogStream {
    db: SqliteDb,
    prefix: Option<KeyPrefix>,
    commits: watch::Receiver<u64>,
    next_seq: u64,
    buf: VecDeque<FeedItem>,
}

impl FeedStream for ChangeLogStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if let Some(item) = self.buf.pop_front() {
                return Some(Ok(item));
            }
            self.commits.borrow_and_update();
            let from = self.next_seq;
            let prefix = self.prefix.clone();
            let read = self
                .db
                .call("feed", move |conn| {
                    let tx = conn.transaction().map_err(sql)?;
                    let first = meta(&tx, "first_available").map_err(sql)?;
                    if from < first {
                        return Err(Error::unavailable(
                            "feed",
                            "history compacted under an open feed",
                        ));
                    }
                    let mut items = Vec::new();
                    let mut last = None;
                    {
                        let mut stmt = tx
                            .prepare_cached(
                                "SELECT key, value, seq, deleted, stamp FROM changelog
                                 WHERE seq >= ?1 ORDER BY seq LIMIT ?2",
                            )
                            .map_err(sql)?;
                        let mut rows =
                            stmt.query(params![to_i64(from), READ_BATCH]).map_err(sql)?;
                        while let Some(row) = rows.next().map_err(sql)? {
                            let stamp = row.get::<_, Option<i64>>(4).map_err(sql)?.map(bits);
                            let e = read_entry(
                                row.get_ref(0).map_err(sql)?,
                                row.get_ref(1).map_err(sql)?,
                                row.get(2).map_err(sql)?,
                                row.get(3).map_err(sql)?,
                            )
                            .map(|e| e.stamped(stamp));
                            last = Some(match &e {
                                Ok(e) => e.seq,
                                Err((seq, _)) => *seq,
                            });
                            items.push(match e {
                                Ok(e) if within(prefix.as_ref(), &e.key) => FeedItem::Entry(e),
                                // Another part of the registry: read past, not delivered.
                                Ok(_) => continue,
                                Err((seq, reason)) => FeedItem::Undecodable {
                                    position: seq,
                                    seq: Some(seq),
                                    reason,
                                },
                            });
                        }
                    }
                    tx.finish().map_err(sql)?;
                    Ok((items, last))
                })
                .await;
            match read {
                Err(e) => return Some(Err(e)),
                Ok((items, last)) => {
                    if let Some(last) = last {
                        self.next_seq = last + 1;
                    }
                    self.buf.extend(items);
                }
            }
            if self.buf.is_empty() && self.commits.changed().await.is_err() {
                return None;
            }
        }
    }
}

impl Feed for SqliteSource {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Replay;
    type Stream = ChangeLogStream;

    async fn open(
        &self,
        from: u64,
        _after_position: Option<u64>,
    ) -> Result<Opened<ChangeLogStream>> {
        let from = from.max(1);
        let prefix = self.prefix.clone();
        let info = self
            .db
            .call("feed", move |conn| {
                let tx = conn.transaction().map_err(sql)?;
                let first_available = meta(&tx, "first_available").map_err(sql)?;
                let head = meta(&tx, "watermark").map_err(sql)?;
                let info = match &prefix {
                    None => FeedInfo::change_log(first_available, head),
                    Some(p) => {
                        let last = last_within(&tx, p, from).map_err(sql)?;
                        FeedInfo::filtered_log(
                            first_available,
                            FeedInfo::filtered_head(last, head, from),
                        )
                    }
                };
                // The history at the follower's watermark, in the same read as the first
                // seq: a compaction between two reads could take the entry whose stamp
                // tells a restored copy from the file the follower read.
                let info = info.with_lineage(lineage_at(&tx, from - 1).map_err(sql)?);
                tx.finish().map_err(sql)?;
                Ok(info)
            })
            .await?;
        Ok(Opened {
            info,
            stream: ChangeLogStream {
                commits: self.db.commits(),
                db: self.db.clone(),
                prefix: self.prefix.clone(),
                next_seq: from,
                buf: VecDeque::new(),
            },
        })
    }
}
