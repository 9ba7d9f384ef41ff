//! The source of truth: a durable, keyed store in which every mutation gets the next seq.

use std::future::Future;

use futures::StreamExt;
use futures::stream::BoxStream;
use tidemark_core::{Entry, KeyPrefix, Lineage};
use tokio::sync::watch;

use crate::error::Result;

/// A value with the seq it was written at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The seq of the mutation that wrote it.
    pub seq: u64,
    /// Its bytes.
    pub value: Vec<u8>,
}

/// The source's changes since a seq, or the news that they are no longer available.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changes {
    /// Every mutation after the requested seq, in seq order: puts (with values) and
    /// removals (tombstones, `Op::Delete`, with their seq). Only the latest mutation per key
    /// need appear.
    Since {
        /// The changes.
        entries: Vec<Entry>,
        /// The source's watermark when they were read.
        watermark: u64,
    },
    /// Tombstones at or below the requested seq were compacted: only a snapshot can bring
    /// a reader up to date.
    Compacted {
        /// The first seq the source can still serve changes from.
        first_available: u64,
    },
}

/// A key's value and the source's watermark: what a read of one key saw, and how far the
/// source it read had got.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ValueAt {
    /// The key's current value and the seq it was written at, or `None` if absent.
    pub value: Option<Versioned>,
    /// The source's watermark when the value was read, or read before it.
    pub watermark: u64,
}

/// The keys a source may hold and its watermark read before listing them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PresentKeys {
    /// The keys, in no particular order.
    pub keys: Vec<String>,
    /// The source's watermark, read before the listing.
    pub watermark: u64,
}

/// Every current entry of the source.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// The current puts, in key order.
    pub entries: Vec<Entry>,
    /// The source's watermark at the snapshot.
    pub watermark: u64,
    /// The source's history, with the stamp of its entry at `watermark`, read with the
    /// snapshot or before it (see [`Source::lineage_at`]).
    pub lineage: Lineage,
}

/// A snapshot read part by part ([`Source::snapshot_parts`]): the watermark it was read
/// at, and its current puts in key order, in parts of at most the length asked for.
///
/// Every part comes from the one point in time the watermark was read at, however long
/// the reader takes between parts: writes made meanwhile show in none of them. A follower
/// reading it keeps only the entries that differ from its cache, so a resync after a
/// short outage costs a part's memory, not a second copy of the source.
pub struct SnapshotParts<'a> {
    /// The source's watermark at the snapshot.
    pub watermark: u64,
    /// The source's history, with the stamp of its entry at `watermark`, read with the
    /// snapshot or before it (see [`Source::lineage_at`]).
    pub lineage: Lineage,
    /// The parts, in key order; none for an empty source. An error ends the read: the
    /// follower drops what it kept and reads the snapshot again after a backoff.
    pub parts: BoxStream<'a, Result<Vec<Entry>>>,
}

impl std::fmt::Debug for SnapshotParts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotParts")
            .field("watermark", &self.watermark)
            .field("lineage", &self.lineage)
            .finish_non_exhaustive()
    }
}

/// The durable, keyed source of truth (the registry).
///
/// Each mutation gets the next seq: positive and strictly increasing. Removals leave
/// tombstones carrying their seq, so [`changes_since`](Self::changes_since) covers them and
/// costs what changed, not the size of the source.
pub trait Source: Send + Sync {
    /// Writes `value` under `key`; returns the mutation's seq once it is durable.
    fn put(&self, key: &str, value: Vec<u8>) -> impl Future<Output = Result<u64>> + Send;

    /// Writes `value` under `key` only if the key's current seq is `expected` (0: the key
    /// must be absent). Otherwise [`Error::Conflict`](crate::Error::Conflict).
    fn update(
        &self,
        key: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Removes `key`, leaving a tombstone; returns its seq, or `None` if the key was absent
    /// (nothing changed, no seq was used).
    fn remove(&self, key: &str) -> impl Future<Output = Result<Option<u64>>> + Send;

    /// The seq of the last mutation (0 for a source never written).
    fn watermark(&self) -> impl Future<Output = Result<u64>> + Send;

    /// Mutations after `since`, including removals, or [`Changes::Compacted`].
    fn changes_since(&self, since: u64) -> impl Future<Output = Result<Changes>> + Send;

    /// Every current entry and the watermark, read at one point in time.
    fn snapshot(&self) -> impl Future<Output = Result<Snapshot>> + Send;

    /// The snapshot [`snapshot`](Self::snapshot) reads, served in parts of at most
    /// `part_len` entries (at least one) in key order, all from one point in time (see
    /// [`SnapshotParts`]). The default reads the whole snapshot and hands it out in parts,
    /// which holds it all at once: override it where the source can read a point in time
    /// piece by piece (a read transaction, a consumer, a copy-on-write map).
    fn snapshot_parts(
        &self,
        part_len: usize,
    ) -> impl Future<Output = Result<SnapshotParts<'_>>> + Send {
        async move {
            let snap = self.snapshot().await?;
            let part_len = part_len.max(1);
            let mut entries = snap.entries.into_iter();
            let parts = std::iter::from_fn(move || {
                let part: Vec<Entry> = entries.by_ref().take(part_len).collect();
                (!part.is_empty()).then_some(Ok(part))
            });
            Ok(SnapshotParts {
                watermark: snap.watermark,
                lineage: snap.lineage,
                parts: futures::stream::iter(parts).boxed(),
            })
        }
    }

