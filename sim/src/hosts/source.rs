//! The source host: serves a [`Memory`]'s source, change log, events stream and wake
//! channels over the sim's wire protocol, and a JetStream bucket kept beside the source
//! ([`JetStream`]). The `Memory` and the bucket live outside the host, so they survive the
//! host's crashes like a disk.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tidemark::tidemark_core::{Event, Legs};
use tidemark::{
    Changes, Cursors, Feed, FeedItem, FeedStream, Outbox, OutboxWatch, Publish, Received, Source,
    Wake, WakeListener,
};
use tidemark_memory::Memory;
use turmoil::net::{TcpListener, TcpStream};

use crate::checks::jobs::JobLedger;
use crate::checks::oracle::{History, RelayLedger};
use crate::hosts::jetstream::JetStream;
use crate::hosts::sweeps::Sweeps;
use crate::trace::Trace;
use crate::wire::{self, HEARTBEAT, PORT, Request, Response, WireEntry};

/// The legs of a write through the announcing source: relays publish it, wake the
/// followers and enqueue its housekeeping job, which the job runners run.
pub const RELAYED_LEGS: Legs = Legs {
    publish: true,
    notify: true,
    enqueue: true,
};

/// Whether the source host takes writes. A restore closes it, and it opens again when the
/// writers' pause after the restore ends. The operator's procedure the world models stops
/// the writers before the restore, but a write one of them sent earlier can still be on
/// the wire (held or slow, and delivered even after its writer gave up waiting): reaching
/// the restored source, it would start the new history before the followers noticed the
/// old one was replaced, which seqs alone cannot show them. A restore that restarts the
/// database drops such a request with its connection; the closed gate refuses it. Writes
/// that reach the source between the writers' stop and the restore land in the history
/// the restore then replaces, as a restore's lost writes do.
#[derive(Clone, Debug)]
pub struct WriteGate {
    closed: Arc<AtomicBool>,
    trace: Trace,
}

impl WriteGate {
    /// An open gate that traces the writes it refuses to `trace`.
    #[must_use]
    pub fn new(trace: Trace) -> Self {
        WriteGate {
            closed: Arc::default(),
            trace,
        }
    }

    /// Refuses writes until [`open`](Self::open).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Takes writes again.
    pub fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
    }

    /// Whether writes are refused now.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The refusal of a write of `key` while the gate is closed, traced; `None` when open.
    fn refuse(&self, key: &str) -> Option<Response> {
        if !self.is_closed() {
            return None;
        }
        self.trace.line(format!(
            "source refuses a write of {key}: writers are paused after a restore"
        ));
        Some(failed("writes are paused after a restore"))
    }
}

/// Whether the source host leaves reads unanswered: a request read while it does is
/// never answered, its connection kept open (a JetStream stream with no leader, or a
/// server node cut off from its cluster: the client's connection stays up, and the
/// request's reply never comes). Writes are carried out as ever. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Silence(Arc<AtomicBool>);

impl Silence {
    /// Leaves reads unanswered from now on (`true`), or answers them again (`false`).
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::SeqCst);
    }

    /// Whether reads are left unanswered now.
    #[must_use]
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// What a read that reaches the source now waits for: nothing, or (reads left
    /// unanswered) forever, its connection held open by the caller until the host goes.
    async fn unanswered(&self) {
        if self.is_on() {
            std::future::pending::<()>().await;
        }
    }
}

/// What the source host serves and records, all of it outside the host (it survives the
/// host's crashes). Cheap to clone.
#[derive(Clone, Debug)]
pub struct SourceHost {
    /// The source, its change log, events stream, wake channels, outbox and job queue.
    pub memory: Memory,
    /// Every commit, for the oracle.
    pub history: History,
    /// What the relays claim, publish and complete.
    pub ledger: RelayLedger,
    /// What the job runners lease and renew.
    pub jobs: JobLedger,
    /// The sweeper lock, schedules and sweeps.
    pub sweeps: Sweeps,
    /// The JetStream bucket beside the source, which takes every commit at its seq.
    pub jetstream: JetStream,
    /// Whether reads are left unanswered now.
    pub silence: Silence,
}

impl SourceHost {
    /// Records a commit of `key` at `seq` (`None`: a removal) in the history and in the
    /// JetStream bucket.
    fn committed(&self, seq: u64, key: &str, value: Option<Vec<u8>>) {
        self.history.record(seq, key, value.clone());
        self.jetstream.mirror(seq, key, value);
    }
}

