//! The supervisor: runs workers with restart policies, lists them, reports a terminal
//! failure, and drains them on shutdown.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_core::{Backoff, Counters, Decode, Phase, RestartPolicy, Rng, Status};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{Instrument, error, info, warn};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::follower::FollowerTask;
use crate::noop::NoFeed;
use crate::ports::{Cursors, Feed, Source, WakeListener};
use crate::shutdown::Shutdown;
use crate::telemetry::{FollowerHealth, Health, Progress};
use crate::worker::{Worker, WorkerSink};

/// Where a supervised worker is.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerPhase {
    /// Running; the follower's own phase.
    Running(Phase),
    /// Exited and waiting to be restarted.
    Restarting,
    /// Stopped by shutdown.
    Stopped,
    /// Exited for good (its restart policy did not allow another start).
    Failed(String),
}

/// What an operator sees of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// The bucket or stream it follows.
    pub source: String,
    /// Where it is.
    pub phase: WorkerPhase,
    /// Its applied watermark (kept across restarts).
    pub watermark: u64,
    /// What its follower has done (across restarts).
    pub counters: Counters,
    /// How many times it was restarted in all.
    pub restarts: u32,
}

/// A worker that exited for good: its name and why. The usual answer is to let the
/// process exit and the orchestrator restart it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerFailure {
    /// The worker's name.
    pub worker: String,
    /// Why its last run ended.
    pub reason: String,
}

#[derive(Debug)]
struct Entry {
    info: Arc<Mutex<WorkerInfo>>,
    /// The running follower's status, read when the worker is listed: it changes with
    /// every batch, far too often to copy on each change.
    live: watch::Receiver<Status>,
    progress: Arc<Progress>,
    task: JoinHandle<()>,
}

impl Entry {
    fn info(&self) -> WorkerInfo {
        let mut info = lock(&self.info).clone();
        let s = self.live.borrow();
        if let WorkerPhase::Running(_) = info.phase {
            info.phase = WorkerPhase::Running(s.phase);
        }
        info.watermark = s.watermark;
        info.counters = s.counters;
        info
    }

    fn health(&self, stall_after: Duration, now: tokio::time::Instant) -> FollowerHealth {
        let status = self.live.borrow().clone();
        let mut health = self.progress.health(&status, stall_after, now);
        health.down = match &lock(&self.info).phase {
            WorkerPhase::Running(_) => health.down,
            WorkerPhase::Restarting => Some("waiting to restart".to_owned()),
            WorkerPhase::Stopped => Some("stopped".to_owned()),
            WorkerPhase::Failed(reason) => Some(format!("failed: {reason}")),
        };
        health
    }
}

/// Runs a set of workers; lists them; reports a terminal failure; shuts them down within
/// a drain budget. Every method takes `&self`, so one supervisor can be shared (in an
/// `Arc`) between the code that spawns workers, a health endpoint and a signal handler.
///
/// A restart keeps what the worker applied (its follower's keys and watermark): a key
/// deleted while it was down reaches `on_delete`, even if the source compacted meanwhile.
/// Changes of the batch that failed are delivered again.
#[derive(Debug)]
pub struct Supervisor {
    workers: Mutex<BTreeMap<String, Entry>>,
    shutdown: Shutdown,
    failures: watch::Sender<Option<WorkerFailure>>,
    seed: u64,
}

impl Default for Supervisor {
    fn default() -> Self {
        Supervisor::new(0)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind: keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Supervisor {
    /// An empty supervisor; `seed` seeds restart jitter.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Supervisor {
            workers: Mutex::new(BTreeMap::new()),
            shutdown: Shutdown::new(),
            failures: watch::channel(None).0,
            seed,
        }
    }

