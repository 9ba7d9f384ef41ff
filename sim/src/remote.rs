//! The ports, implemented over the sim's wire protocol: what writers and followers on
//! other hosts use to reach the source host through turmoil's network.

use std::time::Duration;

use tidemark::tidemark_core::{Entry, FeedInfo, Follow};
use tidemark::{
    Changes, Cursors, Error, Feed, FeedItem, FeedStream, Opened, Publish, Received, Result,
    Snapshot, Source, Versioned, Wake, WakeListener,
};
use turmoil::net::TcpStream;

use crate::proto::{self, FrameReader, Request, Response};
use crate::server::PORT;

/// How long connecting may take before the link counts as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A client of the source host named `host`. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Remote {
    host: String,
}

fn unavailable(port: &'static str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(port, e.to_string())
}

impl Remote {
    /// A client of the source host called `host`.
    #[must_use]
    pub fn new(host: impl Into<String>) -> Self {
        Remote { host: host.into() }
    }

    async fn connect(&self, port: &'static str) -> Result<TcpStream> {
        match tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((self.host.as_str(), PORT)),
        )
        .await
        {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(unavailable(port, e)),
            Err(_) => Err(unavailable(port, "connect timed out")),
        }
    }

    async fn call(&self, port: &'static str, request: Request) -> Result<Response> {
        let mut frames = FrameReader::new(self.connect(port).await?);
        proto::write(frames.stream(), &request)
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

fn entries(wire: Vec<proto::WireEntry>) -> Vec<Entry> {
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

    async fn snapshot(&self) -> Result<Snapshot> {
        match self.call("source", Request::Snapshot).await? {
            Response::Snapshot {
                entries: e,
                watermark,
            } => Ok(Snapshot {
                entries: entries(e),
                watermark,
            }),
            r => Err(unexpected("source", &r)),
        }
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

    async fn first_available(&self) -> Result<u64> {
        match self.call("source", Request::FirstAvailable).await? {
            Response::Seq(s) => Ok(s),
            r => Err(unexpected("source", &r)),
        }
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
        proto::write(frames.stream(), &request)
            .await
            .map_err(|e| unavailable("feed", e))?;
        match frames
            .read::<Response>()
            .await
            .map_err(|e| unavailable("feed", e))?
        {
            Response::FeedOpened(info) => Ok(Opened {
                info: FeedInfo::from(info),
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
}

impl Publish for Remote {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        match self
            .call(
                "publish",
                Request::Publish {
                    key: key.to_owned(),
                    payload,
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
        proto::write(
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
