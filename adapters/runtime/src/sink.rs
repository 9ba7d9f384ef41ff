//! Where a follower's decisions land: a cache, a persisted cache, or a user's worker.
//! A sink owns its durability: it applies a batch, commits it with its watermark, and on
//! start says what it already holds.

use std::future::Future;
use std::sync::Arc;

use crate::error::Result;
use tidemark_core::{Ahead, Lineage};

/// How many waiting feed items one turn takes at most during the initial sync, when
/// nobody waits on a turn but the whole sync: one commit per 16k changes.
pub(crate) const SYNC_FEED_BATCH: usize = 16_384;

/// One change to a stored cache, as a durable sink buffers it until its commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOp {
    /// Upsert `key` to `value` as of `seq`.
    Put {
        /// The key.
        key: String,
        /// The seq of the value.
        seq: u64,
        /// The value's bytes.
        value: Vec<u8>,
    },
    /// Remove `key` as of `seq`.
    Remove {
        /// The key.
        key: String,
        /// The seq of the removal.
        seq: u64,
    },
}

impl CacheOp {
    /// The seq of the change.
    #[must_use]
    pub fn seq(&self) -> u64 {
        match self {
            CacheOp::Put { seq, .. } | CacheOp::Remove { seq, .. } => *seq,
        }
    }

    /// The key it changes.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            CacheOp::Put { key, .. } | CacheOp::Remove { key, .. } => key,
        }
    }

    /// Keeps only the last op per key, in order: what a batch that touched a key twice
    /// leaves behind.
    #[must_use]
    pub fn coalesce(ops: Vec<CacheOp>) -> Vec<CacheOp> {
        let mut last: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            last.insert(op.key(), i);
        }
        let keep: Vec<bool> = (0..ops.len())
            .map(|i| last.get(ops[i].key()) == Some(&i))
            .collect();
        drop(last);
        ops.into_iter()
            .zip(keep)
            .filter_map(|(op, keep)| keep.then_some(op))
            .collect()
    }
}

/// What a durable sink already holds when a follower starts: its watermark, how many
/// keys, and what it committed ahead of the watermark. The follower resumes from
/// `watermark`+1 and asks the sink for the seqs of keys only when the delta names them
/// ([`Sink::seqs_of`]), so a warm start costs the delta, not the cache's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The watermark committed with the sink's last batch.
    pub watermark: u64,
    /// How many keys it holds.
    pub keys: usize,
    /// What it committed ahead of `watermark` and still holds: every put with a higher
    /// seq (with its bytes) and every removal with a higher seq, that no later commit
    /// replaced — on an announcements stream, the announcements no read of the source had
    /// confirmed. The follower holds each unconfirmed again, so the first read checks it
    /// (see [`Follower::remember_ahead`](tidemark_core::Follower::remember_ahead)).
    ///
    /// `None`: the sink does not keep them. The follower then lists every key at start
    /// on an announcements stream (a cost in the cache's size) and checks those past the
    /// watermark by seq alone; a removal committed ahead leaves it nothing to check, so a
    /// crash before the confirming read can lose the key.
    pub ahead: Option<Vec<Ahead>>,
    /// What the follower knew of its source's history when the sink committed
    /// `watermark` (see [`Lineage`]): the first read of the source checks it, so a source
    /// recreated or restored from a backup while the follower was down is noticed. A sink
    /// that does not keep it (the default) leaves a restore made while it was down
    /// unnoticed once the new history passes its watermark.
    pub lineage: Lineage,
}

impl Held {
    /// A sink at `watermark` holding `keys` keys, that does not say what it committed
    /// ahead of its watermark ([`with_ahead`](Self::with_ahead) says it).
    #[must_use]
    pub fn new(watermark: u64, keys: usize) -> Self {
        Held {
            watermark,
            keys,
            ahead: None,
            lineage: Lineage::default(),
        }
    }

    /// The same, with the lineage the sink committed with its watermark.
    #[must_use]
    pub fn with_lineage(mut self, lineage: Lineage) -> Self {
        self.lineage = lineage;
        self
    }

    /// The same, with what the sink committed ahead of its watermark (an empty list: it
    /// keeps them, and holds none).
    #[must_use]
    pub fn with_ahead(mut self, ahead: Vec<Ahead>) -> Self {
        self.ahead = Some(ahead);
        self
    }
}

/// Receives the changes a follower decided, in order, in batches.
///
/// The driver applies a batch with [`put`](Self::put) and [`remove`](Self::remove), then
/// calls [`commit`](Self::commit) with the watermark the batch reaches, before it reports
/// readiness, answers a reconcile, saves a durable cursor or sends a request that may
/// wait. If a call fails, the driver calls [`rollback`](Self::rollback) and goes back to
/// the last commit: everything since is decided again, so a durable sink never holds a
/// watermark its rows do not cover. A retryable failure ([`Error::is_retryable`]) is
/// retried after the follower's failure backoff; any other (a worker's handler error) ends
/// the follower task with it, and its supervisor's restart policy decides what next.
///
/// [`Error::is_retryable`]: crate::Error::is_retryable
pub trait Sink<V>: Send {
    /// Whether a call can fail. A sink that never fails (the in-memory cache) spares the
    /// follower the bookkeeping that a rewind needs.
    const FALLIBLE: bool = true;

