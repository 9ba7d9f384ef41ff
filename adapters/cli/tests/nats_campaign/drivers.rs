//! The drivers beside the followers, all through the fault proxy: a worker run by the
//! runtime's `Supervisor`, following the bucket (what its handlers applied is kept in a
//! map, judged as a follower is); a `JobRunner` over a NATS job queue; two outbox
//! `Relay`s under owners of their own, draining one SQLite registry's outbox into a NATS
//! events stream of their own (`CAMP_RELAYED`, apart from the one the followers read) and
//! enqueueing each row's housekeeping job on the queue. Feeding them, straight and not
//! through the proxy: an enqueuer that enqueues jobs on the server (some fail every
//! attempt, some are slow enough for their leases to be renewed) and a writer of the
//! registry's file. What the runner's handlers ran and what the relays claimed, published
//! and completed is logged here for the checker (`judge_jobs`, `judge_relays`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, stream::RawMessageErrorKind};
use serde_json::Value;
use tidemark::tidemark_core::{Event, Job, JobId, Legs, Rng};
use tidemark::{
    Announcer, BackoffPolicy, Claimed, FollowerConfig, JobContext, JobHandlers, JobRunner,
    JobRunnerHandle, JobState, Outbox, OutboxUpdate, Publish, Queue, RawBytes, Relay, RelayHandle,
    RestartPolicy, Source as _, Supervisor, ValueOf, Worker,
};
use tidemark_nats::{KvBucket, NatsEvents, NatsQueue, NatsWake};
use tidemark_sqlite::{SqliteDb, SqliteOutbox, SqliteOutboxWatch, SqliteSource};
use tokio::sync::{Mutex as AsyncMutex, watch};
use tokio::time::{Instant, sleep, timeout};

use crate::checker::{ClaimRec, JobEnd, JobRun, PublishRec, RelayLog, ReleaseRec, Shown};
use crate::followers::lock;
use crate::ledger::token;

/// The supervised worker's name, and its watcher's.
pub const WORKER: &str = "worker";
/// The job queue (its stream; its state bucket is `CAMP_JOBS_state`).
pub const JOBS: &str = "CAMP_JOBS";
/// The stream the relays publish the outbox's events on, and its subjects' prefix.
pub const RELAYED_STREAM: &str = "CAMP_RELAYED";
pub const RELAYED_PREFIX: &str = "camp.relayed";
/// A job leased this many times is dead-lettered.
/// How long the relays' check keeps reading the relayed stream through transient errors.
/// How long a start-up step of the drivers is tried again on a new cluster.
const START_WITHIN: Duration = Duration::from_secs(30);
const RELAYED_READ_WITHIN: Duration = Duration::from_secs(30);

const MAX_ATTEMPTS: u32 = 3;
/// The runner's leases (the queue consumer's ack wait), renewed every third of it.
const VISIBILITY: Duration = Duration::from_millis(1500);
/// The relays' claims: shorter than a stall of the proxy, so a publish held by one
/// outlives its claim and the other relay takes the row over.
const RELAY_LEASE: Duration = Duration::from_millis(1500);
const RELAY_BATCH: usize = 8;
/// How long a job's state may say leased while its message is gone from the stream
/// before the wait for the jobs' ends takes it as final: a runner that acked it records its
/// end within milliseconds, or never.
const UNRECORDED_FINAL: Duration = Duration::from_secs(5);
/// The campaign's own job kind: `{"kind":"camp_job","n":…,"fails":…,"ms":…}` fails its
/// first `fails` attempts after `ms` of work.
const CAMP_JOB: &str = "camp_job";
/// The registry's keys.
const REGISTRY_KEYS: u64 = 6;

/// What the supervised worker's handlers applied: key → (revision, value).
pub type Applied = Arc<Mutex<BTreeMap<String, (u64, Vec<u8>)>>>;

