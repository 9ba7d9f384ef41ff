//! Deliberately naive follower strategies, which the oracle must catch diverging.

use std::sync::Arc;

use tidemark::tidemark_core::{Continuity, FeedInfo, Follow};
use tidemark::{Feed, Held, Lineage, Opened, Result, Sink, Source};
use tidemark_jetstream::Step;
use tidemark_memory::MemoryCacheSink;

use crate::clients::remote::{Remote, RemoteEvents, RemoteStream};

/// "Watch new changes only": opens the change log at the source's current head, whatever
/// the follower has applied, and claims there is nothing to sync. The common KV watcher
/// that starts empty and loses everything written while it reconnects.
#[derive(Clone, Debug)]
pub struct NewOnlyFeed(pub Remote);

impl Feed for NewOnlyFeed {
    const FOLLOW: Follow = Follow::Replay;
    type Stream = RemoteStream;

    async fn open(&self, _from: u64, _after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        let head = self.0.watermark().await?;
        let opened = Feed::open(&self.0, head + 1, None).await?;
        Ok(Opened {
            // What a KV watch of new changes reports: the stream's real head (so a
            // reopen never looks like a source that went back), and nothing compacted.
            info: FeedInfo {
                first_available: 0,
                head,
                continuity: Continuity::Sparse,
                checkpoints: false,
                follow: Follow::Replay,
                lineage: Default::default(),
            },
            stream: opened.stream,
        })
    }
}

/// "No reconcile": an announcements stream that claims to be the source's own history, so
/// the follower replays it and never reads the source. Every announcement a writer lost
/// between commit and announce is lost for good.
#[derive(Clone, Debug)]
pub struct EventsAsReplay(pub RemoteEvents);

impl Feed for EventsAsReplay {
    const FOLLOW: Follow = Follow::Replay;
    type Stream = RemoteStream;

    async fn open(&self, from: u64, after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        let mut opened = Feed::open(&self.0, from, after_position).await?;
        opened.info.follow = Follow::Replay;
        Ok(opened)
    }
}

/// "A restart forgets the index": a persisted cache that, on a warm start, gives back its
/// watermark but tells the follower nothing of the keys it holds. The follower resumes
/// where the store left off, believes its cache empty, and skips the removal of every key
/// cached before the restart.
#[derive(Debug)]
pub struct ForgetsIndex(pub MemoryCacheSink);

impl<V: AsRef<[u8]> + Send> Sink<V> for ForgetsIndex {
    async fn put(&mut self, key: Arc<str>, seq: u64, value: V) -> Result<()> {
        self.0.put(key, seq, value).await
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        Sink::<V>::remove(&mut self.0, key, seq).await
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        Sink::<V>::commit(&mut self.0, watermark, lineage).await
    }

    async fn rollback(&mut self) {
        Sink::<V>::rollback(&mut self.0).await;
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        Ok(Sink::<V>::resume(&mut self.0)
            .await?
            .map(|held| Held::new(held.watermark, 0).with_lineage(held.lineage)))
    }

    async fn seqs_of(&mut self, _keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        Ok(Vec::new())
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        Ok(Vec::new())
    }
}

/// "The persisted watermark is saved before its rows": a persisted cache whose commit
/// writes the watermark in one durable write and the batch's rows in a second. A crash
/// between the two leaves a store whose watermark claims rows it does not have, and the
/// restarted follower resumes past them.
#[derive(Debug)]
pub struct WatermarkFirst(pub MemoryCacheSink);

impl<V: AsRef<[u8]> + Send> Sink<V> for WatermarkFirst {
    async fn put(&mut self, key: Arc<str>, seq: u64, value: V) -> Result<()> {
        self.0.put(key, seq, value).await
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        Sink::<V>::remove(&mut self.0, key, seq).await
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        let store = self.0.store().clone();
        store.begin_commit().await?;
        let rows = self.0.take_batch();
        store.write(Vec::new(), Some((watermark, lineage))).await;
        store.write(rows, None).await;
        store.end_commit().await;
        Ok(())
    }

    async fn rollback(&mut self) {
        Sink::<V>::rollback(&mut self.0).await;
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        Sink::<V>::resume(&mut self.0).await
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        Sink::<V>::seqs_of(&mut self.0, keys).await
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        Sink::<V>::all_seqs(&mut self.0).await
    }
}

/// A durable follower's sink: the persisted cache, or one of the two naive ones over it.
/// One type for the three, so the follower task is built once for them (each sink type
/// is another copy of the whole task in the simulator's build); every call goes to the
/// variant's own.
#[derive(Debug)]
pub enum Durable {
    /// The persisted cache as tidemark keeps it.
    Store(MemoryCacheSink),
    /// [`ForgetsIndex`].
    ForgetsIndex(ForgetsIndex),
    /// [`WatermarkFirst`].
    WatermarkFirst(WatermarkFirst),
}

/// Calls `$call` on the sink inside a [`Durable`], whichever it is.
macro_rules! each {
    ($self:expr, $s:ident => $call:expr) => {
        match $self {
            Durable::Store($s) => $call,
            Durable::ForgetsIndex($s) => $call,
            Durable::WatermarkFirst($s) => $call,
        }
    };
}

impl Sink<String> for Durable {
    // The persisted cache's: the naive ones over it say they hold none.
    const HOLDS_VALUES: bool = true;

