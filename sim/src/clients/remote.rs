//! The ports, implemented over the sim's wire protocol: what writers and followers on
//! other hosts use to reach the source host through turmoil's network.

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use tidemark::tidemark_core::{Entry, FeedInfo, Follow};
use tidemark::{
    Changes, Claimed, Cursors, Error, Feed, FeedItem, FeedStream, Opened, Outbox, OutboxUpdate,
    OutboxWatch, Publish, Received, Result, Snapshot, SnapshotParts, Source, ValueAt, Versioned,
    Wake, WakeListener,
};
use turmoil::net::TcpStream;

use crate::wire::{self, FrameReader, PORT, Request, Response};

/// How long connecting may take before the link counts as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

thread_local! {
    /// The snapshots read in parts on this thread (a run is simulated on one): reads,
    /// reads of more than one part, parts.
    static PART_READS: Cell<PartReads> = const { Cell::new(PartReads { reads: 0, split: 0, parts: 0 }) };
}

/// Snapshots read in parts during a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartReads {
    /// Snapshots read in parts.
    pub reads: u32,
    /// Of them, those of more than one part.
    pub split: u32,
    /// Parts in all.
    pub parts: u64,
}

thread_local! {
    /// The probes sent on this thread (a run is simulated on one).
    static PROBES: Cell<ProbeCounts> = const { Cell::new(ProbeCounts { sent: 0, answered: 0, missed: 0, answered_after_miss: 0 }) };
}

/// Probes of the source host sent by followers' runtimes during a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeCounts {
    /// Probes sent.
    pub sent: u32,
    /// Of them, answered.
    pub answered: u32,
    /// Failed, or given up by the follower before an answer (a held link).
    pub missed: u32,
    /// Answered when the client's probe before it was missed: the follower heard its
    /// source again after a stall (what ends its backoff where no reconnect comes).
    pub answered_after_miss: u32,
}

fn count_probe(f: impl FnOnce(&mut ProbeCounts)) {
    PROBES.with(|p| {
        let mut counts = p.get();
        f(&mut counts);
        p.set(counts);
    });
}

/// The probes sent on this thread since the last call.
#[must_use]
pub fn take_probe_counts() -> ProbeCounts {
    PROBES.replace(ProbeCounts::default())
}

/// The snapshots read in parts on this thread since the last call.
#[must_use]
pub fn take_part_reads() -> PartReads {
    PART_READS.replace(PartReads::default())
}

/// What a part of a snapshot read part by part comes from: the read the first came from,
/// or (a naive client) a read of its own, after the last key of the part before.
enum NextPart {
    Part(Vec<Entry>),
    After(Arc<str>),
}

/// A client of the source host named `host`. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Remote {
    host: String,
    /// A naive client: each part of a snapshot read in parts is read at its own moment,
    /// not at the first part's point in time.
    parts_apart: bool,
    /// A naive client that cannot tell one history of the source from another.
    blind_to_history: bool,
    /// Writes go through the announcing source (an outbox row in the same step).
    announced: bool,
    /// The relay publishing through this client, named to the source host's ledger.
    by: Option<String>,
    /// The client's view of its link, shared by its clones.
    link: Arc<Link>,
}

/// What a client knows of its link to the source host: whether its last connection
/// attempt failed, and how often it got through again after one did. Like a NATS client,
/// it tells its followers of each reconnect ([`Source::reconnects`]). As a NATS client
/// keeps its connection through a server paused and continued, a connect that only went
/// unanswered (a held link) is no failure of the link: its return is no reconnect, and
/// followers learn of it by their probes ([`Source::probe`]); a refused connect (a
/// partition, a crashed host) is one.
#[derive(Debug)]
struct Link {
    down: AtomicBool,
    reconnects: watch::Sender<u64>,
    /// The last probe failed or was given up before its answer.
    probe_missed: AtomicBool,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            down: AtomicBool::new(false),
            reconnects: watch::Sender::new(0),
            probe_missed: AtomicBool::new(false),
        }
    }
}

