//! A JetStream stream of events keyed by entity key: [`Publish`], [`Feed`] and durable
//! [`Cursors`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::Client;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream::{self, Stream};
use async_nats::jetstream::{self, context::ConsumerInfoErrorKind};
use tidemark::tidemark_core::{Event, FeedInfo};
use tidemark::{Cursors, Feed, FeedItem, FeedStream, Opened, Publish, Result};
use tidemark_jetstream::{Created, Floor, Resume, Start, StreamState};
use tokio::sync::Mutex;
use tracing::warn;

use crate::consumer::{Deliver, PushReader, Seen};
use crate::error::{check_key, check_name, unavailable};
use crate::retention::StreamLimits;

/// The durable events stream: [`tidemark_core::Event`] JSON published on
/// `<prefix>.<key>`, replayed by followers, with cursors kept as durable consumers' ack
/// floors (one consumer per cursor name; moved with the server's consumer reset, so
/// nats-server ≥ 2.14).
///
/// A payload that is not an event is delivered as [`FeedItem::Undecodable`]: counted and
/// checkpointed past, never an error. Cheap to clone.
///
/// A stream deleted and made again under its name starts its positions at 1 again, and
/// its cursors' consumers went with the old one. The handle tells the streams apart by
/// their identity (the time the server created them): a cursor floor it remembers holds
/// only on the stream it was read from, and a feed whose positions came from another
/// stream — one the handle saw before, or, with none seen, a position past the stream's
/// last — starts at the new stream's first event, and from then on trusts the follower's
/// position only up to what it delivered itself (see [`tidemark_jetstream::Resume`]).
/// Each clone is its own reader: it starts from the stream the handle first saw, as
/// [`KvBucket`](crate::KvBucket)'s clones do. A process started after the stream was
/// made again and written past a persisted position is not told (the identity would have
/// to be persisted with the position).
#[derive(Debug)]
pub struct NatsEvents {
    inner: Arc<Inner>,
    /// Where this clone's feeds resume.
    reading: Arc<std::sync::Mutex<Reading>>,
}

