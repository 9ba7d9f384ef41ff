//! Feeds: streams of entries a follower replays from a seq and then keeps following.

use std::future::Future;

use futures::FutureExt;

use tidemark_core::{Entry, FeedInfo, Follow};
use tokio::sync::watch;

use crate::error::Result;

/// One thing a feed delivered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeedItem {
    /// An entry.
    Entry(Entry),
    /// Something at `position` that is not an entry (a payload that is not an event, a key
    /// that is not UTF-8). The follower counts it and checkpoints past it: a data problem,
    /// never an error.
    Undecodable {
        /// Its position on the feed.
        position: u64,
        /// Its seq, where the feed knows it.
        seq: Option<u64>,
        /// What was wrong.
        reason: String,
    },
    /// The head the initial sync must reach moved up: a read that cannot race found the
    /// source past the head the feed reported when it opened (a key overwritten while the
    /// sync read its old revision is only above it). Sent before the entry that reaches
    /// the old head; a follower that is ready already ignores it.
    Head(u64),
}

/// An open feed: what it reported, and its items.
#[derive(Debug)]
pub struct Opened<S> {
    /// First available seq, head, continuity, whether it checkpoints.
    pub info: FeedInfo,
    /// The items, from the requested start on.
    pub stream: S,
}

/// The items of an open feed. It ends cleanly (`None`) or fails (`Some(Err)`); either way
/// the follower reopens it from its watermark + 1.
pub trait FeedStream: Send {
    /// The next item, waiting for one if the feed is caught up.
    ///
    /// Must be cancel-safe: the follower task selects over it together with wakes, timers
    /// and stop, and drops it when another branch wins. A dropped call must lose no item
    /// (buffer what was read, like `tokio::io::AsyncReadExt::read` or an mpsc receiver).
    fn next(&mut self) -> impl Future<Output = Option<Result<FeedItem>>> + Send;

    /// Appends to `into`, in order, up to `max` items that are ready now, without
    /// waiting: what [`next`](Self::next) would give at once, call after call, until it
    /// would wait. The stream's end (`None`) or an error, once reached, is appended too and
    /// is the last item. Returns how many were appended.
    ///
    /// The follower task takes a turn's items this way. The default polls `next` once per
    /// item; a stream that reads in batches (the memory source's log, 1,024 entries a
    /// lock) hands over what it already holds without a future per item.
    fn next_ready(&mut self, max: usize, into: &mut Vec<Option<Result<FeedItem>>>) -> usize {
        take_ready(self, max, into, |_| true)
    }
}

/// What [`FeedStream::next_ready`] does by default, for a stream that overrides it only to
/// stop early: appends what [`next`](FeedStream::next) gives at once, call after call,
/// while `more(stream)` holds (a stream holding an item for a read that cannot be ready at
/// once stops there), up to `max` items or the stream's end or error. Returns how many
/// were appended.
pub fn take_ready<S: FeedStream + ?Sized>(
    stream: &mut S,
    max: usize,
    into: &mut Vec<Option<Result<FeedItem>>>,
    mut more: impl FnMut(&S) -> bool,
) -> usize {
    let mut taken = 0;
    while taken < max && more(stream) {
        let Some(item) = stream.next().now_or_never() else {
            break;
        };
        let last = !matches!(item, Some(Ok(_)));
        into.push(item);
        taken += 1;
        if last {
            break;
        }
    }
    taken
}

/// A feed of entries: a source's change log (gapless), a KV watch (sparse), or an events
/// stream whose positions differ from seqs.
pub trait Feed: Send + Sync {
    /// How this feed must be followed: [`Follow::Replay`] for a source's own history (a
    /// change log, a KV bucket), [`Follow::Announcements`] for a stream of announcements
    /// that may miss, repeat or reorder changes. The follower task takes it from here, so
    /// a follower cannot be wired to a feed it cannot follow. The [`FeedInfo`] an open
    /// feed reports says the same.
    const FOLLOW: Follow;

    /// The stream an open feed yields.
    type Stream: FeedStream + 'static;

    /// Opens the feed at seq `from`. A feed with durable cursors (an events stream) starts
    /// after `after_position` when given, else at its beginning; a feed keyed by seq (a
    /// change log, a KV bucket) starts at `from`.
    fn open(
        &self,
        from: u64,
        after_position: Option<u64>,
    ) -> impl Future<Output = Result<Opened<Self::Stream>>> + Send;

    /// Reconnects of the client beneath this feed, as
    /// [`Source::reconnects`](crate::Source::reconnects): `None` by default. A follower
    /// whose source and feed share one client hears each reconnect once.
    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// A question about this feed's own path, as
    /// [`Source::probe`](crate::Source::probe), for a feed that is not the source's
    /// history (an events stream beside a bucket, which on a cluster elects its leader
    /// apart from the bucket's): a follower's probe is answered when its source's and its
    /// feed's are. `None` (the default): the source's probe speaks for the feed too.
    fn probe(&self) -> Option<impl Future<Output = Result<()>> + Send + 'static> {
        None::<std::future::Ready<Result<()>>>
    }
}