/// Runs the source host until the simulation ends or the host crashes. Every commit is
/// also recorded in the history, for the oracle, and stored in the JetStream bucket;
/// writes that reach it while `gate` is closed are refused. The bucket's pending signals
/// run beside it.
pub async fn serve(host: SourceHost, gate: WriteGate) -> turmoil::Result {
    let jetstream = host.jetstream.clone();
    tokio::select! {
        biased;
        done = accept(host, gate) => done,
        () = jetstream.signals() => Ok(()),
    }
}

async fn accept(host: SourceHost, gate: WriteGate) -> turmoil::Result {
    let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let accepted = host.history.epoch();
        let (host, gate) = (host.clone(), gate.clone());
        // spawn_local: a crash drops a LocalSet's tasks in a fixed order, while tokio's
        // runtime list is sharded by a process-wide task id, so its drop order (and the
        // resets peers see) would differ from one run of a seed to the next.
        tokio::task::spawn_local(async move {
            // A client that goes away mid-request is its own problem.
            let admission = Admission {
                gate: &gate,
                accepted,
            };
            let _ = connection(host, admission, stream).await;
        });
    }
}

/// What decides whether a connection's write is carried out: the gate closed after a
/// restore, and the history epoch the connection was accepted in.
struct Admission<'a> {
    gate: &'a WriteGate,
    accepted: usize,
}

/// What the source host does with a request.
enum Admit {
    /// Carries it out (every read, and a write the restores leave alone).
    Carry,
    /// Answers this refusal (a write while the writers pause after a restore).
    Refuse(Response),
    /// Drops the connection unanswered (a write on one accepted before a restore).
    Reset,
}

impl Admission<'_> {
    fn admit(&self, request: &Request, history: &History) -> Admit {
        let (Request::Put { key, .. } | Request::Update { key, .. } | Request::Remove { key, .. }) =
            request
        else {
            return Admit::Carry;
        };
        if let Some(refused) = self.gate.refuse(key) {
            return Admit::Refuse(refused);
        }
        // A restore restarts the database server: a write on a connection accepted before
        // it was reset with that server, never carried out (its writer sees the connection
        // fail).
        if history.epoch() != self.accepted {
            self.gate
                .trace
                .line("source resets a write on a connection from before a restore".to_owned());
            return Admit::Reset;
        }
        Admit::Carry
    }
}

fn failed(e: impl std::fmt::Display) -> Response {
    Response::Failed(e.to_string())
}

async fn connection(
    host: SourceHost,
    admission: Admission<'_>,
    mut stream: TcpStream,
) -> std::io::Result<()> {
    let request: Request = wire::read_untimed(&mut stream).await?;
    match admission.admit(&request, &host.history) {
        Admit::Carry => {}
        Admit::Refuse(refused) => return wire::write(&mut stream, &refused).await,
        Admit::Reset => return Ok(()),
    }
    let memory = &host.memory;
    let response = match request {
        // The calls that turn the connection into a stream.
        // Boxed, as the services below are: a connection's task holds only the future of
        // the call it serves, not room for the largest of them, and spawning one copies
        // less (about 1% of a seed's CPU went to those copies).
        Request::OpenFeed { from } => {
            host.silence.unanswered().await;
            let opened = memory.source.open(from, None).await;
            return Box::pin(stream_feed(stream, opened)).await;
        }
        Request::OpenEvents { after } => {
            let opened = memory.events.open(0, after).await;
            return Box::pin(stream_feed(stream, opened)).await;
        }
        Request::Listen { channel } => {
            return Box::pin(stream_wakes(memory, stream, &channel)).await;
        }
        Request::WatchOutbox => return Box::pin(stream_outbox(memory, stream)).await,
        Request::JetStream(call) => {
            host.silence.unanswered().await;
            return Box::pin(host.jetstream.serve(call, stream)).await;
        }
        // The other services.
        Request::Queue(call) => Box::pin(serve_queue(memory, &host.jobs, &host.sweeps, call)).await,
        Request::Sweeps(call) => Box::pin(host.sweeps.serve(memory, call)).await,
        request @ (Request::Put { .. } | Request::Update { .. } | Request::Remove { .. }) => {
            Box::pin(write_source(&host, request)).await
        }
        request @ (Request::Publish { .. }
        | Request::Notify { .. }
        | Request::LoadCursor { .. }
        | Request::SaveCursor { .. }
        | Request::Claim { .. }
        | Request::Complete { .. }
        | Request::PendingRows) => Box::pin(serve_announcements(&host, request)).await,
        request => {
            host.silence.unanswered().await;
            Box::pin(read_source(memory, request)).await
        }
    };
    wire::write(&mut stream, &response).await
}

