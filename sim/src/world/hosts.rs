//! The hosts' programs: writers through the announcing registry, relays and worker hosts
//! (job runners and retention beside each relay), and followers of every kind, each
//! watched by its probe. What outlives a host (its control knobs, a persisted follower's
//! store) is made by the world and handed in.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::{Event, FollowerConfig, Phase, RestartPolicy, Rng, Utf8};
use tidemark::{
    Announcer, AnnouncingRegistry, FollowerTask, NoFeed, Relay, Sink, Source, StopSignal,
    Supervisor, Worker, WorkerPhase, WorkerSink,
};
use tidemark_memory::MemoryCacheStore;

use super::jobs::JobFaults;
use super::jobs::{self as jobs_host};
use super::retention;
use crate::checks::jobs::JobLedger;
use crate::checks::oracle::{FeedSkips, History, Probe};
use crate::clients::kv::RemoteKv;
use crate::clients::listener::ReconnectingListener;
use crate::clients::naive::{Durable, EventsAsReplay, ForgetsIndex, NewOnlyFeed, WatermarkFirst};
use crate::clients::remote::{Remote, RemoteEvents};
use crate::scenario::{Durability, FollowerSpec, Kind, SOURCE, Workload, relay_host};
use crate::trace::Trace;

/// The wake channel writers announce on.
pub const CHANNEL: &str = "changes";

#[derive(Debug, Default)]
pub(super) struct WriterControl {
    pub(super) crash_after_commit: AtomicBool,
    pub(super) poison_next: AtomicBool,
    pub(super) quiet: AtomicBool,
    /// Writes to the source sent and not yet answered (or given up): a restore waits for
    /// them, as an operator's procedure stops the writers before it.
    pub(super) in_flight: AtomicU32,
    pub(super) starts: AtomicU64,
    /// Cold keys this writer wrote and has not removed (outlives its crashes).
    pub(super) cold: Mutex<Vec<String>>,
    /// Cold keys written so far (each name is used once).
    pub(super) cold_written: AtomicU64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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

pub(super) async fn writer(
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
    // Which puts are marker races (`Workload::marker_races`): a stream of its own, so every
    // other draw of the writer stays what it was.
    let mut races = Rng::new(seed ^ 0x6d61_726b_7261_6365 ^ ((i as u64 + 1) << 32) ^ (start << 48));
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
            let marker = rng.next_f64() < 0.15;
            if key.starts_with("hot-") && races.next_f64() < workload.marker_races {
                marker_race(i, &registry, &key, value, &mut races, &trace).await;
                continue;
            }
            if marker {
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

/// A marker whose key is overwritten and then removed before anything is announced (a
/// slow announcer): the marker, the overwrite and the removal are announced after all
/// three committed, in their order. A follower fetching the marker finds the key absent,
/// a removal the read does not date, while the overwrite's announcement, older than that
/// removal, is still on its way (the NATS campaign with markers: a key dropped, then
/// shown again at an older seq).
async fn marker_race<S: Source, P: tidemark::Publish, W: tidemark::Wake, Q: tidemark::Queue>(
    i: usize,
    registry: &AnnouncingRegistry<S, P, W, Q>,
    key: &str,
    value: Vec<u8>,
    races: &mut Rng,
    trace: &Trace,
) {
    let again = format!("v{}", races.next_u64() % 1_000_000).into_bytes();
    let source = registry.source();
    let (marked, put, removed) = match (
        source.put(key, value).await,
        source.put(key, again.clone()).await,
        source.remove(key).await,
    ) {
        (Ok(marked), Ok(put), Ok(Some(removed))) => (marked, put, removed),
        (marked, put, removed) => {
            trace.line(format!(
                "writer-{i} marker race on {key} cut short: {:?} {:?} {:?}",
                marked.map_err(|e| e.to_string()),
                put.map_err(|e| e.to_string()),
                removed.map_err(|e| e.to_string())
            ));
            return;
        }
    };
    for event in [
        Event::Mutation {
            seq: marked,
            key: key.to_owned(),
        },
        Event::Put {
            seq: put,
            key: key.to_owned(),
            value: again.clone(),
        },
        Event::Removed {
            seq: removed,
            key: key.to_owned(),
        },
    ] {
        let report = registry.announce(&event).await;
        trace.line(format!(
            "writer-{i} race-announced {} {key}@{} {report:?}",
            match event {
                Event::Put { .. } => "put",
                Event::Removed { .. } => "removal",
                _ => "marker",
            },
            event.seq()
        ));
    }
}

/// How long a relay's claim on outbox rows lasts in the simulated world: short, so a
/// crashed or partitioned relay's rows are taken over within the run.
pub const RELAY_LEASE: Duration = Duration::from_secs(2);

/// Rows a relay claims at a time: few, so relays interleave and leases lapse mid-drain.
const RELAY_BATCH: usize = 4;

/// A worker host: a relay, a job runner and retention (a sweep driver or a sweep
/// scheduler, see [`retention`]), as one process of a user's deployment runs them; a crash
/// takes them all down.
pub(super) async fn worker_host(
    i: usize,
    seed: u64,
    trace: Trace,
    jobs: JobLedger,
    job_faults: Arc<JobFaults>,
) -> turmoil::Result {
    let naive_ticks = job_faults.naive_ticks.load(Ordering::SeqCst);
    let runner = jobs_host::runner(
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

pub(super) async fn follower(
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
            // The ready-made cache, which lives only in the process: it holds values, so
            // a new history equal to them is restamped, and the probe checks that too.
            let (writer, _) = tidemark::cache::<String>();
            drive(&spec, config, probe.sink(writer), false).await
        }
        (durability, Some(store)) => {
            let sink = match durability {
                Durability::ForgetsIndex => Durable::ForgetsIndex(ForgetsIndex(store.sink())),
                Durability::WatermarkFirst => Durable::WatermarkFirst(WatermarkFirst(store.sink())),
                Durability::Store | Durability::Volatile => Durable::Store(store.sink()),
            };
            drive(&spec, config, probe.sink(sink), true).await
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
pub(super) fn probes(
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
