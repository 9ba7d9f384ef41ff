//! The follower task: owns one core [`Follower`], carries out its decisions against the
//! ports, feeds the results back, and sleeps until its next timeout.

use tidemark_core::{
    Decode, Diagnostic, Follower, FollowerConfig, Input, Output, Phase, Status, Token,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::cache::{Cache, CacheWriter, cache};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::noop::{NoCursors, NoFeed, NoWake};
use crate::ports::{Changes, Cursors, Feed, FeedItem, FeedStream, Received, Source, WakeListener};
use crate::shutdown::{Shutdown, StopSignal};
use crate::sink::Sink;

/// What one reconcile caught up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Puts applied.
    pub applied: usize,
    /// Keys removed.
    pub removed: usize,
    /// The applied watermark afterwards.
    pub watermark: u64,
}

enum Command {
    Reconcile(oneshot::Sender<Reconciled>),
}

/// A follower task, configured but not yet running. Build it with
/// [`FollowerTask::new`], add a durable cursor or a wake listener, then
/// [`spawn`](Self::spawn) it (or [`run`](Self::run) it in place).
///
/// `S` answers lookups, reconciles, snapshots and marker fetches; `F` is the feed
/// (use [`NoFeed`] for a wake-only follower); `C` stores the feed's durable cursor;
/// `W` delivers wakes; `K` receives the changes (a cache or a worker).
pub struct FollowerTask<S, F: Feed, C, W, D: Decode, K> {
    core: Follower<D>,
    source: S,
    source_name: String,
    feed: F,
    cursors: C,
    cursor_name: Option<String>,
    cursor_loaded: Option<Option<u64>>,
    wake: Option<W>,
    sink: K,
    clock: Clock,
    stream: Option<(Token, F::Stream)>,
    status: watch::Sender<Status>,
    pending: Vec<oneshot::Sender<Reconciled>>,
    commands: mpsc::Receiver<Command>,
    commands_tx: mpsc::Sender<Command>,
}

impl<S, F, D, K> FollowerTask<S, F, NoCursors, NoWake, D, K>
where
    S: Source,
    F: Feed,
    D: Decode + Send,
    K: Sink<D::Value>,
{
    /// A follower of `source` through `feed`, applying into `sink`.
    pub fn new(config: FollowerConfig, decoder: D, source: S, feed: F, sink: K) -> Self {
        Self::from_core(Follower::new(config, decoder), source, feed, sink)
    }

    /// A task around an existing core (for a warm restart made with
    /// [`Follower::resume`]).
    pub fn from_core(core: Follower<D>, source: S, feed: F, sink: K) -> Self {
        let (commands_tx, commands) = mpsc::channel(16);
        let status = watch::channel(core.status()).0;
        FollowerTask {
            source_name: core.config().name().to_owned(),
            core,
            source,
            feed,
            cursors: NoCursors,
            cursor_name: None,
            cursor_loaded: None,
            wake: None,
            sink,
            clock: Clock::new(),
            stream: None,
            status,
            pending: Vec::new(),
            commands,
            commands_tx,
        }
    }
}

