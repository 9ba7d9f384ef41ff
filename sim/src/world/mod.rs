//! One simulated run: the hosts, the fault plan carried out over simulated time, the safety
//! checks after every step and the liveness phase.

mod faults;
mod hosts;
pub mod jobs;
pub mod retention;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tidemark::{Cursors, Outbox};
use tidemark_memory::{Memory, MemoryCacheStore, MemoryOutbox};

use self::faults::{Restores, World, apply, poll_once};
use self::hosts::{WriterControl, follower, probes, worker_host, writer};
use self::jobs::JobFaults;
use crate::checks::jobs::JobLedger;
use crate::checks::oracle::{Expect, FeedSkips, History, Probe, RelayLedger, differences, holds};
use crate::checks::sweeps::{SweepCounts, SweepLedger};
use crate::clients::remote::PartReads;
use crate::hosts::jetstream::JetStream;
use crate::hosts::queue;
use crate::hosts::source as server;
use crate::hosts::sweeps::Sweeps;
use crate::scenario::{
    Action, FaultKind, FollowerSpec, Kind, SOURCE, Scenario, Strategy, followers, plan, relay_host,
    writer_host,
};
use crate::trace::Trace;

pub use self::hosts::CHANNEL;

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

/// Runs one seed of `scenario`, in phases: build the world, carry out the fault plan with
/// the safety checks after every step, heal, demand convergence within the bound, and
/// give the verdict.
#[must_use]
pub fn run(seed: u64, scenario: &Scenario) -> Outcome {
    let (mut sim, parts, gate) = build(seed, scenario);
    let restores = Restores::new(gate, scenario.recreations_while_cut);
    let world = parts.world(&restores);
    let mut failures = Vec::new();
    let mut downs = Downs::default();
    let lived = fault_phase(
        &mut sim,
        seed,
        scenario,
        &parts,
        &world,
        &mut downs,
        &mut failures,
    )
    .and_then(|()| {
        heal(&mut sim, scenario, &parts, &mut downs.crashed);
        liveness(&mut sim, scenario, &parts, &world, &downs, &mut failures)
    });
    // A safety check that failed ends the run where it failed: no verdict on liveness.
    let converged_after = match lived {
        Ok(Some(after)) => {
            check_what_converged(&parts, &mut failures);
            Some(after)
        }
        Ok(None) => {
            tell_what_did_not_converge(scenario, &parts, &mut failures);
            None
        }
        Err(Unsafe) => None,
    };
    finish(
        seed,
        failures,
        downs.faults,
        converged_after,
        &parts.seen(downs.landed),
    )
}

/// What a run makes before its first step and keeps to its end, outliving every host: the
/// source's memory and its JetStream bucket, the writers' controls, the followers' specs,
/// probes and stores, the faults armed for handlers and jobs, and the checks.
struct Parts {
    trace: Trace,
    history: History,
    ledger: RelayLedger,
    memory: Memory,
    jobs: JobLedger,
    job_faults: Arc<JobFaults>,
    sweeps: Sweeps,
    jetstream: JetStream,
    /// Whether the source host leaves reads unanswered ([`Scenario::silences`]).
    silence: server::Silence,
    controls: Vec<Arc<WriterControl>>,
    specs: Vec<FollowerSpec>,
    probes: Vec<Probe>,
    /// A persisted follower's durable store lives outside its host, like a disk.
    stores: Vec<Option<MemoryCacheStore>>,
    /// Handler failures armed for supervised workers (outlive their hosts too).
    handler_faults: Vec<Arc<AtomicU32>>,
}

impl Parts {
    /// What the fault actions reach, with the restores.
    fn world<'a>(&'a self, restores: &'a Restores) -> World<'a> {
        World {
            memory: &self.memory,
            jetstream: &self.jetstream,
            controls: &self.controls,
            specs: &self.specs,
            stores: &self.stores,
            handler_faults: &self.handler_faults,
            history: &self.history,
            ledger: &self.ledger,
            probes: &self.probes,
            restores,
            silence: &self.silence,
            jobs: &self.jobs,
            job_faults: &self.job_faults,
            sweeps: &self.sweeps.ledger,
        }
    }