/// The worker: keeps what `on_put` and `on_delete` say in [`Applied`]; fails its next
/// call when a fault asks.
struct CampWorker {
    applied: Applied,
    fail_next: Arc<AtomicBool>,
    seed: u64,
}

impl CampWorker {
    fn fault(&self) -> Result<(), String> {
        match self.fail_next.swap(false, Ordering::Relaxed) {
            true => Err("the campaign's fault: a handler error".to_owned()),
            false => Ok(()),
        }
    }
}

impl Worker for CampWorker {
    type Decoder = RawBytes;
    type Error = String;

    fn name(&self) -> &str {
        WORKER
    }

    fn source(&self) -> &str {
        "camp"
    }

    fn decoder(&self) -> RawBytes {
        RawBytes
    }

    fn config(&self) -> tidemark::Result<FollowerConfig> {
        Ok(FollowerConfig::builder("campaign-worker")
            .seed(self.seed)
            .build()?)
    }

    async fn on_put(&mut self, key: &str, seq: u64, value: ValueOf<Self>) -> Result<(), String> {
        self.fault()?;
        lock(&self.applied).insert(key.to_owned(), (seq, value));
        Ok(())
    }

    async fn on_delete(&mut self, key: &str, _seq: u64) -> Result<(), String> {
        self.fault()?;
        lock(&self.applied).remove(key);
        Ok(())
    }
}

/// Microseconds since the Unix epoch: the clock the outbox's claims are leased on.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A relay's outbox: the registry file's, with every claim and complete logged.
#[derive(Clone)]
struct RecordingOutbox {
    inner: SqliteOutbox,
    log: Arc<Mutex<RelayLog>>,
}

impl Outbox for RecordingOutbox {
    type Watch = SqliteOutboxWatch;

    async fn claim(
        &self,
        owner: &str,
        after: u64,
        max: usize,
        lease: Duration,
    ) -> tidemark::Result<Claimed> {
        let asked_us = now_us();
        let claimed = self.inner.claim(owner, after, max, lease).await?;
        let got_us = now_us();
        let mut log = lock(&self.log);
        for row in &claimed.rows {
            log.id_seq.insert(row.id, row.seq);
        }
        if !claimed.rows.is_empty() {
            log.claims.push(ClaimRec {
                owner: owner.to_owned(),
                seqs: claimed.rows.iter().map(|r| r.seq).collect(),
                asked_us,
                got_us,
                lease_us: u64::try_from(lease.as_micros()).unwrap_or(u64::MAX),
            });
        }
        Ok(claimed)
    }

    async fn complete(&self, owner: &str, updates: Vec<OutboxUpdate>) -> tidemark::Result<u64> {
        {
            let mut log = lock(&self.log);
            let seqs = updates
                .iter()
                .filter_map(|u| log.id_seq.get(&u.id).copied())
                .collect();
            log.releases.push(ReleaseRec {
                owner: owner.to_owned(),
                seqs,
                asked_us: now_us(),
            });
        }
        self.inner.complete(owner, updates).await
    }

    async fn pending(&self) -> tidemark::Result<u64> {
        self.inner.pending().await
    }

    fn watch(&self) -> SqliteOutboxWatch {
        self.inner.watch()
    }
}

/// A relay's events stream, with every publish it begins logged (by the seq its event
/// names) and how it ended.
#[derive(Clone)]
struct RecordingPublish {
    inner: NatsEvents,
    owner: String,
    log: Arc<Mutex<RelayLog>>,
}

impl RecordingPublish {
    /// Logs the publishes of `payloads` as begun now; their indexes in the log.
    fn begin<'a>(&self, payloads: impl Iterator<Item = &'a Vec<u8>>) -> Vec<usize> {
        let at_us = now_us();
        let mut log = lock(&self.log);
        payloads
            .map(|payload| {
                let seq = Event::decode(payload).map_or(0, |e| e.seq());
                log.publishes.push(PublishRec {
                    owner: self.owner.clone(),
                    seq,
                    at_us,
                    ok: None,
                });
                log.publishes.len() - 1
            })
            .collect()
    }

    fn end(&self, at: &[usize], ok: impl Iterator<Item = bool>) {
        let mut log = lock(&self.log);
        for (i, ok) in at.iter().zip(ok) {
            log.publishes[*i].ok = Some(ok);
        }
    }
}

