//! The follower task: owns one core [`Follower`], carries out its decisions against the
//! ports, commits each batch to its sink, feeds the results back, and sleeps until its
//! next timeout. Every follower runs on it: caches, persisted caches, wake runners,
//! durable consumers and supervised workers.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use tidemark_core::{
    Apply, Asking, Backoff, BackoffPolicy, CaughtUp, Decode, Diagnostic, Follow, Follower,
    FollowerConfig, Input, Notice, Output, Phase, ProbePolicy, Probed, Request, Rng, Status, Time,
    Token,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::cache::{Cache, CacheWriter, cache};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::noop::{NoCursors, NoFeed, NoWake};
use crate::ports::{Changes, Cursors, Feed, FeedItem, FeedStream, Received, Source, WakeListener};
use crate::probe::{ProbeOut, Prober, probe_of};
use crate::reconnect::Reconnects;
use crate::running::Running;
use crate::shutdown::{Shutdown, StopSignal};
use crate::sink::{SYNC_FEED_BATCH, Sink};
use crate::telemetry::{FollowerHealth, FollowerMetrics, Health, Progress};

pub(crate) mod handle;
mod outputs;

/// Entries a part of a resync's snapshot holds at most, unless
/// [`FollowerTask::snapshot_part_len`] says otherwise: with 100-byte values about 3.5 MB a
/// part, a small share of a large cache's memory, in calls few enough not to matter.
pub const DEFAULT_SNAPSHOT_PART_LEN: usize = 16_384;

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

impl From<CaughtUp> for Reconciled {
    fn from(c: CaughtUp) -> Self {
        Reconciled {
            applied: c.applied,
            removed: c.removed,
            watermark: c.watermark,
        }
    }
}

enum Command {
    Reconcile(oneshot::Sender<Reconciled>),
}

/// What a batch decided that waits for the sink's commit: nobody may see a readiness, a
/// reconcile's answer or a saved cursor that the sink does not yet hold.
#[derive(Debug, Default)]
struct Batch {
    /// Something was applied since the last commit.
    dirty: bool,
    ready: bool,
    checkpoint: Option<u64>,
    caught_up: Option<CaughtUp>,
}

/// A seed for a follower the user gave none: drawn from the OS (outside the core, which
/// stays deterministic), so that a fleet does not retry in lockstep. The status shows it.
fn draw_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x7469_6465_6d61_726b);
    h.finish()
}

/// A follower task, configured but not yet running. Build it with
/// [`FollowerTask::new`], add a durable cursor or a wake listener, then
/// [`spawn`](Self::spawn) it (or [`run`](Self::run) it in place, as often as a supervisor
/// restarts it: the core's applied state is kept across runs).
///
/// `S` answers lookups, reconciles, snapshots and marker fetches; `F` is the feed, which
/// says how it must be followed ([`Feed::FOLLOW`]; [`NoFeed`] for a wake-only follower);
/// `C` stores the feed's durable cursor; `W` delivers wakes; `K` receives the changes and
/// owns their durability (a cache, a persisted cache, a worker).
pub struct FollowerTask<S, F: Feed, C, W, D: Decode, K> {
    core: Follower<D>,
    /// Shared with the probes beside a request that takes long.
    source: Arc<S>,
    source_name: String,
    /// Shared with the probes beside a request, as the source is.
    feed: Arc<F>,
    cursors: C,
    cursor_name: Option<String>,
    cursor_loaded: Option<Option<u64>>,
    wake: Option<W>,
    /// Paces a wake listener that failed (a transient error): wakes resume after this.
    wake_paused_until: Option<Instant>,
    wake_backoff: Backoff,
    rng: Rng,
    /// The source's and feed's client reconnects, each a reason to retry at once.
    reconnects: Reconnects,
    /// Probes of the source while the follower backs off: an answer after a stall is a
    /// reason to retry at once where no reconnect comes.
    prober: Prober,
    sink: K,
    clock: Clock,
    stream: Option<(Token, F::Stream)>,
    status: watch::Sender<Status>,
    pending: Vec<oneshot::Sender<Reconciled>>,
    commands: mpsc::Receiver<Command>,
    commands_tx: mpsc::Sender<Command>,
    batch: Batch,
    /// The watermark the sink last committed.
    committed: u64,
    /// The lineage the sink last committed with it.
    committed_lineage: tidemark_core::Lineage,
    runs: u32,
    /// The source's head as last learned: what lag is measured against.
    head: u64,
    /// Its series, registered when it first runs (with the recorder installed then).
    metrics: Option<FollowerMetrics>,
    progress: Arc<Progress>,
    /// Entries a part of a resync's snapshot holds at most.
    snapshot_part_len: usize,
}

