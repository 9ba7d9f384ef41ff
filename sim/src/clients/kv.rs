//! A KV bucket on the source host's JetStream ([`crate::hosts::jetstream`]), read as the NATS
//! adapter's `KvBucket` reads one: every decision about what the server says — when a
//! replay is complete, when an initial sync may say ready, the head it must reach, the
//! first seq still served, whether a moved first seq is compaction — is taken by
//! tidemark-jetstream's pieces ([`Replay`], [`ReadyGate`], [`head`], [`first_available`],
//! [`per_key_only`]), fed the deliveries, pending counts and stream facts the source host
//! sends over the wire. The async code here only moves facts
//! in and carries decisions out, as in `tidemark-nats`.
//!
//! A naive client ([`RemoteKv::trusting_pending`]) ends its replays on the consumer's
//! pending count and lets its feed say ready at the head read at open.

use std::collections::{BTreeMap, VecDeque};

use tidemark::tidemark_core::{Entry, FeedInfo, Follow, Op};
use tidemark::{
    Changes, Error, Feed, FeedItem, FeedStream, Opened, PresentKeys, Result, Snapshot, Source,
    ValueAt, Versioned,
};
use tidemark_jetstream::{
    Confirmed, Gate, LastPresent, Limits, ReadyGate, Replay, Step, StreamState, first_available,
    head, per_key_only,
};
use tokio::sync::watch;

use crate::clients::naive::PendingEnd;
use crate::clients::remote::Remote;
use crate::wire::{self, FrameReader, Request, Response};
use crate::wire::{JsAnswer, JsCall, JsDelivery, JsStart};

/// How long a request of the JetStream client waits for its reply: async-nats's default
/// request timeout. A reply that never comes (reads left unanswered by a stream with no
/// leader: [`Silence`](crate::hosts::source::Silence)) holds a request this long unless
/// the follower gives it up.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A follower's client of the bucket on the source host. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RemoteKv {
    remote: Remote,
    /// The follower whose feeds these are, named to the source host for the oracle.
    follower: String,
    /// Deliveries asked for at a time.
    batch: u32,
    /// Ends replays on the pending count and opens no ready gate (a naive client).
    trusts_pending: bool,
}

impl RemoteKv {
    /// The bucket behind `remote`, read by `follower`, `batch` deliveries at a time.
    #[must_use]
    pub fn new(remote: Remote, follower: impl Into<String>, batch: u32) -> Self {
        RemoteKv {
            remote,
            follower: follower.into(),
            batch: batch.max(1),
            trusts_pending: false,
        }
    }

    /// A naive client: a replay ends once the consumer delivered the head read at the
    /// start and says nothing is pending ([`PendingEnd`]), and an initial sync is ready
    /// when it reaches the head read at open, confirmed by nothing.
    #[must_use]
    pub fn trusting_pending(mut self) -> Self {
        self.trusts_pending = true;
        self
    }

    async fn call(&self, port: &'static str, call: JsCall) -> Result<JsAnswer> {
        match self
            .remote
            .call_within(port, Request::JetStream(call), REQUEST_TIMEOUT)
            .await?
        {
            Response::JetStream(answer) => Ok(answer),
            r => Err(unexpected(port, &r)),
        }
    }

    /// The stream's state, read now.
    async fn info(&self, port: &'static str) -> Result<StreamState> {
        Ok(self.info_and_limits(port).await?.0)
    }

    /// The stream's state and limits, read now.
    async fn info_and_limits(&self, port: &'static str) -> Result<(StreamState, Limits)> {
        let answer = self.call(port, JsCall::Info).await?;
        answer
            .state()
            .ok_or_else(|| unexpected_answer(port, &answer))
    }

    /// The last message present now: a read that cannot race.
    async fn last_present(&self, port: &'static str) -> Result<LastPresent> {
        match self.call(port, JsCall::LastPresent).await? {
            JsAnswer::LastPresent(last) => Ok(last.map_or(LastPresent::None, LastPresent::At)),
            a => Err(unexpected_answer(port, &a)),
        }
    }

    /// The head an initial sync must reach ([`head`]): the last message present (0 if
    /// none).
    async fn head(&self, state: &StreamState, port: &'static str) -> Result<u64> {
        if state.messages == 0 {
            return Ok(0);
        }
        Ok(head(state, self.last_present(port).await?))
    }

