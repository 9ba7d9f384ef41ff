//! One simulated run: the hosts, the fault plan carried out over simulated time, the safety
//! checks after every step and the liveness phase.

pub mod jobs;
pub mod retention;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::{Event, FollowerConfig, Phase, RestartPolicy, Rng, Utf8};
use tidemark::{
    Announcer, AnnouncingRegistry, Cursors, FollowerTask, NoFeed, Outbox, Publish, Relay, Sink,
    Source, StopSignal, Supervisor, Worker, WorkerPhase, WorkerSink,
};
use tidemark_memory::{
    Mangle, Memory, MemoryBackup, MemoryCacheStore, MemoryOutbox, MemoryOutboxBackup, Port,
};

use self::jobs::JobFaults;
use crate::checks::jobs::JobLedger;
use crate::checks::oracle::{
    Expect, FeedSkips, History, Probe, RelayLedger, Volatile, differences, holds,
};
use crate::checks::sweeps::{SweepCounts, SweepLedger};
use crate::clients::kv::RemoteKv;
use crate::clients::listener::ReconnectingListener;
use crate::clients::naive::{EventsAsReplay, ForgetsIndex, NewOnlyFeed, WatermarkFirst};
use crate::clients::remote::{PartReads, Remote, RemoteEvents};
use crate::hosts::jetstream::JetStream;
use crate::hosts::queue;
use crate::hosts::source as server;
use crate::hosts::sweeps::Sweeps;
use crate::scenario::{
    Action, Durability, FaultKind, FollowerSpec, Kind, SOURCE, Scenario, Strategy, Workload,
    followers, plan, relay_host, writer_host,
};
use crate::trace::Trace;

/// The wake channel writers announce on.
pub const CHANNEL: &str = "changes";

/// What a run found.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// Safety violations and liveness failures; empty when the run passed.
    pub failures: Vec<String>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u32>,
    /// Simulated time from healing to convergence (`None`: did not converge).
    pub converged_after: Option<Duration>,
    /// The trace's hash.
    pub trace_hash: u64,
    /// The trace's lines, if kept.
    pub trace: Vec<String>,
    /// The source's final watermark.
    pub watermark: u64,
    /// Persisted followers' commits that a planned crash interrupted.
    pub commit_crashes: u32,
    /// Persisted followers' commits that failed and were rolled back.
    pub failed_commits: u32,
    /// Restarts of persisted followers that found keys in their durable store.
    pub warm_restarts: u32,
    /// Restarts of supervised workers by their supervisor after a handler failed.
    pub worker_restarts: u32,
    /// Outbox rows published again by design: (by the same relay after a lost answer, by
    /// another relay after a lease ran out).
    pub relay_repeats: (u32, u32),
    /// Outbox rows some relay published.
    pub relayed: u32,
    /// The job runners: (jobs handled, runs after another run's lease ran out, lease
    /// renewals, slow jobs delivered again while their first run went on).
    pub jobs: (u32, u32, u32, u32),
    /// The sweepers: sweeps, takeovers, rows removed, cursors forced past.
    pub sweeps: SweepCounts,
    /// The followers' snapshots read in parts.
    pub part_reads: PartReads,
}