impl Link {
    fn up(&self) {
        if self.down.swap(false, Ordering::SeqCst) {
            self.reconnects.send_modify(|n| *n += 1);
        }
    }

    fn failed(&self) {
        self.down.store(true, Ordering::SeqCst);
    }
}

fn unavailable(port: &'static str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(port, e.to_string())
}

impl Remote {
    /// A client of the source host called `host`.
    #[must_use]
    pub fn new(host: impl Into<String>) -> Self {
        Remote {
            host: host.into(),
            parts_apart: false,
            blind_to_history: false,
            announced: false,
            by: None,
            link: Arc::default(),
        }
    }

    /// A naive client that reads each part of a snapshot read in parts at its own moment
    /// (a paging query outside any read transaction): the parts come from different
    /// points in time under one watermark.
    #[must_use]
    pub fn reading_parts_apart(mut self) -> Self {
        self.parts_apart = true;
        self
    }

    /// A naive client that cannot tell one history of the source from another: it reports
    /// no history and no stamp, so its follower trusts its watermark across a restore (as
    /// tidemark did before the source said which history it serves).
    #[must_use]
    pub fn blind_to_history(mut self) -> Self {
        self.blind_to_history = true;
        self
    }

    /// A client whose writes go through the source host's announcing source: each
    /// commits an outbox row with it, which relays announce.
    #[must_use]
    pub fn announcing(host: impl Into<String>) -> Self {
        Remote {
            announced: true,
            ..Remote::new(host)
        }
    }

    /// A client that names the relay `owner` in what it publishes.
    #[must_use]
    pub fn relay(host: impl Into<String>, owner: impl Into<String>) -> Self {
        Remote {
            by: Some(owner.into()),
            ..Remote::new(host)
        }
    }

    async fn connect(&self, port: &'static str) -> Result<TcpStream> {
        match tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((self.host.as_str(), PORT)),
        )
        .await
        {
            Ok(Ok(stream)) => {
                self.link.up();
                Ok(stream)
            }
            Ok(Err(e)) => {
                self.link.failed();
                Err(unavailable(port, e))
            }
            Err(_) => Err(unavailable(port, "connect timed out")),
        }
    }

    /// The relay (or worker) this client names in what it does, if any.
    #[must_use]
    pub fn owner(&self) -> Option<&str> {
        self.by.as_deref()
    }

    /// A fresh connection to the source host, framed (a dialogue of its own).
    pub(crate) async fn dial(&self, port: &'static str) -> Result<FrameReader> {
        Ok(FrameReader::new(self.connect(port).await?))
    }

    /// Makes one request on a fresh connection and reads its one answer, waiting for it
    /// up to the wire's [`READ_TIMEOUT`](crate::wire::READ_TIMEOUT).
    pub(crate) async fn call(&self, port: &'static str, request: Request) -> Result<Response> {
        self.call_within(port, request, crate::wire::READ_TIMEOUT)
            .await
    }

    /// [`call`](Self::call), waiting for the answer up to `timeout` (a NATS client's
    /// request timeout, say: a reply that never comes, as reads left unanswered by a
    /// [`Silence`](crate::hosts::source::Silence), holds the request that long unless the
    /// follower gives it up).
    pub(crate) async fn call_within(
        &self,
        port: &'static str,
        request: Request,
        timeout: Duration,
    ) -> Result<Response> {
        let mut frames = FrameReader::with_timeout(self.connect(port).await?, timeout);
        wire::write(frames.stream(), &request)
            .await
            .map_err(|e| unavailable(port, e))?;
        match frames.read().await.map_err(|e| unavailable(port, e))? {
            Response::Failed(reason) => Err(Error::unavailable(port, reason)),
            other => Ok(other),
        }
    }
}

fn unexpected(port: &'static str, r: &Response) -> Error {
    Error::unavailable(port, format!("unexpected answer {r:?}"))
}