impl Publish for RecordingPublish {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> tidemark::Result<u64> {
        let at = self.begin(std::iter::once(&payload));
        let published = self.inner.publish(key, payload).await;
        self.end(&at, std::iter::once(published.is_ok()));
        published
    }

    async fn publish_batch(&self, items: Vec<(String, Vec<u8>)>) -> Vec<tidemark::Result<u64>> {
        let at = self.begin(items.iter().map(|(_, p)| p));
        let published = self.inner.publish_batch(items).await;
        self.end(&at, published.iter().map(Result::is_ok));
        published
    }
}

/// What the drivers did, for the report.
#[derive(Debug, Default, Clone, Copy)]
pub struct DriverCounts {
    /// The supervisor's restarts of the worker.
    pub worker_restarts: u64,
    /// Starts of the job runner and of the relays beyond the first.
    pub runner_restarts: u64,
    pub relay_restarts: u64,
    /// Jobs the enqueuer enqueued, and enqueues that failed (landed or not).
    pub enqueued: u64,
    pub enqueue_failed: u64,
    /// Writes of the registry (each an outbox row).
    pub registry_writes: u64,
    /// The runners' own counts: leased, acked, failed and retried, dead-lettered, leases
    /// lost while a handler ran.
    pub leased: u64,
    pub acked: u64,
    pub failed: u64,
    pub dead_lettered: u64,
    pub lost: u64,
    /// The relays' own counts: rows done, events published, jobs enqueued, claims lost.
    pub relayed: u64,
    pub relay_published: u64,
    pub relay_enqueued: u64,
    pub relay_lost: u64,
}

impl DriverCounts {
    pub fn add(&mut self, o: &DriverCounts) {
        self.worker_restarts += o.worker_restarts;
        self.runner_restarts += o.runner_restarts;
        self.relay_restarts += o.relay_restarts;
        self.enqueued += o.enqueued;
        self.enqueue_failed += o.enqueue_failed;
        self.registry_writes += o.registry_writes;
        self.leased += o.leased;
        self.acked += o.acked;
        self.failed += o.failed;
        self.dead_lettered += o.dead_lettered;
        self.lost += o.lost;
        self.relayed += o.relayed;
        self.relay_published += o.relay_published;
        self.relay_enqueued += o.relay_enqueued;
        self.relay_lost += o.relay_lost;
    }
}

/// The job runner, started again after a crash on the same queue handle: a crashed
/// runner's leases are forgotten by the handle once their ack wait passes, as a new
/// process never knew them.
struct Runner {
    queue: NatsQueue,
    handlers: JobHandlers,
    seed: u64,
    starts: u64,
    handle: Option<JobRunnerHandle>,
    counts: DriverCounts,
}

impl Runner {
    fn spawn(&mut self) {
        self.starts += 1;
        let runner = JobRunner::new(
            format!("campaign-runner-{}", self.starts),
            self.queue.clone(),
            self.handlers.clone(),
        )
        .visibility(VISIBILITY)
        .idle_poll(Duration::from_millis(100))
        .retry_backoff(quick_retries())
        .seed(self.seed.wrapping_add(self.starts));
        self.handle = Some(runner.spawn());
    }

    /// Takes the running one's counts and ends it: aborted as a crash, or stopped.
    async fn end(&mut self, crash: bool) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        let c = handle.counters();
        match crash {
            true => handle.abort(),
            false => {
                let _ = handle.stop_within(Duration::from_secs(5)).await;
            }
        }
        self.counts.leased += c.leased;
        self.counts.acked += c.acked;
        self.counts.failed += c.failed;
        self.counts.dead_lettered += c.dead_lettered;
        self.counts.lost += c.lost;
    }
}