impl Outcome {
    /// Whether the run passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

#[derive(Debug, Default)]
struct WriterControl {
    crash_after_commit: AtomicBool,
    poison_next: AtomicBool,
    quiet: AtomicBool,
    /// Writes to the source sent and not yet answered (or given up): a restore waits for
    /// them, as an operator's procedure stops the writers before it.
    in_flight: AtomicU32,
    starts: AtomicU64,
    /// Cold keys this writer wrote and has not removed (outlives its crashes).
    cold: Mutex<Vec<String>>,
    /// Cold keys written so far (each name is used once).
    cold_written: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Commits through the remote source; when armed, stalls forever right after a commit, so
/// the announcement never happens (the orchestrator then crashes the host).
#[derive(Clone, Debug)]
struct CrashAfterCommit {
    remote: Remote,
    control: Arc<WriterControl>,
}

/// A write to the source in flight, counted in its writer's control until it returns or
/// its host crashes (the count is dropped with the future).
struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    fn start(count: &'a AtomicU32) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        InFlight(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl CrashAfterCommit {
    /// Runs one write to the source, counted in flight until it returns, then stalls for
    /// good if the writer is to crash between commit and announce.
    async fn write<T>(
        &self,
        write: impl std::future::Future<Output = tidemark::Result<T>>,
    ) -> tidemark::Result<T> {
        let done = {
            let _sent = InFlight::start(&self.control.in_flight);
            write.await?
        };
        if self
            .control
            .crash_after_commit
            .swap(false, Ordering::SeqCst)
        {
            std::future::pending::<()>().await;
        }
        Ok(done)
    }
}

impl Source for CrashAfterCommit {
    async fn put(&self, key: &str, value: Vec<u8>) -> tidemark::Result<u64> {
        self.write(self.remote.put(key, value)).await
    }
    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> tidemark::Result<u64> {
        self.write(self.remote.update(key, value, expected)).await
    }
    async fn remove(&self, key: &str) -> tidemark::Result<Option<u64>> {
        self.write(self.remote.remove(key)).await
    }
    async fn watermark(&self) -> tidemark::Result<u64> {
        self.remote.watermark().await
    }
    async fn changes_since(&self, since: u64) -> tidemark::Result<tidemark::Changes> {
        self.remote.changes_since(since).await
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        self.remote.snapshot().await
    }
    async fn get(&self, key: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        self.remote.get(key).await
    }
    async fn get_at(&self, key: &str) -> tidemark::Result<tidemark::ValueAt> {
        self.remote.get_at(key).await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        self.remote.first_available().await
    }
}

async fn writer(
    i: usize,
    seed: u64,
    workload: Workload,
    relayed: bool,
    control: Arc<WriterControl>,
    trace: Trace,
) -> turmoil::Result {
    let start = control.starts.fetch_add(1, Ordering::SeqCst);
    let remote = Remote::new(SOURCE);
    // A relayed writer's commits carry their outbox row; the relays announce them.
    let source = CrashAfterCommit {
        remote: if relayed {
            Remote::announcing(SOURCE)
        } else {
            remote.clone()
        },
        control: Arc::clone(&control),
    };
    // Housekeeping jobs go to the source host's queue, where the job runners lease them.
    let registry = AnnouncingRegistry::new(
        source,
        remote.clone(),
        remote.clone(),
        remote.clone(),
        CHANNEL,
    );
    let mut rng = Rng::new(seed ^ ((i as u64 + 1) << 32) ^ (start << 48));
    if start > 0 {
        // A restarted writer may have left a commit unannounced: wake everyone to catch up.
        let _ = tidemark::Wake::notify(&remote, CHANNEL, Vec::new()).await;
        trace.line(format!("writer-{i} restarted; woke followers"));
    }
    loop {
        tokio::time::sleep(Duration::from_millis(5 + rng.next_u64() % 120)).await;
        if control.quiet.load(Ordering::SeqCst) {
            continue;
        }
        // Skewed keys: a few hot keys written and removed often; cold keys each written
        // once, and some removed once later.
        let (key, remove) = if rng.next_f64() < workload.hot_share {
            let key = format!("hot-{}", rng.next_u64() % workload.hot_keys.max(1));
            (key, rng.next_f64() < workload.hot_remove_share)
        } else {
            let mut cold = lock(&control.cold);
            if !cold.is_empty() && rng.next_f64() < workload.cold_remove_share {
                let at = (rng.next_u64() % cold.len() as u64) as usize;
                (cold.swap_remove(at), true)
            } else {
                let n = control.cold_written.fetch_add(1, Ordering::SeqCst);
                let key = format!("cold-{i}-{n}");
                cold.push(key.clone());
                (key, false)
            }
        };
        if relayed {
            let value = if control.poison_next.swap(false, Ordering::SeqCst) {
                vec![0xff, 0xfe, b'!']
            } else {
                format!("v{}", rng.next_u64() % 1_000_000).into_bytes()
            };
            let source = registry.source();
            let done = if remove {
                source
                    .remove(&key)
                    .await
                    .map(|seq| seq.map(|s| ("removed", s)))
            } else {
                source.put(&key, value).await.map(|s| Some(("put", s)))
            };
            match done {
                Ok(Some((what, seq))) => {
                    trace.line(format!("writer-{i} {what} {key}@{seq} through the outbox"));
                }
                Ok(None) => {}
                Err(e) => trace.line(format!("writer-{i} write failed: {e}")),
            }
            continue;
        }
        if remove {
            match registry.remove(&key).await {
                Ok(Some(w)) => {
                    trace.line(format!("writer-{i} removed {key}@{} {:?}", w.seq, w.report))
                }
                Ok(None) => {}
                Err(e) => trace.line(format!("writer-{i} remove failed: {e}")),
            }
        } else {
            let value = if control.poison_next.swap(false, Ordering::SeqCst) {
                vec![0xff, 0xfe, b'!']
            } else {
                format!("v{}", rng.next_u64() % 1_000_000).into_bytes()
            };
            if rng.next_f64() < 0.15 {
                // A mutation marker: commit, then announce only "key changed at seq"; readers
                // of the announcements fetch the value from the source.
                match registry.source().put(&key, value).await {
                    Ok(seq) => {
                        let report = registry
                            .announce(&Event::Mutation {
                                seq,
                                key: key.clone(),
                            })
                            .await;
                        trace.line(format!("writer-{i} marked {key}@{seq} {report:?}"));
                    }
                    Err(e) => trace.line(format!("writer-{i} put failed: {e}")),
                }
            } else {
                match registry.put(&key, value).await {
                    Ok(w) => trace.line(format!("writer-{i} put {key}@{} {:?}", w.seq, w.report)),
                    Err(e) => trace.line(format!("writer-{i} put failed: {e}")),
                }
            }
        }
    }
}

/// How long a relay's claim on outbox rows lasts in the simulated world: short, so a
/// crashed or partitioned relay's rows are taken over within the run.
pub const RELAY_LEASE: Duration = Duration::from_secs(2);

/// Rows a relay claims at a time: few, so relays interleave and leases lapse mid-drain.
const RELAY_BATCH: usize = 4;

/// A worker host: a relay, a job runner and retention (a sweep driver or a sweep
/// scheduler, see [`sweeps`]), as one process of a user's deployment runs them; a crash
/// takes them all down.
async fn worker_host(
    i: usize,
    seed: u64,
    trace: Trace,
    jobs: JobLedger,
    job_faults: Arc<JobFaults>,
) -> turmoil::Result {
    let naive_ticks = job_faults.naive_ticks.load(Ordering::SeqCst);
    let runner = jobs::runner(
        relay_host(i),
        seed ^ (i as u64 + 7),
        jobs,
        job_faults,
        trace.clone(),
    );
    let retention = retention::retention(i, relay_host(i), trace.clone(), naive_ticks);
    tokio::select! {
        biased;
        done = relay(i, seed, trace) => done,
        done = runner => Ok(done?),
        done = retention => Ok(done?),
    }
}

/// A relay on its own host: the runtime's `Relay` draining the source host's outbox into
/// its events stream and wake channel, claiming rows under its host's name.
async fn relay(i: usize, seed: u64, trace: Trace) -> turmoil::Result {
    let owner = relay_host(i);
    let remote = Remote::relay(SOURCE, owner.clone());
    let announcer = Announcer::new(remote.clone(), remote.clone(), remote.clone(), CHANNEL);
    let relay = Relay::new(remote, announcer, owner.clone())
        .with_lease(RELAY_LEASE)
        .with_batch(RELAY_BATCH)
        .with_seed(seed ^ (i as u64 + 1));
    trace.line(format!("{owner} starts"));
    let report = relay.run(StopSignal::never()).await?;
    trace.line(format!("{owner} ended: {report:?}"));
    Ok(())
}

async fn follower(
    spec: FollowerSpec,
    seed: u64,
    probe: Probe,
    store: Option<MemoryCacheStore>,
    handler_faults: Arc<AtomicU32>,
) -> turmoil::Result {
    // What survived the crash: nothing, or what the durable store holds; the follower
    // resumes from the store itself (`Sink::resume`), the probe only watches.
    probe.restart(store.as_ref());
    let config = FollowerConfig::builder(spec.name.clone())
        .seed(seed)
        .build()?;
    if spec.supervised {
        return supervised(spec, config, seed, probe, handler_faults).await;
    }
    match (spec.durability, store) {
        (Durability::Volatile, _) | (_, None) => {
            drive(&spec, config, probe.sink(Volatile), false).await
        }
        (Durability::Store, Some(store)) => {
            drive(&spec, config, probe.sink(store.sink()), true).await
        }
        (Durability::ForgetsIndex, Some(store)) => {
            drive(&spec, config, probe.sink(ForgetsIndex(store.sink())), true).await
        }
        (Durability::WatermarkFirst, Some(store)) => {
            drive(
                &spec,
                config,
                probe.sink(WatermarkFirst(store.sink())),
                true,
            )
            .await
        }
    }
}

/// A user's worker whose handlers report to the probe; the next handler calls fail while
/// `fail_next` is above zero (an error in the user's code).
struct ProbeWorker {
    name: String,
    config: FollowerConfig,
    probe: Probe,
    fail_next: Arc<AtomicU32>,
}

impl ProbeWorker {
    fn fail(&self) -> Result<(), String> {
        let failing = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            Err("injected handler failure".into())
        } else {
            Ok(())
        }
    }
}

impl Worker for ProbeWorker {
    type Decoder = Utf8;
    type Error = String;

