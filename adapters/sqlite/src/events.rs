//! The durable events stream (an append-only table with positions and keys) and its named
//! consumer cursors.

use std::collections::VecDeque;

use rusqlite::{OptionalExtension, params};
use tidemark::tidemark_core::{Event, FeedInfo};
use tidemark::{Cursors, Error, Feed, FeedItem, FeedStream, Opened, Publish, Result};
use tokio::sync::watch;

use crate::db::{SqliteDb, begin_write, to_i64, to_u64};
use crate::error::unavailable;

const READ_BATCH: i64 = 1024;

/// The events stream: payloads keyed by entity key at increasing positions, and named
/// cursors with monotone saves. As a [`Feed`] it is [`Continuity::Sparse`](tidemark::tidemark_core::Continuity::Sparse) (positions are
/// the stream's own, not seqs) and wants a checkpoint per entry; a payload that is not an
/// [`Event`] arrives as [`FeedItem::Undecodable`].
#[derive(Clone, Debug)]
pub struct SqliteEvents {
    db: SqliteDb,
}

/// One record of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its position (from 1, increasing).
    pub position: u64,
    /// The entity key it was published under.
    pub key: String,
    /// The payload.
    pub payload: Vec<u8>,
}

fn sql(port: &'static str) -> impl Fn(rusqlite::Error) -> Error {
    move |e| unavailable(port, &e)
}

fn item(position: u64, payload: &[u8]) -> FeedItem {
    match Event::decode(payload) {
        Ok(event) => FeedItem::Entry(event.into_entry(position)),
        Err(e) => FeedItem::Undecodable {
            position,
            seq: None,
            reason: e.to_string(),
        },
    }
}

impl SqliteEvents {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteEvents { db }
    }

    /// Every record after `after` (0: from the start), up to `limit`, in position order.
    pub async fn records(&self, after: u64, limit: usize) -> Result<Vec<Record>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.db
            .call("events", move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT position, key, payload FROM events WHERE position > ?1
                         ORDER BY position LIMIT ?2",
                    )
                    .map_err(sql("events"))?;
                let rows = stmt
                    .query_map(params![to_i64(after), limit], |r| {
                        Ok(Record {
                            position: to_u64(r.get(0)?),
                            key: r.get(1)?,
                            payload: r.get(2)?,
                        })
                    })
                    .map_err(sql("events"))?;
                rows.collect::<rusqlite::Result<_>>().map_err(sql("events"))
            })
            .await
    }
}

/// Appends one record in the caller's transaction; returns its position.
pub(crate) fn append(
    conn: &rusqlite::Connection,
    key: &str,
    payload: &[u8],
) -> rusqlite::Result<u64> {
    let seq = Event::decode(payload).ok().map(|e| to_i64(e.seq()));
    conn.prepare_cached(
        "INSERT INTO events (key, payload, seq) VALUES (?1, ?2, ?3) RETURNING position",
    )?
    .query_row(params![key, payload, seq], |r| r.get::<_, i64>(0))
    .map(to_u64)
}

impl Publish for SqliteEvents {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        let key = key.to_owned();
        self.db
            .write("publish", move |conn| {
                append(conn, &key, &payload).map_err(sql("publish"))
            })
            .await
    }

    /// One transaction for the whole batch: all appended in order, or none.
    async fn publish_batch(&self, items: Vec<(String, Vec<u8>)>) -> Vec<Result<u64>> {
        let n = items.len();
        if n == 0 {
            return Vec::new();
        }
        let done = self
            .db
            .write("publish", move |conn| {
                let tx = begin_write(conn, sql("publish"))?;
                let positions = items
                    .iter()
                    .map(|(key, payload)| append(&tx, key, payload))
                    .collect::<rusqlite::Result<Vec<_>>>()
                    .map_err(sql("publish"))?;
                tx.commit().map_err(sql("publish"))?;
                Ok(positions)
            })
            .await;
        match done {
            Ok(positions) => positions.into_iter().map(Ok).collect(),
            Err(e) => e.for_each_of(n),
        }
    }
}

/// The events stream read from a position on; waits for commits when caught up.
#[derive(Debug)]
pub struct EventStream {
    db: SqliteDb,
    commits: watch::Receiver<u64>,
    next_position: u64,
    buf: VecDeque<FeedItem>,
}

impl FeedStream for EventStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if let Some(item) = self.buf.pop_front() {
                return Some(Ok(item));
            }
            self.commits.borrow_and_update();
            let from = self.next_position;
            let read = self
                .db
                .call("events", move |conn| {
                    let mut stmt = conn
                        .prepare_cached(
                            "SELECT position, payload FROM events WHERE position >= ?1
                             ORDER BY position LIMIT ?2",
                        )
                        .map_err(sql("events"))?;
                    let rows = stmt
                        .query_map(params![to_i64(from), READ_BATCH], |r| {
                            Ok((to_u64(r.get(0)?), r.get::<_, Vec<u8>>(1)?))
                        })
                        .map_err(sql("events"))?;
                    rows.collect::<rusqlite::Result<Vec<_>>>()
                        .map_err(sql("events"))
                })
                .await;
            match read {
                Err(e) => return Some(Err(e)),
                Ok(rows) => {
                    if let Some((last, _)) = rows.last() {
                        self.next_position = last + 1;
                    }
                    self.buf
                        .extend(rows.iter().map(|(p, payload)| item(*p, payload)));
                }
            }
            if self.buf.is_empty() && self.commits.changed().await.is_err() {
                return None;
            }
        }
    }
}

impl Feed for SqliteEvents {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Announcements;
    type Stream = EventStream;

    /// Starts after `after_position` when given, else at the stream's beginning; `from`
    /// (a seq) does not address an events stream. The head reported is the highest seq
    /// among the events still to be read, so readiness means "caught up with the stream".
    async fn open(&self, _from: u64, after_position: Option<u64>) -> Result<Opened<EventStream>> {
        let start = after_position.map_or(1, |p| p.saturating_add(1));
        let head = self
            .db
            .call("events", move |conn| {
                conn.prepare_cached("SELECT MAX(seq) FROM events WHERE position >= ?1")
                    .and_then(|mut s| s.query_row([to_i64(start)], |r| r.get::<_, Option<i64>>(0)))
                    .map_err(sql("events"))
            })
            .await?
            .map_or(0, to_u64);
        Ok(Opened {
            info: FeedInfo::announcements(head),
            stream: EventStream {
                commits: self.db.commits(),
                db: self.db.clone(),
                next_position: start,
                buf: VecDeque::new(),
            },
        })
    }
}

impl Cursors for SqliteEvents {
    async fn load(&self, name: &str) -> Result<Option<u64>> {
        let name = name.to_owned();
        self.db
            .call("cursor", move |conn| {
                conn.prepare_cached("SELECT position FROM cursors WHERE name = ?1")
                    .and_then(|mut s| s.query_row([&name], |r| r.get::<_, i64>(0)).optional())
                    .map(|p| p.map(to_u64))
                    .map_err(sql("cursor"))
            })
            .await
    }

    async fn save(&self, name: &str, position: u64) -> Result<u64> {
        let name = name.to_owned();
        self.db
            .write("cursor", move |conn| {
                conn.prepare_cached(
                    "INSERT INTO cursors (name, position) VALUES (?1, ?2)
                     ON CONFLICT (name) DO UPDATE SET position = max(position, excluded.position)
                     RETURNING position",
                )
                .and_then(|mut s| {
                    s.query_row(params![name, to_i64(position)], |r| r.get::<_, i64>(0))
                })
                .map(to_u64)
                .map_err(sql("cursor"))
            })
            .await
    }
}