    /// Replays the bucket from `start`, handing each entry to `take`, until the end
    /// decides it is complete ([`Replay`]: a read that cannot race confirms nothing is
    /// above what was delivered; the naive client's [`PendingEnd`]: the pending count).
    /// Returns the stream's state read once the consumer existed, and the highest seq
    /// delivered.
    async fn replay(
        &self,
        start: JsStart,
        port: &'static str,
        headers_only: bool,
        mut take: impl FnMut(Entry),
    ) -> Result<(StreamState, u64)> {
        let from = match start {
            JsStart::Seq(seq) => seq,
            JsStart::LastPerKey => 1,
        };
        // The consumer first, the head after: a key overwritten while the head is read is
        // then delivered at or below it.
        let consume = JsCall::Consume {
            start,
            headers_only,
            feed_of: None,
        };
        let mut consumer = Consumer::open(&self.remote, consume, self.batch, port).await?;
        let state = self.info(port).await?;
        let head = self.head(&state, port).await?;
        let mut end = End::new(self.trusts_pending, from, head);
        let mut step = end.start();
        loop {
            match step {
                Step::Done { through } => return Ok((state, through)),
                Step::Stalled { seen, head } => {
                    return Err(Error::unavailable(
                        port,
                        format!("replay stalled at {seen} below the stream's last message {head}"),
                    ));
                }
                Step::Confirm => {
                    let last = self.last_present(port).await?;
                    step = end.on_confirmed(last.seq());
                }
                Step::Read => {
                    step = match consumer.next(port).await? {
                        Seen::Idle => end.on_idle(),
                        Seen::Message(d) => {
                            let (seq, pending) = (d.seq, d.pending);
                            take(entry(d));
                            end.on_message(seq, pending)
                        }
                    };
                }
            }
        }
    }
}

/// How a replay decides it is complete: tidemark-jetstream's [`Replay`], or the naive
/// client's [`PendingEnd`].
enum End {
    Confirming(Replay),
    Pending(PendingEnd),
}

impl End {
    fn new(trusts_pending: bool, from: u64, head: u64) -> Self {
        if trusts_pending {
            End::Pending(PendingEnd::new(from, head))
        } else {
            End::Confirming(Replay::new(from, head))
        }
    }

    fn start(&self) -> Step {
        match self {
            End::Confirming(r) => r.start(),
            End::Pending(p) => p.start(),
        }
    }

    fn on_message(&mut self, seq: u64, pending: u64) -> Step {
        match self {
            End::Confirming(r) => r.on_message(seq, pending),
            End::Pending(p) => p.on_message(seq, pending),
        }
    }

    fn on_idle(&mut self) -> Step {
        match self {
            End::Confirming(r) => r.on_idle(),
            End::Pending(p) => p.on_idle(),
        }
    }

    fn on_confirmed(&mut self, last: u64) -> Step {
        match self {
            End::Confirming(r) => r.on_confirmed(last),
            // It never asks for a confirmation.
            End::Pending(_) => Step::Read,
        }
    }
}

fn unexpected(port: &'static str, r: &Response) -> Error {
    Error::unavailable(port, format!("unexpected answer {r:?}"))
}

fn unexpected_answer(port: &'static str, a: &JsAnswer) -> Error {
    Error::unavailable(port, format!("unexpected answer {a:?}"))
}

fn transport(port: &'static str, e: std::io::Error) -> Error {
    Error::unavailable(port, e.to_string())
}

/// What a KV feed reports: a bucket that keeps only a history per key says so
/// ([`FeedInfo::kv_per_key`]), so a first sequence moved by rewrites is no compaction
/// ([`per_key_only`]).
fn feed_info(limits: &Limits, first: u64, head: u64) -> FeedInfo {
    if per_key_only(limits) {
        FeedInfo::kv_per_key(first, head)
    } else {
        FeedInfo::kv(first, head)
    }
}

/// A delivered message as an entry: a put, or a delete marker's removal.
fn entry(d: JsDelivery) -> Entry {
    match d.value {
        Some(value) => Entry::new(d.seq, d.seq, d.key, Op::Put, value),
        None => Entry::new(d.seq, d.seq, d.key, Op::Delete, Vec::new()),
    }
}

/// What a consumer's reader found next.
enum Seen {
    Message(JsDelivery),
    /// An idle heartbeat: nothing to deliver for a heartbeat interval.
    Idle,
}

/// A consumer on the source host's stream, read a batch at a time over its own
/// connection. Cancel-safe: a batch asked for and not yet read is read by the next call,
/// and what was read waits here.
#[derive(Debug)]
struct Consumer {
    frames: FrameReader,
    batch: u32,
    buf: VecDeque<JsDelivery>,
    /// A batch was asked for and its answer not read yet.
    asked: bool,
}