    fn name(&self) -> &str {
        &self.name
    }

    fn source(&self) -> &str {
        SOURCE
    }

    fn decoder(&self) -> Utf8 {
        Utf8
    }

    fn config(&self) -> tidemark::Result<FollowerConfig> {
        Ok(self.config.clone())
    }

    async fn on_put(&mut self, key: &str, seq: u64, value: String) -> Result<(), String> {
        self.fail()?;
        self.probe.handler_put(key, seq, &value);
        Ok(())
    }

    async fn on_delete(&mut self, key: &str, seq: u64) -> Result<(), String> {
        self.fail()?;
        self.probe.handler_delete(key, seq);
        Ok(())
    }
}

/// A follower's client of the source host: a naive one for a follower that reads a
/// snapshot's parts apart.
fn source_client(spec: &FollowerSpec) -> Remote {
    let mut remote = Remote::new(SOURCE);
    if spec.parts_apart {
        remote = remote.reading_parts_apart();
    }
    if spec.blind_to_history {
        remote = remote.blind_to_history();
    }
    remote
}

/// How many entries a part of a follower's resync snapshot holds: small (1 to 8) and
/// drawn from its seed, so that resyncs in a campaign come in many parts, split at many
/// places.
fn snapshot_part_len(config: &FollowerConfig) -> usize {
    let seed = config.seed().unwrap_or(0);
    // Bits the follower's other seeded choices do not start from.
    1 + usize::try_from((seed >> 17) % 8).unwrap_or(0)
}

/// How many deliveries a JetStream follower's consumers ask for at a time: one or two,
/// drawn from its seed, so a replay takes many round trips while writers overwrite keys.
fn kv_batch(config: &FollowerConfig) -> u32 {
    // Mixed: a follower's seed is small in a campaign (the run's seed times 31, plus its
    // index), so its high bits are all zero.
    let mut rng = Rng::new(config.seed().unwrap_or(0) ^ 0x006b_7662_6174_6368);
    1 + u32::try_from(rng.next_u64() % 2).unwrap_or(0)
}

/// A JetStream follower's client of the source host's bucket.
fn kv_client(spec: &FollowerSpec, config: &FollowerConfig) -> RemoteKv {
    let kv = RemoteKv::new(Remote::new(SOURCE), spec.name.clone(), kv_batch(config));
    if spec.trusts_pending {
        kv.trusting_pending()
    } else {
        kv
    }
}

/// Runs a follower as a supervised worker (change log and wakes), restarted with a
/// backoff whenever a handler fails, and reports its supervisor's view to the probe.
async fn supervised(
    spec: FollowerSpec,
    config: FollowerConfig,
    seed: u64,
    probe: Probe,
    fail_next: Arc<AtomicU32>,
) -> turmoil::Result {
    let remote = source_client(&spec);
    let worker = ProbeWorker {
        name: spec.name.clone(),
        config: config.clone(),
        probe: probe.clone(),
        fail_next,
    };
    let supervisor = Supervisor::new(seed);
    let part_len = snapshot_part_len(&config);
    let task = FollowerTask::new(
        config,
        Utf8,
        remote.clone(),
        remote.clone(),
        WorkerSink(worker),
    )
    .snapshot_part_len(part_len)
    .with_wake(ReconnectingListener::new(remote.clone(), CHANNEL));
    supervisor.supervise(task, RestartPolicy::with_backoff())?;
    let mut phase = None;
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Some(info) = supervisor.get(&spec.name) {
            let live = info.phase == WorkerPhase::Running(Phase::Live);
            if phase.as_ref() != Some(&info.phase) {
                probe.trace_line(format!("{} worker phase {:?}", spec.name, info.phase));
                phase = Some(info.phase.clone());
            }
            probe.observe(info.watermark, live, info.restarts);
        }
    }
}

/// Runs one follower of `kind` into `sink` on the runtime's one driver; a `durable` one
/// that follows the events stream keeps a durable cursor on it.
async fn drive<K: Sink<String> + 'static>(
    spec: &FollowerSpec,
    config: FollowerConfig,
    sink: K,
    durable: bool,
) -> turmoil::Result {
    let kind = spec.kind;
    let remote = source_client(spec);
    let wake = || ReconnectingListener::new(remote.clone(), CHANNEL);
    let stop = StopSignal::never();
    let part_len = snapshot_part_len(&config);
    let status = match kind {
        Kind::Log => {
            FollowerTask::new(config, Utf8, remote.clone(), remote.clone(), sink)
                .snapshot_part_len(part_len)
                .with_wake(wake())
                .run(stop)
                .await
        }
        Kind::WakeOnly => {
            FollowerTask::new(config, Utf8, remote.clone(), NoFeed, sink)
                .snapshot_part_len(part_len)
                .with_wake(wake())
                .run(stop)
                .await
        }
        Kind::Events if durable => {
            // A durable consumer: its events-stream position is saved on the source host
            // once the sink committed what comes before it, and resumed after a restart.
            let events = RemoteEvents(remote.clone());
            let name = config.name().to_owned();
            FollowerTask::new(config, Utf8, remote.clone(), events, sink)
                .snapshot_part_len(part_len)
                .with_cursor(remote.clone(), name)
                .with_wake(wake())
                .run(stop)
                .await
        }
        Kind::Events => {
            let events = RemoteEvents(remote.clone());
            FollowerTask::new(config, Utf8, remote.clone(), events, sink)
                .snapshot_part_len(part_len)
                .with_wake(wake())
                .run(stop)
                .await
        }
        Kind::NewOnly => {
            let feed = NewOnlyFeed(remote.clone());
            FollowerTask::new(config, Utf8, remote.clone(), feed, sink)
                .snapshot_part_len(part_len)
                .run(stop)
                .await
        }
        Kind::EventsNoReconcile => {
            let events = EventsAsReplay(RemoteEvents(remote.clone()));
            FollowerTask::new(config, Utf8, remote.clone(), events, sink)
                .snapshot_part_len(part_len)
                .run(stop)
                .await
        }
        Kind::JetStream => {
            let kv = kv_client(spec, &config);
            FollowerTask::new(config, Utf8, kv.clone(), kv, sink)
                .snapshot_part_len(part_len)
                .with_wake(wake())
                .run(stop)
                .await
        }
    };
    status?;
    Ok(())
}

