//! The follower task: owns one core [`Follower`], carries out its decisions against the
//! ports, commits each batch to its sink, feeds the results back, and sleeps until its
//! next timeout. Every follower runs on it: caches, persisted caches, wake runners,
//! durable consumers and supervised workers.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use tidemark_core::{
    Apply, Backoff, BackoffPolicy, CaughtUp, Decode, Diagnostic, Follow, Follower, FollowerConfig,
    Input, Notice, Output, Phase, Request, Rng, Status, Token,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::cache::{Cache, CacheWriter, cache};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::noop::{NoCursors, NoFeed, NoWake};
use crate::ports::{Changes, Cursors, Feed, FeedItem, FeedStream, Received, Source, WakeListener};
use crate::reconnect::Reconnects;
use crate::running::Running;
use crate::shutdown::{Shutdown, StopSignal};
use crate::sink::Sink;
use crate::telemetry::{FollowerHealth, FollowerMetrics, Progress};

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
    source: S,
    source_name: String,
    feed: F,
    cursors: C,
    cursor_name: Option<String>,
    cursor_loaded: Option<Option<u64>>,
    /// A checkpoint the sink committed whose save failed: saved with the next commit,
    /// since no later checkpoint may come (a quiet stream, or catch-ups by resync only).
    unsaved_checkpoint: Option<u64>,
    wake: Option<W>,
    /// Paces a wake listener that failed (a transient error): wakes resume after this.
    wake_paused_until: Option<Instant>,
    wake_backoff: Backoff,
    rng: Rng,
    /// The source's and feed's client reconnects, each a reason to retry at once.
    reconnects: Reconnects,
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
        FollowerTask {
            source_name: core.config().name().to_owned(),
            committed: core.watermark(),
            core,
            source,
            feed,
            cursors: NoCursors,
            cursor_name: None,
            cursor_loaded: None,
            unsaved_checkpoint: None,
            wake: None,
            wake_paused_until: None,
            wake_backoff: Backoff::new(BackoffPolicy::default()),
            rng: Rng::new(seed ^ 0x5741_4b45),
            reconnects,
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
            unsaved_checkpoint: None,
            wake,
            wake_paused_until: None,
            wake_backoff: self.wake_backoff,
            rng: self.rng,
            reconnects: self.reconnects,
            sink: self.sink,
            clock: self.clock,
            stream: self.stream,
            status: self.status,
            pending: self.pending,
            commands: self.commands,
            commands_tx: self.commands_tx,
            batch: self.batch,
            committed: self.committed,
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
        if self.metrics.is_none() {
            self.metrics = Some(FollowerMetrics::new(
                self.core.config().name(),
                &self.source_name,
            ));
        }
        if self.runs == 0 {
            if let Some(held) = self.sink.resume().await? {
                info!(worker = %self.core.config().name(), watermark = held.watermark, keys = held.keys, ahead = held.ahead.as_ref().map(Vec::len), "resuming from the sink");
                self.core.start_from(held.watermark, held.keys);
                self.committed = self.core.watermark();
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
            self.core.handle_input(Input::Reconnected, self.clock.now());
        }
        self.runs += 1;
        let mut commands_open = true;
        loop {
            self.perform(&mut stop).await?;
            match self.core.phase() {
                Phase::Stopped => return Ok(()),
                Phase::BackingOff => self.reconnects.backing_off(Instant::now()),
                _ => {}
            }
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
            let event = tokio::select! {
                biased;
                () = stop.stopped() => Event::Stop,
                cmd = commands.recv(), if commands_open => Event::Command(cmd),
                () = reconnects.next(), if watching => Event::Reconnected,
                () = sleep_until(deadline), if deadline.is_some() => Event::Timeout,
                received = recv_wake(wake), if listening => Event::Wake(received),
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
                Event::Reconnected => {
                    if self.reconnects.arrived(Instant::now()) {
                        debug!(worker = %self.core.config().name(), source = %self.source_name, "client reconnected; retrying now");
                        self.core.handle_input(Input::Reconnected, now);
                    }
                }
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
                    self.wake_paused_until = Some(crate::instant_after(Instant::now(), delay));
                    self.core.handle_input(Input::Wake, now);
                }
                Event::Wake(Err(e)) => {
                    warn!(worker = %self.core.config().name(), error = %e, "wake listener failed; stopping");
                    self.core.handle_input(Input::Stop, now);
                    self.perform(&mut stop).await?;
                    return Err(e);
                }
                Event::Feed((token, item)) => self.on_feed(token, item).await?,
            }
        }
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

    /// Takes the items the feed has ready (up to a turn's worth), tells a lazily resumed
    /// core what the sink holds for their keys, and hands them to the core.
    ///
    /// A turn ends with the sink's commit, always: a turn is the batch. During the initial
    /// sync a turn takes up to [`SYNC_FEED_BATCH`] ready items rather than [`FEED_BATCH`],
    /// so a durable sink commits a big batch at a time (one SQLite transaction per 256
    /// entries made a 1M-key cold start take 77 s) without ever keeping applied changes
    /// uncommitted across a turn: the sink is asked what it holds only between commits,
    /// and a rewind goes back to a commit that every earlier turn made.
    async fn on_feed(&mut self, token: Token, first: Option<Result<FeedItem>>) -> Result<()> {
        let turn = if self.core.is_ready() {
            FEED_BATCH
        } else {
            SYNC_FEED_BATCH
        };
        let more = matches!(first, Some(Ok(_)));
        let mut items = vec![first];
        if more
            && let Some((t, s)) = &mut self.stream
            && *t == token
        {
            s.next_ready(turn - 1, &mut items);
        }
        if self.core.needs_keys() {
            let keys: Vec<String> = items
                .iter()
                .filter_map(|i| match i {
                    Some(Ok(FeedItem::Entry(e))) => Some(e.key.to_string()),
                    _ => None,
                })
                .collect();
            if let Err(e) = self.learn(keys).await {
                // The items are dropped with the feed; it redelivers them after the rewind.
                return self.sink_failed(e).await;
            }
        }
        for item in &items {
            match item {
                // A replayed feed's pending count says how much of the source follows.
                Some(Ok(FeedItem::Entry(e))) if F::FOLLOW == Follow::Replay => {
                    self.learn_head(e.seq.saturating_add(e.pending.unwrap_or(0)));
                }
                Some(Ok(FeedItem::Entry(e))) => self.learn_head(e.seq),
                Some(
                    Ok(FeedItem::Undecodable { seq: Some(seq), .. }) | Ok(FeedItem::Head(seq)),
                ) => {
                    self.learn_head(*seq);
                }
                _ => {}
            }
        }
        // The keys the sink holds: every turn ends with its commit.
        let held = self.core.len();
        let now = self.clock.now();
        for item in items {
            let room = self.core.presized();
            self.core.handle_input(feed_input(token, item), now);
            // During an initial sync the sink makes room for what the feed says is coming
            // as the core does for its index, before the entry's change reaches it.
            if self.core.presized() > room {
                self.sink.reserve(self.core.presized().saturating_sub(held));
            }
            // Each entry's apply goes to the sink while it is fresh, not queued behind a
            // whole turn's worth (16k outputs written and read back through memory).
            if !self.apply_now().await? {
                // The sink failed and the core went back to its last commit: the rest of
                // the turn's items are dropped with the feed, which redelivers them.
                return Ok(());
            }
        }
        Ok(())
    }

    /// Carries out the applies (and checkpoints) at the front of the core's decisions, in
    /// order, leaving anything else (a request, a notice) and all after it for
    /// [`perform`](Self::perform). `false` when the sink failed (and the core was taken
    /// back to the last commit).
    async fn apply_now(&mut self) -> Result<bool> {
        while matches!(
            self.core.peek_output(),
            Some(Output::Apply(_) | Output::Request(Request::Checkpoint { .. }))
        ) {
            let applied = match self.core.poll_output() {
                Some(Output::Apply(apply)) => self.apply(apply).await?,
                Some(Output::Request(Request::Checkpoint { position })) => {
                    self.batch.checkpoint = Some(position);
                    true
                }
                _ => true,
            };
            if !applied {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Hands one change to the sink. `false` when it failed (the sink was rolled back and
    /// the core taken back to the last commit); an error that is not retryable ends the run.
    async fn apply(&mut self, apply: Apply<D::Value>) -> Result<bool> {
        self.batch.dirty = true;
        let applied = match apply {
            Apply::Put { key, seq, value } => self.sink.put(key, seq, value).await,
            Apply::Remove { key, seq } => self.sink.remove(key, seq).await,
        };
        match applied {
            Ok(()) => Ok(true),
            Err(e) => {
                self.sink_failed(e).await?;
                Ok(false)
            }
        }
    }

    /// Tells a lazily resumed core every key the sink holds (before a snapshot or a
    /// listing decides which keys the source no longer has).
    async fn complete_index(&mut self) -> Result<()> {
        if self.core.needs_keys() {
            let seqs = self.sink.all_seqs().await?;
            self.core.remember(seqs);
            self.core.index_complete();
        }
        Ok(())
    }

    /// Tells a lazily resumed core the seqs the sink holds for `keys` it does not know.
    async fn learn(&mut self, mut keys: Vec<String>) -> Result<()> {
        keys.retain(|k| !self.core.knows(k));
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(());
        }
        let seqs = self.sink.seqs_of(keys).await?;
        self.core.remember(seqs);
        Ok(())
    }

    /// The sink failed: discard what it had not committed, and take the core back to the
    /// last commit. A retryable failure is retried after the core's backoff; any other
    /// ends the run with it.
    async fn sink_failed(&mut self, e: Error) -> Result<()> {
        self.sink.rollback().await;
        self.batch = Batch::default();
        self.stream = None;
        warn!(worker = %self.core.config().name(), source = %self.source_name, error = %e, watermark = self.committed, "sink failed; going back to its last commit");
        self.core.handle_input(
            Input::SinkFailed {
                error: e.to_string(),
            },
            self.clock.now(),
        );
        if e.is_retryable() { Ok(()) } else { Err(e) }
    }

    /// Carries out every decision the core has, then commits the batch.
    async fn perform(&mut self, stop: &mut StopSignal) -> Result<()> {
        loop {
            self.perform_outputs(stop).await?;
            match self.end_batch().await {
                Ok(()) => return Ok(()),
                // The rewind's own decisions (close the feed, back off) come next.
                Err(e) => self.sink_failed(e).await?,
            }
        }
    }

    /// Commits what was applied with the watermark, then lets the world see it: the
    /// status, readiness, a reconcile's answer, the durable cursor, in that order.
    async fn end_batch(&mut self) -> Result<()> {
        let watermark = self.core.watermark();
        let committing = self.batch.dirty || watermark != self.committed;
        if committing {
            self.sink.commit(watermark).await?;
            self.committed = watermark;
            self.batch.dirty = false;
        }
        // The mark moves even when nothing was written: readiness reached on an empty
        // source, or a checkpoint, is committed state too.
        self.core.commit();
        self.publish_status();
        if std::mem::take(&mut self.batch.ready) {
            info!(worker = %self.core.config().name(), source = %self.source_name, watermark, "ready");
            self.sink.ready(watermark);
            // A caller who asked for a reconcile during the initial sync is answered by it.
            self.answer(Reconciled {
                watermark,
                ..Reconciled::default()
            });
        }
        if let Some(caught_up) = self.batch.caught_up.take() {
            self.answer(caught_up.into());
        }
        // A save that failed before is tried again with the next commit or checkpoint (not
        // before every request, which would wait out a cursor store that is down each
        // time); saves are monotone, so the higher position is the one to save.
        let mut checkpoint = self.batch.checkpoint.take();
        if checkpoint.is_some() || committing {
            checkpoint = checkpoint.max(self.unsaved_checkpoint.take());
        }
        if let Some(position) = checkpoint
            && let Some(name) = &self.cursor_name
            && let Err(e) = self.cursors.save(name, position).await
        {
            // Fail-soft: the position is kept and saved with the next commit.
            warn!(worker = %self.core.config().name(), source = %self.source_name, position, error = %e, "checkpoint failed; saving it with the next commit");
            self.unsaved_checkpoint = Some(position);
        }
        Ok(())
    }

    /// Carries out every decision the core has, in order, feeding results back.
    ///
    /// Before a request to a port (a lookup, an open, a reconcile, a snapshot, a fetch),
    /// which can wait long while a server is away, the batch so far is committed; a stop
    /// asked meanwhile abandons the request, so `stop_within` keeps its budget. Sink
    /// calls and cursor saves are never abandoned halfway.
    async fn perform_outputs(&mut self, stop: &mut StopSignal) -> Result<()> {
        while let Some(output) = self.core.poll_output() {
            let request = match output {
                Output::Request(r) if r.token().is_some() => r,
                Output::Request(Request::CloseFeed { token }) => {
                    if self.stream.as_ref().is_some_and(|(t, _)| *t == token) {
                        self.stream = None;
                    }
                    continue;
                }
                Output::Request(Request::Checkpoint { position }) => {
                    self.batch.checkpoint = Some(position);
                    continue;
                }
                Output::Apply(apply) => {
                    self.apply(apply).await?;
                    continue;
                }
                Output::Notice(Notice::Ready { .. }) => {
                    self.batch.ready = true;
                    continue;
                }
                Output::Notice(Notice::CaughtUp(c)) => {
                    debug!(worker = %self.core.config().name(), source = %self.source_name, applied = c.applied, removed = c.removed, watermark = c.watermark, resynced = c.resynced, "caught up");
                    self.batch.caught_up = Some(c);
                    continue;
                }
                Output::Diagnostic(d) => {
                    self.diagnose(d);
                    continue;
                }
                _ => continue,
            };
            if let Err(e) = self.end_batch().await {
                // The request is dropped with the rest of the batch.
                self.sink_failed(e).await?;
                continue;
            }
            // A request's answer, fed back below; `None` when a stop abandoned it.
            let answer = match request {
                Request::LookupSource { token } => or_stop(stop, self.source.watermark())
                    .await
                    .map(|found| match found {
                        Ok(head) => {
                            // Until a feed says how far it will deliver: a view over a
                            // prefix never reaches the whole source's last seq.
                            if self.source.key_prefix().is_none() {
                                self.head = head;
                            }
                            Input::SourceFound { token }
                        }
                        Err(e) => failed(token, &e),
                    }),
                Request::OpenFeed {
                    token,
                    from,
                    after_position,
                } => match or_stop(stop, self.open(from, after_position)).await {
                    None => None,
                    Some(Ok(opened)) => {
                        debug!(worker = %self.core.config().name(), source = %self.source_name, from, head = opened.info.head, "feed opened");
                        // The head the core becomes ready at: exactly what it can reach (a
                        // sparse or filtered feed's last seq may be a message that is gone,
                        // or another prefix's).
                        if opened.info.follow == Follow::Replay {
                            self.head = opened.info.head;
                        }
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
                Request::Reconcile { token, since } => {
                    match or_stop(stop, self.source.changes_since(since)).await {
                        None => None,
                        Some(Ok(Changes::Since { entries, watermark })) => {
                            self.learn_head(watermark);
                            let keys = entries.iter().map(|e| e.key.to_string()).collect();
                            if let Err(e) = self.learn(keys).await {
                                self.sink_failed(e).await?;
                                continue;
                            }
                            Some(Input::Changes {
                                token,
                                changes: entries,
                                source_watermark: watermark,
                            })
                        }
                        Some(Ok(Changes::Compacted { first_available })) => {
                            Some(Input::ChangesUnavailable {
                                token,
                                first_available,
                            })
                        }
                        Some(Err(e)) => Some(failed(token, &e)),
                    }
                }
                Request::Snapshot { token } => {
                    // The resync judges every cached key: a lazily resumed core must know
                    // them all before the first part.
                    if let Err(e) = self.complete_index().await {
                        self.sink_failed(e).await?;
                        continue;
                    }
                    self.read_snapshot(token, stop).await
                }
                Request::ListKeys { token } => {
                    match or_stop(stop, self.source.present_keys()).await {
                        None => None,
                        Some(Ok(Some(present))) => {
                            // The listing judges every cached key: a lazily resumed core must
                            // know them all first.
                            if let Err(e) = self.complete_index().await {
                                self.sink_failed(e).await?;
                                continue;
                            }
                            Some(Input::Keys {
                                token,
                                keys: present.keys,
                                source_watermark: present.watermark,
                            })
                        }
                        Some(Ok(None)) => Some(Input::RequestFailed {
                            token,
                            error: "this source cannot list its keys".into(),
                        }),
                        Some(Err(e)) => Some(failed(token, &e)),
                    }
                }
                Request::Fetch { token, key, .. } => {
                    match or_stop(stop, self.source.get_at(&key)).await {
                        None => None,
                        Some(Ok(read)) => {
                            if let Err(e) = self.learn(vec![key]).await {
                                self.sink_failed(e).await?;
                                continue;
                            }
                            Some(Input::Fetched {
                                token,
                                value: read.value.map(|v| (v.seq, v.value)),
                                source_watermark: Some(read.watermark),
                            })
                        }
                        Some(Err(e)) => Some(failed(token, &e)),
                    }
                }
                _ => continue,
            };
            self.core
                .handle_input(answer.unwrap_or(Input::Stop), self.clock.now());
        }
        Ok(())
    }

    /// Reads the snapshot asked for under `token` part by part
    /// ([`Source::snapshot_parts`]), handing the core each part as it comes
    /// ([`Input::SnapshotPart`]) and the last as [`Input::Snapshot`], which is the answer
    /// returned (`None`: a stop came first). One part is held back so that the last can
    /// be told apart; a snapshot of one part is handed over whole. A part decides nothing,
    /// so nothing waits to be carried out between parts.
    async fn read_snapshot(&mut self, token: Token, stop: &mut StopSignal) -> Option<Input> {
        let read = match or_stop(stop, self.source.snapshot_parts(self.snapshot_part_len)).await {
            None => return None,
            Some(Err(e)) => return Some(failed(token, &e)),
            Some(Ok(read)) => read,
        };
        // A snapshot reads the source whole: its head now, even a lower one.
        self.head = read.watermark;
        let source_watermark = read.watermark;
        let mut parts = read.parts;
        let mut held: Vec<tidemark_core::Entry> = Vec::new();
        loop {
            let next = match or_stop(stop, parts.next()).await {
                None => return None,
                Some(None) => break,
                // The core drops what it kept and reads again after a backoff.
                Some(Some(Err(e))) => return Some(failed(token, &e)),
                Some(Some(Ok(next))) => next,
            };
            let entries = std::mem::replace(&mut held, next);
            if entries.is_empty() {
                continue;
            }
            self.core.handle_input(
                Input::SnapshotPart {
                    token,
                    entries,
                    source_watermark,
                },
                self.clock.now(),
            );
        }
        Some(Input::Snapshot {
            token,
            entries: held,
            source_watermark,
        })
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

    /// Answers the callers of `reconcile()`, after the batch it covers was committed and
    /// the status published.
    fn answer(&mut self, r: Reconciled) {
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
            Diagnostic::FollowChanged { from, to } => {
                warn!(
                    worker,
                    source,
                    ?from,
                    ?to,
                    "the feed says how it must be followed; following it"
                );
            }
            Diagnostic::Rewound { watermark, error } => {
                warn!(
                    worker,
                    source, watermark, error, "went back to the sink's last commit"
                );
            }
            other => debug!(worker, source, ?other, "diagnostic"),
        }
    }

    /// The source has reached at least `head`.
    fn learn_head(&mut self, head: u64) {
        self.head = self.head.max(head);
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
        let status = self.status.borrow();
        self.progress.observe(&status, self.head, Instant::now());
        if let Some(m) = &self.metrics {
            m.record(&status, self.head);
        }
    }

    /// What the follower's health is judged from, shared with its handle.
    pub(crate) fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
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
        let status = self.status.subscribe();
        let commands = self.commands_tx.clone();
        let name = self.core.config().name().to_owned();
        let span = tracing::info_span!("follower", name = %name);
        let progress = self.progress();
        let mut task = self;
        let running = Running::spawn("follower", name, span, |stop| async move {
            task.run(stop).await
        });
        FollowerHandle {
            progress,
            status,
            commands,
            running,
        }
    }
}

enum Event {
    Stop,
    Command(Option<Command>),
    Reconnected,
    Timeout,
    Wake(Result<Received>),
    Feed((Token, Option<Result<FeedItem>>)),
}

/// How many waiting feed items one turn of the task takes at most, once ready: short
/// turns keep the status, commits and readiness of a live follower prompt.
const FEED_BATCH: usize = 256;

/// How many waiting feed items one turn takes at most during the initial sync, when
/// nobody waits on a turn but the whole sync: one commit per 16k changes.
pub(crate) const SYNC_FEED_BATCH: usize = 16_384;

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
    progress: Arc<Progress>,
    status: watch::Receiver<Status>,
    commands: mpsc::Sender<Command>,
    running: Running<Status>,
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
        self.running.name()
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

    /// The source's head as the follower last learned it (opening its feed, the entries
    /// and pending counts it receives, reconciles, snapshots).
    #[must_use]
    pub fn head(&self) -> u64 {
        self.progress.head().max(self.watermark())
    }

    /// How far behind the source's head it is: [`head`](Self::head) − watermark.
    #[must_use]
    pub fn lag(&self) -> u64 {
        self.head().saturating_sub(self.watermark())
    }

    /// Its health for a readiness probe: ready, running, and not stalled (behind —
    /// backing off, syncing, or short of a head it knows — with its watermark unmoved for
    /// `stall_after` or more; [`DEFAULT_STALL_AFTER`](crate::DEFAULT_STALL_AFTER) is a
    /// fair default). Judged on tokio's clock.
    #[must_use]
    pub fn health(&self, stall_after: Duration) -> FollowerHealth {
        let status = self.status.borrow().clone();
        let mut health = self.progress.health(&status, stall_after, Instant::now());
        if self.running.is_finished() && health.down.is_none() {
            health.down = Some("its task ended".to_owned());
        }
        health
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
        self.running.stop();
    }

    /// A trigger that stops it, for sharing.
    #[must_use]
    pub fn shutdown(&self) -> Shutdown {
        self.running.shutdown()
    }

    /// Whether the task has ended.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.running.is_finished()
    }

    /// Waits for the task to end; its final status, or why it failed.
    pub async fn join(self) -> Result<Status> {
        self.running.join().await
    }

    /// Stops it and waits at most `budget` for it to drain; aborts it after that.
    pub async fn stop_within(self, budget: std::time::Duration) -> Result<Status> {
        self.running.stop_within(budget).await
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
/// wake (and never otherwise: it does not poll), into a new [`Cache`]
/// ([`Follow::WakeOnly`](tidemark_core::Follow::WakeOnly): it has no feed). It ends
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
    let handle = FollowerTask::new(config, decoder, source, NoFeed, writer)
        .with_wake(listener)
        .spawn();
    (reader, handle)
}
