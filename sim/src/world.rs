//! One simulated run: the hosts, the fault plan carried out over simulated time, the safety
//! checks after every step and the liveness phase.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{Event, Follower, FollowerConfig, Rng, Utf8};
use tidemark::{AnnouncingRegistry, FollowerTask, NoFeed, Source, StopSignal};
use tidemark_memory::{Mangle, Memory, MemoryQueue, Port};

use crate::listener::ReconnectingListener;
use crate::naive::{EventsAsReplay, NewOnlyFeed};
use crate::oracle::{History, Probe, differences};
use crate::remote::{Remote, RemoteEvents};
use crate::scenario::{
    Action, FaultKind, SOURCE, Scenario, Strategy, follower_host, plan, writer_host,
};
use crate::server;
use crate::trace::Trace;

/// The wake channel writers announce on.
pub const CHANNEL: &str = "changes";

/// How a follower learns about changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Follows the source's change log (gapless), catches up on wakes too.
    Log,
    /// A wake runner: reconciles on start and on every wake, no feed.
    WakeOnly,
    /// Follows the announcements stream, reconciles first and on every wake.
    Events,
    /// Naive: watches the change log from its current head only.
    NewOnly,
    /// Naive: replays announcements and never reconciles.
    EventsNoReconcile,
}

/// One follower's setup.
#[derive(Clone, Debug)]
pub struct FollowerSpec {
    /// Host name.
    pub name: String,
    /// How it follows.
    pub kind: Kind,
    /// Whether its cache survives its crashes.
    pub persisted: bool,
}

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
    starts: AtomicU64,
}

/// Commits through the remote source; when armed, stalls forever right after a commit, so
/// the announcement never happens (the orchestrator then crashes the host).
#[derive(Clone, Debug)]
struct CrashAfterCommit {
    remote: Remote,
    control: Arc<WriterControl>,
}

impl CrashAfterCommit {
    async fn maybe_stall(&self) {
        if self
            .control
            .crash_after_commit
            .swap(false, Ordering::SeqCst)
        {
            std::future::pending::<()>().await;
        }
    }
}