    /// Which history the source serves, and the stamp of its entry at `seq` (see
    /// [`Lineage`]): the history is made when the source is made and kept for its life
    /// (and by a backup of it); the stamp is one no other mutation at `seq` gets, `None`
    /// where the source no longer holds that entry (compacted, overwritten) or `seq` is 0.
    ///
    /// A follower checks it against what it kept with its watermark on every reopen of a
    /// feed that is the source's own history and after every reconcile, so a source
    /// recreated, or restored from a backup and written past the follower's watermark, is
    /// taken as the new history it is — even by a follower that was down meanwhile. The
    /// default tells nothing: such a source is noticed only while its head is below a
    /// follower's watermark.
    fn lineage_at(&self, seq: u64) -> impl Future<Output = Result<Lineage>> + Send {
        let _ = seq;
        async { Ok(Lineage::default()) }
    }

    /// [`changes_since`](Self::changes_since) and [`lineage_at`](Self::lineage_at)`(since)`
    /// together: what a reconcile reads. The lineage must not be read before the changes (a
    /// restore between the two would go unseen); a source that can read both at one point
    /// (a lock, a read transaction) should, since a compaction between the two reads can
    /// take the entry at `since` and leave its history unconfirmed. The default reads the
    /// changes, then the lineage.
    fn changes_and_lineage(
        &self,
        since: u64,
    ) -> impl Future<Output = Result<(Changes, Lineage)>> + Send {
        async move {
            let changes = self.changes_since(since).await?;
            let lineage = self.lineage_at(since).await?;
            Ok((changes, lineage))
        }
    }

    /// `key`'s current value and its seq, or `None` if absent.
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Versioned>>> + Send;

    /// `key`'s current value, as [`get`](Self::get), and the source's watermark read at
    /// the same point in time, or before the value where a source cannot read both at once
    /// (the default). A follower fetching the key a mutation marker named needs both: a
    /// key found absent by a source whose watermark is below the marker's seq was not
    /// removed after that mutation, and a watermark below the marker says the history the
    /// source serves never made it (a marker of a replaced history). The watermark must be
    /// the head of that history (its leader's, its primary's), never a lagging replica's;
    /// the value may come from a replica. Override it where one read can return both.
    fn get_at(&self, key: &str) -> impl Future<Output = Result<ValueAt>> + Send {
        async move {
            let watermark = self.watermark().await?;
            let value = self.get(key).await?;
            Ok(ValueAt { value, watermark })
        }
    }

    /// Every key the source may hold (a key listed need not hold a value; a key not listed
    /// holds none), and its watermark read before the listing: what a follower's periodic
    /// presence check compares its cache with, to catch keys that vanished without a
    /// message. Cheaper than a snapshot (no values). `Ok(None)`: this source cannot list.
    fn present_keys(&self) -> impl Future<Output = Result<Option<PresentKeys>>> + Send {
        async { Ok(None) }
    }

    /// The prefix this source is a view over, if it serves only part of its keys (a
    /// bucket or registry followed over a key prefix): its reads, listings and feed then
    /// carry only keys under it, and a follower task over it keeps only those keys, even
    /// from announcements ([`Follower::within`](tidemark_core::Follower::within)). `None`
    /// (the default): every key.
    fn key_prefix(&self) -> Option<&KeyPrefix> {
        None
    }

    /// The first seq [`changes_since`](Self::changes_since) can still serve from
    /// (`since + 1 >= first_available`): 1 when nothing was ever compacted.
    fn first_available(&self) -> impl Future<Output = Result<u64>> + Send;

    /// Reconnects of the client beneath this source, where it has one that reconnects on
    /// its own (a NATS connection): a counter bumped on every reconnect. A follower then
    /// retries at once whatever waits out a backoff grown while the server was away.
    /// `None` (the default): the source has no such path (in-process, a local file).
    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// A cheap question to the server beneath this source that changes nothing there (a
    /// stream-info request for the bucket's stream on NATS, which only the stream's
    /// leader answers): it resolves `Ok` when the server answered and the source is there
    /// (whatever else it said: a refusal shows the path works), and fails when it was not
    /// answered (no reply, no leader) or answered that the source is not there (a bucket
    /// deleted): either way the follower cannot read it now. A follower that backs off
    /// sends one now and then ([`ProbePolicy`](tidemark_core::ProbePolicy): one out at a
    /// time, given up after its timeout); an answer after a probe failed means the path
    /// stalled and is back without a reconnect (a server paused and continued, a stream
    /// that elected a leader, a bucket made again), and the follower retries at once
    /// ([`Input::Resumed`](tidemark_core::Input::Resumed)). So does a request that was out
    /// all along, once a grace has passed
    /// ([`Asking`](tidemark_core::Asking)): its reply may never come. The future owns what
    /// it needs, so it may outlive the call. `None` (the default): nothing to probe
    /// (in-process, a local file).
    fn probe(&self) -> Option<impl Future<Output = Result<()>> + Send + 'static> {
        None::<std::future::Ready<Result<()>>>
    }
}