    /// Starts `worker` following `source` through `feed` (the feed says how it is
    /// followed), restarted per `policy`. A duplicate name, or an invalid configuration,
    /// is refused.
    pub fn spawn<W, S, F>(&self, worker: W, source: S, feed: F, policy: RestartPolicy) -> Result<()>
    where
        W: Worker,
        S: Source + 'static,
        F: Feed + 'static,
        <W::Decoder as Decode>::Value: Send,
    {
        let config = worker.config()?;
        let decoder = worker.decoder();
        let task = FollowerTask::new(config, decoder, source, feed, WorkerSink(worker));
        self.supervise(task, policy)
    }

    /// Starts a wake-only `worker`: it catches up from `source` on start and on every wake
    /// from `listener`, restarted per `policy`.
    pub fn spawn_wake<W, S, L>(
        &self,
        worker: W,
        source: S,
        listener: L,
        policy: RestartPolicy,
    ) -> Result<()>
    where
        W: Worker,
        S: Source + 'static,
        L: WakeListener + 'static,
        <W::Decoder as Decode>::Value: Send,
    {
        let config = worker.config()?;
        let decoder = worker.decoder();
        let task = FollowerTask::new(config, decoder, source, NoFeed, WorkerSink(worker))
            .with_wake(listener);
        self.supervise(task, policy)
    }

    /// Supervises a follower task built by hand around a worker (a durable consumer with
    /// [`FollowerTask::with_cursor`], a feed follower that also listens for wakes, …).
    pub fn supervise<W, S, F, C, L>(
        &self,
        task: FollowerTask<S, F, C, L, W::Decoder, WorkerSink<W>>,
        policy: RestartPolicy,
    ) -> Result<()>
    where
        W: Worker,
        S: Source + 'static,
        F: Feed + 'static,
        C: Cursors + 'static,
        L: WakeListener + 'static,
        <W::Decoder as Decode>::Value: Send,
    {
        let worker = &task.sink().0;
        let name = worker.name().to_owned();
        let mut workers = lock(&self.workers);
        if workers.contains_key(&name) {
            return Err(Error::Worker {
                worker: name,
                reason: "a worker of this name is already running".into(),
            });
        }
        let info = Arc::new(Mutex::new(WorkerInfo {
            name: name.clone(),
            description: worker.description().to_owned(),
            source: worker.source().to_owned(),
            phase: WorkerPhase::Running(Phase::Starting),
            watermark: 0,
            counters: Counters::default(),
            restarts: 0,
        }));
        let source = worker.source().to_owned();
        let task = task.source_name(source);
        let live = task.status();
        let progress = task.progress();
        let seed = self.seed ^ (workers.len() as u64).wrapping_mul(0x9E37_79B9);
        let run = run_supervised(
            task,
            policy,
            seed,
            Arc::clone(&info),
            self.shutdown.clone(),
            self.failures.clone(),
        );
        let span = tracing::info_span!("worker", name = %name);
        let handle = tokio::spawn(run.instrument(span));
        workers.insert(
            name,
            Entry {
                info,
                live,
                progress,
                task: handle,
            },
        );
        Ok(())
    }

    /// Every worker, in name order.
    #[must_use]
    pub fn list(&self) -> Vec<WorkerInfo> {
        lock(&self.workers).values().map(Entry::info).collect()
    }