/// The followers' probes: those of JetStream followers know what their feeds skipped.
fn probes(
    specs: &[FollowerSpec],
    history: &History,
    trace: &Trace,
    skips: &FeedSkips,
) -> Vec<Probe> {
    specs
        .iter()
        .map(|f| {
            let probe = Probe::new(f.name.clone(), history.clone(), trace.clone());
            if f.kind == Kind::JetStream {
                probe.reading_a_sparse_feed(skips.clone())
            } else {
                probe
            }
        })
        .collect()
}

/// Runs one seed of `scenario`.
#[must_use]
pub fn run(seed: u64, scenario: &Scenario) -> Outcome {
    // Counted from here: a run is simulated on one thread, which may have run others.
    let _ = crate::clients::remote::take_part_reads();
    let trace = Trace::new(scenario.keep_trace);
    let history = History::default();
    let ledger = RelayLedger::default();
    let mut memory = Memory::new();
    // Outbox and queue leases on the simulation's clock: a source host that restarts gets
    // a new runtime, whose `Instant`s would not compare with the leases taken before.
    let base = tokio::time::Instant::now();
    let sim_clock = move || base + turmoil::sim_elapsed().unwrap_or_default();
    memory.outbox = MemoryOutbox::with_clock(memory.faults.clone(), sim_clock);
    memory.queue = queue::source_queue(memory.faults.clone(), sim_clock);
    let jobs = JobLedger::default();
    let job_faults = Arc::new(JobFaults::default());
    job_faults
        .naive_ticks
        .store(scenario.strategy == Strategy::NaiveTicks, Ordering::SeqCst);
    // The durable consumers, whose events the sweeps must keep (up to the maximum age).
    let cursors = followers(scenario)
        .into_iter()
        .filter(|f| f.kind == Kind::Events && f.persisted())
        .map(|f| f.name)
        .collect();
    let sweeps = Sweeps::new(&memory, sim_clock, cursors);
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(
            scenario.fault_phase + scenario.liveness_bound + Duration::from_secs(30),
        )
        .tick_duration(scenario.tick)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(50))
        .build();

    let gate = server::WriteGate::new(trace.clone());
    // The JetStream bucket beside the source, and what its followers' feeds skip.
    let skips = FeedSkips::default();
    let jetstream = JetStream::new(seed, skips.clone());
    let host = server::SourceHost {
        memory: memory.clone(),
        history: history.clone(),
        ledger: ledger.clone(),
        jobs: jobs.clone(),
        sweeps: sweeps.clone(),
        jetstream: jetstream.clone(),
    };
    let source_gate = gate.clone();
    sim.host(SOURCE, move || {
        server::serve(host.clone(), source_gate.clone())
    });
    for i in 0..scenario.relays {
        let (trace, jobs, job_faults) = (trace.clone(), jobs.clone(), Arc::clone(&job_faults));
        sim.host(relay_host(i).as_str(), move || {
            worker_host(
                i,
                seed,
                trace.clone(),
                jobs.clone(),
                Arc::clone(&job_faults),
            )
        });
    }
    let controls: Vec<Arc<WriterControl>> = (0..scenario.writers).map(|_| Arc::default()).collect();
    for (i, control) in controls.iter().enumerate() {
        let (control, trace) = (Arc::clone(control), trace.clone());
        let workload = scenario.workload.clone();
        let relayed = scenario.relayed(i);
        sim.host(writer_host(i).as_str(), move || {
            writer(
                i,
                seed,
                workload.clone(),
                relayed,
                Arc::clone(&control),
                trace.clone(),
            )
        });
    }
    let specs = followers(scenario);
    let probes = probes(&specs, &history, &trace, &skips);
    // A persisted follower's durable store lives outside its host, like a disk.
    let stores: Vec<Option<MemoryCacheStore>> = specs
        .iter()
        .map(|f| f.persisted().then(MemoryCacheStore::new))
        .collect();
    // Handler failures armed for supervised workers (outlive their hosts too).
    let handler_faults: Vec<Arc<AtomicU32>> = specs.iter().map(|_| Arc::default()).collect();
    for (i, ((spec, probe), store)) in specs.iter().zip(&probes).zip(&stores).enumerate() {
        let (spec, probe, store) = (spec.clone(), probe.clone(), store.clone());
        let faults = Arc::clone(&handler_faults[i]);
        let fseed = seed.wrapping_mul(31).wrapping_add(i as u64);
        sim.host(spec.name.clone().as_str(), move || {
            follower(
                spec.clone(),
                fseed,
                probe.clone(),
                store.clone(),
                Arc::clone(&faults),
            )
        });
    }

    let mut failures = Vec::new();
    let mut faults: BTreeMap<FaultKind, u32> = BTreeMap::new();
    let mut plan = plan(seed, scenario).into_iter().peekable();
    let mut crashed: BTreeSet<String> = BTreeSet::new();
    // Commit crashes armed (follower → time down) and crashed hosts' restart times.
    let mut commit_crashes: BTreeMap<usize, Duration> = BTreeMap::new();
    let mut restarts: Vec<(Duration, usize)> = Vec::new();
    // Worker hosts crashed holding the sweeper lock, and when they restart.
    let mut sweeper_restarts: Vec<(Duration, String)> = Vec::new();
    // Worker hosts stalled holding the sweeper lock, and when their link is released.
    let mut stalls: Vec<(Duration, String)> = Vec::new();
    let mut landed = 0;
    let all_hosts: Vec<String> = specs
        .iter()
        .map(|f| f.name.clone())
        .chain((0..scenario.writers).map(writer_host))
        .chain((0..scenario.relays).map(relay_host))
        .collect();
    // The flaps of reconnect storms still to come: (when, host, partition or repair).
    let mut flaps: Vec<(Duration, String, bool)> = Vec::new();
    let restores = Restores::new(gate);

    // Safety phase: faults on, invariants checked after every step.
    let step = |sim: &mut turmoil::Sim<'_>, failures: &mut Vec<String>| -> bool {
        if let Err(e) = sim.step() {
            failures.push(format!("a host failed: {e}"));
            return false;
        }
        for (spec, probe) in specs.iter().zip(&probes) {
            let s = probe.state();
            if let Some(v) = s.violations.first() {
                failures.push(format!("{}: {v}", spec.name));
                return false;
            }
        }
        if let Some(v) = ledger.violations().first() {
            failures.push(format!("relays: {v}"));
            return false;
        }
        if let Some(v) = jobs.violations().first() {
            failures.push(format!("job runners: {v}"));
            return false;
        }
        if let Some(v) = sweeps.ledger.violations().first() {
            failures.push(format!("sweeps: {v}"));
            return false;
        }
        if let Some(v) = jetstream.out_of_step().first() {
            failures.push(format!("jetstream: {v}"));
            return false;
        }
        true
    };
    // What the fault actions reach, borrowed for the whole run.
    let world = World {
        memory: &memory,
        jetstream: &jetstream,
        controls: &controls,
        specs: &specs,
        stores: &stores,
        handler_faults: &handler_faults,
        history: &history,
        ledger: &ledger,
        probes: &probes,
        restores: &restores,
        jobs: &jobs,
        job_faults: &job_faults,
        sweeps: &sweeps.ledger,
    };
    while sim.elapsed() < scenario.fault_phase {
        while let Some((at, _)) = plan.peek() {
            if *at > sim.elapsed() {
                break;
            }
            let Some((_, action)) = plan.next() else {
                break;
            };
            if let Some(kind) = action.kind() {
                *faults.entry(kind).or_default() += 1;
            }
            trace.line_at(sim.elapsed(), format!("fault {action}"));
            if let Action::Storm(h, n, each) = &action {
                let now = sim.elapsed();
                for k in 0..*n {
                    flaps.push((now + *each * (2 * k), h.clone(), true));
                    flaps.push((now + *each * (2 * k + 1), h.clone(), false));
                }
                continue;
            }
            apply(&mut sim, &action, &world, &mut crashed, &mut commit_crashes);
        }
        let now = sim.elapsed();
        for (_, h, cut) in flaps.iter().filter(|(at, _, _)| *at <= now) {
            if *cut {
                sim.partition(SOURCE, h.as_str());
            } else {
                sim.repair(SOURCE, h.as_str());
            }
        }
        flaps.retain(|(at, _, _)| *at > now);
        if restores.restore_if_due(now, &world, &trace) {
            world.restart_sparse_followers_cold(&mut sim, &crashed, now);
        }
        if restores.pause_over(now) {
            trace.line_at(now, "writers resume after the restore".into());
            for c in &controls {
                c.quiet.store(false, Ordering::SeqCst);
            }
        }
        if !step(&mut sim, &mut failures) {
            let seen = Seen {
                ledger: &ledger,
                sweeps: &sweeps.ledger,
                jobs: &jobs,
                trace: &trace,
                history: &history,
                probes: &probes,
                commit_crashes: landed,
            };
            return finish(seed, failures, faults, None, &seen);
        }
        // A commit the plan crashes stopped halfway: the host dies now, and comes back
        // after its time down.
        for (i, (spec, store)) in specs.iter().zip(&stores).enumerate() {
            if let Some(store) = store
                && store.take_stalled()
                && crashed.insert(spec.name.clone())
            {
                let down = commit_crashes.remove(&i).unwrap_or_default();
                landed += 1;
                trace.line_at(
                    sim.elapsed(),
                    format!("{} crashed in the middle of a commit", spec.name),
                );
                sim.crash(spec.name.as_str());
                restarts.push((sim.elapsed() + down, i));
            }
        }
        if let Some((h, down)) = sweeps.ledger.armed_holder() {
            if crashed.insert(h.clone()) {
                trace.line_at(
                    sim.elapsed(),
                    format!("{h} crashed holding the sweeper lock"),
                );
                sim.crash(h.as_str());
                sweeper_restarts.push((sim.elapsed() + down, h));
            }
        }
        if let Some((h, down)) = sweeps.ledger.doomed_scheduler()
            && crashed.insert(h.clone())
        {
            trace.line_at(
                sim.elapsed(),
                format!("{h} crashed between a tick's claim and its record"),
            );
            sim.crash(h.as_str());
            sweeper_restarts.push((sim.elapsed() + down, h));
        }
        if let Some((h, stall)) = sweeps.ledger.stalled_holder() {
            trace.line_at(
                sim.elapsed(),
                format!("{h} stalls holding the sweeper lock"),
            );
            sim.hold(SOURCE, h.as_str());
            stalls.push((sim.elapsed() + stall, h));
        }
        let now = sim.elapsed();
        for (_, h) in stalls.iter().filter(|(at, _)| *at <= now) {
            sim.release(SOURCE, h.as_str());
        }
        stalls.retain(|(at, _)| *at > now);
        for (_, h) in sweeper_restarts.iter().filter(|(at, _)| *at <= now) {
            if crashed.remove(h) {
                sim.bounce(h.as_str());
            }
        }
        sweeper_restarts.retain(|(at, _)| *at > now);
        let due: Vec<usize> = restarts
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, i)| *i)
            .collect();
        restarts.retain(|(at, _)| *at > now);
        for i in due {
            let h = &specs[i].name;
            if crashed.remove(h) {
                trace.line_at(now, format!("{h} restarts after its commit crash"));
                sim.bounce(h.as_str());
            }
        }
    }

    // Liveness phase: heal everything, quiesce the writers, demand convergence.
    trace.line_at(sim.elapsed(), "heal".into());
    for c in &controls {
        c.quiet.store(true, Ordering::SeqCst);
        c.crash_after_commit.store(false, Ordering::SeqCst);
        c.poison_next.store(false, Ordering::SeqCst);
    }
    for h in &all_hosts {
        sim.repair(SOURCE, h.as_str());
        sim.release(SOURCE, h.as_str());
    }
    sim.set_fail_rate(0.0);
    sim.set_max_message_latency(Duration::from_millis(50));
    memory.faults.heal();
    memory.events.release_held();
    for store in stores.iter().flatten() {
        store.heal();
    }
    for f in &handler_faults {
        f.store(0, Ordering::SeqCst);
    }
    job_faults.slow_next.store(false, Ordering::SeqCst);
    job_faults.fail_next.store(0, Ordering::SeqCst);
    // Every enqueued job must end acked or dead-lettered (the runners run beside relays).
    let jobs_settled = || scenario.relays == 0 || queue::unsettled(&memory.queue).is_empty();
    for h in std::mem::take(&mut crashed) {
        sim.bounce(h.as_str());
    }
    let healed_at = sim.elapsed();
    // An operator's reconcile pass after an incident: one wake once listeners are back and
    // any restore held back past the heal is done (seeds 5491, 8293: a restore after the
    // wake left a wake-only and an announcements follower past the restored head with
    // nothing to make them read the source again).
    let mut woke = false;
    let mut converged_after = None;
    let mut expected = None;
    while sim.elapsed() < healed_at + scenario.liveness_bound {
        if !woke && restores.done() && sim.elapsed() >= healed_at + OPERATOR_WAKE {
            woke = true;
            wake_all(&memory);
        }
        // A restore that waited for a write in flight (one held on its link until the
        // heal) still happens, once the write landed: no fault kind drawn is skipped.
        let now = sim.elapsed();
        if restores.restore_if_due(now, &world, &trace) {
            world.restart_sparse_followers_cold(&mut sim, &crashed, now);
        }
        if !step(&mut sim, &mut failures) {
            let seen = Seen {
                ledger: &ledger,
                sweeps: &sweeps.ledger,
                jobs: &jobs,
                trace: &trace,
                history: &history,
                probes: &probes,
                commit_crashes: landed,
            };
            return finish(seed, failures, faults, None, &seen);
        }
        if woke
            && restores.done()
            && drained(&memory)
            && converged(&probes, &history, &mut expected)
            && jobs_settled()
        {
            converged_after = Some(sim.elapsed() - healed_at);
            break;
        }
    }
    if converged_after.is_some() {
        // Every row of the outbox is done, and a relay published each (the stream itself
        // may have lost one to an injected fault; that is the followers' to survive).
        let published = ledger.published_seqs();
        let unpublished: Vec<u64> = memory
            .outbox
            .rows()
            .into_iter()
            .filter(|(row, _)| row.plan.publish && !published.contains(&row.seq))
            .map(|(row, _)| row.seq)
            .collect();
        if !unpublished.is_empty() {
            failures.push(format!(
                "relays: {} outbox rows done but never published (seqs {:?})",
                unpublished.len(),
                &unpublished[..unpublished.len().min(5)]
            ));
        }
        // What a restart would find: every durable store holds what its follower
        // committed, the probe's view is no model of its own.
        for ((spec, probe), store) in specs.iter().zip(&probes).zip(&stores) {
            let Some(store) = store else { continue };
            // SPEC: every observed entry is checkpointed, and a name with no cursor replays
            // the stream from its head. So while the stream holds an entry, a converged
            // consumer read it and saved a cursor; with the stream emptied by retention, a
            // consumer that only resynced (seed 85222058) observed nothing to save.
            if spec.kind == Kind::Events && !memory.events.records().is_empty() {
                let saved = poll_once(Cursors::load(&memory.events, &spec.name));
                if !matches!(saved, Some(Ok(Some(_)))) {
                    failures.push(format!(
                        "{}: a durable consumer that converged saved no cursor ({saved:?})",
                        spec.name
                    ));
                }
            }
            let s = probe.state();
            let stored: BTreeMap<String, (u64, String)> = store
                .entries()
                .into_iter()
                .map(|(k, (seq, v))| (k, (seq, String::from_utf8_lossy(&v).into_owned())))
                .collect();
            if stored != s.cache || store.watermark() != Some(s.watermark) {
                failures.push(format!(
                    "{}: its durable store (watermark {:?}, {} keys) is not what it committed (watermark {}, {} keys)",
                    spec.name,
                    store.watermark(),
                    stored.len(),
                    s.watermark,
                    s.cache.len()
                ));
            }
        }
    } else {
        if scenario.relays > 0 {
            for line in queue::unsettled(&memory.queue).into_iter().take(3) {
                failures.push(format!(
                    "job runners: within {:?}, {line}",
                    scenario.liveness_bound
                ));
            }
        }
        if !drained(&memory) {
            failures.push(format!(
                "relays did not drain the outbox within {:?}: {:?} rows pending",
                scenario.liveness_bound,
                poll_once(memory.outbox.pending())
            ));
        }
        let wm = history.watermark();
        let expected = history.expected_at(wm);
        for (spec, probe) in specs.iter().zip(&probes) {
            let s = probe.state();
            let diff = differences(&s.cache, &expected);
            if !diff.is_empty() || s.watermark != wm || !s.ready {
                failures.push(format!(
                    "{} ({:?}) did not converge within {:?}: watermark {} of {wm}, ready {}, {} keys differ: {}",
                    spec.name,
                    spec.kind,
                    scenario.liveness_bound,
                    s.watermark,
                    s.ready,
                    diff.len(),
                    diff.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
                ));
            }
        }
    }
    let seen = Seen {
        ledger: &ledger,
        sweeps: &sweeps.ledger,
        jobs: &jobs,
        trace: &trace,
        history: &history,
        probes: &probes,
        commit_crashes: landed,
    };
    finish(seed, failures, faults, converged_after, &seen)
}