/// Retries of a failed job: 100 ms doubling to 1 s, so a job's attempts fit a round.
fn quick_retries() -> BackoffPolicy {
    BackoffPolicy::new(
        Duration::from_millis(100),
        2.0,
        Duration::from_secs(1),
        Duration::from_secs(30),
        0.5,
    )
    .unwrap_or_else(|e| panic!("the campaign's retry policy: {e}"))
}

/// The two relays of the registry's outbox, each on a handle of its own on the file (as
/// two processes would be), a new owner name for each start.
struct Relays {
    dbs: [SqliteDb; 2],
    events: NatsEvents,
    wake: NatsWake,
    queue: NatsQueue,
    log: Arc<Mutex<RelayLog>>,
    seed: u64,
    starts: [u64; 2],
    handles: [Option<RelayHandle>; 2],
    counts: DriverCounts,
}

impl Relays {
    fn spawn(&mut self, i: usize) {
        self.starts[i] += 1;
        let owner = format!("relay-{i}.{}", self.starts[i]);
        let outbox = RecordingOutbox {
            inner: self.dbs[i].outbox(),
            log: Arc::clone(&self.log),
        };
        let publish = RecordingPublish {
            inner: self.events.clone(),
            owner: owner.clone(),
            log: Arc::clone(&self.log),
        };
        let announcer = Announcer::new(publish, self.wake.clone(), self.queue.clone(), "camp");
        let seed = self.seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9) ^ self.starts[i];
        let relay = Relay::new(outbox, announcer, owner)
            .with_lease(RELAY_LEASE)
            .with_batch(RELAY_BATCH)
            .with_seed(seed);
        self.handles[i] = Some(relay.spawn());
    }

    /// Ends relay `i`: at once (its task aborted, as a crash ends it), or stopped.
    async fn end(&mut self, i: usize, crash: bool) {
        let Some(handle) = self.handles[i].take() else {
            return;
        };
        let budget = match crash {
            true => Duration::ZERO,
            false => Duration::from_secs(5),
        };
        if let Ok(r) = handle.stop_within(budget).await {
            self.counts.relayed += r.done;
            self.counts.relay_published += r.published;
            self.counts.relay_enqueued += r.enqueued;
            self.counts.relay_lost += r.lost;
        }
    }
}

/// The round's drivers.
pub struct Drivers {
    supervisor: Supervisor,
    /// What the worker's handlers applied, for the sampler and convergence.
    pub applied: Applied,
    fail_next: Arc<AtomicBool>,
    runner: AsyncMutex<Runner>,
    relays: AsyncMutex<Relays>,
    /// Every handler run of a job.
    pub runs: Arc<Mutex<Vec<JobRun>>>,
    pub relay_log: Arc<Mutex<RelayLog>>,
    /// The registry whose writes fill the outbox, and the queue the enqueuer uses and
    /// the checker reads, straight to the server.
    registry: SqliteSource,
    straight_queue: NatsQueue,
    seed: u64,
}

/// Where the drivers connect: through the proxy and straight.
pub struct Clients {
    pub worker: async_nats::Client,
    pub runner: async_nats::Client,
    pub relays: async_nats::Client,
    pub straight: async_nats::Client,
}