    /// What the verdict reads besides the failures.
    fn seen(&self, commit_crashes: u32) -> Seen<'_> {
        Seen {
            ledger: &self.ledger,
            sweeps: &self.sweeps.ledger,
            jobs: &self.jobs,
            trace: &self.trace,
            history: &self.history,
            probes: &self.probes,
            commit_crashes,
        }
    }
}

/// The source's clock for leases: the simulation's, read outside every host. A source host
/// that restarts gets a new runtime, whose `Instant`s would not compare with the leases
/// taken before.
fn sim_clock() -> impl Fn() -> tokio::time::Instant + Copy + Send + Sync + 'static {
    let base = tokio::time::Instant::now();
    move || base + turmoil::sim_elapsed().unwrap_or_default()
}

/// The build phase: the parts of the run, and the simulation with every host on it (the
/// source host, the relays' worker hosts, the writers, the followers, in that order).
fn build<'a>(seed: u64, scenario: &Scenario) -> (turmoil::Sim<'a>, Parts, server::WriteGate) {
    // Counted from here: a run is simulated on one thread, which may have run others.
    let _ = crate::clients::remote::take_part_reads();
    let trace = Trace::new(scenario.keep_trace);
    let history = History::default();
    let mut memory = Memory::new();
    // Outbox and queue leases on the simulation's clock.
    let clock = sim_clock();
    memory.outbox = MemoryOutbox::with_clock(memory.faults.clone(), clock);
    memory.queue = queue::source_queue(memory.faults.clone(), clock);
    let job_faults = Arc::new(JobFaults::default());
    job_faults
        .naive_ticks
        .store(scenario.strategy == Strategy::NaiveTicks, Ordering::SeqCst);
    let specs = followers(scenario);
    // The durable consumers, whose events the sweeps must keep (up to the maximum age).
    let cursors = specs
        .iter()
        .filter(|f| f.kind == Kind::Events && f.persisted())
        .map(|f| f.name.clone())
        .collect();
    let sweeps = Sweeps::new(&memory, clock, cursors, history.clone());
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
    let parts = Parts {
        probes: probes(&specs, &history, &trace, &skips),
        stores: specs
            .iter()
            .map(|f| f.persisted().then(MemoryCacheStore::new))
            .collect(),
        handler_faults: specs.iter().map(|_| Arc::default()).collect(),
        controls: (0..scenario.writers).map(|_| Arc::default()).collect(),
        specs,
        trace,
        history,
        ledger: RelayLedger::default(),
        memory,
        jobs: JobLedger::default(),
        job_faults,
        sweeps,
        jetstream,
        silence: server::Silence::default(),
    };
    let host = server::SourceHost {
        memory: parts.memory.clone(),
        history: parts.history.clone(),
        ledger: parts.ledger.clone(),
        jobs: parts.jobs.clone(),
        sweeps: parts.sweeps.clone(),
        jetstream: parts.jetstream.clone(),
        silence: parts.silence.clone(),
    };
    let source_gate = gate.clone();
    sim.host(SOURCE, move || {
        server::serve(host.clone(), source_gate.clone())
    });
    add_workers(&mut sim, seed, scenario, &parts);
    add_followers(&mut sim, seed, &parts);
    (sim, parts, gate)
}

