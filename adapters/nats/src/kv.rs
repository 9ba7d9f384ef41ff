//! A KV bucket as both [`Source`] and [`Feed`]: revision = seq.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use async_nats::jetstream::stream::{self, State};
use async_nats::{Client, HeaderMap, jetstream};
use bytes::Bytes;
use tidemark::tidemark_core::{Entry, FeedInfo, KeyPrefix, Lineage, Op};
use tidemark::{
    Changes, Error, Feed, FeedItem, FeedStream, Opened, Result, Snapshot, Source, Versioned,
};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::{debug, warn};

use tidemark_jetstream::{
    Confirmed, Created, Gate, Highest, Identity, LastPresent, Reader, ReadyGate, Remade, Replay,
    Step, StreamLineage, StreamState,
};

use crate::clock::StampedInfo;
use crate::consumer::{Deliver, Delivered, PushReader, Seen};
use crate::error::{check_key, check_name, check_prefix, unavailable};

const KV_OPERATION: &str = "KV-Operation";
const MARKER_REASON: &str = "Nats-Marker-Reason";
const EXPECTED_LAST_SUBJECT_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";

/// A NATS KV bucket as tidemark's source of truth and change feed (revision = seq).
///
/// - As a [`Feed`] it opens an ephemeral push consumer from the follower's watermark + 1
///   (the latest revision per key on a first sync, which replays the stream at server
///   speed — never `keys()` + `get`), reports the stream's first sequence so compaction
///   is detected, the sequence of its last message as the head the initial sync must
///   reach, and which history it serves at the follower's watermark ([`FeedInfo::lineage`],
///   from the same stream info as the head). Any consumer doubt (gap, missed heartbeats,
///   reconnect, a silent consumer the server says is gone) ends the feed with an error;
///   the follower reopens it from its own watermark + 1.
/// - As a [`Source`] it writes (put, compare-and-set update, delete), reads single keys,
///   and replays changes since a seq or a full snapshot from the stream. A replay reads
///   on past the head it read at the start until its consumer caught up: on a bucket
///   keeping one revision per key, a key overwritten meanwhile is only in what follows.
///
/// A snapshot is read whole, and [`Source::snapshot_parts`] keeps the trait's default,
/// which hands it out in key-ordered parts after reading it all; the server cannot serve
/// one point in time part by part. A consumer delivers the bucket in stream order, so a
/// part in key order needs every key first. And a read by key as of a sequence (a direct
/// get of the last message per subject up to the snapshot's watermark) needs the revision
/// the key had then: on a bucket keeping one revision per key (history 1, the default) a
/// put made while the read is in progress deletes it, and the key reads as absent though
/// it never was. (nats-server 2.15: put `a`, put `b`, put `a` again on a history-1
/// bucket, then ask for the last message of `a` and `b` up to sequence 2: only `b`
/// comes; with history 5, both.)
///
/// The bucket is looked up lazily: while it does not exist, every call fails with
/// [`Error::Unavailable`] and the follower's lookup backoff retries until it appears.
/// Cheap to clone.
///
/// A bucket deleted and made again is a new history that reuses the old one's revisions.
/// Where its head is below a follower's watermark the follower sees that on its own; where
/// it was written past the watermark only the stream's identity (the time the server
/// created it) tells. The handle remembers the stream it first saw, and each clone the
/// stream its own feed, replays and snapshots last read: the first of each to find
/// another stream reports it as a new history — a feed opened at a seq past 1 with a head
/// of 0, [`Changes::Compacted`] for changes since a seq, a snapshot at watermark 0 — so the
/// follower resyncs and replaces its cache (counted as a reset) instead of resuming in the
/// new history at its old watermark. Give each follower clones of its own (a clone starts
/// from the stream the handle first saw, not from what another clone read).
///
/// What a handle remembers lives as long as the handle. What a follower keeps with its
/// watermark outlives it: every read says which history it is of ([`Source::lineage_at`],
/// [`FeedInfo::lineage`], [`Snapshot::lineage`], [`Entry::stamp`]) — the stream's creation
/// time, and the stored time of its message at the seq the read names — and a follower
/// whose sink persisted them is told of a bucket recreated while it was down (another
/// creation time), and of a stream restored from a backup and written past its watermark
/// while the message at its watermark is still there (another stored time at that seq;
/// on a bucket keeping one revision per key an overwrite of that key since hides it).
///
/// [`with_prefix`](Self::with_prefix) makes a view over part of the bucket: the server
/// filters every consumer, replay and listing on the prefix's subjects.
pub struct KvBucket {
    inner: Arc<Inner>,
    prefix: Option<KeyPrefix>,
    max_in_flight: Option<usize>,
    /// The streams this clone's reads last found; each clone has its own.
    identity: Arc<std::sync::Mutex<Identity>>,
}

/// A clone is another reader: it starts from the stream the handle knows now (the one
/// any of its reads found last), never from what this clone's reads go on to find, so two
/// followers on clones of one handle are each told of a new stream, and a clone made
/// after a recreate that the handle has seen follows the new stream from the start.
impl Clone for KvBucket {
    fn clone(&self) -> Self {
        KvBucket {
            inner: Arc::clone(&self.inner),
            prefix: self.prefix.clone(),
            max_in_flight: self.max_in_flight,
            identity: self.inner.reader(),
        }
    }
}

struct Inner {
    client: Client,
    context: jetstream::Context,
    bucket: String,
    store: Mutex<Option<kv::Store>>,
    read: AtomicU64,
    /// The stream the handle's reads found last.
    latest: std::sync::Mutex<Option<Created>>,
    /// The bucket's value limit as last read, and when to read it again.
    limit: std::sync::Mutex<tidemark_jetstream::ValueLimit>,
    /// The origin of `limit`'s times.
    origin: Instant,
}