impl Consumer {
    /// Makes the consumer `consume` asks for (a [`JsCall::Consume`]).
    async fn open(
        remote: &Remote,
        consume: JsCall,
        batch: u32,
        port: &'static str,
    ) -> Result<Consumer> {
        let mut frames = remote.dial(port).await?;
        let consume = Request::JetStream(consume);
        wire::write(frames.stream(), &consume)
            .await
            .map_err(|e| transport(port, e))?;
        match frames
            .read::<Response>()
            .await
            .map_err(|e| transport(port, e))?
        {
            Response::JetStream(JsAnswer::Consuming) => Ok(Consumer {
                frames,
                batch,
                buf: VecDeque::new(),
                asked: false,
            }),
            Response::Failed(reason) => Err(Error::unavailable(port, reason)),
            r => Err(unexpected(port, &r)),
        }
    }

    async fn next(&mut self, port: &'static str) -> Result<Seen> {
        if let Some(d) = self.buf.pop_front() {
            return Ok(Seen::Message(d));
        }
        if !self.asked {
            let next = Request::JetStream(JsCall::Next { max: self.batch });
            // A frame is written whole or not at all (one segment on turmoil's network).
            wire::write(self.frames.stream(), &next)
                .await
                .map_err(|e| transport(port, e))?;
            self.asked = true;
        }
        let answer = self.frames.read::<Response>().await;
        self.asked = false;
        match answer.map_err(|e| transport(port, e))? {
            Response::JetStream(JsAnswer::Batch(batch)) => {
                self.buf.extend(batch);
                Ok(self.buf.pop_front().map_or(Seen::Idle, Seen::Message))
            }
            Response::Failed(reason) => Err(Error::unavailable(port, reason)),
            r => Err(unexpected(port, &r)),
        }
    }
}

impl Source for RemoteKv {
    /// Writes go to the source host, whose bucket takes them at the source's seqs.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        self.remote.put(key, value).await
    }

    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        self.remote.update(key, value, expected).await
    }

    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        self.remote.remove(key).await
    }

    async fn watermark(&self) -> Result<u64> {
        Ok(self.info("source").await?.last_seq)
    }

    async fn changes_since(&self, since: u64) -> Result<Changes> {
        let state = self.info("source").await?;
        let first = first_available(&state);
        if since.saturating_add(1) < first && since < state.last_seq {
            return Ok(Changes::Compacted {
                first_available: first,
            });
        }
        // The latest change per key as the replay goes.
        let mut latest: BTreeMap<String, Entry> = BTreeMap::new();
        let mut watermark = state.last_seq;
        if state.last_seq > since && state.messages > 0 {
            let start = JsStart::Seq(since + 1);
            let (after, through) = self
                .replay(start, "source", false, |e| {
                    latest.insert(e.key.to_string(), e);
                })
                .await?;
            watermark = after.last_seq.max(through);
        }
        let mut entries: Vec<Entry> = latest.into_values().collect();
        entries.sort_by_key(|e| e.seq);
        Ok(Changes::Since { entries, watermark })
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        let mut latest: BTreeMap<String, Entry> = BTreeMap::new();
        let (state, through) = self
            .replay(JsStart::LastPerKey, "source", false, |e| {
                // A key overwritten during the read comes again, later.
                latest.insert(e.key.to_string(), e);
            })
            .await?;
        let entries = latest.into_values().filter(|e| e.op == Op::Put).collect();
        Ok(Snapshot {
            entries,
            watermark: through.max(state.last_seq),
            lineage: tidemark::Lineage::default(),
        })
    }

    /// The keys the bucket holds now, from a headers-only replay of the last message per
    /// key, ended like every replay ([`Replay`]): the keys of the source as of the
    /// returned watermark.
    async fn present_keys(&self) -> Result<Option<PresentKeys>> {
        // The latest operation per key: a key overwritten (or deleted) during the read
        // comes again later.
        let mut latest: BTreeMap<String, (u64, bool)> = BTreeMap::new();
        let (state, through) = self
            .replay(JsStart::LastPerKey, "source", true, |e| {
                let put = e.op == Op::Put;
                let held = latest.entry(e.key.to_string()).or_insert((e.seq, put));
                if e.seq >= held.0 {
                    *held = (e.seq, put);
                }
            })
            .await?;
        let keys = latest
            .into_iter()
            .filter(|(_, (_, put))| *put)
            .map(|(key, _)| key)
            .collect();
        Ok(Some(PresentKeys {
            keys,
            watermark: through.max(state.last_seq),
        }))
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        Ok(self.get_at(key).await?.value)
    }

    async fn get_at(&self, key: &str) -> Result<ValueAt> {
        let key = key.to_owned();
        match self.call("source", JsCall::Last { key }).await? {
            JsAnswer::Last { message, last_seq } => Ok(ValueAt {
                value: message.and_then(|(seq, value)| Some(Versioned { seq, value: value? })),
                watermark: last_seq,
            }),
            a => Err(unexpected_answer("source", &a)),
        }
    }

    async fn first_available(&self) -> Result<u64> {
        Ok(first_available(&self.info("source").await?))
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Source::reconnects(&self.remote)
    }

    fn probe(&self) -> Option<impl std::future::Future<Output = Result<()>> + Send + 'static> {
        Source::probe(&self.remote)
    }
}

