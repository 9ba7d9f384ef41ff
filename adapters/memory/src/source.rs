//! The in-process source of truth, whose own change log is a gapless feed.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;

use tidemark::tidemark_core::{AnnouncePlan, Entry, Event, FeedInfo, KeyPrefix, Legs, Lineage, Op};
use tidemark::{
    Changes, Error, Feed, FeedItem, FeedStream, Opened, Result, Snapshot, SnapshotParts, Source,
    ValueAt, Versioned, check_key_within, check_value,
};

use crate::faults::{Faults, Port};
use crate::outbox::MemoryOutbox;
use crate::signal::Signal;

pub use tidemark::tidemark_core::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
/// How many log entries a feed copies per lock of the source.
const READ_BATCH: usize = 1024;

/// A current value: shared, so that a snapshot read in parts can hold every value of its
/// point in time without copying them all at once.
#[derive(Clone, Debug)]
struct Stored {
    seq: u64,
    value: Arc<[u8]>,
    /// The stamp of the mutation that wrote it.
    stamp: u64,
}

impl Stored {
    fn versioned(&self) -> Versioned {
        Versioned {
            seq: self.seq,
            value: self.value.to_vec(),
        }
    }
}

#[derive(Clone, Debug, Default)]
struct State {
    seq: u64,
    /// Keys shared with the log's entries: a snapshot, the log and a follower's cache
    /// hold one allocation per key.
    entries: BTreeMap<Arc<str>, Stored>,
    /// Every mutation from `log_base` on, in seq order (`log[i].seq == log_base + i`).
    log: VecDeque<Entry>,
    log_base: u64,
    /// The history this state belongs to: made with the source, kept by a backup, new
    /// when the source is [`recreate`](MemorySource::recreate)d.
    history: u64,
    /// The seq and stamp of the last entry compaction dropped: a follower whose watermark
    /// is the compaction's horizon still reads from the log, and its watermark's stamp
    /// must still tell its history (seed 119).
    floor: Option<(u64, u64)>,
}

impl State {
    /// The source's history, with the stamp of its entry at `seq`: the log's while it
    /// holds it, else the current value's written at `seq`, if one is (a scan of the
    /// values, only for a seq compacted out of the log).
    fn lineage_at(&self, seq: u64) -> Lineage {
        let stamp = if seq == 0 || seq > self.seq {
            None
        } else if let Some((_, stamp)) = self.floor.filter(|(at, _)| *at == seq) {
            Some(stamp)
        } else if seq >= self.log_base {
            usize::try_from(seq - self.log_base)
                .ok()
                .and_then(|i| self.log.get(i))
                .and_then(|e| e.stamp)
        } else {
            self.entries
                .values()
                .find(|v| v.seq == seq)
                .map(|v| v.stamp)
        };
        Lineage::new(Some(self.history), stamp)
    }
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    head: Signal,
    /// Bumped to end every open feed cleanly (under the state's lock where the history
    /// changes, so a feed never reads another history's entries under its generation).
    generation: AtomicU64,
    /// The stamp of the last mutation (see [`Entry::stamp`]): never reset, not by a
    /// restore either, so a mutation written after a restore at a seq the restore took back
    /// has another stamp than the one it replaces.
    stamps: AtomicU64,
    /// The last history made (see [`MemorySource::recreate`]).
    histories: AtomicU64,
    faults: Faults,
    /// The watermark each restore put back, in order: a sweep's marks taken before a
    /// restore name seqs the restored history reuses for other, younger changes.
    restores: Mutex<Vec<u64>>,
}

/// A copy of a [`MemorySource`]'s whole state (entries, change log, seq), taken by
/// [`backup`](MemorySource::backup) and put back by [`restore`](MemorySource::restore).
#[derive(Clone, Debug)]
pub struct MemoryBackup {
    state: State,
}

impl MemoryBackup {
    /// The source's watermark when the backup was taken.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.state.seq
    }
}

