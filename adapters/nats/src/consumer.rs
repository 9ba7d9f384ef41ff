//! A push consumer the follower controls: ephemeral, flow-controlled, with idle heartbeats,
//! unacknowledged unless a cap on the messages delivered ahead of the reader is asked for,
//! read from its delivery subject.
//!
//! async-nats' ordered consumer recovers on its own (recreating itself, from "deliver all"
//! when it has seen nothing). Here any doubt — a consumer sequence gap, a heartbeat that
//! names another last sequence, missing heartbeats, a reconnect — ends the stream with an
//! error, and the follower reopens from *its* watermark + 1. A consumer silent for a
//! heartbeat interval is looked up on the server (without holding up delivery): one that
//! is gone ends the stream at once, not three intervals later.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, ReplayPolicy, push};
use async_nats::jetstream::{self, stream::Stream};
use async_nats::{Client, HeaderMap, Message, StatusCode, Subscriber, connection::State};
use bytes::Bytes;
use futures::StreamExt as _;
use tidemark::Result;
use tokio::sync::mpsc;
use tracing::debug;

use tidemark_jetstream::{ConsumerInfo, Failure, Heard, Liveness, Sent, Tick};

use crate::error::unavailable;

/// How often an idle consumer proves it is alive. One missed has the reader look the
/// consumer up; three missed in a row end the stream.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(1);
/// [`HEARTBEAT`] in nanoseconds, as [`Liveness`] takes it.
const HEARTBEAT_NS: u64 = 1_000_000_000;
/// How long the server keeps a consumer nobody listens to (a crashed process's).
const INACTIVE: Duration = Duration::from_secs(10);
/// How long the server waits for an acknowledgement of a capped consumer before it counts
/// a message as given up (never redelivered: `max_deliver` is 1) and delivers past the
/// cap: longer than any sink commit the reader waits on.
const ACK_WAIT: Duration = Duration::from_secs(120);
/// How often the reader looks at the connection while waiting.
const TICK: Duration = Duration::from_millis(250);
/// [`TICK`] in nanoseconds.
const TICK_NS: u64 = 250_000_000;

/// [`Sent`] as the reader updates it once a reply is handed to the client, shared with
/// the pump, which stamps each batch it takes off the client with it (what the server
/// surely had when the heartbeat after that batch was sent: see [`Sent`]).
#[derive(Debug, Default)]
struct Replies {
    acked: AtomicU64,
    answers: AtomicU64,
}

impl Replies {
    fn now(&self) -> Sent {
        Sent {
            acked: self.acked.load(Ordering::Acquire),
            answers: self.answers.load(Ordering::Acquire),
        }
    }
}

/// A reply owed to the server.
#[derive(Debug)]
enum Reply {
    /// Acknowledges every message up to this consumer sequence.
    Ack(async_nats::Subject, u64),
    /// Answers a flow-control request (or the stalled heartbeat naming it).
    Answer(async_nats::Subject),
}

/// One stream message delivered to the consumer.
#[derive(Debug)]
pub(crate) struct Delivered {
    pub subject: async_nats::Subject,
    pub seq: u64,
    pub pending: u64,
    pub headers: Option<HeaderMap>,
    pub payload: Bytes,
    /// When the server stored it, in nanoseconds since the Unix epoch (0 if unknown).
    pub published_ns: u64,
}

/// What the reader saw.
#[derive(Debug)]
pub(crate) enum Seen {
    /// A message.
    Message(Delivered),
    /// An idle heartbeat while in step with the server: it has nothing more to send now.
    Idle,
}

/// What a consumer delivers, and how.
#[derive(Debug)]
pub(crate) struct Deliver {
    /// The subjects it delivers.
    pub filter: String,
    /// Where it starts.
    pub policy: DeliverPolicy,
    /// At most this many messages ahead of what the reader read (see
    /// [`KvBucket::with_max_in_flight`](crate::KvBucket::with_max_in_flight)).
    pub max_in_flight: Option<usize>,
    /// Headers only, no payload (a listing of keys).
    pub headers_only: bool,
}