impl Source for CrashAfterCommit {
    async fn put(&self, key: &str, value: Vec<u8>) -> tidemark::Result<u64> {
        let seq = self.remote.put(key, value).await?;
        self.maybe_stall().await;
        Ok(seq)
    }
    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> tidemark::Result<u64> {
        let seq = self.remote.update(key, value, expected).await?;
        self.maybe_stall().await;
        Ok(seq)
    }
    async fn remove(&self, key: &str) -> tidemark::Result<Option<u64>> {
        let seq = self.remote.remove(key).await?;
        self.maybe_stall().await;
        Ok(seq)
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
    async fn first_available(&self) -> tidemark::Result<u64> {
        self.remote.first_available().await
    }
}

async fn writer(i: usize, seed: u64, control: Arc<WriterControl>, trace: Trace) -> turmoil::Result {
    let start = control.starts.fetch_add(1, Ordering::SeqCst);
    let remote = Remote::new(SOURCE);
    let source = CrashAfterCommit {
        remote: remote.clone(),
        control: Arc::clone(&control),
    };
    let registry = AnnouncingRegistry::new(
        source,
        remote.clone(),
        remote.clone(),
        MemoryQueue::default(),
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
        // Skewed keys: a few hot keys written often, many written once and never again.
        let key = if rng.next_f64() < 0.7 {
            format!("hot-{}", rng.next_u64() % 8)
        } else {
            format!("once-{i}-{}", rng.next_u64() % 10_000)
        };
        if rng.next_f64() < 0.2 {
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

async fn follower(spec: FollowerSpec, seed: u64, probe: Probe) -> turmoil::Result {
    probe.restart(spec.persisted);
    let remote = Remote::new(SOURCE);
    let config = FollowerConfig::builder(spec.name.clone())
        .seed(seed)
        .build()?;
    let core = if spec.persisted {
        let s = probe.state();
        let keys: Vec<(String, u64)> = s
            .cache
            .iter()
            .map(|(k, (seq, _))| (k.clone(), *seq))
            .collect();
        Follower::resume(config, Utf8, s.watermark, keys)
    } else {
        Follower::new(config, Utf8)
    };
    let wake = || ReconnectingListener::new(remote.clone(), CHANNEL);
    let stop = StopSignal::never();
    let status = match spec.kind {
        Kind::Log => {
            FollowerTask::from_core(core, remote.clone(), remote.clone(), probe)
                .with_wake(wake())
                .run(stop.clone())
                .await
        }
        Kind::WakeOnly => {
            FollowerTask::from_core(core, remote.clone(), NoFeed, probe)
                .with_wake(wake())
                .run(stop.clone())
                .await
        }
        Kind::Events => {
            FollowerTask::from_core(core, remote.clone(), RemoteEvents(remote.clone()), probe)
                .with_wake(wake())
                .run(stop.clone())
                .await
        }
        Kind::NewOnly => {
            FollowerTask::from_core(core, remote.clone(), NewOnlyFeed(remote.clone()), probe)
                .run(stop.clone())
                .await
        }
        Kind::EventsNoReconcile => {
            let events = EventsAsReplay(RemoteEvents(remote.clone()));
            FollowerTask::from_core(core, remote.clone(), events, probe)
                .run(stop.clone())
                .await
        }
    };
    status?;
    Ok(())
}

/// The followers of a scenario.
#[must_use]
pub fn followers(s: &Scenario) -> Vec<FollowerSpec> {
    (0..s.followers)
        .map(|i| {
            let kind = match s.strategy {
                Strategy::Correct => [Kind::Log, Kind::WakeOnly, Kind::Events][i % 3],
                Strategy::WatchNewOnly => Kind::NewOnly,
                Strategy::NoReconcile => Kind::EventsNoReconcile,
            };
            FollowerSpec {
                name: follower_host(i),
                kind,
                persisted: i % 2 == 1,
            }
        })
        .collect()
}

/// Runs one seed of `scenario`.
#[must_use]
pub fn run(seed: u64, scenario: &Scenario) -> Outcome {
    let trace = Trace::new(scenario.keep_trace);
    let history = History::default();
    let memory = Memory::new();
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(
            scenario.fault_phase + scenario.liveness_bound + Duration::from_secs(30),
        )
        .tick_duration(Duration::from_millis(2))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(50))
        .build();

    {
        let (memory, history) = (memory.clone(), history.clone());
        sim.host(SOURCE, move || {
            server::serve(memory.clone(), history.clone())
        });
    }
    let controls: Vec<Arc<WriterControl>> = (0..scenario.writers).map(|_| Arc::default()).collect();
    for (i, control) in controls.iter().enumerate() {
        let (control, trace) = (Arc::clone(control), trace.clone());
        sim.host(writer_host(i).as_str(), move || {
            writer(i, seed, Arc::clone(&control), trace.clone())
        });
    }
    let specs = followers(scenario);
    let probes: Vec<Probe> = specs
        .iter()
        .map(|f| Probe::new(f.name.clone(), history.clone(), trace.clone()))
        .collect();
    for (i, (spec, probe)) in specs.iter().zip(&probes).enumerate() {
        let (spec, probe) = (spec.clone(), probe.clone());
        let fseed = seed.wrapping_mul(31).wrapping_add(i as u64);
        sim.host(spec.name.clone().as_str(), move || {
            follower(spec.clone(), fseed, probe.clone())
        });
    }

    let mut failures = Vec::new();
    let mut faults: BTreeMap<FaultKind, u32> = BTreeMap::new();
    let mut plan = plan(seed, scenario).into_iter().peekable();
    let mut crashed: BTreeSet<String> = BTreeSet::new();
    let all_hosts: Vec<String> = specs
        .iter()
        .map(|f| f.name.clone())
        .chain((0..scenario.writers).map(writer_host))
        .collect();

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
        true
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
            trace.line(format!("fault {action}"));
            apply(&mut sim, &action, &memory, &controls, &specs, &mut crashed);
        }
        if !step(&mut sim, &mut failures) {
            return finish(seed, failures, faults, None, &trace, &history);
        }
    }

    // Liveness phase: heal everything, quiesce the writers, demand convergence.
    trace.line("heal".into());
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
    for h in std::mem::take(&mut crashed) {
        sim.bounce(h.as_str());
    }
    let healed_at = sim.elapsed();
    // An operator's reconcile pass after an incident: one wake once listeners are back.
    let mut woke = false;
    let mut converged_after = None;
    while sim.elapsed() < healed_at + scenario.liveness_bound {
        if !woke && sim.elapsed() >= healed_at + Duration::from_secs(3) {
            woke = true;
            wake_all(&memory);
        }
        if !step(&mut sim, &mut failures) {
            return finish(seed, failures, faults, None, &trace, &history);
        }
        if woke && converged(&probes, &history) {
            converged_after = Some(sim.elapsed() - healed_at);
            break;
        }
    }
    if converged_after.is_none() {
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
    finish(seed, failures, faults, converged_after, &trace, &history)
}

fn wake_all(memory: &Memory) {
    // The memory wake's notify completes on its first poll; drive it without a runtime.
    let fut = tidemark::Wake::notify(&memory.wake, CHANNEL, Vec::new());
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut fut = std::pin::pin!(fut);
    let _ = fut.as_mut().poll(&mut cx);
}

fn converged(probes: &[Probe], history: &History) -> bool {
    let wm = history.watermark();
    let expected = history.expected_at(wm);
    probes.iter().all(|p| {
        let s = p.state();
        s.ready && s.watermark == wm && differences(&s.cache, &expected).is_empty()
    })
}

fn apply(
    sim: &mut turmoil::Sim<'_>,
    action: &Action,
    memory: &Memory,
    controls: &[Arc<WriterControl>],
    specs: &[FollowerSpec],
    crashed: &mut BTreeSet<String>,
) {
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
    }
}

fn finish(
    seed: u64,
    failures: Vec<String>,
    faults: BTreeMap<FaultKind, u32>,
    converged_after: Option<Duration>,
    trace: &Trace,
    history: &History,
) -> Outcome {
    Outcome {
        seed,
        failures,
        faults,
        converged_after,
        trace_hash: trace.hash(),
        trace: trace.lines(),
        watermark: history.watermark(),
    }
}