/// An in-process source: a key → value map in which every mutation gets the next seq, with
/// a change log (puts and tombstones) that serves [`Source::changes_since`] and is itself
/// a [`Continuity::Gapless`](tidemark::tidemark_core::Continuity::Gapless) [`Feed`].
///
/// A cheap handle: clones share the state, which can live outside a simulated host that
/// crashes, like a disk. An [`announced`](Self::announced) handle also appends an outbox
/// row for each of its writes, in the same step as the write.
#[derive(Clone, Debug)]
pub struct MemorySource {
    inner: Arc<Inner>,
    announce: Option<(Legs, MemoryOutbox)>,
    prefix: Option<KeyPrefix>,
}

impl Default for MemorySource {
    fn default() -> Self {
        MemorySource::new(Faults::new())
    }
}

/// The announcement of the write at `seq` (`value` `None` for a removal) as `outbox`'s
/// next row; an event that cannot be serialised appends none (a committed write's always
/// can: its seq is positive and its key checked).
fn append_announcement(
    (legs, outbox): &(Legs, MemoryOutbox),
    seq: u64,
    key: &str,
    value: Option<&[u8]>,
) {
    let event = Event::of_write(seq, key, value);
    match AnnouncePlan::new(&event, *legs) {
        Ok(plan) => outbox.append(seq, plan),
        Err(e) => tracing::warn!(key, seq, error = %e, "not announced"),
    }
}