impl<S, F, C, W, D, K> FollowerTask<S, F, C, W, D, K>
where
    S: Source,
    F: Feed,
    C: Cursors,
    W: WakeListener,
    D: Decode + Send,
    K: Sink<D::Value>,
{
    /// Names the source or stream in logs (default: the follower's name).
    #[must_use]
    pub fn source_name(mut self, name: impl Into<String>) -> Self {
        self.source_name = name.into();
        self
    }

    /// Checkpoints the feed's position under `name` in `cursors`, and resumes after the
    /// saved position when (re)started: a durable consumer.
    pub fn with_cursor<C2: Cursors>(
        self,
        cursors: C2,
        name: impl Into<String>,
    ) -> FollowerTask<S, F, C2, W, D, K> {
        FollowerTask {
            core: self.core,
            source: self.source,
            source_name: self.source_name,
            feed: self.feed,
            cursors,
            cursor_name: Some(name.into()),
            cursor_loaded: None,
            wake: self.wake,
            sink: self.sink,
            clock: self.clock,
            stream: self.stream,
            status: self.status,
            pending: self.pending,
            commands: self.commands,
            commands_tx: self.commands_tx,
        }
    }

    /// Catches up from the source on every wake from `listener`; the task ends cleanly
    /// when the wake source closes.
    pub fn with_wake<W2: WakeListener>(self, listener: W2) -> FollowerTask<S, F, C, W2, D, K> {
        FollowerTask {
            core: self.core,
            source: self.source,
            source_name: self.source_name,
            feed: self.feed,
            cursors: self.cursors,
            cursor_name: self.cursor_name,
            cursor_loaded: self.cursor_loaded,
            wake: Some(listener),
            sink: self.sink,
            clock: self.clock,
            stream: self.stream,
            status: self.status,
            pending: self.pending,
            commands: self.commands,
            commands_tx: self.commands_tx,
        }
    }

    /// The follower's status, updated as it runs.
    #[must_use]
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    /// Runs until `stop` fires (or the wake source closes); returns the final status.
    /// Fails only if the sink fails (a worker's handler error).
    pub async fn run(mut self, stop: StopSignal) -> Result<Status> {
        let result = self.run_loop(stop).await;
        self.sink.drain().await;
        self.publish_status();
        result.map(|()| self.core.status())
    }

    async fn run_loop(&mut self, mut stop: StopSignal) -> Result<()> {
        let mut commands_open = true;
        loop {
            self.perform(&mut stop).await?;
            if self.core.phase() == Phase::Stopped {
                return Ok(());
            }
            let deadline = self.core.poll_timeout().map(|t| self.clock.instant(t));
            let stream = &mut self.stream;
            let wake = &mut self.wake;
            let commands = &mut self.commands;
            let event = tokio::select! {
                biased;
                () = stop.stopped() => Event::Stop,
                cmd = commands.recv(), if commands_open => Event::Command(cmd),
                () = sleep_until(deadline), if deadline.is_some() => Event::Timeout,
                received = recv_wake(wake), if wake.is_some() => Event::Wake(received),
                item = next_item(stream), if stream.is_some() => Event::Feed(item),
            };
            let now = self.clock.now();
            match event {
                Event::Stop => self.core.handle_input(Input::Stop, now),
                Event::Command(None) => commands_open = false,
                Event::Command(Some(Command::Reconcile(reply))) => {
                    self.pending.push(reply);
                    self.core.handle_input(Input::Wake, now);
                }
                Event::Timeout => self.core.handle_timeout(now),
                Event::Wake(Ok(Received::Wake(_) | Received::TimedOut)) => {
                    self.core.handle_input(Input::Wake, now);
                }
                Event::Wake(Ok(Received::Closed)) => {
                    info!(worker = %self.core.config().name(), "wake source closed; stopping");
                    self.core.handle_input(Input::Stop, now);
                }
                Event::Wake(Err(e)) => {
                    warn!(worker = %self.core.config().name(), error = %e, "wake listener failed; stopping");
                    self.core.handle_input(Input::Stop, now);
                    return Err(e);
                }
                Event::Feed((token, item)) => {
                    // Items already waiting are taken in a batch: one turn of the select
                    // and one status update for up to FEED_BATCH items, not one each.
                    let mut next = Some(item);
                    let mut taken = 0;
                    while let Some(item) = next.take() {
                        let more = matches!(item, Some(Ok(_)));
                        self.core
                            .handle_input(feed_input(token, item), self.clock.now());
                        taken += 1;
                        if !more || taken == FEED_BATCH {
                            break;
                        }
                        // Carry out this item's decisions before reading the next one.
                        self.perform_outputs(&mut stop).await?;
                        next = match &mut self.stream {
                            Some((t, s)) if *t == token => poll_now(s.next()),
                            _ => None,
                        };
                    }
                }
            }
        }
    }

    /// Carries out every decision the core has, then publishes the status and watermark.
    ///
    /// The status goes first, here and before a ready or a saved checkpoint: whoever sees a
    /// watermark, readiness or a cursor sees a status at least as new (its counters
    /// included).
    async fn perform(&mut self, stop: &mut StopSignal) -> Result<()> {
        self.perform_outputs(stop).await?;
        self.publish_status();
        self.sink.watermark(self.core.watermark());
        Ok(())
    }

    /// Carries out every decision the core has, in order, feeding results back.
    ///
    /// A request to a port (a lookup, an open, a reconcile, a snapshot, a fetch) can wait
    /// long while a server is away; a stop asked meanwhile abandons it, so `stop_within`
    /// keeps its budget. Sink calls and cursor saves are never abandoned halfway.
    async fn perform_outputs(&mut self, stop: &mut StopSignal) -> Result<()> {
        while let Some(output) = self.core.poll_output() {
            let publish = match output {
                // A request can wait long (a reopen while the server is away): show the
                // attempt, not the state before it.
                Output::LookupSource { .. }
                | Output::OpenFeed { .. }
                | Output::Reconcile { .. }
                | Output::Snapshot { .. }
                | Output::Fetch { .. }
                | Output::Ready { .. } => true,
                // A saved cursor is visible to others: the status covers it first.
                Output::Checkpoint { .. } => self.cursor_name.is_some(),
                // Applies need no status of their own: the turn ends with one.
                _ => false,
            };
            if publish {
                self.publish_status();
            }
            // A request's answer, fed back below; `None` when a stop abandoned it.
            let answer = match output {
                Output::LookupSource { token } => {
                    or_stop(stop, self.source.watermark())
                        .await
                        .map(|found| match found {
                            Ok(_) => Input::SourceFound { token },
                            Err(e) => failed(token, &e),
                        })
                }
                Output::OpenFeed {
                    token,
                    from,
                    after_position,
                } => match or_stop(stop, self.open(from, after_position)).await {
                    None => None,
                    Some(Ok(opened)) => {
                        debug!(worker = %self.core.config().name(), source = %self.source_name, from, head = opened.info.head, "feed opened");
                        self.stream = Some((token, opened.stream));
                        Some(Input::FeedOpened {
                            token,
                            info: opened.info,
                        })
                    }
                    Some(Err(e)) => Some(Input::FeedFailed {
                        token,
                        error: e.to_string(),
                    }),
                },
                Output::Reconcile { token, since } => {
                    or_stop(stop, self.source.changes_since(since))
                        .await
                        .map(|changes| match changes {
                            Ok(Changes::Since { entries, watermark }) => Input::Changes {
                                token,
                                changes: entries,
                                source_watermark: watermark,
                            },
                            Ok(Changes::Compacted { first_available }) => {
                                Input::ChangesUnavailable {
                                    token,
                                    first_available,
                                }
                            }
                            Err(e) => failed(token, &e),
                        })
                }
                Output::Snapshot { token } => {
                    or_stop(stop, self.source.snapshot())
                        .await
                        .map(|snapshot| match snapshot {
                            Ok(snap) => Input::Snapshot {
                                token,
                                entries: snap.entries,
                                source_watermark: snap.watermark,
                            },
                            Err(e) => failed(token, &e),
                        })
                }
                Output::Fetch { token, key, .. } => {
                    or_stop(stop, self.source.get(&key))
                        .await
                        .map(|fetched| match fetched {
                            Ok(value) => Input::Fetched {
                                token,
                                value: value.map(|v| (v.seq, v.value)),
                            },
                            Err(e) => failed(token, &e),
                        })
                }
                other => {
                    self.carry_out(other).await?;
                    continue;
                }
            };
            self.core
                .handle_input(answer.unwrap_or(Input::Stop), self.clock.now());
        }
        Ok(())
    }

    /// Carries out an output that asks nothing back: an apply, a close, a checkpoint,
    /// readiness, a diagnostic.
    async fn carry_out(&mut self, output: Output<D::Value>) -> Result<()> {
        match output {
            Output::CloseFeed { token }
                if self.stream.as_ref().is_some_and(|(t, _)| *t == token) =>
            {
                self.stream = None;
            }
            Output::Put { key, seq, value } => self.sink.put(key, seq, value).await?,
            Output::Remove { key, seq } => self.sink.remove(key, seq).await?,
            Output::Checkpoint { position } => {
                if let Some(name) = &self.cursor_name
                    && let Err(e) = self.cursors.save(name, position).await
                {
                    // Fail-soft: the next checkpoint saves a higher position anyway.
                    warn!(worker = %self.core.config().name(), source = %self.source_name, position, error = %e, "checkpoint failed");
                }
            }
            Output::Ready { watermark } => {
                info!(worker = %self.core.config().name(), source = %self.source_name, watermark, "ready");
                self.sink.ready(watermark);
                self.answer(Reconciled {
                    watermark,
                    ..Reconciled::default()
                });
            }
            Output::Diagnostic(d) => self.diagnose(d),
            _ => {}
        }
        Ok(())
    }

    async fn open(
        &mut self,
        from: u64,
        after: Option<u64>,
    ) -> Result<crate::ports::Opened<F::Stream>> {
        let saved = match (&self.cursor_name, self.cursor_loaded) {
            (None, _) => None,
            (Some(_), Some(saved)) => saved,
            (Some(name), None) => {
                let saved = self.cursors.load(name).await?;
                self.cursor_loaded = Some(saved);
                saved
            }
        };
        // The core knows only positions it checkpointed since it started; a restarted
        // consumer resumes after the durable cursor.
        let after = match (after, saved) {
            (Some(a), Some(s)) => Some(a.max(s)),
            (a, s) => a.or(s),
        };
        self.feed.open(from, after).await
    }

    /// Answers the callers of `reconcile()`. Status and watermark go first: a caller who
    /// got `r` sees a status and a cache watermark at least at `r.watermark` (the core
    /// emits the answer after the applies it covers, so they are in the sink).
    fn answer(&mut self, r: Reconciled) {
        if self.pending.is_empty() {
            return;
        }
        self.publish_status();
        self.sink.watermark(r.watermark);
        for reply in self.pending.drain(..) {
            let _ = reply.send(r);
        }
    }

    fn diagnose(&mut self, d: Diagnostic) {
        let worker = self.core.config().name();
        let source = &self.source_name;
        match d {
            Diagnostic::DecodeFailed { key, seq, error } => {
                warn!(
                    worker,
                    source, key, seq, error, "value failed to decode; skipped"
                );
            }
            Diagnostic::InvalidEntry { seq, key, reason } => {
                warn!(worker, source, key, seq, ?reason, "invalid entry skipped");
            }
            Diagnostic::Gap { expected, got } => {
                warn!(
                    worker,
                    source,
                    expected,
                    seq = got,
                    "gap in a gapless feed; reconciling"
                );
            }
            Diagnostic::SeqRegressed { previous, got } => {
                debug!(
                    worker,
                    source,
                    previous,
                    seq = got,
                    "feed seq went backwards"
                );
            }
            Diagnostic::Compacted {
                wanted,
                first_available,
            } => {
                warn!(
                    worker,
                    source, wanted, first_available, "history compacted; resyncing"
                );
            }
            Diagnostic::Resynced { removed, watermark } => {
                info!(worker, source, removed, watermark, "resynced");
                self.answer(Reconciled {
                    applied: 0,
                    removed,
                    watermark,
                });
            }
            Diagnostic::Reconciled {
                applied,
                removed,
                watermark,
            } => {
                debug!(worker, source, applied, removed, watermark, "reconciled");
                self.answer(Reconciled {
                    applied,
                    removed,
                    watermark,
                });
            }
            Diagnostic::BackingOff {
                cause,
                attempt,
                delay,
                error,
            } => {
                warn!(
                    worker,
                    source,
                    ?cause,
                    attempt,
                    ?delay,
                    error,
                    "backing off"
                );
            }
            Diagnostic::HeadBehind { head, watermark } => {
                warn!(
                    worker,
                    source, head, watermark, "feed head below the watermark; resyncing"
                );
            }
            Diagnostic::SourceReset {
                watermark,
                source_watermark,
            } => {
                warn!(
                    worker,
                    source,
                    watermark,
                    source_watermark,
                    "the source is a new history (recreated or restored); cache replaced"
                );
            }
            other => debug!(worker, source, ?other, "diagnostic"),
        }
    }

    fn publish_status(&self) {
        let core = &self.core;
        self.status.send_if_modified(|s| {
            let before = (s.phase, s.ready, s.watermark, s.keys, s.counters);
            s.phase = core.phase();
            s.ready = core.is_ready();
            s.watermark = core.watermark();
            s.keys = core.len();
            s.counters = core.counters();
            // Watchers wake for any change, counters included: `wait_for(|s| s.counters
            // .poison > 0)` must not hang on a counter-only change.
            before != (s.phase, s.ready, s.watermark, s.keys, s.counters)
        });
    }

    /// Spawns the task on the current tokio runtime.
    pub fn spawn(self) -> FollowerHandle
    where
        S: 'static,
        F: 'static,
        C: 'static,
        W: 'static,
        D: 'static,
        D::Value: Send,
        K: 'static,
    {
        let shutdown = Shutdown::new();
        let status = self.status.subscribe();
        let commands = self.commands_tx.clone();
        let name = self.core.config().name().to_owned();
        let task = tokio::spawn(self.run(shutdown.signal()));
        FollowerHandle {
            name,
            status,
            commands,
            shutdown,
            task,
        }
    }
}