/// How often a handle reads its bucket's value limit again, and how recent a read must be
/// to refuse a value on.
const LIMIT_REFRESH: Duration = Duration::from_secs(30);
const LIMIT_CONFIRM: Duration = Duration::from_secs(1);

impl Inner {
    /// A new reader's identity: it starts from the stream the handle knows now.
    fn reader(&self) -> Arc<std::sync::Mutex<Identity>> {
        let latest = *self.latest.lock().unwrap_or_else(|e| e.into_inner());
        Arc::new(std::sync::Mutex::new(Identity::starting_from(latest)))
    }
}

fn created(info: &jetstream::stream::Info) -> Created {
    info.created.unix_timestamp_nanos()
}

/// A lineage of the stream, as tidemark's core takes it.
fn lineage(read: StreamLineage) -> Lineage {
    Lineage::new(read.history, read.stamp)
}

/// The stored time (nanoseconds since the Unix epoch) of the stream's message at `seq`,
/// from the stream leader (a read a lagging replica cannot answer, as
/// [`last_present`]'s), or `None` when the stream no longer holds it (overwritten,
/// deleted, purged) or `seq` is 0.
async fn stored_at(stream: &stream::Stream, seq: u64, port: &'static str) -> Result<Option<u64>> {
    if seq == 0 {
        return Ok(None);
    }
    match stream.get_raw_message(seq).await {
        Ok(message) => Ok(u64::try_from(message.time.unix_timestamp_nanos()).ok()),
        Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => {
            debug!(error = %e, seq, "message lookup failed");
            Err(unavailable(port, e))
        }
    }
}