impl MemorySource {
    /// An empty source whose calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemorySource {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    log_base: 1,
                    history: 1,
                    ..State::default()
                }),
                head: Signal::default(),
                generation: AtomicU64::new(0),
                stamps: AtomicU64::new(0),
                histories: AtomicU64::new(1),
                faults,
                restores: Mutex::default(),
            }),
            announce: None,
            prefix: None,
        }
    }

    /// A view of the same source over the keys that begin with `prefix` (byte for byte):
    /// its reads, listings, changes, snapshots and feed carry only those keys, and a
    /// follower over it keeps only those ([`Source::key_prefix`]). Its feed is
    /// [`Continuity::Filtered`](tidemark::tidemark_core::Continuity::Filtered) (the other
    /// keys' seqs are skipped). Writes outside the prefix are refused.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a prefix no key could begin with (empty, too long,
    /// control characters).
    pub fn with_prefix(&self, prefix: &str) -> Result<MemorySource> {
        Ok(MemorySource {
            prefix: Some(tidemark::key_prefix(prefix)?),
            ..self.clone()
        })
    }

    /// Whether this view carries `key`.
    fn holds(&self, key: &str) -> bool {
        self.prefix.as_ref().is_none_or(|p| p.matches(key))
    }

    /// The current entries this view carries, in key order.
    fn current<'s>(&self, s: &'s State) -> impl Iterator<Item = (&'s Arc<str>, &'s Stored)> {
        let from = self.prefix.as_ref().map_or("", KeyPrefix::as_str);
        let prefix = self.prefix.clone();
        s.entries
            .range::<str, _>((std::ops::Bound::Included(from), std::ops::Bound::Unbounded))
            .take_while(move |(k, _)| prefix.as_ref().is_none_or(|p| p.matches(k)))
    }

    /// A handle on the same source whose every write also appends a row to `outbox`,
    /// announcing it on `legs`, in the same step as the write (the memory counterpart of
    /// an outbox row in the write's own transaction). A [`Relay`](tidemark::Relay) over
    /// `outbox` drains it.
    #[must_use]
    pub fn announced(&self, legs: Legs, outbox: MemoryOutbox) -> MemorySource {
        MemorySource {
            inner: Arc::clone(&self.inner),
            announce: Some((legs, outbox)),
            prefix: self.prefix.clone(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn commit(&self, key: &str, op: Op, value: Vec<u8>) -> u64 {
        let seq = self.commit_in(&mut self.state(), key, op, value);
        self.inner.head.bump();
        seq
    }

    /// Writes one mutation under the state's lock, which the caller holds (so that what it
    /// checked before, a removal's key being there, still holds when it commits).
    fn commit_in(&self, s: &mut State, key: &str, op: Op, value: Vec<u8>) -> u64 {
        s.seq += 1;
        let seq = s.seq;
        let stamp = self.next_stamp();
        let key: Arc<str> = match s.entries.get_key_value(key) {
            Some((held, _)) => Arc::clone(held),
            None => key.into(),
        };
        if op == Op::Put {
            s.entries.insert(
                Arc::clone(&key),
                Stored {
                    seq,
                    value: value.as_slice().into(),
                    stamp,
                },
            );
        } else {
            s.entries.remove(&*key);
        }
        if let Some(announce) = &self.announce {
            let value = (op == Op::Put).then_some(value.as_slice());
            append_announcement(announce, seq, &key, value);
        }
        s.log
            .push_back(Entry::new(seq, seq, key, op, value).stamped(Some(stamp)));
        seq
    }

    /// A stamp no mutation of this source had before.
    fn next_stamp(&self) -> u64 {
        self.inner.stamps.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Drops the change log below `seq` (tombstones and superseded puts): a reader whose
    /// watermark + 1 is below it must resync from a snapshot.
    pub fn compact_below(&self, seq: u64) {
        self.compact_counting(seq);
    }

    /// [`compact_below`](Self::compact_below), returning how many log entries went and
    /// the first seq served afterwards.
    pub(crate) fn compact_counting(&self, seq: u64) -> (u64, u64) {
        let mut s = self.state();
        let upto = seq.min(s.seq + 1);
        let mut removed = 0;
        while s.log_base < upto {
            if let Some(gone) = s.log.pop_front()
                && let Some(stamp) = gone.stamp
            {
                s.floor = Some((gone.seq, stamp));
            }
            s.log_base += 1;
            removed += 1;
        }
        (removed, s.log_base)
    }

    /// A copy of the whole source as it is now: what a database backup holds.
    #[must_use]
    pub fn backup(&self) -> MemoryBackup {
        MemoryBackup {
            state: self.state().clone(),
        }
    }

    /// Puts `backup` back in place of the whole source, as restoring a database from a
    /// backup does: its seqs go back to the backup's, and the writes made since are gone
    /// (the next writes reuse their seqs, with other changes: a new history). Open feeds
    /// end, as a server restart would. A follower notices when it reads the source while
    /// the source's head is below its watermark, and resyncs.
    ///
    /// The restored source keeps the backup's history, as a restored database does; the
    /// mutations written after it have other stamps than those it lost at the same seqs,
    /// and a follower tells the histories apart by the stamp at its watermark
    /// ([`Source::lineage_at`]).
    pub fn restore(&self, backup: &MemoryBackup) {
        {
            let mut s = self.state();
            *s = backup.state.clone();
            self.restored().push(s.seq);
            self.inner.generation.fetch_add(1, Ordering::AcqRel);
        }
        self.inner.head.bump();
    }

    /// Deletes the source and makes it again, empty and with a new history, as deleting
    /// and recreating a bucket or a registry file does: seqs start again at 1. Open feeds
    /// end. A follower tells the new source from the old by its history
    /// ([`Source::lineage_at`]), even once the new one passes its watermark.
    pub fn recreate(&self) {
        {
            let mut s = self.state();
            let history = self.inner.histories.fetch_add(1, Ordering::AcqRel) + 1;
            *s = State {
                log_base: 1,
                history,
                ..State::default()
            };
            self.restored().push(0);
            self.inner.generation.fetch_add(1, Ordering::AcqRel);
        }
        self.inner.head.bump();
    }

    fn restored(&self) -> MutexGuard<'_, Vec<u64>> {
        self.inner
            .restores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current watermark and the watermark each restore so far put back, in order,
    /// read together (for a sweep, whose marks must forget seqs a restore took back).
    pub(crate) fn watermark_and_restores(&self) -> (u64, Vec<u64>) {
        let s = self.state();
        let restores = self.restored().clone();
        (s.seq, restores)
    }

    /// How many restores this source has had.
    pub(crate) fn restore_count(&self) -> usize {
        self.restored().len()
    }

    /// Ends every open feed cleanly (as a server restart would); followers reopen.
    pub fn end_feeds(&self) {
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        self.inner.head.bump();
    }

    /// The changes after `since` in `s`, or the news that they were compacted.
    fn changes_in(&self, s: &State, since: u64) -> Changes {
        if since.saturating_add(1) < s.log_base {
            return Changes::Compacted {
                first_available: s.log_base,
            };
        }
        let skip = usize::try_from(since.saturating_add(1) - s.log_base).unwrap_or(usize::MAX);
        // Only the latest mutation per key: the cost is what changed, once per key.
        let mut latest: BTreeMap<&str, &Entry> = BTreeMap::new();
        for e in s.log.iter().skip(skip).filter(|e| self.holds(&e.key)) {
            latest.insert(&*e.key, e);
        }
        let mut entries: Vec<Entry> = latest.into_values().cloned().collect();
        entries.sort_by_key(|e| e.seq);
        Changes::Since {
            entries,
            watermark: s.seq,
        }
    }

    /// The fault switches this source consults.
    #[must_use]
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// The current entries, in key order, without consulting faults (for oracles).
    #[must_use]
    pub fn contents(&self) -> BTreeMap<String, Versioned> {
        let s = self.state();
        s.entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.versioned()))
            .collect()
    }

    /// The current watermark, without consulting faults (for oracles).
    #[must_use]
    pub fn current_watermark(&self) -> u64 {
        self.state().seq
    }
}

impl Source for MemorySource {
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        self.inner.faults.check(Port::Source)?;
        check_key_within(key, self.prefix.as_ref())?;
        check_value(&value)?;
        Ok(self.commit(key, Op::Put, value))
    }

    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        self.inner.faults.check(Port::Source)?;
        check_key_within(key, self.prefix.as_ref())?;
        check_value(&value)?;
        let seq = {
            let mut s = self.state();
            let current = s.entries.get(key).map(|v| v.seq);
            if current.unwrap_or(0) != expected {
                return Err(Error::Conflict {
                    key: key.to_owned(),
                    expected,
                    current,
                });
            }
            s.seq += 1;
            let seq = s.seq;
            let stamp = self.next_stamp();
            let key: Arc<str> = match s.entries.get_key_value(key) {
                Some((held, _)) => Arc::clone(held),
                None => key.into(),
            };
            s.entries.insert(
                Arc::clone(&key),
                Stored {
                    seq,
                    value: value.as_slice().into(),
                    stamp,
                },
            );
            if let Some(announce) = &self.announce {
                append_announcement(announce, seq, &key, Some(&value));
            }
            s.log
                .push_back(Entry::put(seq, key, value).stamped(Some(stamp)));
            seq
        };
        self.inner.head.bump();
        Ok(seq)
    }

    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        self.inner.faults.check(Port::Source)?;
        check_key_within(key, self.prefix.as_ref())?;
        // Checked and removed under one lock: two removes of a key racing each other
        // commit one removal between them, not two (two seqs, two announcements).
        let seq = {
            let mut s = self.state();
            if !s.entries.contains_key(key) {
                return Ok(None);
            }
            self.commit_in(&mut s, key, Op::Delete, Vec::new())
        };
        self.inner.head.bump();
        Ok(Some(seq))
    }

    async fn watermark(&self) -> Result<u64> {
        self.inner.faults.check(Port::Source)?;
        Ok(self.state().seq)
    }

    async fn changes_since(&self, since: u64) -> Result<Changes> {
        self.inner.faults.check(Port::Source)?;
        Ok(self.changes_in(&self.state(), since))
    }

    /// Both under one lock: a compaction cannot take the entry at `since` between them.
    async fn changes_and_lineage(&self, since: u64) -> Result<(Changes, Lineage)> {
        self.inner.faults.check(Port::Source)?;
        let s = self.state();
        Ok((self.changes_in(&s, since), s.lineage_at(since)))
    }

    async fn present_keys(&self) -> Result<Option<tidemark::PresentKeys>> {
        self.inner.faults.check(Port::Source)?;
        let state = self.state();
        Ok(Some(tidemark::PresentKeys {
            keys: self.current(&state).map(|(k, _)| k.to_string()).collect(),
            watermark: state.seq,
        }))
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        self.inner.faults.check(Port::Source)?;
        let s = self.state();
        Ok(Snapshot {
            entries: self
                .current(&s)
                .map(|(k, v)| Entry::put(v.seq, Arc::clone(k), v.value.to_vec()))
                .collect(),
            watermark: s.seq,
            lineage: s.lineage_at(s.seq),
        })
    }

    /// Takes a handle on every current value under the lock (its key, seq and shared
    /// bytes, about 40 bytes an entry) and copies each part's values as the part is read:
    /// one point in time, without a second copy of the source at once. Each part consults
    /// the faults, as a read over a connection that can drop midway would.
    async fn snapshot_parts(&self, part_len: usize) -> Result<SnapshotParts<'_>> {
        self.inner.faults.check(Port::Source)?;
        let (watermark, lineage, handles) = {
            let s = self.state();
            let handles: Vec<(Arc<str>, u64, Arc<[u8]>)> = self
                .current(&s)
                .map(|(k, v)| (Arc::clone(k), v.seq, Arc::clone(&v.value)))
                .collect();
            (s.seq, s.lineage_at(s.seq), handles)
        };
        let part_len = part_len.max(1);
        let faults = self.inner.faults.clone();
        let mut handles = handles.into_iter();
        let parts = std::iter::from_fn(move || {
            if handles.len() == 0 {
                return None;
            }
            if let Err(e) = faults.check(Port::Source) {
                return Some(Err(e));
            }
            let part: Vec<Entry> = handles
                .by_ref()
                .take(part_len)
                .map(|(key, seq, value)| Entry::put(seq, key, value.to_vec()))
                .collect();
            Some(Ok(part))
        });
        Ok(SnapshotParts {
            watermark,
            lineage,
            parts: futures::stream::iter(parts).boxed(),
        })
    }

    /// `None` for a key outside this view's prefix.
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        Ok(self.get_at(key).await?.value)
    }

    async fn get_at(&self, key: &str) -> Result<ValueAt> {
        self.inner.faults.check(Port::Source)?;
        let s = self.state();
        let value = if self.holds(key) {
            s.entries.get(key).map(Stored::versioned)
        } else {
            None
        };
        Ok(ValueAt {
            value,
            watermark: s.seq,
        })
    }

    fn key_prefix(&self) -> Option<&KeyPrefix> {
        self.prefix.as_ref()
    }

    async fn lineage_at(&self, seq: u64) -> Result<Lineage> {
        self.inner.faults.check(Port::Source)?;
        Ok(self.state().lineage_at(seq))
    }

    async fn first_available(&self) -> Result<u64> {
        self.inner.faults.check(Port::Source)?;
        Ok(self.state().log_base)
    }
}