enum Event {
    Stop,
    Command(Option<Command>),
    Timeout,
    Wake(Result<Received>),
    Feed((Token, Option<Result<FeedItem>>)),
}

/// How many waiting feed items one turn of the task takes at most.
const FEED_BATCH: usize = 256;

fn feed_input(token: Token, item: Option<Result<FeedItem>>) -> Input {
    match item {
        Some(Ok(FeedItem::Entry(entry))) => Input::Entry { token, entry },
        Some(Ok(FeedItem::Undecodable {
            position,
            seq,
            reason,
        })) => Input::Undecodable {
            token,
            position,
            seq,
            reason,
        },
        Some(Err(e)) => Input::FeedFailed {
            token,
            error: e.to_string(),
        },
        None => Input::FeedEnded { token },
    }
}

/// Polls `fut` once: its output if it is ready now, else `None` (and it is dropped, which
/// the cancel-safety of feed reads allows).
fn poll_now<F: std::future::Future>(fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The input that reports request `token` failed with `e`.
fn failed(token: Token, e: &Error) -> Input {
    Input::RequestFailed {
        token,
        error: e.to_string(),
    }
}

/// `request`'s result, or `None` if a stop is asked first (the request is dropped).
async fn or_stop<T>(stop: &mut StopSignal, request: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.stopped() => None,
        result = request => Some(result),
    }
}