/// The bucket's entries from a consumer, as the NATS adapter's `KvStream` hands them on:
/// through the ready gate, which holds the message that reaches the head until a read
/// that cannot race confirms it (a naive client opens none).
#[derive(Debug)]
pub struct KvFeed {
    consumer: Consumer,
    kv: RemoteKv,
    /// `None` for a naive client.
    gate: Option<ReadyGate>,
    /// The head read at open.
    head: u64,
    /// A message that reached the head, held while the gate's read confirms it (kept
    /// here, so a dropped call loses nothing).
    held: Option<JsDelivery>,
    /// An entry to hand on after a raised head.
    queued: Option<FeedItem>,
    seen: u64,
}

impl KvFeed {
    /// An idle heartbeat: `Err(head)` when the consumer went idle below the head
    /// ([`ReadyGate::on_idle`]; a naive client compares with the head read at open).
    fn idle(&self) -> std::result::Result<(), u64> {
        match &self.gate {
            Some(gate) => gate.on_idle(self.seen),
            None if self.seen < self.head => Err(self.head),
            None => Ok(()),
        }
    }

    /// Hands on the held message, told by the gate whether the stream moved past it.
    async fn confirm_held(&mut self, seq: u64) -> Result<FeedItem> {
        let last = self.kv.last_present("feed").await?.seq();
        let (Some(held), Some(gate)) = (self.held.take(), self.gate.as_mut()) else {
            return Err(Error::unavailable("feed", "nothing held"));
        };
        let item = FeedItem::Entry(entry(held));
        Ok(match gate.on_confirmed(seq, last) {
            Confirmed::Ready => item,
            Confirmed::Raise { head } => {
                self.queued = Some(item);
                FeedItem::Head(head)
            }
        })
    }
}

impl FeedStream for KvFeed {
    fn next_ready(&mut self, max: usize, into: &mut Vec<Option<Result<FeedItem>>>) -> usize {
        // Stop at a message held for the ready gate's read: it cannot be ready at once.
        tidemark::take_ready(self, max, into, |s| s.held.is_none())
    }

    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if let Some(item) = self.queued.take() {
                return Some(Ok(item));
            }
            if let Some(seq) = self.held.as_ref().map(|d| d.seq) {
                return Some(self.confirm_held(seq).await);
            }
            match self.consumer.next("feed").await {
                Err(e) => return Some(Err(e)),
                Ok(Seen::Idle) => {
                    if let Err(head) = self.idle() {
                        // The server says it has nothing more, yet the head was not
                        // delivered (a fresh consumer on a just-restarted server): reopen.
                        let why = format!("consumer idle at {} below the head {head}", self.seen);
                        return Some(Err(Error::unavailable("feed", why)));
                    }
                }
                Ok(Seen::Message(d)) => {
                    self.seen = self.seen.max(d.seq);
                    match self.gate.as_ref().map(|g| g.on_message(d.seq)) {
                        Some(Gate::Confirm) => self.held = Some(d),
                        Some(Gate::Pass) | None => return Some(Ok(FeedItem::Entry(entry(d)))),
                    }
                }
            }
        }
    }
}

impl Feed for RemoteKv {
    const FOLLOW: Follow = Follow::Replay;
    type Stream = KvFeed;

    async fn open(&self, from: u64, _after_position: Option<u64>) -> Result<Opened<KvFeed>> {
        // A first sync needs only the latest revision per key; a resume needs everything
        // after the watermark, in order.
        let start = if from <= 1 {
            JsStart::LastPerKey
        } else {
            JsStart::Seq(from)
        };
        // The consumer first, the head after (see `replay`).
        let consume = JsCall::Consume {
            start,
            headers_only: false,
            feed_of: Some(self.follower.clone()),
        };
        let consumer = Consumer::open(&self.remote, consume, self.batch, "feed").await?;
        let (state, limits) = self.info_and_limits("feed").await?;
        let head = FeedInfo::filtered_head(self.head(&state, "feed").await?, state.last_seq, from);
        Ok(Opened {
            info: feed_info(&limits, first_available(&state), head),
            stream: KvFeed {
                consumer,
                kv: self.clone(),
                gate: (!self.trusts_pending).then(|| ReadyGate::new(head)),
                head,
                held: None,
                queued: None,
                seen: from.saturating_sub(1),
            },
        })
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Source::reconnects(&self.remote)
    }
}
