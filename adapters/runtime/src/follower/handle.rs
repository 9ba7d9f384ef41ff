//! The handle of a spawned follower task, and the ready-made caches built on one.

use super::*;

/// A running follower task: its status, a reconcile on demand, and stop.
#[derive(Debug)]
pub struct FollowerHandle {
    pub(super) progress: Arc<Progress>,
    pub(super) status: watch::Receiver<Status>,
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) running: Running<Status>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reconcile")
    }
}

/// Written beside the handle, so the telemetry it reads knows nothing of the follower
/// task.
impl Health {
    /// Gathers the health of standalone followers, judged with `stall_after`.
    pub fn of<'a>(
        handles: impl IntoIterator<Item = &'a FollowerHandle>,
        stall_after: Duration,
    ) -> Self {
        Health {
            followers: handles.into_iter().map(|h| h.health(stall_after)).collect(),
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