async fn recv_wake<W: WakeListener>(wake: &mut Option<W>) -> Result<Received> {
    match wake {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

async fn next_item<T: FeedStream>(
    stream: &mut Option<(Token, T)>,
) -> (Token, Option<Result<FeedItem>>) {
    match stream {
        Some((token, s)) => (*token, s.next().await),
        None => std::future::pending().await,
    }
}

/// A running follower task: its status, a reconcile on demand, and stop.
#[derive(Debug)]
pub struct FollowerHandle {
    name: String,
    status: watch::Receiver<Status>,
    commands: mpsc::Sender<Command>,
    shutdown: Shutdown,
    task: JoinHandle<Result<Status>>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reconcile")
    }
}

impl FollowerHandle {
    /// The follower's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its status now (phase, watermark, counters).
    ///
    /// The status is published before the watermark, readiness or a saved cursor that
    /// the same decisions produce: after `wait_ready`, after seeing a cache's watermark or
    /// a durable cursor reach a position, the status read here covers at least that much.
    /// Single applies between two such points may be visible in the cache a moment before
    /// they are counted.
    #[must_use]
    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// A receiver of its status as it changes: it is marked changed whenever the phase,
    /// readiness, watermark, key count or any counter moved. It is published at the end
    /// of each turn (one per batch of feed entries, not one per entry), and before a
    /// request, readiness, a reconcile's answer or a saved cursor.
    #[must_use]
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Its applied watermark now.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.status.borrow().watermark
    }

    /// Reads the source's changes since the watermark and applies them; returns what it
    /// caught up. Closes the window of an announcement that was lost after its commit.
    pub async fn reconcile(&self) -> Result<Reconciled> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::Reconcile(tx))
            .await
            .map_err(|_| Error::Closed("follower"))?;
        rx.await.map_err(|_| Error::Closed("follower"))
    }

    /// Asks it to stop (it closes its feed and drains its sink).
    pub fn stop(&self) {
        self.shutdown.trigger();
    }

    /// A trigger that stops it, for sharing.
    #[must_use]
    pub fn shutdown(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Whether the task has ended.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the task to end; its final status, or why it failed.
    pub async fn join(self) -> Result<Status> {
        match self.task.await {
            Ok(result) => result,
            Err(e) => Err(Error::Worker {
                worker: self.name,
                reason: e.to_string(),
            }),
        }
    }

    /// Stops it and waits at most `budget` for it to drain; aborts it after that.
    pub async fn stop_within(mut self, budget: std::time::Duration) -> Result<Status> {
        self.stop();
        match tokio::time::timeout(budget, &mut self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(Error::Worker {
                worker: self.name,
                reason: e.to_string(),
            }),
            Err(_) => {
                self.task.abort();
                Err(Error::Timeout {
                    what: format!("follower {}", self.name),
                    budget,
                })
            }
        }
    }
}