impl std::fmt::Debug for KvBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBucket")
            .field("bucket", &self.inner.bucket)
            .field("prefix", &self.prefix)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl KvBucket {
    /// The bucket called `bucket`, reached through `client`. Nothing is requested yet.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if `bucket` is not a valid bucket name.
    pub fn new(client: Client, bucket: impl Into<String>) -> Result<KvBucket> {
        let context = jetstream::new(client.clone());
        Self::with_context(client, context, bucket)
    }

    /// As [`new`](Self::new), with a JetStream context of your own (a domain, a prefix, a
    /// timeout).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if `bucket` is not a valid bucket name.
    pub fn with_context(
        client: Client,
        context: jetstream::Context,
        bucket: impl Into<String>,
    ) -> Result<KvBucket> {
        let bucket = bucket.into();
        check_name(&bucket)?;
        Ok(KvBucket {
            inner: Arc::new(Inner {
                client,
                context,
                bucket,
                store: Mutex::new(None),
                read: AtomicU64::new(0),
                latest: std::sync::Mutex::new(None),
                limit: std::sync::Mutex::new(tidemark_jetstream::ValueLimit::new(
                    LIMIT_REFRESH,
                    LIMIT_CONFIRM,
                )),
                origin: Instant::now(),
            }),
            prefix: None,
            max_in_flight: None,
            identity: Arc::new(std::sync::Mutex::new(Identity::starting_from(None))),
        })
    }

    /// The same bucket (or view), with its feeds and replays delivering at most `messages`
    /// (at least 1) ahead of what the follower has read.
    ///
    /// The client drops what overflows a subscription's channel (async-nats's
    /// `subscription_capacity`, 65,536 messages by default), and the server's flow control
    /// bounds bytes in flight, which hold hundreds of thousands of small KV entries. By
    /// default a task of the feed moves every delivered message off the client's channel
    /// as it arrives, which keeps up unless the runtime's workers are all busy; a feed that
    /// loses messages anyway fails on the gap and is reopened from the follower's
    /// watermark, so nothing is lost for good, but a follower whose sink pauses long (a
    /// big durable commit) may then reopen turn after turn. With a cap below the client's
    /// capacity no message is dropped whatever the reader does; it costs the server an
    /// acknowledgement entry per message (about 70% more of its CPU per message in the
    /// `nats` bench), so a fast initial sync into memory is better off without it.
    #[must_use]
    pub fn with_max_in_flight(mut self, messages: usize) -> KvBucket {
        self.max_in_flight = Some(messages.max(1));
        self
    }

    /// A view of the same bucket over the keys under `prefix`, given as whole subject
    /// tokens: `"orders.eu"` (or `"orders.eu."`) holds `orders.eu.1` and `orders.eu.x.2`,
    /// not `orders.eu` itself nor `orders.europe.1`. Every consumer, replay, head and
    /// listing is filtered on the server (`$KV.<bucket>.orders.eu.>`), so the rest of the
    /// bucket is never sent; a follower over the view keeps only its keys
    /// ([`Source::key_prefix`]). Writes outside the prefix are refused. The view shares
    /// the bucket's lookup and its [`entries_read`](Self::entries_read) count.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a prefix the server cannot filter on: empty tokens
    /// (`""`, `"a..b"`, `".a"`), wildcards (`*`, `>`), or characters no KV key holds.
    pub fn with_prefix(&self, prefix: &str) -> Result<KvBucket> {
        Ok(KvBucket {
            inner: Arc::clone(&self.inner),
            prefix: Some(check_prefix(prefix)?),
            max_in_flight: self.max_in_flight,
            identity: self.inner.reader(),
        })
    }

    /// Whether this view holds `key`.
    fn holds(&self, key: &str) -> bool {
        self.prefix.as_ref().is_none_or(|p| p.matches(key))
    }

    /// [`check_key`], and a key this view does not hold.
    fn check_write(&self, key: &str) -> Result<()> {
        check_key(key)?;
        tidemark::check_key_within(key, self.prefix.as_ref())
    }

    /// The bucket's name.
    #[must_use]
    pub fn bucket(&self) -> &str {
        &self.inner.bucket
    }

    /// The client.
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// How many entries the feeds of this handle (and its clones) have delivered so far:
    /// what a warm restart saves shows here.
    #[must_use]
    pub fn entries_read(&self) -> u64 {
        self.inner.read.load(Ordering::Relaxed)
    }

    async fn store(&self, port: &'static str) -> Result<kv::Store> {
        let mut cached = self.inner.store.lock().await;
        if let Some(store) = cached.as_ref() {
            return Ok(store.clone());
        }
        let store = self
            .inner
            .context
            .get_key_value(self.inner.bucket.clone())
            .await
            .map_err(|e| unavailable(port, format!("bucket {}: {e}", self.inner.bucket)))?;
        self.saw(created(store.stream.cached_info()));
        *cached = Some(store.clone());
        Ok(store)
    }

    /// Notes the stream a read found: what the handle knows now.
    fn saw(&self, stream: Created) {
        *self.inner.latest.lock().unwrap_or_else(|e| e.into_inner()) = Some(stream);
    }

    /// Whether `stream` is not the one `reader` last found on this clone (or, before it
    /// found any, the one the clone started from): a new history, reported once per kind
    /// of read ([`Identity`] decides).
    fn new_stream(&self, reader: Reader, stream: Created) -> bool {
        let mut identity = self.identity.lock().unwrap_or_else(|e| e.into_inner());
        if !identity.is_new(reader, stream) {
            return false;
        }
        warn!(
            bucket = %self.inner.bucket,
            ?reader,
            "the bucket's stream is not the one read before (deleted and made again): a new history"
        );
        true
    }

    async fn forget(&self) {
        *self.inner.store.lock().await = None;
    }

    /// The bucket's stream state and identity, read now.
    async fn state(&self, port: &'static str) -> Result<(kv::Store, State, Created)> {
        let (store, info, stream) = self.info(port).await?;
        Ok((store, info.state, stream))
    }

    /// The bucket's stream info (state and config) and identity, read now. The store's
    /// own copy (`cached_info`) is from when the handle looked the bucket up, and an
    /// operator may have edited the bucket since (its `max_age`, its limit markers).
    async fn info(&self, port: &'static str) -> Result<(kv::Store, stream::Info, Created)> {
        let (store, stamped, stream) = self.stamped_info(port, Instant::now()).await?;
        Ok((store, stamped.info, stream))
    }

    /// [`info`](Self::info) with the server's clock read from the same answer, its local
    /// readings measured from `origin`.
    async fn stamped_info(
        &self,
        port: &'static str,
        origin: Instant,
    ) -> Result<(kv::Store, StampedInfo, Created)> {
        let store = self.store(port).await?;
        let name = store.stream.cached_info().config.name.clone();
        match crate::clock::stream_info(&self.inner.context, &name, origin, port).await {
            Ok(stamped) => {
                let stream = created(&stamped.info);
                self.saw(stream);
                Ok((store, stamped, stream))
            }
            Err(e) => {
                // Deleted and recreated, or never there: look it up afresh next time.
                self.forget().await;
                Err(e)
            }
        }
    }

    /// The subjects this view reads: the bucket's, or the prefix's.
    fn filter(&self, store: &kv::Store) -> String {
        let within = self.prefix.as_ref().map_or("", KeyPrefix::as_str);
        format!("{}{within}>", store.prefix)
    }

    /// The subjects this view reads, and whether they are the whole stream's
    /// ([`tidemark_jetstream::whole_stream`]) as the bucket's config said when the handle
    /// looked it up.
    fn subjects(&self, store: &kv::Store) -> Subjects {
        let filter = self.filter(store);
        let config = &store.stream.cached_info().config;
        let copies =
            config.mirror.is_some() || config.sources.as_ref().is_some_and(|s| !s.is_empty());
        Subjects {
            whole: tidemark_jetstream::whole_stream(&config.subjects, copies, &filter),
            filter,
            per_subject: config.max_messages_per_subject,
        }
    }

    /// The head an initial sync must reach ([`tidemark_jetstream::head`]): the seq of the
    /// last message still in the stream for this view (0 if none).
    async fn head(
        &self,
        store: &kv::Store,
        subjects: &Subjects,
        state: &State,
        port: &'static str,
    ) -> Result<u64> {
        if state.messages == 0 {
            return Ok(0);
        }
        let last = view_last_present(&store.stream, subjects, Some(state), port).await?;
        Ok(tidemark_jetstream::head(&facts(state), last))
    }

    /// Replays the bucket with `deliver`, handing each entry to `take`, until a read
    /// that cannot race confirms that nothing present is above what was delivered
    /// ([`Replay`] decides: never on the consumer's pending count alone). Returns the
    /// stream's state and identity read once the consumer existed, and the highest seq
    /// delivered. The entries are every mutation up to the last one delivered (or the
    /// latest per key): on a bucket keeping one revision per key, a key overwritten during
    /// the read loses the revision the consumer had not delivered yet, and only its new
    /// one, which may come after the head read at the start, stands for it.
    async fn replay(
        &self,
        store: &kv::Store,
        deliver: DeliverPolicy,
        port: &'static str,
        headers_only: bool,
        mut take: impl FnMut(Entry),
    ) -> Result<(State, Created, u64)> {
        let from = match deliver {
            DeliverPolicy::ByStartSequence { start_sequence } => start_sequence,
            _ => 1,
        };
        // The consumer and every read confirming its end take the same view.
        let subjects = self.subjects(store);
        let (filter, policy) = subjects.consumer(deliver);
        let mut reader = PushReader::open(
            &self.inner.client,
            &self.inner.context,
            &store.stream,
            Deliver {
                filter,
                policy,
                max_in_flight: self.max_in_flight,
                headers_only,
            },
            port,
        )
        .await?;
        let origin = Instant::now();
        let (store, stamped, stream) = self.stamped_info(port, origin).await?;
        let aging = aging(&stamped, origin);
        let state = stamped.info.state;
        let head = self.head(&store, &subjects, &state, port).await?;
        let mut replay = Replay::new(from, head);
        let mut step = replay.start();
        loop {
            match step {
                Step::Done { through } => return Ok((state, stream, through)),
                Step::Stalled { seen, head } => {
                    return Err(unavailable(
                        port,
                        format!("replay stalled at {seen} below the stream's last message {head}"),
                    ));
                }
                Step::Confirm => {
                    let last = view_last_present(&store.stream, &subjects, None, port).await?;
                    step = replay.on_confirmed(last.seq());
                }
                Step::Read => {
                    step = match reader.next(port).await {
                        None => return Err(unavailable(port, "replay subscription closed")),
                        Some(Err(e)) => return Err(e),
                        Some(Ok(Seen::Idle)) => replay.on_idle(),
                        Some(Ok(Seen::Message(d))) => {
                            let (seq, pending) = (d.seq, d.pending);
                            if let FeedItem::Entry(mut e) =
                                to_item(&store.prefix, d, aging.as_ref())
                            {
                                e.pending = None;
                                take(e);
                            }
                            replay.on_message(seq, pending)
                        }
                    };
                }
            }
        }
    }

    /// The current entry of `key`, whatever its operation.
    async fn entry(&self, key: &str) -> Result<Option<kv::Entry>> {
        let store = self.store("source").await?;
        store
            .entry(key.to_owned())
            .await
            .map_err(|e| unavailable("source", e))
    }

    async fn conflict(&self, key: &str, expected: u64) -> Error {
        let current = match self.get(key).await {
            Ok(v) => v.map(|v| v.seq),
            Err(e) => return e,
        };
        Error::Conflict {
            key: key.to_owned(),
            expected,
            current,
        }
    }

    /// Refuses a value of `len` bytes larger than a write can carry (see
    /// [`tidemark_jetstream::value_limit`]) with [`Error::ValueTooLarge`], before sending,
    /// rather than a server error or a committed value no cache would ever hold. The
    /// bucket's limit is read from the server again when it is stale, before a value
    /// above it is refused, and after the server refused a write for its size
    /// ([`tidemark_jetstream::ValueLimit`]): an operator may change it at any time.
    async fn check_value(&self, store: &kv::Store, len: usize) -> Result<()> {
        use tidemark_jetstream::Verdict;
        // Twice at most: a read, then a verdict on it.
        for _ in 0..2 {
            let now = self.inner.origin.elapsed();
            let verdict = self.limit().judge(len, now);
            match verdict {
                Verdict::Send => return Ok(()),
                Verdict::TooLarge { max } => return Err(Error::ValueTooLarge { len, max }),
                Verdict::ReadFirst => {
                    let info = store
                        .stream
                        .get_info()
                        .await
                        .map_err(|e| unavailable("source", e))?;
                    let max = tidemark_jetstream::value_limit(
                        i64::from(info.config.max_message_size),
                        self.inner.client.server_info().max_payload,
                        tidemark::tidemark_core::MAX_VALUE_BYTES,
                    );
                    self.limit().observe(max, self.inner.origin.elapsed());
                }
            }
        }
        Ok(())
    }

    fn limit(&self) -> std::sync::MutexGuard<'_, tidemark_jetstream::ValueLimit> {
        self.inner.limit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A write of `len` bytes the server refused with `error`: [`Error::ValueTooLarge`]
    /// if it was refused for its size (the limit is read again first), else unavailable.
    async fn refused<E>(&self, store: &kv::Store, len: usize, error: E) -> Error
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        if refused_for_size(&error) {
            self.limit().refused();
            if let Err(e) = self.check_value(store, len).await {
                return e;
            }
        }
        unavailable("source", error)
    }
}