impl Drivers {
    /// Makes the relayed stream and the queue and starts the worker, the runner and both
    /// relays; the registry's file is made in `dir`.
    pub async fn start(
        clients: Clients,
        bucket: &str,
        dir: &Path,
        replicas: usize,
        seed: u64,
    ) -> Result<Drivers, String> {
        let e = |what: &str| {
            let what = what.to_owned();
            move |e: tidemark::Error| format!("starting the drivers: {what}: {e}")
        };
        let relayed = NatsEvents::new(clients.straight.clone(), RELAYED_STREAM, RELAYED_PREFIX)
            .map_err(e("the relayed stream"))?;
        // A new cluster may answer these late (its meta leader still placing its first
        // assignments: the relayed stream's creation timed out, seed 30014): each is
        // idempotent, and tried again for a while.
        settled(|| relayed.ensure(replicas))
            .await
            .map_err(e("the relayed stream"))?;
        // The runner's handle first: it makes the queue, and sets the lease it uses.
        let queue = settled(|| NatsQueue::open(clients.runner.clone(), JOBS, MAX_ATTEMPTS))
            .await
            .map_err(e("the runner's queue"))?;
        let straight_queue =
            settled(|| NatsQueue::open(clients.straight.clone(), JOBS, MAX_ATTEMPTS))
                .await
                .map_err(e("the enqueuer's queue"))?;
        let applied = Applied::default();
        let fail_next = Arc::new(AtomicBool::new(false));
        let supervisor = Supervisor::new(seed);
        let source = KvBucket::new(clients.worker, bucket).map_err(e("the worker's bucket"))?;
        let worker = CampWorker {
            applied: Arc::clone(&applied),
            fail_next: Arc::clone(&fail_next),
            seed,
        };
        let policy = RestartPolicy::OnExit {
            backoff: BackoffPolicy::fast_reopen(),
            max_restarts: None,
        };
        supervisor
            .spawn(worker, source.clone(), source, policy)
            .map_err(e("the worker"))?;
        let runs = Arc::new(Mutex::new(Vec::new()));
        let mut runner = Runner {
            queue: queue.clone(),
            handlers: handlers(&runs),
            seed,
            starts: 0,
            handle: None,
            counts: DriverCounts::default(),
        };
        runner.spawn();
        let file = dir.join("registry.db");
        let registry = open(&file).await?.announced_source(Legs {
            publish: true,
            notify: false,
            enqueue: true,
        });
        let relay_log = Arc::new(Mutex::new(RelayLog::default()));
        let relays_client = clients.relays;
        let mut relays = Relays {
            dbs: [open(&file).await?, open(&file).await?],
            events: NatsEvents::new(relays_client.clone(), RELAYED_STREAM, RELAYED_PREFIX)
                .map_err(e("the relays' stream"))?,
            wake: NatsWake::new(relays_client.clone(), "camp.wake").map_err(e("a wake"))?,
            queue: NatsQueue::open(relays_client, JOBS, MAX_ATTEMPTS)
                .await
                .map_err(e("the relays' queue"))?,
            log: Arc::clone(&relay_log),
            seed,
            starts: [0; 2],
            handles: [None, None],
            counts: DriverCounts::default(),
        };
        relays.spawn(0);
        relays.spawn(1);
        Ok(Drivers {
            supervisor,
            applied,
            fail_next,
            runner: AsyncMutex::new(runner),
            relays: AsyncMutex::new(relays),
            runs,
            relay_log,
            registry,
            straight_queue,
            seed,
        })
    }

    /// The worker's entries as the checker reads a follower's: key, revision, value.
    pub fn worker_entries(&self) -> Vec<(String, u64, Vec<u8>)> {
        lock(&self.applied)
            .iter()
            .map(|(k, (s, v))| (k.clone(), *s, v.clone()))
            .collect()
    }

    /// What the worker's handlers applied, as a sample shows it (values by their tokens).
    pub fn worker_shown(&self) -> Vec<Shown> {
        lock(&self.applied)
            .iter()
            .map(|(k, (s, v))| (k.clone(), *s, token(v)))
            .collect()
    }