/// Spawns a follower of `source` through `feed` into a new [`Cache`]; returns the
/// reader and the task's handle. The usual way to keep a local copy of a source.
pub fn spawn_cache<S, F, D>(
    config: FollowerConfig,
    decoder: D,
    source: S,
    feed: F,
) -> (Cache<D::Value>, FollowerHandle)
where
    S: Source + 'static,
    F: Feed + 'static,
    D: Decode + Send + 'static,
    D::Value: Send + Sync + 'static,
{
    let (writer, reader): (CacheWriter<D::Value>, _) = cache();
    let handle = FollowerTask::new(config, decoder, source, feed, writer).spawn();
    (reader, handle)
}

/// Spawns a wake runner: a follower with no feed that catches up from `source` on every
/// wake (and never otherwise: it does not poll), into a new [`Cache`]. It runs in
/// [`Sync::WakeOnly`](tidemark_core::Sync::WakeOnly) whatever `config` says. It ends
/// cleanly when the wake source closes.
pub fn spawn_wake_cache<S, W, D>(
    config: FollowerConfig,
    decoder: D,
    source: S,
    listener: W,
) -> (Cache<D::Value>, FollowerHandle)
where
    S: Source + 'static,
    W: WakeListener + 'static,
    D: Decode + Send + 'static,
    D::Value: Send + Sync + 'static,
{
    let (writer, reader): (CacheWriter<D::Value>, _) = cache();
    let config = config.with_sync(tidemark_core::Sync::WakeOnly);
    let handle = FollowerTask::new(config, decoder, source, NoFeed, writer)
        .with_wake(listener)
        .spawn();
    (reader, handle)
}