/// An open ephemeral push consumer. Dropping it unsubscribes and deletes the consumer (in
/// the background; the inactivity threshold is the backstop).
pub(crate) struct PushReader {
    client: Client,
    /// The client's counters, taken once: `Client::statistics` clones an `Arc` per call,
    /// and the reconnect check runs per message.
    statistics: std::sync::Arc<async_nats::Statistics>,
    context: jetstream::Context,
    /// The delivered messages, moved off the client's subscription as they arrive by
    /// [`pump`] (see there why), in batches of whatever had arrived together, each with
    /// what the reader had sent when it arrived.
    delivered: mpsc::UnboundedReceiver<(Sent, Vec<Message>)>,
    /// The rest of the batch being read.
    batch: std::vec::IntoIter<Message>,
    /// What the reader sent, kept up to date as replies go out, for the pump.
    replies: Arc<Replies>,
    /// What every message, heartbeat and tick means: the decisions of this reader.
    liveness: Liveness,
    /// Held only to stop the pump (and unsubscribe) when the reader goes.
    _pump: Pump,
    stream: String,
    consumer: String,
    connects: u64,
    /// One timer for the whole subscription, checked every TICK: arming a fresh timeout
    /// for every message cost a timer registration per entry on the initial sync's hot
    /// path.
    tick: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Replies owed to the server (flow-control answers, acknowledgements), sent before
    /// the next message is taken. [`next`](PushReader::next) awaits nothing once it holds
    /// a message: a caller may drop it at any await (the follower polls it once to fill a
    /// turn), and a message taken by a dropped call would be lost — a flow-control
    /// request's answer lost so stalls delivery until the next heartbeat.
    owed: std::collections::VecDeque<Reply>,
    /// With a cap: the ack subject and consumer sequence of the last message read, which
    /// an acknowledgement [`Liveness`] asks for names.
    last_read: Option<(async_nats::Subject, u64)>,
    /// Whether the consumer has a cap (and so acknowledgements).
    capped: bool,
    /// The question [`Tick::Ask`] had the reader send: is the consumer still there?
    asking: Option<tokio::task::JoinHandle<ConsumerInfo>>,
}

impl std::fmt::Debug for PushReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushReader")
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("last_consumer_seq", &self.liveness.last_consumer_seq())
            .finish_non_exhaustive()
    }
}