impl<S, F, D, K> FollowerTask<S, F, NoCursors, NoWake, D, K>
where
    S: Source,
    F: Feed,
    D: Decode + Send,
    K: Sink<D::Value>,
{
    /// A follower of `source` through `feed`, applying into `sink`. It follows the feed
    /// the way the feed says ([`Feed::FOLLOW`]). If the sink already holds a cache (a
    /// persisted one), the follower resumes from it when it first runs. Without a seed in
    /// `config`, one is drawn here and shown in the status.
    pub fn new(config: FollowerConfig, decoder: D, source: S, feed: F, sink: K) -> Self {
        let config = config.with_seed_if_unset(draw_seed());
        Self::from_core(Follower::new(config, decoder), source, feed, sink)
    }

    /// A task around an existing core (one made with [`Follower::resume`], say). The core
    /// is set to follow the feed the way the feed says.
    /// A source over a key prefix ([`Source::key_prefix`]) limits the core to it.
    pub fn from_core(core: Follower<D>, source: S, feed: F, sink: K) -> Self {
        let mut core = core.following(F::FOLLOW);
        if let Some(prefix) = source.key_prefix()
            && !core.prefixes().contains(prefix)
        {
            core = core.within(prefix.clone());
        }
        if K::FALLIBLE {
            core.track_commits(true);
        }
        let (commands_tx, commands) = mpsc::channel(16);
        let status = watch::channel(core.status()).0;
        let seed = core.status().seed;
        let reconnects = Reconnects::new(source.reconnects(), feed.reconnects());
        let prober = Prober::new(&source, &feed, ProbePolicy::default());
        FollowerTask {
            source_name: core.config().name().to_owned(),
            committed: core.watermark(),
            committed_lineage: core.lineage(),
            core,
            source: Arc::new(source),
            feed: Arc::new(feed),
            cursors: NoCursors,
            cursor_name: None,
            cursor_loaded: None,
            wake: None,
            wake_paused_until: None,
            wake_backoff: Backoff::new(BackoffPolicy::default()),
            rng: Rng::new(seed ^ 0x5741_4b45),
            reconnects,
            prober,
            sink,
            clock: Clock::new(),
            stream: None,
            status,
            pending: Vec::new(),
            commands,
            commands_tx,
            batch: Batch::default(),
            runs: 0,
            head: 0,
            metrics: None,
            progress: Arc::default(),
            snapshot_part_len: DEFAULT_SNAPSHOT_PART_LEN,
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

    /// Reads a resync's snapshot in parts of at most `len` entries (at least 1; default
    /// [`DEFAULT_SNAPSHOT_PART_LEN`]): the follower keeps only what differs from its cache
    /// as each part passes, so a resync holds about one part of the source beside what
    /// changed. Smaller parts cost more calls to the source; larger ones more memory.
    #[must_use]
    pub fn snapshot_part_len(mut self, len: usize) -> Self {
        self.snapshot_part_len = len.max(1);
        self
    }

    /// The same task with other cursors, cursor name or wake listener.
    fn rebuild<C2, W2>(
        self,
        parts: impl FnOnce(C, Option<String>, Option<W>) -> (C2, Option<String>, Option<W2>),
    ) -> FollowerTask<S, F, C2, W2, D, K> {
        let (cursors, cursor_name, wake) = parts(self.cursors, self.cursor_name, self.wake);
        FollowerTask {
            core: self.core,
            source: self.source,
            source_name: self.source_name,
            feed: self.feed,
            cursors,
            cursor_name,
            cursor_loaded: None,
            wake,
            wake_paused_until: None,
            wake_backoff: self.wake_backoff,
            rng: self.rng,
            reconnects: self.reconnects,
            prober: self.prober,
            sink: self.sink,
            clock: self.clock,
            stream: self.stream,
            status: self.status,
            pending: self.pending,
            commands: self.commands,
            commands_tx: self.commands_tx,
            batch: self.batch,
            committed: self.committed,
            committed_lineage: self.committed_lineage,
            runs: self.runs,
            head: self.head,
            metrics: self.metrics,
            progress: self.progress,
            snapshot_part_len: self.snapshot_part_len,
        }
    }

    /// Checkpoints the feed's position under `name` in `cursors`, and resumes after the
    /// saved position when (re)started: a durable consumer. A position is saved only after
    /// the sink committed the entries before it.
    pub fn with_cursor<C2: Cursors>(
        self,
        cursors: C2,
        name: impl Into<String>,
    ) -> FollowerTask<S, F, C2, W, D, K> {
        let name = name.into();
        self.rebuild(|_, _, wake| (cursors, Some(name), wake))
    }

    /// Catches up from the source on every wake from `listener`; the task ends cleanly
    /// when the wake source closes. A listener that fails with a retryable error is
    /// paced by a backoff and kept; the follower catches up meanwhile.
    pub fn with_wake<W2: WakeListener>(self, listener: W2) -> FollowerTask<S, F, C, W2, D, K> {
        self.rebuild(|cursors, name, _| (cursors, name, Some(listener)))
    }

    /// The sink the changes go to.
    #[must_use]
    pub fn sink(&self) -> &K {
        &self.sink
    }

    /// The follower's status, updated as it runs.
    #[must_use]
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    /// Runs until `stop` fires (or the wake source closes); returns the final status.
    /// Fails if the sink fails with an error that is not retryable (a worker's handler
    /// error) or cannot say what it holds. The task can be run again after a failure (a
    /// supervisor's restart): it keeps what it applied and tries again at once.
    pub async fn run(&mut self, stop: StopSignal) -> Result<Status> {
        let result = self.run_loop(stop).await;
        self.stream = None;
        self.sink.drain().await;
        self.publish_status();
        result.map(|()| self.core.status())
    }

    async fn run_loop(&mut self, mut stop: StopSignal) -> Result<()> {
        self.start_run().await?;
        let mut commands_open = true;
        loop {
            self.perform(&mut stop).await?;
            match self.core.phase() {
                Phase::Stopped => return Ok(()),
                Phase::BackingOff => self.reconnects.backing_off(Instant::now()),
                _ => {}
            }
            let retry_at = self.retry_at();
            let (source, feed) = (&*self.source, &*self.feed);
            self.prober.poll(
                || probe_of(source, feed),
                &self.clock,
                self.clock.now(),
                retry_at,
            );
            let event = self.next_event(&mut stop, commands_open, retry_at).await;
            if matches!(event, Event::Command(None)) {
                commands_open = false;
            }
            self.on_event(event, &mut stop).await?;
        }
    }

    /// What a run does first: on the first, resume from what the sink holds; on a
    /// restart, try now whatever waits out a backoff.
    async fn start_run(&mut self) -> Result<()> {
        if self.metrics.is_none() {
            self.metrics = Some(FollowerMetrics::new(
                self.core.config().name(),
                &self.source_name,
            ));
        }
        if self.runs == 0 {
            if let Some(held) = self.sink.resume().await? {
                info!(worker = %self.core.config().name(), watermark = held.watermark, keys = held.keys, ahead = held.ahead.as_ref().map(Vec::len), lineage = ?held.lineage, "resuming from the sink");
                self.core.start_from(held.watermark, held.keys);
                self.core.remember_lineage(held.lineage);
                self.committed = self.core.watermark();
                self.committed_lineage = self.core.lineage();
                match held.ahead {
                    // Announcements run ahead of the source, and a sink keeps them with
                    // their batch: what it committed past the watermark may be a foreign
                    // event or a replaced history's, which no read has confirmed yet. The
                    // core holds each unconfirmed until a read checks it.
                    Some(ahead) => self.core.remember_ahead(ahead),
                    // A sink that does not say: only a listing finds the keys held past
                    // the watermark (and no removal).
                    None if F::FOLLOW == Follow::Announcements && held.keys > 0 => {
                        self.complete_index().await?;
                    }
                    None => {}
                }
            }
        } else {
            // A restart: whatever waits out a backoff is tried now.
            self.reconnects.acted(Instant::now());
            self.prober.reset();
            self.core.handle_input(Input::Reconnected, self.clock.now());
        }
        self.runs += 1;
        Ok(())
    }

    /// When a follower that backs off retries next (its backoff's end, or a reconnect's
    /// deferred retry), `None` when it is not backing off: what its probes are paced by.
    fn retry_at(&self) -> Option<Time> {
        if self.core.phase() != Phase::BackingOff {
            return None;
        }
        let deferred = self
            .reconnects
            .deferred_until()
            .map(|at| self.clock.time(at));
        [self.core.poll_timeout(), deferred]
            .into_iter()
            .flatten()
            .min()
    }

    /// Waits for the next thing that happens: a stop, a command, a reconnect, a timeout,
    /// a probe's outcome or due time, a wake or a feed item (in that order when several
    /// are ready).
    /// `retry_at`: what [`retry_at`](Self::retry_at) gave, read once by the loop.
    async fn next_event(
        &mut self,
        stop: &mut StopSignal,
        commands_open: bool,
        retry_at: Option<Time>,
    ) -> Event {
        let probe_due = self.prober.due(&self.clock, retry_at);
        let mut deadline = self.core.poll_timeout().map(|t| self.clock.instant(t));
        for at in [self.wake_paused_until, self.reconnects.deferred_until()]
            .into_iter()
            .flatten()
        {
            deadline = Some(deadline.map_or(at, |d| d.min(at)));
        }
        let stream = &mut self.stream;
        let wake = &mut self.wake;
        let listening = wake.is_some() && self.wake_paused_until.is_none();
        let commands = &mut self.commands;
        let reconnects = &mut self.reconnects;
        let watching = reconnects.watching();
        let prober = &mut self.prober;
        let probing = prober.is_out();
        tokio::select! {
            biased;
            () = stop.stopped() => Event::Stop,
            cmd = commands.recv(), if commands_open => Event::Command(cmd),
            () = reconnects.next(), if watching => Event::Reconnected,
            () = sleep_until(deadline), if deadline.is_some() => Event::Timeout,
            answered = prober.outcome(), if probing => Event::Probed(answered),
            () = sleep_until(probe_due), if probe_due.is_some() => Event::ProbeDue,
            received = recv_wake(wake), if listening => Event::Wake(received),
            item = next_item(stream), if stream.is_some() => Event::Feed(item),
        }
    }

    /// Reports what happened to the core (a fatal wake failure ends the run).
    async fn on_event(&mut self, event: Event, stop: &mut StopSignal) -> Result<()> {
        let now = self.clock.now();
        match event {
            Event::Stop => self.core.handle_input(Input::Stop, now),
            Event::Command(None) => {}
            Event::Command(Some(Command::Reconcile(reply))) => {
                self.pending.push(reply);
                self.core.handle_input(Input::Wake, now);
            }
            Event::Reconnected => {
                self.prober.reset();
                if self.reconnects.arrived(Instant::now()) {
                    debug!(worker = %self.core.config().name(), source = %self.source_name, "client reconnected; retrying now");
                    self.core.handle_input(Input::Reconnected, now);
                }
            }
            // Paced as a reconnect is; unlike one, it cuts no request (none was lost).
            Event::Probed(answered) => {
                if self.prober.judge(now, answered) == Probed::Resumed
                    && self.reconnects.arrived(Instant::now())
                {
                    debug!(worker = %self.core.config().name(), source = %self.source_name, "source answers again after a stall; retrying now");
                    self.core.handle_input(Input::Resumed, now);
                }
            }
            // The loop sends the probe that is due.
            Event::ProbeDue => {}
            Event::Timeout => {
                if self
                    .wake_paused_until
                    .is_some_and(|at| at <= Instant::now())
                {
                    self.wake_paused_until = None;
                }
                if self.reconnects.take_due(Instant::now()) {
                    self.core.handle_input(Input::Reconnected, now);
                }
                self.core.handle_timeout(now);
            }
            Event::Wake(Ok(Received::Wake(payload))) if !self.wakes_for_us(&payload) => {
                self.wake_backoff.reset();
            }
            Event::Wake(Ok(Received::Wake(_) | Received::TimedOut)) => {
                self.wake_backoff.reset();
                self.core.handle_input(Input::Wake, now);
            }
            Event::Wake(Ok(Received::Closed)) => {
                info!(worker = %self.core.config().name(), "wake source closed; stopping");
                self.core.handle_input(Input::Stop, now);
            }
            Event::Wake(Err(e)) if e.is_retryable() => {
                // A listener that failed once (a busy database, a dropped connection)
                // is kept: catch up now, and listen again after a backoff, so a
                // listener that keeps failing cannot spin.
                let delay = self.wake_backoff.next_delay(now, &mut self.rng);
                warn!(worker = %self.core.config().name(), error = %e, ?delay, "wake listener failed; catching up and listening again after a pause");
                self.wake_paused_until = Some(crate::clock::instant_after(Instant::now(), delay));
                self.core.handle_input(Input::Wake, now);
            }
            Event::Wake(Err(e)) => {
                warn!(worker = %self.core.config().name(), error = %e, "wake listener failed; stopping");
                self.core.handle_input(Input::Stop, now);
                self.perform(stop).await?;
                return Err(e);
            }
            Event::Feed((token, item)) => self.on_feed(token, item).await?,
        }
        Ok(())
    }

    /// Whether a wake's payload may concern this follower's keys: an event about a key
    /// outside its prefix announces a change it does not keep, so no catch-up is needed
    /// for it (every change is announced on its own, and an empty or foreign payload
    /// always catches up).
    fn wakes_for_us(&self, payload: &[u8]) -> bool {
        if self.core.prefixes().is_empty() || payload.is_empty() {
            return true;
        }
        tidemark_core::Event::decode(payload).map_or(true, |e| self.core.keeps(e.key()))
    }
}

/// What asking a port for a request came to.
enum Asked {
    /// Its answer, for the core.
    Answer(Input),
    /// The path to the source came back while it was out, and it was cut: its failure
    /// for the core, then [`Input::Resumed`] (paced as a reconnect is).
    Resumed(Input),
    /// A stop came first: the core is told to stop. (A reconnect that cuts a request
    /// answers it as failed.)
    Abandoned,
    /// The sink failed meanwhile (the core rewound) or there was nothing to ask: no answer.
    Dropped,
}

enum Event {
    Stop,
    Command(Option<Command>),
    Reconnected,
    Timeout,
    /// The probe out was answered (`true`), or failed or timed out.
    Probed(bool),
    ProbeDue,
    Wake(Result<Received>),
    Feed((Token, Option<Result<FeedItem>>)),
}

/// How many waiting feed items one turn of the task takes at most, once ready: short
/// turns keep the status, commits and readiness of a live follower prompt.
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
        Some(Ok(FeedItem::Head(head))) => Input::FeedHead { token, head },
        Some(Err(e)) => Input::FeedFailed {
            token,
            error: e.to_string(),
        },
        None => Input::FeedEnded { token },
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

/// What abandons a request to a port before its answer: a stop; a reconnect of the
/// client beneath the source or feed heard while the request is out; or the path to the
/// source coming back while it is out, as probes beside it tell ([`Asking`]). A reply due
/// on the old connection is lost with it, and a request sent while the path was cut (a
/// node cut off from its cluster, a stream with no leader) may never get one, with the
/// connection up all along: either would wait out the client's whole request timeout
/// (10 s on NATS) after the source came back. Abandoned, it fails at once and the
/// follower retries it (paced as every reconnect is).
struct Cut<'a, S, F> {
    stop: &'a mut StopSignal,
    /// The counters as of the request's start: only a reconnect after it cuts it.
    reconnects: Reconnects,
    /// A reconnect cut a request (not a stop).
    by_reconnect: bool,
    /// The path came back while a request was out, and it was cut.
    by_resume: bool,
    /// What the probes beside a request ask (the source and the feed: [`probe_of`]);
    /// `None` when the path cannot be probed.
    path: Option<(Arc<S>, Arc<F>)>,
    clock: Clock,
}

impl<'a, S: Source, F: Feed> Cut<'a, S, F> {
    fn new(
        stop: &'a mut StopSignal,
        reconnects: &Reconnects,
        path: Option<(Arc<S>, Arc<F>)>,
        clock: Clock,
    ) -> Self {
        Cut {
            stop,
            reconnects: reconnects.listen_from_now(),
            by_reconnect: false,
            by_resume: false,
            path,
            clock,
        }
    }

    /// `request`'s result, or `None` if a stop, a reconnect or the path's return comes
    /// first (the request is dropped).
    async fn or_cut<T>(&mut self, request: impl Future<Output = T>) -> Option<T> {
        let asking = Asking::new(ProbePolicy::default(), self.clock.now());
        self.or_cut_asking(request, asking).await
    }

    /// [`or_cut`](Self::or_cut) for a request of one round trip (a lookup, an open, a
    /// read of one key), which is also given up once probes answered beside it show
    /// its reply is not coming ([`Asking::single`]).
    async fn or_cut_single<T>(&mut self, request: impl Future<Output = T>) -> Option<T> {
        let asking = Asking::single(ProbePolicy::default(), self.clock.now());
        self.or_cut_asking(request, asking).await
    }

    async fn or_cut_asking<T>(
        &mut self,
        request: impl Future<Output = T>,
        mut asking: Asking,
    ) -> Option<T> {
        let mut out = ProbeOut::default();
        let watching = self.reconnects.watching();
        tokio::pin!(request);
        loop {
            let now = self.clock.now();
            let mut wake = None;
            if let Some((source, feed)) = &self.path
                && !out.is_out()
            {
                if asking.cut_due(now) {
                    self.by_resume = true;
                    return None;
                }
                if let Some(deadline) = asking.poll_probe(now)
                    && !out.send(probe_of(&**source, &**feed), self.clock.instant(deadline))
                {
                    asking.handle_missed(now);
                }
                if !out.is_out() {
                    wake = asking.poll_timeout(now).map(|t| self.clock.instant(t));
                }
            }
            tokio::select! {
                biased;
                () = self.stop.stopped() => return None,
                () = self.reconnects.next(), if watching => {
                    self.by_reconnect = true;
                    return None;
                }
                result = &mut request => return Some(result),
                answered = out.outcome(), if out.is_out() => {
                    let now = self.clock.now();
                    match answered {
                        true => asking.handle_answer(now),
                        false => asking.handle_missed(now),
                    }
                }
                () = sleep_until(wake), if wake.is_some() => {}
            }
        }
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