/// A write to the source (through the announcing source if the writer announces through
/// the relays), recorded in the history once committed.
async fn write_source(host: &SourceHost, request: Request) -> Response {
    let announced = host.memory.announced_source(RELAYED_LEGS);
    let source = |relayed: bool| {
        if relayed {
            &announced
        } else {
            &host.memory.source
        }
    };
    match request {
        Request::Put {
            key,
            value,
            announced,
        } => match source(announced).put(&key, value.clone()).await {
            Ok(seq) => {
                host.committed(seq, &key, Some(value));
                Response::Seq(seq)
            }
            Err(e) => failed(e),
        },
        Request::Update {
            key,
            value,
            expected,
            announced,
        } => match source(announced)
            .update(&key, value.clone(), expected)
            .await
        {
            Ok(seq) => {
                host.committed(seq, &key, Some(value));
                Response::Seq(seq)
            }
            Err(e) => failed(e),
        },
        Request::Remove { key, announced } => match source(announced).remove(&key).await {
            Ok(seq) => {
                if let Some(seq) = seq {
                    host.committed(seq, &key, None);
                }
                Response::MaybeSeq(seq)
            }
            Err(e) => failed(e),
        },
        other => unserved(&other),
    }
}

/// A read of the source: its watermark, changes, snapshot, lineage and values.
async fn read_source(memory: &Memory, request: Request) -> Response {
    match request {
        Request::Watermark => memory
            .source
            .watermark()
            .await
            .map_or_else(failed, Response::Seq),
        Request::FirstAvailable => memory
            .source
            .first_available()
            .await
            .map_or_else(failed, Response::Seq),
        Request::ChangesSince { since } => match memory.source.changes_since(since).await {
            Ok(Changes::Since { entries, watermark }) => Response::Changes {
                entries: entries.into_iter().map(WireEntry::from).collect(),
                watermark,
            },
            Ok(Changes::Compacted { first_available }) => Response::Compacted { first_available },
            Err(e) => failed(e),
        },
        Request::Snapshot => match memory.source.snapshot().await {
            Ok(s) => Response::Snapshot {
                entries: s.entries.into_iter().map(WireEntry::from).collect(),
                watermark: s.watermark,
                lineage: s.lineage.into(),
            },
            Err(e) => failed(e),
        },
        Request::ChangesAndLineage { since } => {
            match memory.source.changes_and_lineage(since).await {
                Ok((changes, lineage)) => {
                    let changes = match changes {
                        Changes::Since { entries, watermark } => Response::Changes {
                            entries: entries.into_iter().map(WireEntry::from).collect(),
                            watermark,
                        },
                        Changes::Compacted { first_available } => {
                            Response::Compacted { first_available }
                        }
                    };
                    Response::ChangesAndLineage(Box::new(changes), lineage.into())
                }
                Err(e) => failed(e),
            }
        }
        Request::LineageAt { seq } => memory
            .source
            .lineage_at(seq)
            .await
            .map_or_else(failed, |l| Response::Lineage(l.into())),
        Request::Get { key } => match memory.source.get(&key).await {
            Ok(v) => Response::Value(v.map(|v| (v.seq, v.value))),
            Err(e) => failed(e),
        },
        Request::GetAt { key } => match memory.source.get_at(&key).await {
            Ok(at) => Response::ValueAt {
                value: at.value.map(|v| (v.seq, v.value)),
                watermark: at.watermark,
            },
            Err(e) => failed(e),
        },
        other => unserved(&other),
    }
}

/// The announcements' side of the source host: its events stream, wake channels, durable
/// cursors and outbox, told to the relays' ledger as it serves them.
async fn serve_announcements(host: &SourceHost, request: Request) -> Response {
    let (memory, ledger) = (&host.memory, &host.ledger);
    match request {
        Request::Publish { key, payload, by } => {
            let seq = Event::decode(&payload).ok().map(|e| e.seq());
            match memory.events.publish(&key, payload).await {
                Ok(position) => {
                    if let (Some(owner), Some(seq)) = (by, seq) {
                        ledger.published(&owner, seq);
                    }
                    Response::Seq(position)
                }
                Err(e) => failed(e),
            }
        }
        Request::Notify { channel, payload } => memory
            .wake
            .notify(&channel, payload)
            .await
            .map_or_else(failed, |()| Response::Ok),
        Request::LoadCursor { name } => Cursors::load(&memory.events, &name)
            .await
            .map_or_else(failed, Response::MaybeSeq),
        Request::SaveCursor { name, position } => Cursors::save(&memory.events, &name, position)
            .await
            .map_or_else(failed, Response::Seq),
        Request::Claim {
            owner,
            after,
            max,
            lease,
        } => match memory.outbox.claim(&owner, after, max, lease).await {
            Ok(claimed) => {
                let rows: Vec<(u64, u64)> = claimed.rows.iter().map(|r| (r.id, r.seq)).collect();
                let now = turmoil::sim_elapsed().unwrap_or_default();
                ledger.claimed(&owner, &rows, now, lease);
                Response::Claimed(claimed.into())
            }
            Err(e) => failed(e),
        },
        Request::Complete { owner, updates } => {
            let rows: Vec<(u64, bool)> =
                updates.iter().map(|u| (u.id, u.landed.published)).collect();
            ledger.completed(&owner, &rows);
            memory
                .outbox
                .complete(&owner, updates.into_iter().map(Into::into).collect())
                .await
                .map_or_else(failed, Response::Seq)
        }
        Request::PendingRows => memory
            .outbox
            .pending()
            .await
            .map_or_else(failed, Response::Seq),
        other => unserved(&other),
    }
}