fn entries(wire: Vec<wire::WireEntry>) -> Vec<Entry> {
    wire.into_iter().map(Entry::from).collect()
}

impl Source for Remote {
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64> {
        match self
            .call(
                "source",
                Request::Put {
                    key: key.to_owned(),
                    value,
                    announced: self.announced,
                },
            )
            .await?
        {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> Result<u64> {
        match self
            .call(
                "source",
                Request::Update {
                    key: key.to_owned(),
                    value,
                    expected,
                    announced: self.announced,
                },
            )
            .await?
        {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn remove(&self, key: &str) -> Result<Option<u64>> {
        match self
            .call(
                "source",
                Request::Remove {
                    key: key.to_owned(),
                    announced: self.announced,
                },
            )
            .await?
        {
            Response::MaybeSeq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn watermark(&self) -> Result<u64> {
        match self.call("source", Request::Watermark).await? {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
    }

    /// What the source host says of its history at `seq`; nothing for a naive client
    /// ([`blind_to_history`](Self::blind_to_history)).
    async fn lineage_at(&self, seq: u64) -> Result<tidemark::Lineage> {
        if self.blind_to_history {
            return Ok(tidemark::Lineage::default());
        }
        match self.call("source", Request::LineageAt { seq }).await? {
            Response::Lineage(l) => Ok(l.into()),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn changes_since(&self, since: u64) -> Result<Changes> {
        match self.call("source", Request::ChangesSince { since }).await? {
            Response::Changes {
                entries: e,
                watermark,
            } => Ok(Changes::Since {
                entries: entries(e),
                watermark,
            }),
            Response::Compacted { first_available } => Ok(Changes::Compacted { first_available }),
            r => Err(unexpected("source", &r)),
        }
    }

    /// One call, read at one point on the source host; nothing of the history for a
    /// naive client ([`blind_to_history`](Self::blind_to_history)).
    async fn changes_and_lineage(&self, since: u64) -> Result<(Changes, tidemark::Lineage)> {
        if self.blind_to_history {
            return Ok((
                self.changes_since(since).await?,
                tidemark::Lineage::default(),
            ));
        }
        match self
            .call("source", Request::ChangesAndLineage { since })
            .await?
        {
            Response::ChangesAndLineage(changes, lineage) => {
                let changes = match *changes {
                    Response::Changes {
                        entries: e,
                        watermark,
                    } => Changes::Since {
                        entries: entries(e),
                        watermark,
                    },
                    Response::Compacted { first_available } => {
                        Changes::Compacted { first_available }
                    }
                    r => return Err(unexpected("source", &r)),
                };
                Ok((changes, lineage.into()))
            }
            r => Err(unexpected("source", &r)),
        }
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        match self.call("source", Request::Snapshot).await? {
            Response::Snapshot {
                entries: e,
                watermark,
                lineage,
            } => Ok(Snapshot {
                entries: entries(e),
                watermark,
                lineage: if self.blind_to_history {
                    tidemark::Lineage::default()
                } else {
                    lineage.into()
                },
            }),
            r => Err(unexpected("source", &r)),
        }
    }

    /// The source host answers a snapshot in one message: it is read once and handed out
    /// in parts (the default's way), counted for the campaign's summary. A naive client
    /// ([`reading_parts_apart`](Self::reading_parts_apart)) reads every part after the
    /// first again, at its own moment.
    async fn snapshot_parts(&self, part_len: usize) -> Result<SnapshotParts<'_>> {
        let snap = self.snapshot().await?;
        let part_len = part_len.max(1);
        let parts = snap.entries.len().div_ceil(part_len);
        PART_READS.with(|c| {
            let mut r = c.get();
            r.reads += 1;
            r.split += u32::from(parts > 1);
            r.parts += parts as u64;
            c.set(r);
        });
        let (watermark, lineage) = (snap.watermark, snap.lineage);
        let mut entries = snap.entries.into_iter();
        if !self.parts_apart {
            let parts = std::iter::from_fn(move || {
                let part: Vec<Entry> = entries.by_ref().take(part_len).collect();
                (!part.is_empty()).then_some(Ok(part))
            });
            return Ok(SnapshotParts {
                watermark,
                lineage,
                parts: futures::stream::iter(parts).boxed(),
            });
        }
        let first: Vec<Entry> = entries.by_ref().take(part_len).collect();
        let parts = futures::stream::unfold(Some(NextPart::Part(first)), move |next| async move {
            let part = match next? {
                NextPart::Part(part) => part,
                NextPart::After(after) => match self.snapshot().await {
                    Ok(now) => now
                        .entries
                        .into_iter()
                        .filter(|e| *e.key > *after)
                        .take(part_len)
                        .collect(),
                    Err(e) => return Some((Err(e), None)),
                },
            };
            let after = Arc::clone(&part.last()?.key);
            Some((Ok(part), Some(NextPart::After(after))))
        });
        Ok(SnapshotParts {
            watermark,
            lineage,
            parts: parts.boxed(),
        })
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>> {
        match self
            .call(
                "source",
                Request::Get {
                    key: key.to_owned(),
                },
            )
            .await?
        {
            Response::Value(v) => Ok(v.map(|(seq, value)| Versioned { seq, value })),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn get_at(&self, key: &str) -> Result<ValueAt> {
        match self
            .call(
                "source",
                Request::GetAt {
                    key: key.to_owned(),
                },
            )
            .await?
        {
            Response::ValueAt { value, watermark } => Ok(ValueAt {
                value: value.map(|(seq, value)| Versioned { seq, value }),
                watermark,
            }),
            r => Err(unexpected("source", &r)),
        }
    }

    async fn first_available(&self) -> Result<u64> {
        match self.call("source", Request::FirstAvailable).await? {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.link.reconnects.subscribe())
    }

    /// A read of the watermark on a connection of its own: any answer, even a refusal,
    /// shows the source host is there.
    fn probe(&self) -> Option<impl Future<Output = Result<()>> + Send + 'static> {
        /// Counts a probe dropped before its answer as missed.
        struct Out(Arc<Link>, bool);
        impl Drop for Out {
            fn drop(&mut self) {
                if !self.1 {
                    self.0.probe_missed.store(true, Ordering::SeqCst);
                    count_probe(|c| c.missed += 1);
                }
            }
        }
        let remote = self.clone();
        Some(async move {
            count_probe(|c| c.sent += 1);
            let mut out = Out(Arc::clone(&remote.link), false);
            let answered = async {
                let mut frames = remote.dial("probe").await?;
                wire::write(frames.stream(), &Request::Watermark)
                    .await
                    .map_err(|e| unavailable("probe", e))?;
                frames
                    .read::<Response>()
                    .await
                    .map(|_| ())
                    .map_err(|e| unavailable("probe", e))
            }
            .await;
            out.1 = true;
            let after = remote
                .link
                .probe_missed
                .swap(answered.is_err(), Ordering::SeqCst);
            count_probe(|c| match answered {
                Ok(()) => {
                    c.answered += 1;
                    c.answered_after_miss += u32::from(after);
                }
                Err(_) => c.missed += 1,
            });
            answered
        })
    }
}

/// The source's change log, streamed from the source host.
#[derive(Debug)]
pub struct RemoteStream {
    frames: FrameReader,
    done: bool,
}

impl FeedStream for RemoteStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        loop {
            if self.done {
                return None;
            }
            match self.frames.read::<Response>().await {
                Ok(Response::Heartbeat) => {}
                Ok(Response::Item(e)) => return Some(Ok(FeedItem::Entry(e.into()))),
                Ok(Response::Head(head)) => return Some(Ok(FeedItem::Head(head))),
                Ok(Response::Undecodable {
                    position,
                    seq,
                    reason,
                }) => {
                    return Some(Ok(FeedItem::Undecodable {
                        position,
                        seq,
                        reason,
                    }));
                }
                Ok(Response::End) => {
                    self.done = true;
                    return None;
                }
                Ok(Response::Failed(reason)) => {
                    self.done = true;
                    return Some(Err(Error::unavailable("feed", reason)));
                }
                Ok(r) => {
                    self.done = true;
                    return Some(Err(unexpected("feed", &r)));
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(unavailable("feed", e)));
                }
            }
        }
    }
}

impl Remote {
    async fn open_stream(&self, request: Request) -> Result<Opened<RemoteStream>> {
        let mut frames = FrameReader::new(self.connect("feed").await?);
        wire::write(frames.stream(), &request)
            .await
            .map_err(|e| unavailable("feed", e))?;
        match frames
            .read::<Response>()
            .await
            .map_err(|e| unavailable("feed", e))?
        {
            Response::FeedOpened(info) => Ok(Opened {
                info: if self.blind_to_history {
                    FeedInfo {
                        lineage: tidemark::Lineage::default(),
                        ..FeedInfo::from(info)
                    }
                } else {
                    FeedInfo::from(info)
                },
                stream: RemoteStream {
                    frames,
                    done: false,
                },
            }),
            Response::Failed(reason) => Err(Error::unavailable("feed", reason)),
            r => Err(unexpected("feed", &r)),
        }
    }
}

/// The source's change log (a gapless feed keyed by seq).
impl Feed for Remote {
    const FOLLOW: Follow = Follow::Replay;
    type Stream = RemoteStream;

    async fn open(&self, from: u64, _after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        self.open_stream(Request::OpenFeed { from }).await
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Source::reconnects(self)
    }
}

/// The events stream of announcements on the source host (a sparse feed with positions).
#[derive(Clone, Debug)]
pub struct RemoteEvents(pub Remote);

impl Feed for RemoteEvents {
    const FOLLOW: Follow = Follow::Announcements;
    type Stream = RemoteStream;

    async fn open(&self, _from: u64, after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        self.0
            .open_stream(Request::OpenEvents {
                after: after_position,
            })
            .await
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Source::reconnects(&self.0)
    }
}

impl Publish for Remote {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        match self
            .call(
                "publish",
                Request::Publish {
                    key: key.to_owned(),
                    payload,
                    by: self.by.clone(),
                },
            )
            .await?
        {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("publish", &r)),
        }
    }
}

/// A wake subscription streamed from the source host.
#[derive(Debug)]
pub struct RemoteListener {
    frames: FrameReader,
}

impl WakeListener for RemoteListener {
    async fn recv(&mut self) -> Result<Received> {
        loop {
            match self.frames.read::<Response>().await {
                Ok(Response::Heartbeat) => {}
                Ok(Response::Wake(payload)) => return Ok(Received::Wake(payload)),
                Ok(Response::End) => return Ok(Received::Closed),
                Ok(Response::Failed(reason)) => return Err(Error::unavailable("listen", reason)),
                Ok(r) => return Err(unexpected("listen", &r)),
                Err(e) => return Err(unavailable("listen", e)),
            }
        }
    }
}

/// The events stream's durable cursors, kept by the source host (like a NATS durable
/// consumer's position on the server).
impl Cursors for Remote {
    async fn load(&self, name: &str) -> Result<Option<u64>> {
        let request = Request::LoadCursor {
            name: name.to_owned(),
        };
        match self.call("cursor", request).await? {
            Response::MaybeSeq(p) => Ok(p),
            r => Err(unexpected("cursor", &r)),
        }
    }

    async fn save(&self, name: &str, position: u64) -> Result<u64> {
        let request = Request::SaveCursor {
            name: name.to_owned(),
            position,
        };
        match self.call("cursor", request).await? {
            Response::Seq(p) => Ok(p),
            r => Err(unexpected("cursor", &r)),
        }
    }
}

impl Wake for Remote {
    type Listener = RemoteListener;

    async fn notify(&self, channel: &str, payload: Vec<u8>) -> Result<()> {
        match self
            .call(
                "notify",
                Request::Notify {
                    channel: channel.to_owned(),
                    payload,
                },
            )
            .await?
        {
            Response::Ok => Ok(()),
            r => Err(unexpected("notify", &r)),
        }
    }

    async fn listen(&self, channel: &str) -> Result<RemoteListener> {
        let mut frames = FrameReader::new(self.connect("listen").await?);
        wire::write(
            frames.stream(),
            &Request::Listen {
                channel: channel.to_owned(),
            },
        )
        .await
        .map_err(|e| unavailable("listen", e))?;
        match frames
            .read::<Response>()
            .await
            .map_err(|e| unavailable("listen", e))?
        {
            Response::Ok => Ok(RemoteListener { frames }),
            Response::Failed(reason) => Err(Error::unavailable("listen", reason)),
            r => Err(unexpected("listen", &r)),
        }
    }
}

/// The source host's outbox, claimed and completed over the wire by relays on other hosts.
impl Outbox for Remote {
    type Watch = RemoteOutboxWatch;

    async fn claim(&self, owner: &str, after: u64, max: usize, lease: Duration) -> Result<Claimed> {
        let request = Request::Claim {
            owner: owner.to_owned(),
            after,
            max,
            lease,
        };
        match self.call("outbox", request).await? {
            Response::Claimed(c) => Ok(c.into()),
            r => Err(unexpected("outbox", &r)),
        }
    }

    async fn complete(&self, owner: &str, updates: Vec<OutboxUpdate>) -> Result<u64> {
        let request = Request::Complete {
            owner: owner.to_owned(),
            updates: updates.into_iter().map(Into::into).collect(),
        };
        match self.call("outbox", request).await? {
            Response::Seq(n) => Ok(n),
            r => Err(unexpected("outbox", &r)),
        }
    }

    async fn pending(&self) -> Result<u64> {
        match self.call("outbox", Request::PendingRows).await? {
            Response::Seq(n) => Ok(n),
            r => Err(unexpected("outbox", &r)),
        }
    }

    fn watch(&self) -> RemoteOutboxWatch {
        RemoteOutboxWatch {
            remote: self.clone(),
            frames: None,
        }
    }
}

/// How long a watch whose link failed waits before it says "something may have changed"
/// (the relay then claims, and backs off if the source is still away).
const WATCH_RETRY: Duration = Duration::from_millis(500);

/// A watch of the source host's outbox over a streaming connection. A (re)connection
/// counts as a change: what happened while it was away is unknown, so the relay claims.
#[derive(Debug)]
pub struct RemoteOutboxWatch {
    remote: Remote,
    frames: Option<FrameReader>,
}

impl RemoteOutboxWatch {
    async fn connect(&self) -> Result<FrameReader> {
        let mut frames = FrameReader::new(self.remote.connect("outbox").await?);
        wire::write(frames.stream(), &Request::WatchOutbox)
            .await
            .map_err(|e| unavailable("outbox", e))?;
        match frames.read::<Response>().await {
            Ok(Response::Ok) => Ok(frames),
            Ok(r) => Err(unexpected("outbox", &r)),
            Err(e) => Err(unavailable("outbox", e)),
        }
    }
}

impl OutboxWatch for RemoteOutboxWatch {
    async fn changed(&mut self) {
        loop {
            match &mut self.frames {
                None => {
                    match self.connect().await {
                        Ok(frames) => self.frames = Some(frames),
                        Err(_) => tokio::time::sleep(WATCH_RETRY).await,
                    }
                    return;
                }
                Some(frames) => match frames.read::<Response>().await {
                    Ok(Response::Heartbeat) => {}
                    Ok(Response::Changed) => return,
                    Ok(_) | Err(_) => {
                        self.frames = None;
                        return;
                    }
                },
            }
        }
    }
}