impl PushReader {
    /// Subscribes to a fresh inbox, then creates the consumer on `stream` delivering
    /// `filter` per `deliver` to it (subscribing first loses nothing); with
    /// `max_in_flight`, at most that many messages ahead of what [`next`](Self::next)
    /// returned.
    pub(crate) async fn open(
        client: &Client,
        context: &jetstream::Context,
        stream: &Stream,
        what: Deliver,
        port: &'static str,
    ) -> Result<PushReader> {
        let Deliver {
            filter,
            policy: deliver,
            max_in_flight,
            headers_only,
        } = what;
        let connects = client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        let inbox = client.new_inbox();
        let subscriber = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| unavailable(port, e))?;
        let config = push::Config {
            deliver_subject: inbox,
            description: Some("tidemark follower".into()),
            deliver_policy: deliver,
            // With a cap, acknowledged in bulk as it is read (`ack_every`), so the server
            // never has more than the cap out (flow control bounds only bytes). It costs
            // the server a pending entry per message, about 70% more CPU per message.
            ack_policy: if max_in_flight.is_some() {
                AckPolicy::All
            } else {
                AckPolicy::None
            },
            max_ack_pending: max_in_flight
                .map_or(0, |m| i64::try_from(m.max(1)).unwrap_or(i64::MAX)),
            ack_wait: ACK_WAIT,
            max_deliver: 1,
            filter_subject: filter,
            replay_policy: ReplayPolicy::Instant,
            flow_control: true,
            idle_heartbeat: HEARTBEAT,
            inactive_threshold: INACTIVE,
            num_replicas: 1,
            memory_storage: true,
            headers_only,
            ..Default::default()
        };
        let consumer = stream
            .create_consumer(config)
            .await
            .map_err(|e| unavailable(port, format!("creating a consumer: {e}")))?;
        let (tx, delivered) = mpsc::unbounded_channel();
        let replies = Arc::new(Replies::default());
        Ok(PushReader {
            statistics: client.statistics(),
            client: client.clone(),
            context: context.clone(),
            delivered,
            batch: Vec::new().into_iter(),
            _pump: Pump::spawn(subscriber, tx, Arc::clone(&replies))
                .map_err(|e| unavailable(port, format!("starting the pump: {e}")))?,
            replies,
            liveness: Liveness::new(HEARTBEAT_NS, max_in_flight.map(|m| m.max(1) as u64))
                .created_at(consumer.cached_info().created.unix_timestamp_nanos()),
            stream: stream.cached_info().config.name.clone(),
            consumer: consumer.cached_info().name.clone(),
            connects,
            tick: Box::pin(tokio::time::sleep(TICK)),
            owed: std::collections::VecDeque::new(),
            last_read: None,
            capped: max_in_flight.is_some(),
            asking: None,
        })
    }

    /// The next message or idle heartbeat; an error when the consumer can no longer be
    /// trusted to deliver every message in order; `None` if the subscription closed.
    /// What each thing the server sent means is [`Liveness`]'s to say; this only reads
    /// and replies.
    pub(crate) async fn next(&mut self, port: &'static str) -> Option<Result<Seen>> {
        loop {
            // Cancel-safe: a reply leaves the list only once the client took it.
            while let Some(reply) = self.owed.front() {
                let subject = match reply {
                    Reply::Ack(subject, _) | Reply::Answer(subject) => subject,
                };
                if let Err(e) = self.client.publish(subject.clone(), Bytes::new()).await {
                    debug!(consumer = %self.consumer, error = %e, "reply to the server failed");
                }
                if let Some(sent) = self.owed.pop_front() {
                    self.sent(&sent);
                }
            }
            let message = if let Some(message) = self.batch.next() {
                message
            } else {
                // The connection is looked at once per batch (and every tick): a batch
                // arrived in one piece, and a reconnect shows before the next.
                if let Err(e) = self.check_connection() {
                    return Some(Err(self.failed(port, &e)));
                }
                let woke = tokio::select! {
                    biased;
                    batch = self.delivered.recv() => Woke::Batch(batch),
                    info = answer(&mut self.asking) => Woke::Answer(info),
                    () = self.tick.as_mut() => Woke::Tick,
                };
                match woke {
                    Woke::Batch(Some((sent, batch))) => {
                        self.batch = batch.into_iter();
                        self.liveness.on_batch(sent);
                        continue;
                    }
                    Woke::Batch(None) => return None,
                    Woke::Answer(info) => {
                        debug!(consumer = %self.consumer, ?info, "the server on a silent consumer");
                        if let Err(e) = self.liveness.on_consumer_info(info) {
                            return Some(Err(self.failed(port, &e)));
                        }
                        continue;
                    }
                    Woke::Tick => {
                        self.tick.as_mut().reset(tokio::time::Instant::now() + TICK);
                        let judged = self
                            .check_connection()
                            .and_then(|()| self.liveness.on_tick(TICK_NS));
                        match judged {
                            Ok(Tick::Wait) => {}
                            Ok(Tick::Ask) => self.ask(),
                            Err(e) => return Some(Err(self.failed(port, &e))),
                        }
                        continue;
                    }
                }
            };
            match message.status {
                Some(StatusCode::IDLE_HEARTBEAT) => {
                    if let Some(reply) = message.reply {
                        // A flow-control request: answer it or delivery stops.
                        self.liveness.on_flow_control();
                        self.owed.push_back(Reply::Answer(reply));
                        continue;
                    }
                    let headers = message.headers.as_ref();
                    let last = headers
                        .and_then(|h| h.get_last(async_nats::header::NATS_LAST_CONSUMER))
                        .and_then(|v| v.as_str().parse::<u64>().ok());
                    let stalled = headers
                        .and_then(|h| h.get("Nats-Consumer-Stalled"))
                        .map(async_nats::HeaderValue::as_str);
                    let beat = match self.liveness.on_heartbeat(last, stalled) {
                        Ok(beat) => beat,
                        Err(e) => return Some(Err(self.failed(port, &e))),
                    };
                    if beat.ack {
                        self.owed.extend(
                            self.last_read
                                .clone()
                                .map(|(subject, seq)| Reply::Ack(subject, seq)),
                        );
                    }
                    match beat.heard {
                        Heard::Idle => return Some(Ok(Seen::Idle)),
                        Heard::Skip => {
                            debug!(consumer = %self.consumer, "a heartbeat sent while the server waited on the reader");
                        }
                        Heard::Answer(subject) => {
                            debug!(consumer = %self.consumer, "consumer stalled waiting for a flow-control answer; answering");
                            self.owed.push_back(Reply::Answer(subject.into()));
                        }
                    }
                    continue;
                }
                Some(status) => {
                    let e = Failure::Status(status.as_u16());
                    let why = message.description.as_deref().unwrap_or("");
                    return Some(Err(unavailable(
                        port,
                        format!("consumer {}: {e} {why}", self.consumer),
                    )));
                }
                None => {}
            }
            let Some((seq, consumer_seq, pending, published_ns)) =
                message.reply.as_deref().and_then(parse_ack)
            else {
                return Some(Err(self.failed(port, &Failure::NoMetadata)));
            };
            let ack = match self.liveness.on_message(consumer_seq) {
                Ok(ack) => ack,
                Err(e) => return Some(Err(self.failed(port, &e))),
            };
            if self.capped {
                self.last_read = message.reply.map(|s| (s, consumer_seq));
                if ack {
                    self.owed.extend(
                        self.last_read
                            .clone()
                            .map(|(subject, seq)| Reply::Ack(subject, seq)),
                    );
                }
            }
            return Some(Ok(Seen::Message(Delivered {
                subject: message.subject,
                seq,
                pending,
                headers: message.headers,
                payload: message.payload,
                published_ns,
            })));
        }
    }

    /// Notes a reply the client took: in [`Liveness`], and in what the pump stamps on the
    /// batches that follow.
    fn sent(&mut self, reply: &Reply) {
        let sent = match reply {
            Reply::Ack(_, seq) => self.liveness.on_sent(tidemark_jetstream::Reply::Ack(*seq)),
            Reply::Answer(subject) => self
                .liveness
                .on_sent(tidemark_jetstream::Reply::Answer(subject.as_str())),
        };
        self.replies.acked.store(sent.acked, Ordering::Release);
        self.replies.answers.store(sent.answers, Ordering::Release);
    }

    /// Asks the server whether the consumer is still there, in a task of its own: the
    /// answer comes back through [`answer`] while delivery goes on.
    fn ask(&mut self) {
        debug!(consumer = %self.consumer, "silent for a heartbeat interval: is the consumer still there?");
        let task = tokio::spawn(consumer_info(
            self.context.clone(),
            self.stream.clone(),
            self.consumer.clone(),
        ));
        if let Some(old) = self.asking.replace(task) {
            old.abort();
        }
    }

    fn failed(&self, port: &'static str, failure: &Failure) -> tidemark::Error {
        unavailable(port, format!("consumer {}: {failure}", self.consumer))
    }

    fn check_connection(&self) -> std::result::Result<(), Failure> {
        let connects = self
            .statistics
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        let connected = self.client.connection_state() == State::Connected;
        tidemark_jetstream::connection(self.connects, connects, connected)
    }
}