/// When the operator's wake comes after healing: soon, since a listener still away then
/// reports a wake of its own when it reconnects (the sim's `ReconnectingListener`), so
/// waiting longer only runs a converged world for nothing.
const OPERATOR_WAKE: Duration = Duration::from_millis(500);

/// Whether every outbox row is done.
fn drained(memory: &Memory) -> bool {
    matches!(poll_once(memory.outbox.pending()), Some(Ok(0)))
}

fn wake_all(memory: &Memory) {
    let _ = poll_once(tidemark::Wake::notify(&memory.wake, CHANNEL, Vec::new()));
}

/// Polls a memory port's future once, outside every host: they complete on their first
/// poll (`None` if one did not).
fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(fut).as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// Whether every follower holds the source's state at its head. Checked at every step of
/// the liveness phase: the cheap conditions first, and the expected state is computed once
/// per head (`expected` keeps it), since the writers are quiet.
fn converged(
    probes: &[Probe],
    history: &History,
    expected: &mut Option<(u64, BTreeMap<String, Expect>)>,
) -> bool {
    let wm = history.watermark();
    let at_head = probes.iter().all(|p| {
        let s = p.state();
        s.ready && s.watermark == wm
    });
    if !at_head {
        return false;
    }
    let want = match expected {
        Some((at, want)) if *at == wm => want,
        _ => &expected.insert((wm, history.expected_at(wm))).1,
    };
    probes.iter().all(|p| holds(&p.state().cache, want))
}