    fn holds(&self, key: &str, new: &String, same: &dyn Fn(&String, &String) -> bool) -> bool {
        match self {
            Durable::Store(s) => Sink::<String>::holds(s, key, new, same),
            Durable::ForgetsIndex(_) | Durable::WatermarkFirst(_) => false,
        }
    }

    async fn restamp(&mut self, keys: Vec<(Arc<str>, u64)>) -> Result<()> {
        each!(self, s => Sink::<String>::restamp(s, keys).await)
    }

    async fn put(&mut self, key: Arc<str>, seq: u64, value: String) -> Result<()> {
        each!(self, s => Sink::<String>::put(s, key, seq, value).await)
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        each!(self, s => Sink::<String>::remove(s, key, seq).await)
    }

    fn reserve(&mut self, keys: usize) {
        each!(self, s => Sink::<String>::reserve(s, keys));
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        each!(self, s => Sink::<String>::commit(s, watermark, lineage).await)
    }

    async fn rollback(&mut self) {
        each!(self, s => Sink::<String>::rollback(s).await);
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        each!(self, s => Sink::<String>::resume(s).await)
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        each!(self, s => Sink::<String>::seqs_of(s, keys).await)
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        each!(self, s => Sink::<String>::all_seqs(s).await)
    }

    fn ready(&mut self, watermark: u64) {
        each!(self, s => Sink::<String>::ready(s, watermark));
    }

    async fn drain(&mut self) {
        each!(self, s => Sink::<String>::drain(s).await);
    }
}

/// "The replay ends on pending == 0": the end of a JetStream replay as tidemark took it
/// before `tidemark_jetstream::Replay` — done once the consumer delivered the head read
/// at the start and says nothing is pending (or goes idle there), never confirmed by a
/// read that cannot race. nats-server's pending count reads one low for a moment after an
/// overwrite removes a revision the consumer had not delivered (the new message is
/// counted only when a queued signal runs), so the replay can end with that key missing:
/// its old revision is gone, and its new one is above the end.
#[derive(Clone, Copy, Debug)]
pub struct PendingEnd {
    head: u64,
    seen: u64,
}

impl PendingEnd {
    /// A replay whose consumer delivers from `from`, reading to `head`.
    #[must_use]
    pub fn new(from: u64, head: u64) -> Self {
        PendingEnd {
            head,
            seen: from.saturating_sub(1),
        }
    }

    /// Done at once when nothing at or after `from` was present.
    #[must_use]
    pub fn start(&self) -> Step {
        if self.head <= self.seen {
            Step::Done { through: self.seen }
        } else {
            Step::Read
        }
    }

    /// A message at `seq` with the consumer's `pending` count: done at the head when the
    /// count says nothing more is pending.
    pub fn on_message(&mut self, seq: u64, pending: u64) -> Step {
        self.seen = self.seen.max(seq);
        self.idle().filter(|_| pending == 0).unwrap_or(Step::Read)
    }

    /// An idle heartbeat: done when the head was delivered.
    pub fn on_idle(&mut self) -> Step {
        self.idle().unwrap_or(Step::Read)
    }

    fn idle(&self) -> Option<Step> {
        (self.seen >= self.head).then_some(Step::Done { through: self.seen })
    }
}

/// "Keyless ticks": the sweep scheduler's queue enqueues each tick's job without its
/// (schedule, tick) key, as a plain enqueue: a tick whose scheduler died after the enqueue,
/// before recording it, is enqueued again by the pass that finds it pending.
#[derive(Clone, Debug)]
pub struct KeylessTicks(pub Remote);

impl tidemark::Queue for KeylessTicks {
    async fn enqueue(&self, job: tidemark::Job) -> Result<tidemark::JobId> {
        tidemark::Queue::enqueue(&self.0, job).await
    }
    async fn enqueue_tick(
        &self,
        _tick: &tidemark::TickKey,
        job: tidemark::Job,
    ) -> Result<Option<tidemark::JobId>> {
        tidemark::Queue::enqueue(&self.0, job).await.map(Some)
    }
    async fn get(&self, id: tidemark::JobId) -> Result<Option<tidemark::JobRecord>> {
        tidemark::Queue::get(&self.0, id).await
    }
    async fn lease(&self, visibility: std::time::Duration) -> Result<Option<tidemark::Leased>> {
        self.0.lease(visibility).await
    }
    async fn ack(&self, lease: &tidemark::Leased) -> Result<()> {
        self.0.ack(lease).await
    }
    async fn fail(
        &self,
        lease: &tidemark::Leased,
        error: &str,
        retry_after: std::time::Duration,
    ) -> Result<tidemark::JobState> {
        self.0.fail(lease, error, retry_after).await
    }
    async fn renew(&self, lease: &tidemark::Leased, visibility: std::time::Duration) -> Result<()> {
        self.0.renew(lease, visibility).await
    }
    async fn dead_letter(&self, lease: &tidemark::Leased, error: &str) -> Result<()> {
        self.0.dead_letter(lease, error).await
    }
    async fn dead_letters(
        &self,
        after: Option<tidemark::JobId>,
        limit: usize,
    ) -> Result<Vec<tidemark::JobRecord>> {
        self.0.dead_letters(after, limit).await
    }
    async fn requeue(&self, id: tidemark::JobId) -> Result<tidemark::JobId> {
        self.0.requeue(id).await
    }
    async fn counts(&self) -> Result<tidemark::JobCounts> {
        self.0.counts().await
    }
    async fn remove_finished(&self, retention: tidemark::JobRetention) -> Result<u64> {
        self.0.remove_finished(retention).await
    }
}