    /// One worker.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<WorkerInfo> {
        lock(&self.workers).get(name).map(Entry::info)
    }

    /// Whether every worker is ready, running and not stalled (behind with its watermark
    /// unmoved for `stall_after` or more): the answer for a readiness probe, with each
    /// worker's health to say why not. Judged on tokio's clock.
    #[must_use]
    pub fn health(&self, stall_after: Duration) -> Health {
        let now = tokio::time::Instant::now();
        Health {
            followers: lock(&self.workers)
                .values()
                .map(|e| e.health(stall_after, now))
                .collect(),
        }
    }

    /// Waits until a worker exits for good (its restart policy allowed no other start)
    /// and says which and why. A process usually exits then, and its orchestrator
    /// restarts it. Resolves at once if one already has.
    pub async fn terminal_failure(&self) -> WorkerFailure {
        let mut rx = self.failures.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(failure) => failure.clone().unwrap_or_else(unreachable_failure),
            // The sender lives in `self`: it cannot close while we borrow it.
            Err(_) => std::future::pending().await,
        }
    }

    /// Stops every worker, letting each drain within `budget`; workers still running
    /// after it are aborted and named in the error.
    pub async fn shutdown(&self, budget: Duration) -> Result<Vec<WorkerInfo>> {
        self.shutdown.trigger();
        let deadline = crate::clock::instant_after(tokio::time::Instant::now(), budget);
        let workers = std::mem::take(&mut *lock(&self.workers));
        let mut late = Vec::new();
        let mut infos = Vec::new();
        for (name, mut entry) in workers {
            if tokio::time::timeout_at(deadline, &mut entry.task)
                .await
                .is_err()
            {
                entry.task.abort();
                late.push(name);
            }
            infos.push(entry.info());
        }
        if late.is_empty() {
            info!(workers = infos.len(), "supervisor shut down");
            Ok(infos)
        } else {
            Err(Error::Timeout {
                what: format!("workers {}", late.join(", ")),
                budget,
            })
        }
    }
}

fn unreachable_failure() -> WorkerFailure {
    WorkerFailure {
        worker: String::new(),
        reason: String::new(),
    }
}

/// Runs one worker's task until shutdown or a terminal exit, restarting it per `policy`.
/// The same task (and so the same core) runs each time.
async fn run_supervised<S, F, C, L, W>(
    mut task: FollowerTask<S, F, C, L, W::Decoder, WorkerSink<W>>,
    policy: RestartPolicy,
    seed: u64,
    info: Arc<Mutex<WorkerInfo>>,
    shutdown: Shutdown,
    failures: watch::Sender<Option<WorkerFailure>>,
) where
    W: Worker,
    S: Source,
    F: Feed,
    C: Cursors,
    L: WakeListener,
    <W::Decoder as Decode>::Value: Send,
{
    let name = lock(&info).name.clone();
    let clock = Clock::new();
    let mut rng = Rng::new(seed);
    let mut backoff = match &policy {
        RestartPolicy::OnExit { backoff, .. } => Some(Backoff::new(*backoff)),
        RestartPolicy::Never => None,
    };
    loop {
        lock(&info).phase = WorkerPhase::Running(Phase::Starting);
        if let Some(b) = &mut backoff {
            // Restarts count "in a row" until a run stays up for the reset period.
            b.healthy(clock.now());
        }
        let result = task.run(shutdown.signal()).await;
        if shutdown.is_triggered() {
            lock(&info).phase = WorkerPhase::Stopped;
            return;
        }
        let reason = match &result {
            Ok(_) => "exited".to_owned(),
            Err(e) => e.to_string(),
        };
        let (delay, in_a_row) = match &mut backoff {
            Some(b) => {
                let delay = b.next_delay(clock.now(), &mut rng);
                (delay, b.attempt().saturating_sub(1))
            }
            None => (Duration::ZERO, 0),
        };
        if !policy.allows_restart(in_a_row) {
            error!(worker = %name, reason, "worker exited; not restarting");
            lock(&info).phase = WorkerPhase::Failed(reason.clone());
            failures.send_replace(Some(WorkerFailure {
                worker: name,
                reason,
            }));
            return;
        }
        warn!(worker = %name, reason, ?delay, "worker exited; restarting");
        {
            let mut i = lock(&info);
            i.phase = WorkerPhase::Restarting;
            i.restarts += 1;
        }
        let mut stop = shutdown.signal();
        tokio::select! {
            biased;
            () = stop.stopped() => {
                lock(&info).phase = WorkerPhase::Stopped;
                return;
            }
            () = tokio::time::sleep(delay) => {}
        }
    }
}