/// What the orchestrator acts on.
struct World<'a> {
    memory: &'a Memory,
    /// The JetStream bucket beside the source: backed up and restored with it.
    jetstream: &'a JetStream,
    controls: &'a [Arc<WriterControl>],
    specs: &'a [FollowerSpec],
    stores: &'a [Option<MemoryCacheStore>],
    handler_faults: &'a [Arc<AtomicU32>],
    jobs: &'a JobLedger,
    job_faults: &'a JobFaults,
    sweeps: &'a SweepLedger,
    history: &'a History,
    ledger: &'a RelayLedger,
    probes: &'a [Probe],
    restores: &'a Restores,
}

/// How long a restore waits, writers stopped, for the writes they had in flight.
const RESTORE_DRAIN: Duration = Duration::from_millis(500);

/// The backup a restore puts back, when it does, and until when writers pause after one.
struct Restores {
    backup: Mutex<Option<(MemoryBackup, MemoryOutboxBackup)>>,
    restore_at: Mutex<Option<Duration>>,
    /// Writers are stopped for a restore due then.
    pause_until: Mutex<Option<Duration>>,
    /// The source host's writes: closed from a restore until the writers' pause ends.
    gate: server::WriteGate,
    /// Whether the restore had to wait for writes in flight (traced once).
    waited: AtomicBool,
}