/// Whether a write error is the server's "message size exceeds maximum allowed".
fn refused_for_size(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return tidemark_jetstream::refused_for_size(js.error_code().0);
        }
        next = e.source();
    }
    false
}

/// The last message present now for the subjects `filter`, from the stream leader: a
/// read that cannot race (the server answers from the stream as it is, not from a count it
/// keeps, and not a direct get that a lagging replica may answer).
pub(crate) async fn last_present(
    stream: &stream::Stream,
    filter: &str,
    port: &'static str,
) -> Result<LastPresent> {
    match stream.get_last_raw_message_by_subject(filter).await {
        Ok(message) => Ok(LastPresent::At(message.sequence)),
        Err(e)
            if e.kind()
                == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
        {
            Ok(LastPresent::None)
        }
        Err(e) => {
            debug!(error = %e, "last message lookup failed");
            Err(unavailable(port, e))
        }
    }
}

/// The subjects a view reads: a filter, and whether it names every subject of a stream
/// that copies nothing from another ([`tidemark_jetstream::whole_stream`]).
#[derive(Clone, Debug)]
pub(crate) struct Subjects {
    filter: String,
    whole: bool,
    /// The messages the stream keeps per subject, as its config said.
    per_subject: i64,
}

impl Subjects {
    /// The subject filter and start of a consumer of the view reading per `deliver`:
    /// unfiltered where [`tidemark_jetstream::read_unfiltered`] says so, "last per
    /// subject" then being "all".
    fn consumer(&self, deliver: DeliverPolicy) -> (String, DeliverPolicy) {
        let last_per_subject = matches!(deliver, DeliverPolicy::LastPerSubject);
        if tidemark_jetstream::read_unfiltered(self.whole, self.per_subject, last_per_subject) {
            let deliver = if last_per_subject {
                DeliverPolicy::All
            } else {
                deliver
            };
            (String::new(), deliver)
        } else {
            (self.filter.clone(), deliver)
        }
    }
}