/// A clone is another reader: it starts from the stream the handle first saw, never from
/// what another clone's feeds read.
impl Clone for NatsEvents {
    fn clone(&self) -> Self {
        NatsEvents {
            inner: Arc::clone(&self.inner),
            reading: Arc::default(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    client: Client,
    context: jetstream::Context,
    stream: String,
    prefix: String,
    /// Each cursor's floor as this handle last set or read it, with the stream it holds on.
    floors: Mutex<HashMap<String, Floor>>,
    /// The stream the handle first saw.
    first: std::sync::Mutex<Option<Created>>,
}

/// Where one clone's feeds resume.
#[derive(Debug, Default)]
struct Reading {
    /// `None` until the first open, which starts from the stream the handle first saw.
    resume: Option<Resume>,
    /// The highest position this clone's feeds delivered since the stream was last found
    /// new; a fresh counter for each new stream (a feed still open on the old one keeps
    /// counting into its own).
    delivered: Arc<AtomicU64>,
}

/// A stream's identity: when the server created it.
fn identity(info: &stream::Info) -> Created {
    info.created.unix_timestamp_nanos()
}

impl NatsEvents {
    /// The stream `stream` holding subjects `<prefix>.>`; nothing is requested yet.
    ///
    /// # Errors
    /// [`tidemark::Error::InvalidKey`] for an invalid stream name or prefix.
    pub fn new(
        client: Client,
        stream: impl Into<String>,
        prefix: impl Into<String>,
    ) -> Result<Self> {
        let (stream, prefix) = (stream.into(), prefix.into());
        check_name(&stream)?;
        check_key(&prefix)?;
        Ok(NatsEvents {
            inner: Arc::new(Inner {
                context: jetstream::new(client.clone()),
                client,
                stream,
                prefix,
                floors: Mutex::new(HashMap::new()),
                first: std::sync::Mutex::new(None),
            }),
            reading: Arc::default(),
        })
    }

    /// Creates the stream (file storage, `replicas` copies, the default
    /// [`StreamLimits::EVENTS`]) unless it exists.
    ///
    /// # Errors
    /// [`tidemark::Error::Unavailable`] if the server cannot create it.
    pub async fn ensure(&self, replicas: usize) -> Result<()> {
        self.ensure_with(replicas, StreamLimits::EVENTS).await
    }

    /// Creates the stream with `limits` unless it exists (an existing stream keeps its
    /// own: a [`NatsSweep`](crate::NatsSweep) brings them in line).
    ///
    /// # Errors
    /// [`tidemark::Error::Unavailable`] if the server cannot create it.
    pub async fn ensure_with(&self, replicas: usize, limits: StreamLimits) -> Result<()> {
        let stream = self
            .inner
            .context
            .get_or_create_stream(limits.apply(stream::Config {
                name: self.inner.stream.clone(),
                subjects: vec![format!("{}.>", self.inner.prefix)],
                num_replicas: replicas.max(1),
                ..Default::default()
            }))
            .await
            .map_err(|e| unavailable("events", e))?;
        self.saw(identity(stream.cached_info()));
        Ok(())
    }

    /// The stream's name.
    #[must_use]
    pub fn stream_name(&self) -> &str {
        &self.inner.stream
    }

    /// The stream, its info read now, and its identity.
    async fn stream(&self, port: &'static str) -> Result<(Stream, Created)> {
        let stream = self
            .inner
            .context
            .get_stream(&self.inner.stream)
            .await
            .map_err(|e| unavailable(port, format!("stream {}: {e}", self.inner.stream)))?;
        let id = identity(stream.cached_info());
        self.saw(id);
        Ok((stream, id))
    }

    /// Notes the stream found, if the handle saw none before.
    fn saw(&self, stream: Created) {
        let mut first = self.inner.first.lock().unwrap_or_else(|e| e.into_inner());
        first.get_or_insert(stream);
    }

    /// The durable consumer standing for cursor `name` on `stream`, created at the
    /// stream's start; its ack floor.
    async fn cursor_consumer(&self, stream: &Stream, name: &str) -> Result<u64> {
        let consumer: jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                name,
                pull::Config {
                    durable_name: Some(name.to_owned()),
                    description: Some("tidemark cursor".into()),
                    ack_policy: AckPolicy::All,
                    deliver_policy: DeliverPolicy::All,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable("cursor", e))?;
        Ok(consumer.cached_info().ack_floor.stream_sequence)
    }

    /// Where this clone's feed opens on stream `id` for a caller after `after`, and the
    /// counter of positions it delivers.
    fn resume(
        &self,
        id: Created,
        after: Option<u64>,
        state: StreamState,
    ) -> (tidemark_jetstream::Opening, Arc<AtomicU64>) {
        let first = *self.inner.first.lock().unwrap_or_else(|e| e.into_inner());
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let delivered = reading.delivered.load(Ordering::Relaxed);
        let opening = reading
            .resume
            .get_or_insert_with(|| Resume::new(first))
            .open(id, after, delivered, state);
        if opening.new_stream {
            warn!(
                stream = %self.inner.stream,
                ?after,
                last = state.last_seq,
                "the position is not one of this stream's (made again, or it lost its newest events): reading it from its first event"
            );
            reading.delivered = Arc::default();
        }
        (opening, Arc::clone(&reading.delivered))
    }
}

impl Publish for NatsEvents {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        check_key(key)?;
        let subject = format!("{}.{key}", self.inner.prefix);
        let ack = self
            .inner
            .context
            .publish(subject, payload.into())
            .await
            .map_err(|e| unavailable("events", e))?
            .await
            .map_err(|e| unavailable("events", e))?;
        Ok(ack.sequence)
    }

    /// Sends every publish before awaiting any ack, then awaits the acks together: one
    /// round trip for the batch instead of one per item. Each item's result is its own.
    async fn publish_batch(&self, items: Vec<(String, Vec<u8>)>) -> Vec<Result<u64>> {
        let mut pending = Vec::with_capacity(items.len());
        for (key, payload) in items {
            let sent = match check_key(&key) {
                Err(e) => Err(e),
                Ok(()) => self
                    .inner
                    .context
                    .publish(format!("{}.{key}", self.inner.prefix), payload.into())
                    .await
                    .map_err(|e| unavailable("events", e)),
            };
            pending.push(sent);
        }
        let acks = pending.into_iter().map(|sent| async move {
            sent?
                .await
                .map(|ack| ack.sequence)
                .map_err(|e| unavailable("events", e))
        });
        futures::future::join_all(acks).await
    }
}

/// The items of an open events feed.
#[derive(Debug)]
pub struct EventStream {
    reader: PushReader,
    /// The highest position handed out, shared with the clone that opened it.
    delivered: Arc<AtomicU64>,
}

impl FeedStream for EventStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            match self.reader.next("events").await? {
                Err(e) => return Some(Err(e)),
                Ok(Seen::Idle) => {}
                Ok(Seen::Message(d)) => {
                    self.delivered.fetch_max(d.seq, Ordering::Relaxed);
                    return Some(Ok(match Event::decode(&d.payload) {
                        Ok(event) => {
                            FeedItem::Entry(event.into_entry(d.seq).with_pending(d.pending))
                        }
                        Err(e) => FeedItem::Undecodable {
                            position: d.seq,
                            seq: None,
                            reason: e.to_string(),
                        },
                    }));
                }
            }
        }
    }
}