impl Restores {
    fn new(gate: server::WriteGate) -> Self {
        Restores {
            backup: Mutex::default(),
            restore_at: Mutex::default(),
            pause_until: Mutex::default(),
            gate,
            waited: AtomicBool::new(false),
        }
    }

    /// Restores the backup if its time came at `now`; whether it did.
    fn restore_if_due(&self, now: Duration, world: &World<'_>, trace: &Trace) -> bool {
        let mut at = lock(&self.restore_at);
        if !at.is_some_and(|at| at <= now) {
            return false;
        }
        // The writers stopped, and the writes they had sent landed or were given up: a
        // write sent before the restore and landing after it would be a writer that did
        // not stop (seed 128: a write held on its link since before the writers stopped
        // landed just after the restore, as the new history's seq 83, while two followers
        // held the replaced 83).
        let writing = world
            .controls
            .iter()
            .any(|c| c.in_flight.load(Ordering::SeqCst) > 0);
        if writing {
            if !self.waited.swap(true, Ordering::SeqCst) {
                trace.line_at(now, "restore waits for the writes in flight".to_owned());
            }
            return false;
        }
        *at = None;
        let Some((source, outbox)) = lock(&self.backup).take() else {
            return false;
        };
        let head = source.watermark();
        trace.line_at(now, format!("source restored to its backup at {head}"));
        // Writes still on the wire from before the writers stopped are refused until the
        // followers have read the restored source (see `server::WriteGate`).
        self.gate.close();
        world.memory.source.restore(&source);
        world.memory.outbox.restore(&outbox);
        world.jetstream.restore(head);
        world.history.restore(head);
        world.ledger.restore(head, now);
        world.sweeps.restored(head);
        for p in world.probes {
            p.restored(head, now);
        }
        true
    }

    /// Whether no restore is waiting to happen.
    fn done(&self) -> bool {
        lock(&self.restore_at).is_none()
    }

    /// Whether the writers, stopped for a restore, write again at `now` (once): as soon
    /// as the backup is back in. Followers are not waited for: one that reads the source
    /// only after the new history passed its watermark tells the two apart by what the
    /// source says of its history (issue 25).
    fn pause_over(&self, now: Duration) -> bool {
        let mut until = lock(&self.pause_until);
        let restored = lock(&self.restore_at).is_none();
        if restored && until.is_some_and(|at| at <= now) {
            *until = None;
            self.gate.open();
            true
        } else {
            false
        }
    }
}

impl World<'_> {
    fn store(&self, i: usize) -> Option<&MemoryCacheStore> {
        self.stores.get(i).and_then(Option::as_ref)
    }

    /// Schedules the restore of the last backup, if one was taken, once the writers
    /// stopped at `now` had their writes land; they write again right after it.
    fn schedule_restore(&self, now: Duration) {
        if lock(&self.restores.backup).is_none() {
            return;
        }
        // Writers stop first, as an operator's restore procedure has them do, and the
        // writes they had in flight land before the backup goes back in.
        for c in self.controls {
            c.quiet.store(true, Ordering::SeqCst);
        }
        let at = now + RESTORE_DRAIN;
        *lock(&self.restores.restore_at) = Some(at);
        let mut pause_until = lock(&self.restores.pause_until);
        *pause_until = Some(pause_until.map_or(at, |was| was.max(at)));
    }

    /// Throws follower `i`'s cache away (its durable store, and the probe's view): it
    /// starts cold at its next start. Its host must be down.
    fn wipe(&self, i: usize, now: Duration) {
        if let Some(store) = self.store(i) {
            store.wipe();
        }
        self.probes[i].wiped(now);
    }

    /// After a restore, the operator restarts the JetStream followers cold (their caches
    /// wiped; one down now starts cold when it comes back). A bucket restored from a
    /// backup keeps its identity here, and tidemark has no history id (README, "Open"):
    /// a follower of a sparse feed can hold, below its watermark, a key's older value
    /// because the replaced history overwrote the revision the restore puts back, and
    /// nothing tells it. The other kinds face the restore as they are.
    fn restart_sparse_followers_cold(
        &self,
        sim: &mut turmoil::Sim<'_>,
        crashed: &BTreeSet<String>,
        now: Duration,
    ) {
        for (i, spec) in self.specs.iter().enumerate() {
            if spec.kind != Kind::JetStream {
                continue;
            }
            let running = !crashed.contains(&spec.name);
            if running {
                sim.crash(spec.name.as_str());
            }
            self.wipe(i, now);
            if running {
                sim.bounce(spec.name.as_str());
            }
        }
    }
}