/// [`last_present`] for the view `subjects`: for a view of the whole stream, the message at
/// the stream's last seq (from `state`, or stream info read now) when it is still there —
/// a read by seq, where nats-server's lookup by a wildcard subject walks its index of every
/// subject the stream holds (`fileStore.loadLastLocked` matches the wildcard against all
/// of them) — and the lookup when it is gone. Both answer from the stream leader, after
/// the delivery they confirm.
pub(crate) async fn view_last_present(
    stream: &stream::Stream,
    subjects: &Subjects,
    state: Option<&State>,
    port: &'static str,
) -> Result<LastPresent> {
    if subjects.whole {
        let state = match state {
            Some(state) => facts(state),
            None => facts(
                &stream
                    .get_info()
                    .await
                    .map_err(|e| unavailable(port, e))?
                    .state,
            ),
        };
        if let tidemark_jetstream::LastRead::AtSeq(seq) =
            tidemark_jetstream::last_read(true, &state)
        {
            match stream.get_raw_message(seq).await {
                Ok(message) => return Ok(LastPresent::At(message.sequence)),
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound => {}
                Err(e) => {
                    debug!(error = %e, seq, "message lookup failed");
                    return Err(unavailable(port, e));
                }
            }
        }
    }
    last_present(stream, &subjects.filter, port).await
}

/// What a KV feed reports: a bucket that keeps only a history per key says so
/// ([`FeedInfo::kv_per_key`]), so a first sequence moved by rewrites is no compaction
/// ([`tidemark_jetstream::per_key_only`]).
fn feed_info(config: &stream::Config, first: u64, head: u64) -> FeedInfo {
    let limits = tidemark_jetstream::Limits {
        per_subject: config.max_messages_per_subject,
        max_age_ns: u64::try_from(config.max_age.as_nanos()).unwrap_or(u64::MAX),
        max_messages: config.max_messages,
        max_bytes: config.max_bytes,
        message_ttl: config.allow_message_ttl,
    };
    if tidemark_jetstream::per_key_only(&limits) {
        FeedInfo::kv_per_key(first, head)
    } else {
        FeedInfo::kv(first, head)
    }
}

/// What stream info says of the stream's contents, as the decisions take it.
fn facts(state: &State) -> StreamState {
    StreamState {
        messages: state.messages,
        first_seq: state.first_sequence,
        last_seq: state.last_sequence,
    }
}

/// The first seq a replay from the stream can still serve.
fn first_available(state: &State) -> u64 {
    tidemark_jetstream::first_available(&facts(state))
}

/// What a KV message's headers say happened to its key.
pub(crate) fn operation(headers: Option<&HeaderMap>) -> Op {
    let Some(headers) = headers else {
        return Op::Put;
    };
    if let Some(op) = headers.get(KV_OPERATION) {
        return match op.as_str() {
            "PUT" => Op::Put,
            "DEL" => Op::Delete,
            "PURGE" => Op::Purge,
            other => Op::Unknown(other.to_owned()),
        };
    }
    // Server-written markers (expiry, purge, removal by TTL) carry a reason instead.
    if let Some(reason) = headers.get(MARKER_REASON) {
        return match reason.as_str() {
            "MaxAge" | "Purge" => Op::Purge,
            "Remove" => Op::Delete,
            other => Op::Unknown(format!("marker {other}")),
        };
    }
    Op::Put
}

/// How a feed or a replay judges a value's expiry: the bucket's age limit, when it drops
/// values silently, and the server's clock read with it (SPEC §17: the server's stamps
/// against the server's time, carried forward by the local monotonic clock).
#[derive(Clone, Copy, Debug)]
struct Aging {
    expiry: tidemark_jetstream::Expiry,
    clock: tidemark_jetstream::ServerClock,
    origin: Instant,
}

impl Aging {
    /// What is left of the life of a value the server stored at `published_ns`, now.
    fn remaining(&self, published_ns: u64) -> Option<Duration> {
        self.expiry
            .remaining_at(published_ns, &self.clock, self.origin.elapsed())
    }
}

/// The aging of a read whose stream info is `stamped`, its clock's readings measured from
/// `origin`. None without an age limit, with limit markers (the server announces
/// removals), or from a server that does not stamp its answers (before 2.10: the values
/// are then kept, and the presence check finds those the server dropped).
fn aging(stamped: &StampedInfo, origin: Instant) -> Option<Aging> {
    let config = &stamped.info.config;
    Some(Aging {
        // From the config as read now, not as cached when the bucket was looked up: a
        // limit lifted since would expire values the bucket keeps, one set since would
        // never be applied.
        expiry: tidemark_jetstream::Expiry::silent(
            config.max_age,
            config.subject_delete_marker_ttl.is_some(),
        )?,
        clock: stamped.clock?,
        origin,
    })
}

/// A message's payload as a `Vec` that holds only its bytes. A payload that is the only
/// owner of the buffer it was read into becomes a `Vec` of that whole buffer: a 100-byte
/// value kept its message's 295 bytes, and a cache fed by a bucket held 2.6× what a bare
/// map of its entries does (the `snapshot_memory` bench). Shrinking gives the rest back
/// in place, with no copy.
fn owned(payload: Bytes) -> Vec<u8> {
    let mut value = Vec::from(payload);
    value.shrink_to_fit();
    value
}