    /// Whether it keeps its values in memory and says which it holds
    /// ([`holds`](Self::holds)) and can keep one as of a new seq
    /// ([`restamp`](Self::restamp)). The follower then takes a new history (a source
    /// restored from a backup, a bucket recreated and refilled) without a second copy of
    /// each value it already holds: see [`Cached`](tidemark_core::Cached).
    const HOLDS_VALUES: bool = false;

    /// Upsert `key` to `value` as of `seq`. The key is shared with the follower's index
    /// (a clone is a count, not a copy): a sink that keeps keys can keep this one.
    fn put(&mut self, key: Arc<str>, seq: u64, value: V)
    -> impl Future<Output = Result<()>> + Send;

    /// Remove `key` as of `seq`.
    fn remove(&mut self, key: Arc<str>, seq: u64) -> impl Future<Output = Result<()>> + Send;

    /// Whether the value committed for `key` is `new`: by `same` (the decoder's
    /// [`Decode::same`](tidemark_core::Decode::same)) against a value it keeps, or by its
    /// own means (a store of bytes compares bytes); `false` when it holds none. Asked only
    /// of a sink that says [`HOLDS_VALUES`](Self::HOLDS_VALUES), between commits.
    fn holds(&self, key: &str, new: &V, same: &dyn Fn(&V, &V) -> bool) -> bool {
        let _ = (key, new, same);
        false
    }

    /// Each of `keys` keeps the value it holds, now as of its seq (a new history's
    /// entries equal to what it held: [`Apply::Restamp`](tidemark_core::Apply::Restamp)),
    /// in order with the batch's other changes. Asked only of a sink that says
    /// [`HOLDS_VALUES`](Self::HOLDS_VALUES), and only for keys it said it holds; the
    /// default refuses (a sink that says it holds values must restamp them).
    fn restamp(&mut self, keys: Vec<(Arc<str>, u64)>) -> impl Future<Output = Result<()>> + Send {
        let _ = keys;
        async {
            Err(crate::Error::Worker {
                worker: "sink".into(),
                reason: "it says it holds values (HOLDS_VALUES) but cannot restamp them".into(),
            })
        }
    }

    /// A hint, during an initial sync: about `keys` more keys than it held at its last
    /// commit are coming (the feed's pending count, bounded by
    /// [`presize_for`](tidemark_core::presize_for) before the first key and by
    /// [`presize_more`](tidemark_core::presize_more) each time the follower's own room
    /// fills: [`Follower::presized`]). A sink that keeps its keys in a table in memory
    /// makes room for them at once rather than growing it on the way; the default does
    /// nothing.
    ///
    /// [`Follower::presized`]: tidemark_core::Follower::presized
    fn reserve(&mut self, keys: usize) {
        let _ = keys;
    }

    /// Makes everything applied since the last commit durable together with `watermark`
    /// and what the follower knows of its source's history there, `lineage` (one
    /// transaction for a persisted cache). Called at every batch boundary, also when
    /// nothing was applied but the watermark or the lineage moved. A persisted sink keeps
    /// the lineage and gives it back with [`resume`](Self::resume) ([`Held::lineage`]).
    fn commit(
        &mut self,
        watermark: u64,
        lineage: Lineage,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (watermark, lineage);
        async { Ok(()) }
    }

    /// Discards everything applied since the last commit (after a failed call).
    fn rollback(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// What the sink already holds, read once when the follower first runs: `None` for a
    /// sink that starts empty.
    ///
    /// A persisted sink keeps, beside its rows, what it committed ahead of each commit's
    /// watermark ([`Held::ahead`]): a put or removal whose seq is above it, kept until a
    /// commit's watermark passes it or a later commit changes the key again (a commit
    /// whose watermark went back, a resync onto a restored source, drops the rest). That
    /// list is small (the announcements not yet confirmed), so a warm start reads it
    /// whole. A sink that leaves it `None` is still correct for replayed feeds; on an
    /// announcements stream it costs a listing of every key at start and cannot bring
    /// back a key a claimed removal took before a crash.
    fn resume(&mut self) -> impl Future<Output = Result<Option<Held>>> + Send {
        async { Ok(None) }
    }

    /// The seqs at which the sink holds those of `keys` it holds (asked only after a warm
    /// start, for keys a batch names that the follower does not know yet).
    fn seqs_of(
        &mut self,
        keys: Vec<String>,
    ) -> impl Future<Output = Result<Vec<(String, u64)>>> + Send {
        let _ = keys;
        async { Ok(Vec::new()) }
    }

    /// The seq of every key the sink holds (asked only after a warm start, before a
    /// resync decides which keys the source no longer has).
    fn all_seqs(&mut self) -> impl Future<Output = Result<Vec<(String, u64)>>> + Send {
        async { Ok(Vec::new()) }
    }

    /// The initial sync completed at `watermark` (after the batch that reached it was
    /// committed).
    fn ready(&mut self, watermark: u64) {
        let _ = watermark;
    }

    /// The follower is stopping: finish in-flight work (within the shutdown budget).
    fn drain(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}