/// The worker hosts (a relay, a job runner and retention each) and the writers.
fn add_workers(sim: &mut turmoil::Sim<'_>, seed: u64, scenario: &Scenario, parts: &Parts) {
    for i in 0..scenario.relays {
        let (trace, jobs) = (parts.trace.clone(), parts.jobs.clone());
        let job_faults = Arc::clone(&parts.job_faults);
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
    for (i, control) in parts.controls.iter().enumerate() {
        let (control, trace) = (Arc::clone(control), parts.trace.clone());
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
}

/// The followers, each with its probe, its store if persisted, and its handler faults.
fn add_followers(sim: &mut turmoil::Sim<'_>, seed: u64, parts: &Parts) {
    let each = parts.specs.iter().zip(&parts.probes).zip(&parts.stores);
    for (i, ((spec, probe), store)) in each.enumerate() {
        let (spec, probe, store) = (spec.clone(), probe.clone(), store.clone());
        let faults = Arc::clone(&parts.handler_faults[i]);
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
}

/// A safety check failed at a step: the run ends there, with its failures.
struct Unsafe;

/// One simulation step, then the safety checks: every probe, the relays', job runners' and
/// sweeps' ledgers, and the JetStream bucket beside the source. The first violation found
/// is a failure.
fn step(
    sim: &mut turmoil::Sim<'_>,
    parts: &Parts,
    failures: &mut Vec<String>,
) -> Result<(), Unsafe> {
    if let Err(e) = sim.step() {
        failures.push(format!("a host failed: {e}"));
        return Err(Unsafe);
    }
    for (spec, probe) in parts.specs.iter().zip(&parts.probes) {
        let s = probe.state();
        if let Some(v) = s.violations.first() {
            failures.push(format!("{}: {v}", spec.name));
            return Err(Unsafe);
        }
    }
    let ledgers = [
        ("relays", parts.ledger.violations()),
        ("job runners", parts.jobs.violations()),
        ("sweeps", parts.sweeps.ledger.violations()),
        ("jetstream", parts.jetstream.out_of_step()),
    ];
    for (who, violations) in ledgers {
        if let Some(v) = violations.first() {
            failures.push(format!("{who}: {v}"));
            return Err(Unsafe);
        }
    }
    Ok(())
}

/// What the fault phase keeps from step to step: hosts down and when they come back,
/// links held and flapping, and what it counted.
#[derive(Default)]
struct Downs {
    /// Faults injected, by kind.
    faults: BTreeMap<FaultKind, u32>,
    crashed: BTreeSet<String>,
    /// Commit crashes armed (follower → time down).
    commit_crashes: BTreeMap<usize, Duration>,
    /// Followers crashed in a commit, and when they restart.
    restarts: Vec<(Duration, usize)>,
    /// Worker hosts crashed holding the sweeper lock (or between a tick's claim and its
    /// record), and when they restart.
    sweeper_restarts: Vec<(Duration, String)>,
    /// Worker hosts stalled holding the sweeper lock, and when their link is released.
    stalls: Vec<(Duration, String)>,
    /// Commits a crash interrupted.
    landed: u32,
    /// The flaps of reconnect storms still to come: (when, host, partition or repair).
    flaps: Vec<(Duration, String, bool)>,
}

/// The fault phase: the plan carried out over simulated time, the safety checks after
/// every step, and the crashes the ledgers and stores armed landing as they come due.
fn fault_phase(
    sim: &mut turmoil::Sim<'_>,
    seed: u64,
    scenario: &Scenario,
    parts: &Parts,
    world: &World<'_>,
    downs: &mut Downs,
    failures: &mut Vec<String>,
) -> Result<(), Unsafe> {
    let mut plan = plan(seed, scenario).into_iter().peekable();
    while sim.elapsed() < scenario.fault_phase {
        while let Some((at, _)) = plan.peek() {
            if *at > sim.elapsed() {
                break;
            }
            let Some((_, action)) = plan.next() else {
                break;
            };
            carry_out(sim, &action, parts, world, downs);
        }
        let now = sim.elapsed();
        for (_, h, cut) in downs.flaps.iter().filter(|(at, _, _)| *at <= now) {
            if *cut {
                sim.partition(SOURCE, h.as_str());
            } else {
                sim.repair(SOURCE, h.as_str());
            }
        }
        downs.flaps.retain(|(at, _, _)| *at > now);
        if world.restores.restore_if_due(now, world, &parts.trace) {
            world.restart_sparse_followers_cold(sim, &downs.crashed, now);
        }
        if world.restores.pause_over(now) {
            parts
                .trace
                .line_at(now, "writers resume after the restore".into());
            for c in &parts.controls {
                c.quiet.store(false, Ordering::SeqCst);
            }
        }
        step(sim, parts, failures)?;
        land_armed_crashes(sim, parts, downs);
        bring_back(sim, parts, downs);
    }
    Ok(())
}

/// One action of the plan, counted and traced; a reconnect storm is laid out as flaps.
fn carry_out(
    sim: &mut turmoil::Sim<'_>,
    action: &Action,
    parts: &Parts,
    world: &World<'_>,
    downs: &mut Downs,
) {
    if let Some(kind) = action.kind() {
        *downs.faults.entry(kind).or_default() += 1;
    }
    parts
        .trace
        .line_at(sim.elapsed(), format!("fault {action}"));
    if let Action::Storm(h, n, each) = action {
        let now = sim.elapsed();
        for k in 0..*n {
            downs.flaps.push((now + *each * (2 * k), h.clone(), true));
            downs
                .flaps
                .push((now + *each * (2 * k + 1), h.clone(), false));
        }
        return;
    }
    apply(
        sim,
        action,
        world,
        &mut downs.crashed,
        &mut downs.commit_crashes,
    );
}

/// The crashes armed earlier that land at this step: a commit the plan crashes stopped
/// halfway (the host dies now, and comes back after its time down), a worker host seen
/// holding the sweeper lock, a scheduler between a tick's claim and its record, and a
/// sweeper stalled holding the lock.
fn land_armed_crashes(sim: &mut turmoil::Sim<'_>, parts: &Parts, downs: &mut Downs) {
    let trace = &parts.trace;
    for (i, (spec, store)) in parts.specs.iter().zip(&parts.stores).enumerate() {
        if let Some(store) = store
            && store.take_stalled()
            && downs.crashed.insert(spec.name.clone())
        {
            let down = downs.commit_crashes.remove(&i).unwrap_or_default();
            downs.landed += 1;
            trace.line_at(
                sim.elapsed(),
                format!("{} crashed in the middle of a commit", spec.name),
            );
            sim.crash(spec.name.as_str());
            downs.restarts.push((sim.elapsed() + down, i));
        }
    }
    let ledger = &parts.sweeps.ledger;
    if let Some((h, down)) = ledger.armed_holder() {
        if downs.crashed.insert(h.clone()) {
            trace.line_at(
                sim.elapsed(),
                format!("{h} crashed holding the sweeper lock"),
            );
            sim.crash(h.as_str());
            downs.sweeper_restarts.push((sim.elapsed() + down, h));
        }
    }
    if let Some((h, down)) = ledger.doomed_scheduler()
        && downs.crashed.insert(h.clone())
    {
        trace.line_at(
            sim.elapsed(),
            format!("{h} crashed between a tick's claim and its record"),
        );
        sim.crash(h.as_str());
        downs.sweeper_restarts.push((sim.elapsed() + down, h));
    }
    if let Some((h, stall)) = ledger.stalled_holder() {
        trace.line_at(
            sim.elapsed(),
            format!("{h} stalls holding the sweeper lock"),
        );
        sim.hold(SOURCE, h.as_str());
        downs.stalls.push((sim.elapsed() + stall, h));
    }
}

/// What comes back at this step: stalled links released, crashed sweepers and followers
/// crashed in a commit restarted once their time down is over.
fn bring_back(sim: &mut turmoil::Sim<'_>, parts: &Parts, downs: &mut Downs) {
    let now = sim.elapsed();
    for (_, h) in downs.stalls.iter().filter(|(at, _)| *at <= now) {
        sim.release(SOURCE, h.as_str());
    }
    downs.stalls.retain(|(at, _)| *at > now);
    for (_, h) in downs.sweeper_restarts.iter().filter(|(at, _)| *at <= now) {
        if downs.crashed.remove(h) {
            sim.bounce(h.as_str());
        }
    }
    downs.sweeper_restarts.retain(|(at, _)| *at > now);
    let due: Vec<usize> = downs
        .restarts
        .iter()
        .filter(|(at, _)| *at <= now)
        .map(|(_, i)| *i)
        .collect();
    downs.restarts.retain(|(at, _)| *at > now);
    for i in due {
        let h = &parts.specs[i].name;
        if downs.crashed.remove(h) {
            parts
                .trace
                .line_at(now, format!("{h} restarts after its commit crash"));
            sim.bounce(h.as_str());
        }
    }
}

/// The heal: every link repaired and released, every fault disarmed, the writers quiet,
/// every crashed host restarted.
fn heal(
    sim: &mut turmoil::Sim<'_>,
    scenario: &Scenario,
    parts: &Parts,
    crashed: &mut BTreeSet<String>,
) {
    parts.trace.line_at(sim.elapsed(), "heal".into());
    parts.silence.set(false);
    for c in &parts.controls {
        c.quiet.store(true, Ordering::SeqCst);
        c.crash_after_commit.store(false, Ordering::SeqCst);
        c.poison_next.store(false, Ordering::SeqCst);
    }
    let all_hosts = parts
        .specs
        .iter()
        .map(|f| f.name.clone())
        .chain((0..scenario.writers).map(writer_host))
        .chain((0..scenario.relays).map(relay_host));
    for h in all_hosts {
        sim.repair(SOURCE, h.as_str());
        sim.release(SOURCE, h.as_str());
    }
    sim.set_fail_rate(0.0);
    sim.set_max_message_latency(Duration::from_millis(50));
    parts.memory.faults.heal();
    parts.memory.events.release_held();
    for store in parts.stores.iter().flatten() {
        store.heal();
    }
    for f in &parts.handler_faults {
        f.store(0, Ordering::SeqCst);
    }
    parts.job_faults.slow_next.store(false, Ordering::SeqCst);
    parts.job_faults.fail_next.store(0, Ordering::SeqCst);
    for h in std::mem::take(crashed) {
        sim.bounce(h.as_str());
    }
}

/// The liveness phase: how long after the heal every follower held the source's state,
/// the outbox was drained and every job settled (`None`: not within the bound).
fn liveness(
    sim: &mut turmoil::Sim<'_>,
    scenario: &Scenario,
    parts: &Parts,
    world: &World<'_>,
    downs: &Downs,
    failures: &mut Vec<String>,
) -> Result<Option<Duration>, Unsafe> {
    let memory = &parts.memory;
    // Every enqueued job must end acked or dead-lettered (the runners run beside relays).
    let jobs_settled = || scenario.relays == 0 || queue::unsettled(&memory.queue).is_empty();
    let healed_at = sim.elapsed();
    // An operator's reconcile pass after an incident: one wake once listeners are back and
    // any restore held back past the heal is done (seeds 5491, 8293: a restore after the
    // wake left a wake-only and an announcements follower past the restored head with
    // nothing to make them read the source again).
    let mut woke = false;
    let mut expected = None;
    while sim.elapsed() < healed_at + scenario.liveness_bound {
        if !woke && world.restores.done() && sim.elapsed() >= healed_at + OPERATOR_WAKE {
            woke = true;
            wake_all(memory);
        }
        // A restore that waited for a write in flight (one held on its link until the
        // heal) still happens, once the write landed: no fault kind drawn is skipped.
        let now = sim.elapsed();
        if world.restores.restore_if_due(now, world, &parts.trace) {
            world.restart_sparse_followers_cold(sim, &downs.crashed, now);
        }
        step(sim, parts, failures)?;
        if woke
            && world.restores.done()
            && drained(memory)
            && converged(&parts.probes, &parts.history, &mut expected)
            && jobs_settled()
        {
            return Ok(Some(sim.elapsed() - healed_at));
        }
    }
    Ok(None)
}

/// The verdict on a run that converged: a relay published every outbox row, and every
/// durable store holds what its follower committed (what a restart would find: the probe's
/// view is no model of its own).
fn check_what_converged(parts: &Parts, failures: &mut Vec<String>) {
    let memory = &parts.memory;
    // Every row of the outbox is done, and a relay published each (the stream itself
    // may have lost one to an injected fault; that is the followers' to survive).
    let published = parts.ledger.published_seqs();
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
    let each = parts.specs.iter().zip(&parts.probes).zip(&parts.stores);
    for ((spec, probe), store) in each {
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
        // A store never written holds no watermark: what a follower that read an empty
        // source at 0 (a source made anew, nothing written since) has to commit — its next
        // start is cold, and reads the same nothing.
        let empty_at_zero = store.watermark().is_none() && s.watermark == 0 && stored.is_empty();
        if stored != s.cache || (store.watermark() != Some(s.watermark) && !empty_at_zero) {
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
}

/// The verdict on a run that did not converge: what was left unsettled, undrained or
/// different from the source.
fn tell_what_did_not_converge(scenario: &Scenario, parts: &Parts, failures: &mut Vec<String>) {
    let memory = &parts.memory;
    if scenario.relays > 0 {
        for line in queue::unsettled(&memory.queue).into_iter().take(3) {
            failures.push(format!(
                "job runners: within {:?}, {line}",
                scenario.liveness_bound
            ));
        }
    }
    if !drained(memory) {
        failures.push(format!(
            "relays did not drain the outbox within {:?}: {:?} rows pending",
            scenario.liveness_bound,
            poll_once(memory.outbox.pending())
        ));
    }
    let wm = parts.history.watermark();
    let expected = parts.history.expected_at(wm);
    for (spec, probe) in parts.specs.iter().zip(&parts.probes) {
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