/// A request routed to a part of the host that does not serve it (none is: `connection`
/// routes each to its own).
fn unserved(request: &Request) -> Response {
    Response::Failed(format!("not served here: {request:?}"))
}

/// A queue call, the sweep ledger told of the jobs enqueued for schedule ticks (`sweep`
/// jobs, keyed or not), and a scheduler doomed to crash served no tick's enqueue.
async fn serve_queue(
    memory: &Memory,
    jobs: &JobLedger,
    sweeps: &Sweeps,
    call: crate::wire::QueueCall,
) -> Response {
    use crate::wire::{QueueAnswer, QueueCall};
    let (tick_job, by) = match &call {
        QueueCall::EnqueueTick { by, .. } => (true, by.clone()),
        QueueCall::Enqueue(job) => (*job == tidemark::tidemark_core::Job::Sweep, None),
        _ => (false, None),
    };
    if tick_job && sweeps.ledger.is_doomed(by.as_deref()) {
        return Response::Failed("the scheduler is crashing".into());
    }
    let response = crate::hosts::queue::serve(&memory.queue, jobs, call).await;
    if tick_job
        && matches!(
            response,
            Response::Queue(QueueAnswer::Id(_) | QueueAnswer::Tick(Some(_)))
        )
    {
        sweeps.ledger.tick_job_enqueued(by.as_deref());
    }
    response
}

async fn stream_feed<S: FeedStream>(
    mut stream: TcpStream,
    opened: tidemark::Result<tidemark::Opened<S>>,
) -> std::io::Result<()> {
    let opened = match opened {
        Ok(opened) => opened,
        Err(e) => return wire::write(&mut stream, &failed(e)).await,
    };
    wire::write(&mut stream, &Response::FeedOpened(opened.info.into())).await?;
    let mut items = opened.stream;
    loop {
        let next = tokio::select! {
            biased;
            item = items.next() => Some(item),
            () = tokio::time::sleep(HEARTBEAT) => None,
        };
        let response = match next {
            None => Response::Heartbeat,
            Some(None) => Response::End,
            Some(Some(Ok(FeedItem::Entry(entry)))) => Response::Item(entry.into()),
            Some(Some(Ok(FeedItem::Undecodable {
                position,
                seq,
                reason,
            }))) => Response::Undecodable {
                position,
                seq,
                reason,
            },
            Some(Some(Ok(FeedItem::Head(head)))) => Response::Head(head),
            Some(Some(Err(e))) => failed(e),
        };
        let last = matches!(response, Response::End | Response::Failed(_));
        wire::write(&mut stream, &response).await?;
        if last {
            return Ok(());
        }
    }
}

async fn stream_wakes(
    memory: &Memory,
    mut stream: TcpStream,
    channel: &str,
) -> std::io::Result<()> {
    let mut listener = match memory.wake.listen(channel).await {
        Ok(l) => l,
        Err(e) => return wire::write(&mut stream, &failed(e)).await,
    };
    wire::write(&mut stream, &Response::Ok).await?;
    loop {
        let response = match listener.recv_timeout(HEARTBEAT).await {
            Ok(Received::Wake(payload)) => Response::Wake(payload),
            Ok(Received::TimedOut) => Response::Heartbeat,
            Ok(Received::Closed) => Response::End,
            Err(e) => failed(e),
        };
        let last = matches!(response, Response::End | Response::Failed(_));
        wire::write(&mut stream, &response).await?;
        if last {
            return Ok(());
        }
    }
}

async fn stream_outbox(memory: &Memory, mut stream: TcpStream) -> std::io::Result<()> {
    let mut watch = memory.outbox.watch();
    wire::write(&mut stream, &Response::Ok).await?;
    loop {
        let response = tokio::select! {
            biased;
            () = watch.changed() => Response::Changed,
            () = tokio::time::sleep(HEARTBEAT) => Response::Heartbeat,
        };
        wire::write(&mut stream, &response).await?;
    }
}