impl Feed for NatsEvents {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Announcements;
    type Stream = EventStream;

    /// Starts after `after_position` when given, else at the stream's first message; `from`
    /// (a seq) does not address an events stream. A position of another stream (made again
    /// under this name) is not one of this one: the feed starts at the first event (see
    /// [`NatsEvents`]). The head is the seq of the stream's last event, so readiness means
    /// "caught up with the stream".
    async fn open(&self, _from: u64, after_position: Option<u64>) -> Result<Opened<EventStream>> {
        let (stream, id) = self.stream("events").await?;
        let state = stream.cached_info().state.clone();
        let (opening, delivered) = self.resume(
            id,
            after_position,
            StreamState {
                messages: state.messages,
                first_seq: state.first_sequence,
                last_seq: state.last_sequence,
            },
        );
        let start = match opening.start {
            Start::First => 1,
            Start::After(position) => position.saturating_add(1),
        };
        let head = if state.messages == 0 || state.last_sequence < start {
            0
        } else {
            match stream.get_raw_message(state.last_sequence).await {
                Ok(m) => Event::decode(&m.payload).map_or(0, |e| e.seq()),
                Err(_) => 0,
            }
        };
        let deliver = if start <= 1 {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: start,
            }
        };
        let reader = PushReader::open(
            &self.inner.client,
            &self.inner.context,
            &stream,
            Deliver {
                filter: format!("{}.>", self.inner.prefix),
                policy: deliver,
                max_in_flight: None,
                headers_only: false,
            },
            "events",
        )
        .await?;
        Ok(Opened {
            info: FeedInfo::announcements(head),
            stream: EventStream { reader, delivered },
        })
    }

    /// The reconnects of the client, if [`NatsOptions::connect`](crate::NatsOptions::connect)
    /// made it.
    fn reconnects(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        crate::reconnects::of(&self.inner.client)
    }

    /// A stream-info request for the events stream, as [`KvBucket`](crate::KvBucket)'s
    /// probe is for the bucket's: on a cluster the events stream elects its leader apart
    /// from the bucket's, and a follower of announcements whose feed failed while it had
    /// none learns it has one again from this answer.
    fn probe(&self) -> Option<impl std::future::Future<Output = Result<()>> + Send + 'static> {
        Some(crate::reconnects::probe(
            &self.inner.context,
            self.inner.stream.clone(),
        ))
    }
}

/// A cursor is a durable pull consumer whose ack floor is the saved position. Saves are
/// monotone per handle (it remembers the floor it set); a cursor name belongs to one
/// consumer at a time, because two processes saving under one name could move the server's
/// floor back (JetStream has no compare-and-set for it).
impl Cursors for NatsEvents {
    async fn load(&self, name: &str) -> Result<Option<u64>> {
        check_name(name)?;
        let (stream, _) = self.stream("cursor").await?;
        match stream.consumer_info(name).await {
            Ok(info) => Ok(Some(info.ack_floor.stream_sequence)),
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Ok(None),
            Err(e) => Err(unavailable("cursor", e)),
        }
    }

    async fn save(&self, name: &str, position: u64) -> Result<u64> {
        check_name(name)?;
        let mut floors = self.inner.floors.lock().await;
        let (stream, id) = self.stream("cursor").await?;
        // A floor read from another stream (this one made again since) holds nothing
        // here: the cursor's consumer went with that stream.
        let floor = match floors.get(name).and_then(|f| f.on(id)) {
            Some(f) => f,
            None => self.cursor_consumer(&stream, name).await?,
        };
        if position <= floor {
            floors.insert(
                name.to_owned(),
                Floor {
                    stream: id,
                    position: floor,
                },
            );
            return Ok(floor);
        }
        // The ack floor becomes `position`: the next delivery would be position + 1.
        let reset = stream.reset_consumer(name, Some(position + 1)).await;
        if let Err(e) = reset {
            // The consumer may be gone (deleted by an operator, expired): forget what we
            // knew, so the next save finds or makes it again instead of failing forever.
            floors.remove(name);
            return Err(unavailable("cursor", e));
        }
        floors.insert(
            name.to_owned(),
            Floor {
                stream: id,
                position,
            },
        );
        Ok(position)
    }
}