/// The source's change log, read from a seq on.
#[derive(Debug)]
pub struct LogStream {
    inner: Arc<Inner>,
    prefix: Option<KeyPrefix>,
    seen: u64,
    next_seq: u64,
    generation: u64,
    buf: VecDeque<Entry>,
}

impl LogStream {
    /// The entry due now, if the stream holds or can read one without waiting; `Err(None)`
    /// when the feed was ended (a new history), `Err(Some(e))` when it failed.
    fn ready(&mut self) -> std::result::Result<Option<Entry>, Option<Error>> {
        if self.inner.generation.load(Ordering::Acquire) != self.generation {
            return Err(None);
        }
        self.inner.faults.check(Port::Feed).map_err(Some)?;
        if let Some(entry) = self.buf.pop_front() {
            return Ok(Some(entry));
        }
        self.seen = self.inner.head.version();
        self.refill().map_err(Some)?;
        Ok(None)
    }

    /// Copies up to [`READ_BATCH`] log entries from `next_seq` on, under one lock.
    fn refill(&mut self) -> Result<()> {
        let s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock a restore changes it under: what is read here is the
        // history this stream began on.
        if self.inner.generation.load(Ordering::Acquire) != self.generation {
            return Ok(());
        }
        if self.next_seq < s.log_base {
            return Err(Error::unavailable(
                "feed",
                "history compacted under an open feed",
            ));
        }
        let skip = usize::try_from(self.next_seq - s.log_base).unwrap_or(usize::MAX);
        let read: Vec<&Entry> = s.log.iter().skip(skip).take(READ_BATCH).collect();
        self.next_seq += read.len() as u64;
        match self.prefix.as_ref() {
            // The whole log: every seq after an entry is one more to come, so it says how
            // many (a follower presizes its index and cache by it).
            None => {
                let head = s.seq;
                self.buf.extend(
                    read.into_iter()
                        .map(|e| e.clone().with_pending(head.saturating_sub(e.seq))),
                );
            }
            // A view delivers only its prefix's entries: how many is not known.
            Some(p) => self
                .buf
                .extend(read.into_iter().filter(|e| p.matches(&e.key)).cloned()),
        }
        Ok(())
    }
}