fn apply(
    sim: &mut turmoil::Sim<'_>,
    action: &Action,
    world: &World<'_>,
    crashed: &mut BTreeSet<String>,
    commit_crashes: &mut BTreeMap<usize, Duration>,
) {
    let World {
        memory,
        controls,
        specs,
        ..
    } = *world;
    match action {
        Action::Partition(a, b) => sim.partition(a.as_str(), b.as_str()),
        Action::PartitionOneWay(a, b) => sim.partition_oneway(a.as_str(), b.as_str()),
        Action::Repair(a, b) => sim.repair(a.as_str(), b.as_str()),
        Action::Hold(a, b) => sim.hold(a.as_str(), b.as_str()),
        Action::Release(a, b) => sim.release(a.as_str(), b.as_str()),
        Action::Latency(d) => sim.set_max_message_latency(*d),
        Action::FailRate(r) => sim.set_fail_rate(*r),
        Action::CrashFollower(i) => {
            let h = &specs[*i].name;
            if crashed.insert(h.clone()) {
                sim.crash(h.as_str());
            }
        }
        Action::RestartFollower(i) => {
            let h = &specs[*i].name;
            if crashed.remove(h) {
                sim.bounce(h.as_str());
            }
        }
        Action::CrashFollowerMidCommit(i, after_writes, down) => {
            // Armed until the follower's next commit, however long that takes.
            if let Some(store) = world.store(*i) {
                store.crash_next_commit(*after_writes);
                commit_crashes.insert(*i, *down);
            }
        }
        Action::SlowCommits(i, latency) => {
            if let Some(store) = world.store(*i) {
                store.set_write_latency(*latency);
            }
        }
        Action::FailHandler(i, n) => {
            if specs.get(*i).is_some_and(|f| f.supervised) {
                world.handler_faults[*i].store(*n, Ordering::SeqCst);
            }
        }
        Action::FailCommits(i, n) => {
            if let Some(store) = world.store(*i) {
                store.fail_next_commits(*n);
            }
        }
        Action::CrashSource => {
            if crashed.insert(SOURCE.into()) {
                sim.crash(SOURCE);
            }
        }
        Action::RestartSource => {
            if crashed.remove(SOURCE) {
                sim.bounce(SOURCE);
            }
        }
        Action::WriterCrashAfterCommit(i) => {
            if let Some(c) = controls.get(*i) {
                c.crash_after_commit.store(true, Ordering::SeqCst);
            }
        }
        Action::RestartWriter(i) => {
            let h = writer_host(*i);
            // The writer stalled after a commit (or never committed): crash, then start anew.
            if let Some(c) = controls.get(*i) {
                c.crash_after_commit.store(false, Ordering::SeqCst);
            }
            if !crashed.contains(&h) {
                sim.crash(h.as_str());
            }
            crashed.remove(&h);
            sim.bounce(h.as_str());
        }
        Action::DropAnnounce => memory.faults.mangle_next(Mangle::Drop),
        Action::DuplicateAnnounce => memory.faults.mangle_next(Mangle::Duplicate),
        Action::ReorderAnnounce => memory.faults.mangle_next(Mangle::Reorder),
        Action::DropWake => memory.faults.fail_next(Port::Notify, 1),
        Action::Poison(i) => {
            if let Some(c) = controls.get(*i) {
                c.poison_next.store(true, Ordering::SeqCst);
            }
        }
        Action::Compact => {
            let wm = memory.source.current_watermark();
            memory.source.compact_below(wm.saturating_sub(3));
        }
        Action::CrashRelay(i) => {
            let h = relay_host(*i);
            if crashed.insert(h.clone()) {
                sim.crash(h.as_str());
            }
        }
        Action::RestartRelay(i) => {
            let h = relay_host(*i);
            if crashed.remove(&h) {
                sim.bounce(h.as_str());
            }
        }
        Action::Foreign(draw) => publish_foreign(memory, *draw),
        Action::Backup => {
            *lock(&world.restores.backup) = Some((memory.source.backup(), memory.outbox.backup()));
            world.jetstream.backup();
        }
        Action::Restore => world.schedule_restore(sim.elapsed()),
        Action::CrashRunner(i) => {
            let h = relay_host(*i);
            // Only while it runs a job: a crash with no lease held is a relay crash.
            if world.jobs.running_on(&h) && crashed.insert(h.clone()) {
                sim.crash(h.as_str());
            }
        }
        Action::CrashSweeper(down) => world.sweeps.arm_crash(*down),
        Action::StallSweeper(stall) => world.sweeps.arm_stall(*stall),
        Action::CrashScheduler {
            after_enqueue,
            down,
        } => world.sweeps.arm_scheduler_crash(*after_enqueue, *down),
        Action::SlowJob => world.job_faults.slow_next.store(true, Ordering::SeqCst),
        Action::FailJobs(n) => world.job_faults.fail_next.store(*n, Ordering::SeqCst),
        // Carried out by the orchestrator, flap by flap.
        Action::Storm(..) => {}
    }
}

/// Publishes foreign and adversarial payloads on the events stream, straight into the
/// source host's stream as another producer would: JSON that is not an event, bytes that
/// are not JSON, events with seqs near `u64::MAX`, and events of another history (a seq
/// the source has, with another value or key).
fn publish_foreign(memory: &Memory, draw: u64) {
    let head = memory.source.current_watermark();
    let key = format!("hot-{}", draw % 8);
    let near_max = u64::MAX - draw % 3;
    let other_seq = 1 + draw % head.max(1);
    let payloads: Vec<(String, Vec<u8>)> = vec![
        (key.clone(), br#"{"hello":"world"}"#.to_vec()),
        (key.clone(), b"\"just a string\"".to_vec()),
        (key.clone(), br#"{"kind":"put","seq":7,"key":"#.to_vec()),
        (key.clone(), vec![0xff, 0x00, 0x13]),
        (
            key.clone(),
            format!(r#"{{"kind":"put","seq":"{head}","key":"{key}","value":"eA=="}}"#).into_bytes(),
        ),
        (
            key.clone(),
            format!(r#"{{"kind":"put","seq":{near_max},"key":"{key}","value":"Zm9yZWlnbg=="}}"#)
                .into_bytes(),
        ),
        (
            key.clone(),
            format!(r#"{{"kind":"removed","seq":{near_max},"key":"{key}"}}"#).into_bytes(),
        ),
        (
            "cold-x".into(),
            format!(r#"{{"kind":"mutation","seq":{},"key":"cold-x"}}"#, u64::MAX).into_bytes(),
        ),
        (
            key.clone(),
            format!(r#"{{"kind":"put","seq":{other_seq},"key":"{key}","value":"b3RoZXI="}}"#)
                .into_bytes(),
        ),
        (
            format!("foreign-{draw}"),
            format!(
                r#"{{"kind":"put","seq":{},"key":"foreign-{draw}","value":"b3RoZXI="}}"#,
                head + 1 + draw % 5
            )
            .into_bytes(),
        ),
    ];
    for (key, payload) in payloads {
        let _ = poll_once(Publish::publish(&memory.events, &key, payload));
    }
}

/// What a run saw besides its failures.
struct Seen<'a> {
    ledger: &'a RelayLedger,
    sweeps: &'a SweepLedger,
    jobs: &'a JobLedger,
    trace: &'a Trace,
    history: &'a History,
    probes: &'a [Probe],
    commit_crashes: u32,
}

fn finish(
    seed: u64,
    failures: Vec<String>,
    faults: BTreeMap<FaultKind, u32>,
    converged_after: Option<Duration>,
    seen: &Seen<'_>,
) -> Outcome {
    let (mut failed_commits, mut warm_restarts, mut worker_restarts) = (0, 0, 0);
    for p in seen.probes {
        let s = p.state();
        failed_commits += s.failed_commits;
        warm_restarts += s.warm_restarts;
        worker_restarts += s.worker_restarts;
    }
    Outcome {
        seed,
        failures,
        faults,
        converged_after,
        trace_hash: seen.trace.hash(),
        trace: seen.trace.lines(),
        watermark: seen.history.watermark(),
        commit_crashes: seen.commit_crashes,
        failed_commits,
        warm_restarts,
        worker_restarts,
        relay_repeats: seen.ledger.repeats(),
        relayed: u32::try_from(seen.ledger.published_seqs().len()).unwrap_or(u32::MAX),
        jobs: seen.jobs.counts(),
        sweeps: SweepCounts {
            jobs_removed: seen.jobs.jobs_removed(),
            ..seen.sweeps.counts()
        },
        part_reads: crate::clients::remote::take_part_reads(),
    }
}