/// What woke a reader waiting for the next batch.
enum Woke {
    /// A batch from the pump (`None`: the subscription closed).
    Batch(Option<(Sent, Vec<Message>)>),
    /// The server's answer to the question the reader asked.
    Answer(ConsumerInfo),
    /// The timer.
    Tick,
}

/// The answer to the question out in `asking`, once it comes (never, when none is out).
/// Cancel-safe: the question stays out until its answer is taken.
async fn answer(asking: &mut Option<tokio::task::JoinHandle<ConsumerInfo>>) -> ConsumerInfo {
    let Some(task) = asking else {
        return std::future::pending().await;
    };
    let info = task.await.unwrap_or(ConsumerInfo::NoAnswer);
    *asking = None;
    info
}

/// What the server says of consumer `consumer` on `stream`: its info (a read that cannot
/// race: the consumer as the server has it now), an API error, or no answer within a
/// heartbeat interval.
async fn consumer_info(
    context: jetstream::Context,
    stream: String,
    consumer: String,
) -> ConsumerInfo {
    use async_nats::jetstream::response::Response;
    let empty = serde_json::json!({});
    let request = context.request::<_, _, Response<async_nats::jetstream::consumer::Info>>(
        format!("CONSUMER.INFO.{stream}.{consumer}"),
        &empty,
    );
    match tokio::time::timeout(HEARTBEAT, request).await {
        Ok(Ok(Response::Ok(info))) => ConsumerInfo::Found {
            created: info.created.unix_timestamp_nanos(),
        },
        Ok(Ok(Response::Err { error })) => ConsumerInfo::Refused {
            code: error.error_code().0,
        },
        Ok(Err(_)) | Err(_) => ConsumerInfo::NoAnswer,
    }
}