fn to_item(prefix: &str, d: Delivered, aging: Option<&Aging>) -> FeedItem {
    let Some(key) = d.subject.strip_prefix(prefix) else {
        return FeedItem::Undecodable {
            position: d.seq,
            seq: Some(d.seq),
            reason: format!("subject {} is outside the bucket", d.subject),
        };
    };
    let op = operation(d.headers.as_ref());
    let value = if op == Op::Put {
        owned(d.payload)
    } else {
        Vec::new()
    };
    let entry = Entry::new(d.seq, d.seq, key, op, value)
        .with_pending(d.pending)
        .stamped(tidemark_jetstream::stamp(d.published_ns));
    let remaining = aging
        .filter(|_| entry.op == Op::Put)
        .and_then(|a| a.remaining(d.published_ns));
    FeedItem::Entry(match remaining {
        Some(remaining) => entry.expiring_in(remaining),
        None => entry,
    })
}

impl Source for KvBucket {
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        self.check_write(key)?;
        let store = self.store("source").await?;
        self.check_value(&store, value.len()).await?;
        let len = value.len();
        match store.put(key, Bytes::from(value)).await {
            Ok(seq) => Ok(seq),
            Err(e) => Err(self.refused(&store, len, e).await),
        }
    }

    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        self.check_write(key)?;
        let store = self.store("source").await?;
        self.check_value(&store, value.len()).await?;
        let len = value.len();
        if expected == 0 {
            return match store.create(key, Bytes::from(value)).await {
                Ok(seq) => Ok(seq),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {
                    Err(self.conflict(key, expected).await)
                }
                Err(e) => Err(self.refused(&store, len, e).await),
            };
        }
        // NATS accepts an update whose expected revision is a delete marker's; for us the
        // key is absent then, and only 0 may be expected.
        if let Some(entry) = self.entry(key).await?
            && entry.revision == expected
            && entry.operation != Operation::Put
        {
            return Err(Error::Conflict {
                key: key.to_owned(),
                expected,
                current: None,
            });
        }
        match store.update(key, Bytes::from(value), expected).await {
            Ok(seq) => Ok(seq),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                Err(self.conflict(key, expected).await)
            }
            Err(e) => Err(self.refused(&store, len, e).await),
        }
    }

    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        self.check_write(key)?;
        let store = self.store("source").await?;
        let subject = format!(
            "{}{key}",
            store.put_prefix.as_deref().unwrap_or(store.prefix.as_str())
        );
        // Delete only what exists, against the revision read, so an absent key uses no
        // seq and the delete's own seq is known.
        for _ in 0..16 {
            let Some(entry) = self.entry(key).await? else {
                return Ok(None);
            };
            if entry.operation != Operation::Put {
                return Ok(None);
            }
            let mut headers = HeaderMap::new();
            headers.insert(KV_OPERATION, "DEL");
            headers.insert(
                EXPECTED_LAST_SUBJECT_SEQ,
                entry.revision.to_string().as_str(),
            );
            let ack = self
                .inner
                .context
                .publish_with_headers(subject.clone(), headers, Bytes::new())
                .await
                .map_err(|e| unavailable("source", e))?
                .await;
            match ack {
                Ok(ack) => return Ok(Some(ack.sequence)),
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {}
                Err(e) => return Err(unavailable("source", e)),
            }
        }
        Err(unavailable(
            "source",
            format!("remove of {key:?} kept racing other writers"),
        ))
    }

    async fn watermark(&self) -> Result<u64> {
        Ok(self.state("source").await?.1.last_sequence)
    }

    async fn changes_since(&self, since: u64) -> Result<Changes> {
        let (store, info, stream) = self.info("source").await?;
        let state = &info.state;
        if self.new_stream(Reader::Changes, stream) && since > 0 {
            // The seq `since` is another stream's: nothing since it can be served.
            return Ok(Changes::Compacted {
                first_available: first_available(state),
            });
        }
        let first = first_available(state);
        if since.saturating_add(1) < first && since < state.last_sequence {
            return Ok(Changes::Compacted {
                first_available: first,
            });
        }
        // One entry per key as the replay goes, not every message since: a bucket keeping
        // many revisions per key would otherwise hold them all at once.
        let mut latest: HashMap<std::sync::Arc<str>, Entry> = HashMap::new();
        let mut watermark = state.last_sequence;
        if state.last_sequence > since && state.messages > 0 {
            let deliver = DeliverPolicy::ByStartSequence {
                start_sequence: since + 1,
            };
            let (after, _, through) = self
                .replay(&store, deliver, "source", false, |e| {
                    latest.insert(e.key.clone(), e);
                })
                .await?;
            watermark = after.last_sequence.max(through);
        }
        let mut entries: Vec<Entry> = latest
            .into_values()
            .filter_map(|mut e| match e.op {
                Op::Put | Op::Delete => Some(e),
                Op::Purge => {
                    e.op = Op::Delete;
                    Some(e)
                }
                _ => None,
            })
            .collect();
        entries.sort_by_key(|e| e.seq);
        Ok(Changes::Since { entries, watermark })
    }

    /// The keys the bucket holds now, from a headers-only replay of the last message per
    /// key, ended like every replay on a read that cannot race ([`Replay`]): the keys of
    /// the source as of the returned watermark, whatever their number. (It listed the
    /// stream's subjects before; the server pages that listing by offset, so on buckets
    /// of more than 100,000 subjects a subject purged between two pages hid later ones,
    /// and the presence check dropped live keys.) No value crosses the wire.
    async fn present_keys(&self) -> Result<Option<tidemark::PresentKeys>> {
        let store = self.store("source").await?;
        // The latest operation per key: a key overwritten (or deleted) during the read
        // comes again later.
        let mut latest: HashMap<std::sync::Arc<str>, (u64, bool)> = HashMap::new();
        let (state, _, through) = self
            .replay(&store, DeliverPolicy::LastPerSubject, "source", true, |e| {
                let put = e.op == Op::Put;
                let held = latest.entry(e.key).or_insert((e.seq, put));
                if e.seq >= held.0 {
                    *held = (e.seq, put);
                }
            })
            .await?;
        let keys = latest
            .into_iter()
            .filter(|(_, (_, put))| *put)
            .map(|(key, _)| key.to_string())
            .collect();
        Ok(Some(tidemark::PresentKeys {
            keys,
            watermark: through.max(state.last_sequence),
        }))
    }

    /// The lineage it reports is read before and with its messages, never after them
    /// ([`tidemark_jetstream::snapshot_lineage`]): the stream's creation time before the
    /// replay, confirmed by the one read once its consumer existed, and the stored time of
    /// the message at the watermark as the replay delivered it.
    async fn snapshot(&self) -> Result<Snapshot> {
        let (store, _, before) = self.info("source").await?;
        let mut entries = Vec::new();
        let mut highest = Highest::default();
        let (state, stream, through) = self
            .replay(
                &store,
                DeliverPolicy::LastPerSubject,
                "source",
                false,
                |e| {
                    highest.on_message(e.seq, e.stamp.unwrap_or(0));
                    entries.push(e);
                },
            )
            .await?;
        let top = through.max(state.last_sequence);
        // The latest revision per key, sorted in place rather than gathered in a map: a
        // key overwritten during the read came twice, and the map cost more memory than
        // the entries it held.
        entries.sort_unstable_by(|a, b| a.key.cmp(&b.key).then(a.seq.cmp(&b.seq)));
        entries.dedup_by(|later, kept| {
            let same = later.key == kept.key;
            if same {
                std::mem::swap(later, kept);
            }
            same
        });
        entries.retain(|e| e.op == Op::Put);
        // A new stream: a watermark below any follower's, so a follower that held the old
        // stream's seqs forgets them and replaces its cache (its watermark becomes the
        // highest seq of the entries, and its feed reads the rest).
        let watermark = if self.new_stream(Reader::Snapshot, stream) {
            0
        } else {
            top
        };
        let lineage = match tidemark_jetstream::snapshot_lineage(before, stream, watermark, highest)
        {
            Ok(read) => lineage(read),
            Err(Remade::During { .. }) => {
                return Err(unavailable(
                    "source",
                    format!(
                        "bucket {}: its stream was made again during the snapshot",
                        self.inner.bucket
                    ),
                ));
            }
        };
        Ok(Snapshot {
            entries,
            watermark,
            lineage,
        })
    }

    /// `None` for a key outside this view's prefix.
    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        check_key(key)?;
        if !self.holds(key) {
            return Ok(None);
        }
        Ok(self.entry(key).await?.and_then(|e| {
            (e.operation == Operation::Put).then(|| Versioned {
                seq: e.revision,
                value: owned(e.value),
            })
        }))
    }

    async fn first_available(&self) -> Result<u64> {
        Ok(first_available(&self.state("source").await?.1))
    }

    /// The stream's creation time (from stream info) and the stored time of its message
    /// at `seq` (from the stream leader), each read now ([`StreamLineage`]). The message
    /// is the stream's at `seq` whatever its key, also for a view over a prefix: a stamp
    /// names a mutation of the bucket.
    async fn lineage_at(&self, seq: u64) -> Result<Lineage> {
        let (store, _, stream) = self.info("source").await?;
        let stored = stored_at(&store.stream, seq, "source").await?;
        Ok(lineage(StreamLineage::read(stream, stored)))
    }

    fn key_prefix(&self) -> Option<&KeyPrefix> {
        self.prefix.as_ref()
    }

    /// The reconnects of the client, if [`NatsOptions::connect`](crate::NatsOptions::connect)
    /// made it.
    fn reconnects(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        crate::reconnects::of(&self.inner.client)
    }

    /// A stream-info request for the bucket's stream: answered by its leader means the
    /// bucket is served, "stream not found" that it is missing (see [`Source::probe`]).
    fn probe(&self) -> Option<impl std::future::Future<Output = Result<()>> + Send + 'static> {
        Some(crate::reconnects::probe(
            &self.inner.context,
            format!("KV_{}", self.inner.bucket),
        ))
    }
}