    /// The writers of the drivers until `stop`: the registry's (its seqs, each an outbox
    /// row) and the enqueuer's.
    pub fn write(
        &self,
        stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<Result<(BTreeSet<u64>, DriverCounts), String>> {
        let registry = write_registry(self.registry.clone(), self.seed, stop.clone());
        let enqueuer = enqueue_jobs(self.straight_queue.clone(), self.seed, stop);
        tokio::spawn(async move {
            let (written, enqueued) = tokio::join!(registry, enqueuer);
            let (written, mut counts) = (written?, enqueued);
            counts.registry_writes = written.len() as u64;
            Ok((written, counts))
        })
    }

    /// The worker's next handler call fails.
    pub fn fail_worker(&self) {
        self.fail_next.store(true, Ordering::Relaxed);
    }

    /// The runner crashes; a new one starts after `down`.
    pub async fn crash_runner(&self, down: Duration) {
        self.runner.lock().await.end(true).await;
        sleep(down).await;
        self.runner.lock().await.spawn();
    }

    /// Relay `i` crashes; a new one (a new owner) starts after `down`.
    pub async fn crash_relay(&self, i: usize, down: Duration) {
        self.relays.lock().await.end(i, true).await;
        sleep(down).await;
        self.relays.lock().await.spawn(i);
    }

    /// Every job of the queue (ids 1 to the stream's last) as it stands once each is
    /// acked or dead-lettered, or `within` has passed. A job whose state says leased while
    /// its message is gone from the stream for [`UNRECORDED_FINAL`] will never move (no
    /// runner can lease it again): it does not hold the wait up.
    pub async fn job_ends(
        &self,
        admin: &async_nats::Client,
        within: Duration,
    ) -> Result<BTreeMap<u64, (String, JobEnd)>, String> {
        let js = jetstream::new(admin.clone());
        let deadline = Instant::now() + within;
        let mut ends: BTreeMap<u64, (String, JobEnd)> = BTreeMap::new();
        let mut unrecorded: BTreeMap<u64, Instant> = BTreeMap::new();
        loop {
            let read = async {
                let stream = js.get_stream(JOBS).await.map_err(|e| e.to_string())?;
                let last = stream.cached_info().state.last_sequence;
                for id in 1..=last {
                    let finished = ends.get(&id).is_some_and(|(_, end)| {
                        matches!(end, JobEnd::Acked | JobEnd::DeadLettered)
                    });
                    if !finished {
                        let end = self.job_end(&stream, id).await?;
                        ends.insert(id, end);
                    }
                }
                Ok::<_, String>(())
            };
            let read = timeout(Duration::from_secs(5), read).await;
            let now = Instant::now();
            for (id, (_, end)) in &ends {
                match end {
                    JobEnd::Leased { in_stream: false } => {
                        unrecorded.entry(*id).or_insert(now);
                    }
                    _ => {
                        unrecorded.remove(id);
                    }
                }
            }
            let all = ends.iter().all(|(id, (_, end))| match end {
                JobEnd::Acked | JobEnd::DeadLettered => true,
                JobEnd::Leased { in_stream: false } => unrecorded
                    .get(id)
                    .is_some_and(|since| now - *since >= UNRECORDED_FINAL),
                _ => false,
            });
            match read {
                Ok(Ok(())) if all => return Ok(ends),
                _ if Instant::now() > deadline => {
                    return match read {
                        Ok(Ok(())) => Ok(ends),
                        Ok(Err(e)) => Err(format!("reading the job queue after healing: {e}")),
                        Err(_) => Err("reading the job queue after healing: timed out".into()),
                    };
                }
                _ => sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Job `id` as its state says, or, with no state, as its message's presence says.
    async fn job_end(
        &self,
        stream: &jetstream::stream::Stream,
        id: u64,
    ) -> Result<(String, JobEnd), String> {
        if let Some(record) = self
            .straight_queue
            .get(JobId(id))
            .await
            .map_err(|e| e.to_string())?
        {
            let end = match record.state {
                JobState::Done => JobEnd::Acked,
                JobState::DeadLettered => JobEnd::DeadLettered,
                JobState::Leased => JobEnd::Leased {
                    in_stream: in_stream(stream, id).await?,
                },
                _ => JobEnd::Waiting,
            };
            return Ok((record.job.kind().to_owned(), end));
        }
        match stream.get_raw_message(id).await {
            Ok(m) => {
                let kind = Job::decode(&m.payload).map_or("?".to_owned(), |j| j.kind().to_owned());
                Ok((kind, JobEnd::Waiting))
            }
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => {
                Ok(("?".to_owned(), JobEnd::Lost))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// The outbox's pending rows once none is, or `within` has passed; then every event
    /// of the relayed stream, counted by the seq it names.
    pub async fn relayed(
        &self,
        admin: &async_nats::Client,
        within: Duration,
    ) -> Result<(u64, BTreeMap<u64, u64>), String> {
        let deadline = Instant::now() + within;
        let outbox = self.registry.db().outbox();
        let pending = loop {
            match outbox.pending().await {
                Ok(0) => break 0,
                Ok(n) if Instant::now() > deadline => break n,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("counting the outbox after healing: {e}"));
                }
                _ => sleep(Duration::from_millis(100)).await,
            }
        };
        let js = jetstream::new(admin.clone());
        // A cluster's stream may still answer "temporarily unavailable" (503) just after
        // healing: each read is tried again until a deadline of its own (seed 30009).
        let read_by = Instant::now() + RELAYED_READ_WITHIN;
        let stream = retried_until(read_by, || js.get_stream(RELAYED_STREAM))
            .await
            .map_err(|e| format!("the relayed stream after healing: {e}"))?;
        let last = stream.cached_info().state.last_sequence;
        let mut events = BTreeMap::new();
        for position in 1..=last {
            let message = retried_until(read_by, || stream.get_raw_message(position))
                .await
                .map_err(|e| format!("the relayed stream's event {position}: {e}"))?;
            let seq = Event::decode(&message.payload).map_or(0, |e| e.seq());
            *events.entry(seq).or_default() += 1;
        }
        Ok((pending, events))
    }

    /// Stops them all; what they did.
    pub async fn stop(&self) -> DriverCounts {
        let mut counts = DriverCounts {
            // Read before the shutdown, which reports none if the worker is late to stop.
            worker_restarts: self
                .supervisor
                .get(WORKER)
                .map_or(0, |i| u64::from(i.restarts)),
            ..DriverCounts::default()
        };
        let _ = self.supervisor.shutdown(Duration::from_secs(5)).await;
        let mut runner = self.runner.lock().await;
        runner.end(false).await;
        counts.add(&runner.counts);
        counts.runner_restarts = runner.starts.saturating_sub(1);
        let mut relays = self.relays.lock().await;
        relays.end(0, false).await;
        relays.end(1, false).await;
        counts.add(&relays.counts);
        counts.relay_restarts = relays.starts.iter().map(|s| s.saturating_sub(1)).sum();
        counts
    }
}

/// Whether the queue's stream still holds job `id`'s message (not yet acked or
/// terminated).
async fn in_stream(stream: &jetstream::stream::Stream, id: u64) -> Result<bool, String> {
    match stream.get_raw_message(id).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// A handle on the registry's file (each relay has its own, as a process would).
async fn open(file: &Path) -> Result<SqliteDb, String> {
    SqliteDb::open(file)
        .await
        .map_err(|e| format!("starting the drivers: the registry's file: {e}"))
}

/// The runner's handlers: the campaign's jobs (failing their first `fails` attempts after
/// `ms` of work) and the relays' housekeeping jobs; each run logged as it ends.
fn handlers(runs: &Arc<Mutex<Vec<JobRun>>>) -> JobHandlers {
    let camp = Arc::clone(runs);
    let housekeeping = Arc::clone(runs);
    JobHandlers::new()
        .on([CAMP_JOB], move |job: Value, ctx: JobContext| {
            let runs = Arc::clone(&camp);
            async move {
                let field = |name: &str| job.get(name).and_then(Value::as_u64).unwrap_or(0);
                sleep(Duration::from_millis(field("ms"))).await;
                let ok = u64::from(ctx.attempt) > field("fails");
                lock(&runs).push(JobRun { id: ctx.id.0, ok });
                match ok {
                    true => Ok(()),
                    false => Err(format!("the campaign's job fails attempt {}", ctx.attempt)),
                }
            }
        })
        .on(["pack_housekeeping"], move |_job: Job, ctx: JobContext| {
            let runs = Arc::clone(&housekeeping);
            async move {
                sleep(Duration::from_millis(5)).await;
                lock(&runs).push(JobRun {
                    id: ctx.id.0,
                    ok: true,
                });
                Ok::<(), String>(())
            }
        })
}

/// Enqueues the campaign's jobs until `stop`, 80-300 ms apart: most succeed at once, one
/// in five fails once first, one in five fails every attempt (dead-lettered); one in ten
/// works 0.6-2 s (its lease renewed meanwhile).
async fn enqueue_jobs(
    queue: NatsQueue,
    seed: u64,
    mut stop: watch::Receiver<bool>,
) -> DriverCounts {
    let mut rng = Rng::new(seed ^ 0x6a6f_6273);
    let mut counts = DriverCounts::default();
    let mut n = 0u64;
    while !*stop.borrow_and_update() {
        n += 1;
        let fails = match rng.next_u64() % 10 {
            0..6 => 0,
            6 | 7 => 1,
            _ => u64::from(MAX_ATTEMPTS),
        };
        let ms = match rng.next_u64() % 10 {
            0 => 600 + rng.next_u64() % 1400,
            _ => rng.next_u64() % 100,
        };
        let job = serde_json::json!({ "kind": CAMP_JOB, "n": n, "fails": fails, "ms": ms });
        let enqueued = match Job::custom(&job) {
            Ok(job) => timeout(Duration::from_secs(5), queue.enqueue(job)).await,
            Err(e) => panic!("the campaign's job: {e}"),
        };
        match enqueued {
            Ok(Ok(_)) => counts.enqueued += 1,
            _ => counts.enqueue_failed += 1,
        }
        let pause = Duration::from_millis(80 + rng.next_u64() % 220);
        let _ = timeout(pause, stop.changed()).await;
    }
    counts
}

/// Writes the registry until `stop`, 30-150 ms apart: puts mostly, removals of its six
/// keys sometimes; each write's seq (its outbox row).
async fn write_registry(
    registry: SqliteSource,
    seed: u64,
    mut stop: watch::Receiver<bool>,
) -> Result<BTreeSet<u64>, String> {
    let mut rng = Rng::new(seed ^ 0x7265_6769_7374_7279);
    let mut written = BTreeSet::new();
    while !*stop.borrow_and_update() {
        let key = format!("r{}", rng.next_u64() % REGISTRY_KEYS);
        let seq = match rng.next_u64() % 10 {
            0..8 => {
                let value = format!("{key}#{}|", written.len()).into_bytes();
                Some(registry.put(&key, value).await)
            }
            _ => registry.remove(&key).await.transpose(),
        };
        match seq {
            Some(Ok(seq)) => {
                written.insert(seq);
            }
            Some(Err(e)) => return Err(format!("writing the registry: {e}")),
            None => {}
        }
        let pause = Duration::from_millis(30 + rng.next_u64() % 120);
        let _ = timeout(pause, stop.changed()).await;
    }
    Ok(written)
}

/// A start-up step tried again on failure for [`START_WITHIN`]: its last error after that.
async fn settled<T, F, Fut>(step: F) -> tidemark::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = tidemark::Result<T>>,
{
    retried_until(Instant::now() + START_WITHIN, step).await
}

/// `step` tried again every 200 ms while it fails, until `deadline`: its last error after.
async fn retried_until<T, E, F, Fut>(deadline: Instant, mut step: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    loop {
        match step().await {
            Ok(done) => return Ok(done),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}
