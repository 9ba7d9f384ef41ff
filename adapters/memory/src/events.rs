//! The in-process durable events stream: announcements keyed by entity key, with named
//! durable cursors.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::tidemark_core::{Event, FeedInfo};
use tidemark::{Cursors, Feed, FeedItem, FeedStream, Opened, Publish, Result};

use crate::faults::{Faults, Mangle, Port};
use crate::signal::Signal;

const READ_BATCH: usize = 1024;

/// One record of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its position (from 1, increasing by one per record).
    pub position: u64,
    /// The entity key it was published under.
    pub key: String,
    /// The payload (an event's JSON, or anything a foreign producer sent).
    pub payload: Vec<u8>,
}

#[derive(Debug, Default)]
struct State {
    /// How many records retention dropped from the front: `records[i]` is at position
    /// `dropped + i + 1`.
    dropped: u64,
    records: Vec<Record>,
    held: Option<(String, Vec<u8>)>,
    cursors: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    head: Signal,
    faults: Faults,
}

/// An in-process events stream. Positions are the stream's own (they differ from the
/// source's seqs); payloads are [`Event`] JSON, or anything else a foreign producer
/// published (delivered as [`FeedItem::Undecodable`]). As a [`Feed`] it is
/// [`Continuity::Sparse`](tidemark::tidemark_core::Continuity::Sparse) and wants a checkpoint per entry.
#[derive(Clone, Debug)]
pub struct MemoryEvents {
    inner: Arc<Inner>,
}

impl Default for MemoryEvents {
    fn default() -> Self {
        MemoryEvents::new(Faults::new())
    }
}

impl MemoryEvents {
    /// An empty stream whose calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemoryEvents {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                head: Signal::default(),
                faults,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every record, in position order (for oracles and tests).
    #[must_use]
    pub fn records(&self) -> Vec<Record> {
        self.state().records.clone()
    }

    /// Releases an announcement held back by [`Mangle::Reorder`], if any.
    pub fn release_held(&self) {
        {
            let mut s = self.state();
            let Some((key, payload)) = s.held.take() else {
                return;
            };
            append(&mut s, key, payload);
        }
        self.inner.head.bump();
    }
}

impl State {
    /// The position the next record gets.
    fn next_position(&self) -> u64 {
        self.dropped + self.records.len() as u64 + 1
    }

    /// Index into `records` of the first record at or after `position`.
    fn index_of(&self, position: u64) -> usize {
        usize::try_from(position.saturating_sub(self.dropped + 1)).unwrap_or(usize::MAX)
    }
}

impl MemoryEvents {
    /// Drops every record below `position` (retention); returns how many it dropped.
    pub(crate) fn truncate_below(&self, position: u64) -> u64 {
        let mut s = self.state();
        let n = s.index_of(position).min(s.records.len());
        s.records.drain(..n);
        s.dropped += n as u64;
        n as u64
    }

    /// The last position written (0 when nothing was) and the lowest durable cursor.
    pub(crate) fn head_and_floor(&self) -> (u64, Option<u64>) {
        let s = self.state();
        (s.next_position() - 1, s.cursors.values().min().copied())
    }
}

fn append(s: &mut State, key: String, payload: Vec<u8>) -> u64 {
    let position = s.next_position();
    s.records.push(Record {
        position,
        key,
        payload,
    });
    position
}

impl Publish for MemoryEvents {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        self.inner.faults.check(Port::Publish)?;
        let mangle = self.inner.faults.take_mangle();
        let position = {
            let mut s = self.state();
            match mangle {
                Mangle::Deliver => {
                    let p = append(&mut s, key.to_owned(), payload);
                    if let Some((k, v)) = s.held.take() {
                        append(&mut s, k, v);
                    }
                    p
                }
                Mangle::Drop => s.next_position(),
                Mangle::Duplicate => {
                    let p = append(&mut s, key.to_owned(), payload.clone());
                    append(&mut s, key.to_owned(), payload);
                    p
                }
                Mangle::Reorder => {
                    if let Some((k, v)) = s.held.replace((key.to_owned(), payload)) {
                        append(&mut s, k, v);
                    }
                    s.next_position()
                }
            }
        };
        self.inner.head.bump();
        Ok(position)
    }
}

fn item(record: &Record) -> FeedItem {
    match Event::decode(&record.payload) {
        Ok(event) => FeedItem::Entry(event.into_entry(record.position)),
        Err(e) => FeedItem::Undecodable {
            position: record.position,
            seq: None,
            reason: e.to_string(),
        },
    }
}

/// The events stream, read from a position on.
#[derive(Debug)]
pub struct EventStream {
    inner: Arc<Inner>,
    seen: u64,
    next_position: u64,
    buf: VecDeque<FeedItem>,
}

impl FeedStream for EventStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if let Err(e) = self.inner.faults.check(Port::Events) {
                return Some(Err(e));
            }
            if let Some(item) = self.buf.pop_front() {
                return Some(Ok(item));
            }
            self.seen = self.inner.head.version();
            {
                let s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
                // Records dropped by retention are passed over: the feed is sparse, and a
                // follower finds what it missed by its seqs.
                let skip = s.index_of(self.next_position).min(s.records.len());
                let taken = &s.records[skip..(skip + READ_BATCH).min(s.records.len())];
                if let Some(last) = taken.last() {
                    self.next_position = last.position + 1;
                }
                self.buf.extend(taken.iter().map(item));
            }
            if self.buf.is_empty() {
                self.inner.head.changed_since(self.seen).await;
            }
        }
    }
}

impl Feed for MemoryEvents {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Announcements;
    type Stream = EventStream;

    /// Starts after `after_position` when given, else at the stream's beginning; `from`
    /// (a seq) does not address an events stream. The head reported is the highest seq
    /// among the events still to be read, so readiness means "caught up with the stream".
    async fn open(&self, _from: u64, after_position: Option<u64>) -> Result<Opened<EventStream>> {
        self.inner.faults.check(Port::Events)?;
        let start = after_position.map_or(1, |p| p.saturating_add(1));
        let head = {
            let s = self.state();
            let skip = s.index_of(start);
            s.records
                .iter()
                .skip(skip)
                .filter_map(|r| Event::decode(&r.payload).ok())
                .map(|e| e.seq())
                .max()
                .unwrap_or(0)
        };
        Ok(Opened {
            info: FeedInfo::announcements(head),
            stream: EventStream {
                inner: Arc::clone(&self.inner),
                seen: self.inner.head.version(),
                next_position: start,
                buf: VecDeque::new(),
            },
        })
    }
}

impl Cursors for MemoryEvents {
    async fn load(&self, name: &str) -> Result<Option<u64>> {
        self.inner.faults.check(Port::Cursor)?;
        Ok(self.state().cursors.get(name).copied())
    }

    async fn save(&self, name: &str, position: u64) -> Result<u64> {
        self.inner.faults.check(Port::Cursor)?;
        let mut s = self.state();
        let stored = s.cursors.entry(name.to_owned()).or_insert(position);
        *stored = (*stored).max(position);
        Ok(*stored)
    }
}