/// The entries of an open KV feed.
#[derive(Debug)]
pub struct KvStream {
    reader: PushReader,
    prefix: String,
    /// The bucket's `max_age` when it drops values silently (no limit markers), as the
    /// server said when this feed opened.
    aging: Option<Aging>,
    /// Keeps the initial sync from saying ready before a read that cannot race confirms
    /// the head ([`ReadyGate`]).
    gate: ReadyGate,
    /// A message that reached the head, held while the gate's read confirms it (kept
    /// here, so a dropped call loses nothing).
    held: Option<Delivered>,
    /// An entry to hand on after a raised head.
    queued: Option<FeedItem>,
    /// For the gate's reads.
    store: kv::Store,
    subjects: Subjects,
    seen: u64,
    owner: Arc<Inner>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.bucket)
    }
}

impl FeedStream for KvStream {
    fn next_ready(&mut self, max: usize, into: &mut Vec<Option<Result<FeedItem>>>) -> usize {
        // Stop at a message held for the ready gate's read: it cannot be ready at once,
        // and polling it would only send the read and drop it.
        tidemark::take_ready(self, max, into, |s| s.held.is_none())
    }

    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if let Some(item) = self.queued.take() {
                return Some(Ok(item));
            }
            if let Some(seq) = self.held.as_ref().map(|d| d.seq) {
                let last = match view_last_present(&self.store.stream, &self.subjects, None, "feed")
                    .await
                {
                    Ok(last) => last.seq(),
                    Err(e) => return Some(Err(e)),
                };
                let held = self.held.take()?;
                let item = self.item(held);
                return Some(Ok(match self.gate.on_confirmed(seq, last) {
                    Confirmed::Ready => item,
                    Confirmed::Raise { head } => {
                        debug!(
                            held = seq,
                            head,
                            "the stream moved past the head during the initial sync: reading on"
                        );
                        self.queued = Some(item);
                        FeedItem::Head(head)
                    }
                }));
            }
            match self.reader.next("feed").await? {
                Err(e) => return Some(Err(e)),
                Ok(Seen::Idle) => {
                    if let Err(head) = self.gate.on_idle(self.seen) {
                        // The server says it has nothing more, yet the head was not
                        // delivered (a fresh consumer on a just-restarted server): reopen.
                        return Some(Err(unavailable(
                            "feed",
                            format!("consumer idle at {} below the head {head}", self.seen),
                        )));
                    }
                }
                Ok(Seen::Message(d)) => {
                    self.seen = self.seen.max(d.seq);
                    self.owner.read.fetch_add(1, Ordering::Relaxed);
                    match self.gate.on_message(d.seq) {
                        Gate::Pass => return Some(Ok(self.item(d))),
                        Gate::Confirm => self.held = Some(d),
                    }
                }
            }
        }
    }
}