/// Moves every message of `subscriber` into `tx` as soon as the client has it, until
/// either side closes.
///
/// The client holds a subscription's messages in a channel of fixed capacity (65,536
/// messages by default) and drops what overflows it. A reader that pauses — a durable
/// sink committing a 16k-entry batch — let a fast initial sync overflow it: the server's
/// flow control bounds bytes in flight (megabytes: hundreds of thousands of small KV
/// entries), not messages. The lost messages showed as a consumer sequence gap, the feed
/// failed and was reopened after a backoff, again and again: a 1M-key cold start into
/// SQLite took 93-100 s, mostly waiting (the `pauses` bench shows the gap). Moved here,
/// they wait in an unbounded queue instead, still bounded by flow control: it is answered
/// only when the reader reaches the request, in order, so the server sends no more than
/// its window ahead of the reader. The pump runs on a thread of its own ([`Pump`]): as a
/// task it waited behind whatever held the runtime's workers (the follower's turn of 16k
/// entries on one, the client's connection task, which moves a whole burst into the
/// channel in one poll, on the other), and a 1M-key initial sync into memory failed on a
/// gap and backed off 1-5 times a round under load. Only a cap on the messages in flight
/// ([`KvBucket::with_max_in_flight`](crate::KvBucket::with_max_in_flight)) rules an
/// overflow out whatever the machine does.
///
/// What the client already holds goes along with the message awaited, one batch per send
/// (at most [`PUMP_BATCH`]): on an initial sync that is most of them, and the reader then
/// takes them from its own batch without touching the channel.
///
/// Each batch goes with what the reader had sent when the pump took it (see [`Sent`]).
async fn pump(
    mut subscriber: Subscriber,
    tx: mpsc::UnboundedSender<(Sent, Vec<Message>)>,
    replies: Arc<Replies>,
) {
    use futures::FutureExt as _;
    while let Some(first) = subscriber.next().await {
        let sent = replies.now();
        let mut batch = vec![first];
        while batch.len() < PUMP_BATCH {
            match subscriber.next().now_or_never() {
                Some(Some(message)) => batch.push(message),
                // Nothing more now, or closed (the next await says so).
                _ => break,
            }
        }
        if tx.send((sent, batch)).is_err() {
            return;
        }
    }
}