impl FeedStream for LogStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            match self.ready() {
                Ok(Some(entry)) => return Some(Ok(FeedItem::Entry(entry))),
                Ok(None) => {}
                Err(None) => return None,
                Err(Some(e)) => return Some(Err(e)),
            }
            if self.buf.is_empty() {
                self.inner.head.changed_since(self.seen).await;
            }
        }
    }

    /// What the log holds from `next_seq` on, up to `max`, read 1,024 entries a lock:
    /// the items `next` would give at once, with the same checks per item.
    fn next_ready(&mut self, max: usize, into: &mut Vec<Option<Result<FeedItem>>>) -> usize {
        let mut taken = 0;
        while taken < max {
            match self.ready() {
                Ok(Some(entry)) => into.push(Some(Ok(FeedItem::Entry(entry)))),
                // Read more: nothing new, and `next` would wait.
                Ok(None) if self.buf.is_empty() => break,
                Ok(None) => continue,
                Err(None) => into.push(None),
                Err(Some(e)) => into.push(Some(Err(e))),
            }
            taken += 1;
            if !matches!(into.last(), Some(Some(Ok(_)))) {
                break;
            }
        }
        taken
    }
}

impl Feed for MemorySource {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Replay;
    type Stream = LogStream;

    async fn open(&self, from: u64, _after_position: Option<u64>) -> Result<Opened<LogStream>> {
        self.inner.faults.check(Port::Feed)?;
        let from = from.max(1);
        let info = {
            let s = self.state();
            // The history at the follower's watermark under the same lock as the first
            // seq: a compaction between two reads could take the entry whose stamp tells
            // a restored history from the one the follower read (seed 63 of
            // `--restores-while-cut`).
            let lineage = s.lineage_at(from - 1);
            let info = match &self.prefix {
                None => FeedInfo::change_log(s.log_base, s.seq),
                Some(p) => {
                    // The last entry of the prefix this feed will deliver.
                    let last = s
                        .log
                        .iter()
                        .rev()
                        .take_while(|e| e.seq >= from)
                        .find(|e| p.matches(&e.key))
                        .map_or(0, |e| e.seq);
                    FeedInfo::filtered_log(s.log_base, FeedInfo::filtered_head(last, s.seq, from))
                }
            };
            info.with_lineage(lineage)
        };
        Ok(Opened {
            info,
            stream: LogStream {
                inner: Arc::clone(&self.inner),
                prefix: self.prefix.clone(),
                seen: self.inner.head.version(),
                next_seq: from,
                generation: self.inner.generation.load(Ordering::Acquire),
                buf: VecDeque::new(),
            },
        })
    }
}