impl KvStream {
    fn item(&self, d: Delivered) -> FeedItem {
        to_item(&self.prefix, d, self.aging.as_ref())
    }
}

impl Feed for KvBucket {
    const FOLLOW: tidemark::tidemark_core::Follow = tidemark::tidemark_core::Follow::Replay;
    type Stream = KvStream;

    /// Sets [`FeedInfo::lineage`] itself rather than leaving it to the runtime's later
    /// [`Source::lineage_at`]: the creation time comes from the stream info that gives the
    /// head and first seq (one stream, one answer, one round trip fewer), the stamp at
    /// `from - 1` is read once the consumer exists.
    async fn open(&self, from: u64, _after_position: Option<u64>) -> Result<Opened<KvStream>> {
        let store = self.store("feed").await?;
        // A first sync needs only the latest revision per key; a resume needs everything
        // after the watermark, in order.
        let deliver = if from <= 1 {
            DeliverPolicy::LastPerSubject
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: from,
            }
        };
        // The consumer first, the head after: a key overwritten while the head is read is
        // then delivered at or below it, and a first sync waits for it. The consumer and
        // every read of the head take the same view.
        let subjects = self.subjects(&store);
        let (filter, policy) = subjects.consumer(deliver);
        let reader = PushReader::open(
            &self.inner.client,
            &self.inner.context,
            &store.stream,
            Deliver {
                filter,
                policy,
                max_in_flight: self.max_in_flight,
                headers_only: false,
            },
            "feed",
        )
        .await?;
        let origin = Instant::now();
        let (store, stamped, stream) = self.stamped_info("feed", origin).await?;
        let aging = aging(&stamped, origin);
        let state = stamped.info.state;
        let mut head = FeedInfo::filtered_head(
            self.head(&store, &subjects, &state, "feed").await?,
            state.last_sequence,
            from,
        );
        if self.new_stream(Reader::Feed, stream) && from > 1 {
            // The watermark is another stream's: a head behind it makes the follower
            // resync, and the snapshot it reads says the rest.
            head = 0;
        }
        // The history from the same stream info as the head and first seq it reports, and
        // the stamp at the watermark read after the consumer exists: a stream remade or
        // restored since the watermark was reached is told at this open.
        let stored = stored_at(&store.stream, from.saturating_sub(1), "feed").await?;
        let lineage = lineage(StreamLineage::read(stream, stored));
        Ok(Opened {
            info: feed_info(&stamped.info.config, first_available(&state), head)
                .with_lineage(lineage),
            stream: KvStream {
                reader,
                prefix: store.prefix.clone(),
                aging,
                gate: ReadyGate::new(head),
                held: None,
                queued: None,
                subjects,
                store,
                seen: from.saturating_sub(1),
                owner: Arc::clone(&self.inner),
            },
        })
    }

    /// The reconnects of the client, if [`NatsOptions::connect`](crate::NatsOptions::connect)
    /// made it.
    fn reconnects(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        crate::reconnects::of(&self.inner.client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn kv_operations_and_markers_map_to_ops() {
        assert_eq!(operation(None), Op::Put);
        assert_eq!(
            operation(Some(&headers(&[(KV_OPERATION, "DEL")]))),
            Op::Delete
        );
        assert_eq!(
            operation(Some(&headers(&[(KV_OPERATION, "PURGE")]))),
            Op::Purge
        );
        assert_eq!(
            operation(Some(&headers(&[(MARKER_REASON, "MaxAge")]))),
            Op::Purge,
            "an expiry marker is a removal"
        );
        assert_eq!(
            operation(Some(&headers(&[(MARKER_REASON, "Remove")]))),
            Op::Delete
        );
        assert_eq!(
            operation(Some(&headers(&[(MARKER_REASON, "Purge")]))),
            Op::Purge
        );
        assert_eq!(
            operation(Some(&headers(&[(KV_OPERATION, "ROLLUP")]))),
            Op::Unknown("ROLLUP".into()),
            "an unknown operation must never become a put"
        );
        assert_eq!(operation(Some(&headers(&[("X-Other", "1")]))), Op::Put);
    }
}