/// The thread that runs [`pump`] for one subscription. Dropping it stops the pump, which
/// drops the subscription (unsubscribed).
struct Pump {
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Pump {
    fn spawn(
        subscriber: Subscriber,
        tx: mpsc::UnboundedSender<(Sent, Vec<Message>)>,
        replies: Arc<Replies>,
    ) -> std::io::Result<Pump> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // In the runtime's context: dropping the subscription may spawn its unsubscribe.
        let runtime = tokio::runtime::Handle::try_current().ok();
        std::thread::Builder::new()
            .name("tidemark-pump".into())
            .spawn(move || {
                let _entered = runtime.as_ref().map(tokio::runtime::Handle::enter);
                futures::executor::block_on(async move {
                    let pumping = std::pin::pin!(pump(subscriber, tx, replies));
                    futures::future::select(pumping, stopped).await;
                });
            })?;
        Ok(Pump { _stop: stop })
    }
}

/// The most messages [`pump`] moves in one send.
const PUMP_BATCH: usize = 512;

impl Drop for PushReader {
    fn drop(&mut self) {
        if let Some(asking) = self.asking.take() {
            asking.abort();
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let context = self.context.clone();
            let (consumer, stream) = (self.consumer.clone(), self.stream.clone());
            handle.spawn(async move {
                // Best effort: the inactivity threshold removes it otherwise.
                let _ = context.delete_consumer_from_stream(consumer, stream).await;
            });
        }
    }
}

/// The tokens of a JetStream ack subject and where its numbers start:
/// `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (v1) or with a
/// domain and account hash after `ACK` (v2, optionally with a trailing token).
///
/// Read once per delivered message, so it allocates nothing.
fn ack_tokens(reply: &str) -> Option<([&str; 12], usize)> {
    let mut tokens = [""; 12];
    let mut count = 0;
    for token in reply.split('.') {
        *tokens.get_mut(count)? = token;
        count += 1;
    }
    let at = match count {
        9 => 4,
        11 | 12 => 6,
        _ => return None,
    };
    (tokens[0] == "$JS" && tokens[1] == "ACK").then_some((tokens, at))
}

/// The timestamp (nanoseconds since the Unix epoch) a JetStream ack subject carries.
pub(crate) fn ack_timestamp(reply: &str) -> Option<u64> {
    let (tokens, at) = ack_tokens(reply)?;
    tokens.get(at + 3)?.parse().ok()
}

/// Stream sequence, consumer sequence and pending count from a JetStream ack subject
/// (see [`ack_tokens`]).
pub(crate) fn parse_ack_subject(reply: &str) -> Option<(u64, u64, u64)> {
    parse_ack(reply).map(|(seq, consumer_seq, pending, _)| (seq, consumer_seq, pending))
}

/// [`parse_ack_subject`] and [`ack_timestamp`] (0 when it does not parse) from one pass
/// over the subject: the feed's hot path reads both for every message.
fn parse_ack(reply: &str) -> Option<(u64, u64, u64, u64)> {
    let (tokens, at) = ack_tokens(reply)?;
    let number = |i: usize| tokens.get(at + i).and_then(|t| t.parse::<u64>().ok());
    Some((number(1)?, number(2)?, number(4)?, number(3).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects_parse_in_both_formats() {
        assert_eq!(
            parse_ack_subject("$JS.ACK.KV_b.c1.1.42.7.1700000000.3"),
            Some((42, 7, 3))
        );
        assert_eq!(
            parse_ack_subject("$JS.ACK.dom.hash.KV_b.c1.2.42.7.1700000000.3.tok"),
            Some((42, 7, 3))
        );
        assert_eq!(
            parse_ack_subject("$JS.ACK.a.b.c.d.e.f.g.h.i.j.k"),
            None,
            "too many tokens"
        );
        assert_eq!(parse_ack_subject("_INBOX.x"), None, "not an ack subject");
        assert_eq!(
            ack_timestamp("$JS.ACK.KV_b.c1.1.42.7.1700000000.3"),
            Some(1_700_000_000)
        );
        assert_eq!(
            ack_timestamp("$JS.ACK.dom.hash.KV_b.c1.2.42.7.1700000001.3.tok"),
            Some(1_700_000_001)
        );
        assert_eq!(parse_ack_subject("$JS.ACK.S.c.x.1.1.1.0"), Some((1, 1, 0)));
    }
}
