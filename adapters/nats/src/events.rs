//! A JetStream stream of events keyed by entity key: [`Publish`], [`Feed`] and durable
//! [`Cursors`].

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::Client;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream::{self, Stream};
use async_nats::jetstream::{self, context::ConsumerInfoErrorKind};
use tidemark::tidemark_core::{Event, FeedInfo};
use tidemark::{Cursors, Feed, FeedItem, FeedStream, Opened, Publish, Result};
use tokio::sync::Mutex;

use crate::consumer::{PushReader, Seen};
use crate::error::{check_key, check_name, unavailable};
use crate::retention::StreamLimits;

/// The durable events stream: [`tidemark_core::Event`] JSON published on
/// `<prefix>.<key>`, replayed by followers, with cursors kept as durable consumers' ack
/// floors (one consumer per cursor name; moved with the server's consumer reset, so
/// nats-server ≥ 2.14).
///
/// A payload that is not an event is delivered as [`FeedItem::Undecodable`]: counted and
/// checkpointed past, never an error. Cheap to clone.
#[derive(Clone, Debug)]
pub struct NatsEvents {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    context: jetstream::Context,
    stream: String,
    prefix: String,
    floors: Mutex<HashMap<String, u64>>,
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
            }),
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
        self.inner
            .context
            .get_or_create_stream(limits.apply(stream::Config {
                name: self.inner.stream.clone(),
                subjects: vec![format!("{}.>", self.inner.prefix)],
                num_replicas: replicas.max(1),
                ..Default::default()
            }))
            .await
            .map_err(|e| unavailable("events", e))?;
        Ok(())
    }

    /// The stream's name.
    #[must_use]
    pub fn stream_name(&self) -> &str {
        &self.inner.stream
    }

    async fn stream(&self, port: &'static str) -> Result<Stream> {
        self.inner
            .context
            .get_stream(&self.inner.stream)
            .await
            .map_err(|e| unavailable(port, format!("stream {}: {e}", self.inner.stream)))
    }

    /// The durable consumer standing for cursor `name`, created at the stream's start.
    async fn cursor_consumer(&self, name: &str) -> Result<u64> {
        let stream = self.stream("cursor").await?;
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
}

impl FeedStream for EventStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            match self.reader.next("events").await? {
                Err(e) => return Some(Err(e)),
                Ok(Seen::Idle) => {}
                Ok(Seen::Message(d)) => {
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
    /// (a seq) does not address an events stream. The head is the seq of the stream's last
    /// event, so readiness means "caught up with the stream".
    async fn open(&self, _from: u64, after_position: Option<u64>) -> Result<Opened<EventStream>> {
        let mut stream = self.stream("events").await?;
        let state = stream
            .info()
            .await
            .map_err(|e| unavailable("events", e))?
            .state
            .clone();
        let start = after_position.map_or(1, |p| p.saturating_add(1));
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
            format!("{}.>", self.inner.prefix),
            deliver,
            None,
            "events",
        )
        .await?;
        Ok(Opened {
            info: FeedInfo::announcements(head),
            stream: EventStream { reader },
        })
    }

    /// The reconnects of the client, if [`NatsOptions::connect`](crate::NatsOptions::connect)
    /// made it.
    fn reconnects(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        crate::reconnects::of(&self.inner.client)
    }
}

/// A cursor is a durable pull consumer whose ack floor is the saved position. Saves are
/// monotone per handle (it remembers the floor it set); a cursor name belongs to one
/// consumer at a time, because two processes saving under one name could move the server's
/// floor back (JetStream has no compare-and-set for it).
impl Cursors for NatsEvents {
    async fn load(&self, name: &str) -> Result<Option<u64>> {
        check_name(name)?;
        let stream = self.stream("cursor").await?;
        match stream.consumer_info(name).await {
            Ok(info) => Ok(Some(info.ack_floor.stream_sequence)),
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Ok(None),
            Err(e) => Err(unavailable("cursor", e)),
        }
    }

    async fn save(&self, name: &str, position: u64) -> Result<u64> {
        check_name(name)?;
        let mut floors = self.inner.floors.lock().await;
        let floor = match floors.get(name) {
            Some(&f) => f,
            None => self.cursor_consumer(name).await?,
        };
        if position <= floor {
            floors.insert(name.to_owned(), floor);
            return Ok(floor);
        }
        // The ack floor becomes `position`: the next delivery would be position + 1.
        let reset = self
            .stream("cursor")
            .await?
            .reset_consumer(name, Some(position + 1))
            .await;
        if let Err(e) = reset {
            // The consumer may be gone (deleted by an operator, expired): forget what we
            // knew, so the next save finds or makes it again instead of failing forever.
            floors.remove(name);
            return Err(unavailable("cursor", e));
        }
        floors.insert(name.to_owned(), position);
        Ok(position)
    }
}
