//! The supervisor: runs workers with restart policies and drains them on shutdown.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_core::{Backoff, Counters, Follower, Phase, RestartPolicy, Rng, Status};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::follower::FollowerTask;
use crate::ports::{Feed, Source};
use crate::shutdown::Shutdown;
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
    /// Its applied watermark.
    pub watermark: u64,
    /// What its follower has done (in its current run).
    pub counters: Counters,
    /// How many times it was restarted.
    pub restarts: u32,
}

#[derive(Debug)]
struct Entry {
    info: Arc<Mutex<WorkerInfo>>,
    /// The running follower's status, read when the worker is listed: it changes with
    /// every batch, far too often to copy on each change.
    live: Arc<Mutex<Option<watch::Receiver<Status>>>>,
    task: JoinHandle<()>,
}

impl Entry {
    fn info(&self) -> WorkerInfo {
        let mut info = lock(&self.info).clone();
        if let WorkerPhase::Running(_) = info.phase
            && let Some(status) = lock(&self.live).as_ref()
        {
            let s = status.borrow();
            info.phase = WorkerPhase::Running(s.phase);
            info.watermark = s.watermark;
            info.counters = s.counters;
        }
        info
    }
}

/// Runs a set of workers; lists them; shuts them down within a drain budget.
#[derive(Debug, Default)]
pub struct Supervisor {
    workers: BTreeMap<String, Entry>,
    shutdown: Shutdown,
    seed: u64,
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
            seed,
            ..Supervisor::default()
        }
    }

    /// Starts `worker` following `source` through `feed`, restarted per `policy`.
    /// A duplicate name, or an invalid configuration, is refused.
    pub fn spawn<W, S, F>(
        &mut self,
        worker: W,
        source: S,
        feed: F,
        policy: RestartPolicy,
    ) -> Result<()>
    where
        W: Worker,
        S: Source + Clone + 'static,
        F: Feed + Clone + 'static,
    {
        let name = worker.name().to_owned();
        if self.workers.contains_key(&name) {
            return Err(Error::Worker {
                worker: name,
                reason: "a worker of this name is already running".into(),
            });
        }
        let config = worker.config()?;
        let info = Arc::new(Mutex::new(WorkerInfo {
            name: name.clone(),
            description: worker.description().to_owned(),
            source: worker.source().to_owned(),
            phase: WorkerPhase::Running(Phase::Starting),
            watermark: 0,
            counters: Counters::default(),
            restarts: 0,
        }));
        let shutdown = self.shutdown.clone();
        let seed = self.seed ^ (self.workers.len() as u64).wrapping_mul(0x9E37_79B9);
        let task_info = Arc::clone(&info);
        let live: Arc<Mutex<Option<watch::Receiver<Status>>>> = Arc::default();
        let task_live = Arc::clone(&live);
        let worker_name = name.clone();
        let task = tokio::spawn(async move {
            let name = worker_name;
            let clock = Clock::new();
            let mut rng = Rng::new(seed);
            let mut backoff = match &policy {
                RestartPolicy::OnExit { backoff, .. } => Some(Backoff::new(*backoff)),
                RestartPolicy::Never => None,
            };
            let mut sink = WorkerSink(worker);
            let mut restarts = 0u32;
            loop {
                let source_name = sink.0.source().to_owned();
                let core = Follower::new(config.clone(), sink.0.decoder());
                let task = FollowerTask::from_core(
                    core,
                    source.clone(),
                    feed.clone(),
                    Borrowed(&mut sink),
                )
                .source_name(source_name);
                let status = task.status();
                *lock(&task_live) = Some(status.clone());
                let mirror = mirror_status(status, Arc::clone(&task_info));
                let result = task.run(shutdown.signal()).await;
                mirror.abort();
                if let Some(status) = lock(&task_live).take() {
                    // Keep the last figures of the run that ended.
                    let s = status.borrow();
                    let mut i = lock(&task_info);
                    i.watermark = s.watermark;
                    i.counters = s.counters;
                }
                if shutdown.is_triggered() {
                    let mut i = lock(&task_info);
                    i.phase = WorkerPhase::Stopped;
                    return;
                }
                let reason = match &result {
                    Ok(_) => "exited".to_owned(),
                    Err(e) => e.to_string(),
                };
                if !policy.allows_restart(restarts) {
                    error!(worker = %name, reason, "worker exited; not restarting");
                    lock(&task_info).phase = WorkerPhase::Failed(reason);
                    return;
                }
                let delay = backoff
                    .as_mut()
                    .map_or(Duration::ZERO, |b| b.next_delay(clock.now(), &mut rng));
                warn!(worker = %name, reason, ?delay, "worker exited; restarting");
                restarts += 1;
                {
                    let mut i = lock(&task_info);
                    i.phase = WorkerPhase::Restarting;
                    i.restarts = restarts;
                }
                let mut stop = shutdown.signal();
                tokio::select! {
                    biased;
                    () = stop.stopped() => {
                        lock(&task_info).phase = WorkerPhase::Stopped;
                        return;
                    }
                    () = tokio::time::sleep(delay) => {}
                }
            }
        });
        self.workers.insert(name, Entry { info, live, task });
        Ok(())
    }

    /// Every worker, in name order.
    #[must_use]
    pub fn list(&self) -> Vec<WorkerInfo> {
        self.workers.values().map(Entry::info).collect()
    }

    /// One worker.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<WorkerInfo> {
        self.workers.get(name).map(Entry::info)
    }

    /// Stops every worker, letting each drain within `budget`; workers still running
    /// after it are aborted and named in the error.
    pub async fn shutdown(self, budget: Duration) -> Result<Vec<WorkerInfo>> {
        self.shutdown.trigger();
        let deadline = tokio::time::Instant::now() + budget;
        let mut late = Vec::new();
        let mut infos = Vec::new();
        for (name, mut entry) in self.workers {
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

fn mirror_status(
    mut status: watch::Receiver<Status>,
    info: Arc<Mutex<WorkerInfo>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            {
                let s = status.borrow_and_update();
                let mut i = lock(&info);
                i.phase = WorkerPhase::Running(s.phase);
                i.watermark = s.watermark;
                i.counters = s.counters;
            }
            if status.changed().await.is_err() {
                return;
            }
        }
    })
}

/// Lends a sink to one run of a follower, so a restart keeps the same worker.
struct Borrowed<'a, K>(&'a mut K);

impl<V: Send, K: crate::sink::Sink<V>> crate::sink::Sink<V> for Borrowed<'_, K> {
    async fn put(&mut self, key: String, seq: u64, value: V) -> Result<()> {
        self.0.put(key, seq, value).await
    }
    async fn remove(&mut self, key: String, seq: u64) -> Result<()> {
        self.0.remove(key, seq).await
    }
    fn ready(&mut self, watermark: u64) {
        self.0.ready(watermark);
    }
    fn watermark(&mut self, watermark: u64) {
        self.0.watermark(watermark);
    }
    async fn drain(&mut self) {
        self.0.drain().await;
    }
}
