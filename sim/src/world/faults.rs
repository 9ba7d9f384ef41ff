//! The faults the plan draws, carried out on the world: what each action does to the
//! simulation and the shared state the hosts read, and the restores of the source from a
//! backup.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::Publish;
use tidemark_memory::{Mangle, Memory, MemoryBackup, MemoryCacheStore, MemoryOutboxBackup, Port};

use super::hosts::{WriterControl, lock};
use super::jobs::JobFaults;
use crate::checks::jobs::JobLedger;
use crate::checks::oracle::{History, Probe, RelayLedger};
use crate::checks::sweeps::SweepLedger;
use crate::hosts::jetstream::JetStream;
use crate::hosts::source as server;
use crate::scenario::{Action, FollowerSpec, Kind, SOURCE, relay_host, writer_host};
use crate::trace::Trace;

/// What the orchestrator acts on.
pub(super) struct World<'a> {
    pub(super) memory: &'a Memory,
    /// The JetStream bucket beside the source: backed up and restored with it.
    pub(super) jetstream: &'a JetStream,
    pub(super) controls: &'a [Arc<WriterControl>],
    pub(super) specs: &'a [FollowerSpec],
    pub(super) stores: &'a [Option<MemoryCacheStore>],
    pub(super) handler_faults: &'a [Arc<AtomicU32>],
    pub(super) jobs: &'a JobLedger,
    pub(super) job_faults: &'a JobFaults,
    pub(super) sweeps: &'a SweepLedger,
    pub(super) history: &'a History,
    pub(super) ledger: &'a RelayLedger,
    pub(super) probes: &'a [Probe],
    pub(super) restores: &'a Restores,
    /// Whether the source host leaves reads unanswered.
    pub(super) silence: &'a server::Silence,
}

/// How long a restore waits, writers stopped, for the writes they had in flight.
const RESTORE_DRAIN: Duration = Duration::from_millis(500);

/// The backup a restore puts back, when it does, and until when writers pause after one.
pub(super) struct Restores {
    backup: Mutex<Option<(MemoryBackup, MemoryOutboxBackup)>>,
    restore_at: Mutex<Option<Duration>>,
    /// Writers are stopped for a restore due then.
    pause_until: Mutex<Option<Duration>>,
    /// The source host's writes: closed from a restore until the writers' pause ends.
    gate: server::WriteGate,
    /// Whether the restore had to wait for writes in flight (traced once).
    waited: AtomicBool,
    /// Every restore puts back the same backup, the one taken before any write: the source
    /// made anew, as a bucket deleted and created again ([`Scenario::recreations_while_cut`]).
    recreations: bool,
}

impl Restores {
    pub(super) fn new(gate: server::WriteGate, recreations: bool) -> Self {
        Restores {
            backup: Mutex::default(),
            restore_at: Mutex::default(),
            pause_until: Mutex::default(),
            gate,
            waited: AtomicBool::new(false),
            recreations,
        }
    }

    /// Restores the backup if its time came at `now`; whether it did.
    pub(super) fn restore_if_due(&self, now: Duration, world: &World<'_>, trace: &Trace) -> bool {
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
        let kept = if self.recreations {
            lock(&self.backup).clone()
        } else {
            lock(&self.backup).take()
        };
        let Some((source, outbox)) = kept else {
            return false;
        };
        let head = source.watermark();
        trace.line_at(now, format!("source restored to its backup at {head}"));
        // Writes still on the wire from before the writers stopped are refused until the
        // followers have read the restored source (see `server::WriteGate`).
        self.gate.close();
        world.memory.source.restore(&source);
        world.memory.outbox.restore(&outbox);
        world.jetstream.restore(head, self.recreations);
        world.history.restore(head);
        world.ledger.restore(head, now);
        world.sweeps.restored(head);
        for p in world.probes {
            p.restored(head, now);
        }
        true
    }

    /// Whether no restore is waiting to happen.
    pub(super) fn done(&self) -> bool {
        lock(&self.restore_at).is_none()
    }

    /// Whether the writers, stopped for a restore, write again at `now` (once): as soon
    /// as the backup is back in. Followers are not waited for: one that reads the source
    /// only after the new history passed its watermark tells the two apart by what the
    /// source says of its history (issue 25).
    pub(super) fn pause_over(&self, now: Duration) -> bool {
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
    pub(super) fn restart_sparse_followers_cold(
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

pub(super) fn apply(
    sim: &mut turmoil::Sim<'_>,
    action: &Action,
    world: &World<'_>,
    crashed: &mut BTreeSet<String>,
    commit_crashes: &mut BTreeMap<usize, Duration>,
) {
    if !apply_to_links_and_hosts(sim, action, world, crashed) {
        arm(action, world, commit_crashes, sim.elapsed());
    }
}

/// An action on the network (a link cut, held, slowed or failing) or on a host (crashed
/// or restarted); `false` if `action` is not one of those.
fn apply_to_links_and_hosts(
    sim: &mut turmoil::Sim<'_>,
    action: &Action,
    world: &World<'_>,
    crashed: &mut BTreeSet<String>,
) -> bool {
    let World {
        controls, specs, ..
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
        Action::CrashRunner(i) => {
            let h = relay_host(*i);
            // Only while it runs a job: a crash with no lease held is a relay crash.
            if world.jobs.running_on(&h) && crashed.insert(h.clone()) {
                sim.crash(h.as_str());
            }
        }
        _ => return false,
    }
    true
}

/// An action on what outlives the hosts, carried out when its moment comes: a store's
/// commits, a writer's next write, a handler, the source's announcements, wakes, change
/// log and backups, the sweepers and the jobs.
fn arm(
    action: &Action,
    world: &World<'_>,
    commit_crashes: &mut BTreeMap<usize, Duration>,
    now: Duration,
) {
    let World {
        memory,
        controls,
        specs,
        ..
    } = *world;
    match action {
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
        Action::FailHandler(i, n) if specs.get(*i).is_some_and(|f| f.supervised) => {
            world.handler_faults[*i].store(*n, Ordering::SeqCst);
        }
        Action::FailCommits(i, n) => {
            if let Some(store) = world.store(*i) {
                store.fail_next_commits(*n);
            }
        }
        Action::WriterCrashAfterCommit(i) => {
            if let Some(c) = controls.get(*i) {
                c.crash_after_commit.store(true, Ordering::SeqCst);
            }
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
            world.history.compacted(wm.saturating_sub(3));
        }
        Action::Foreign(draw) => publish_foreign(memory, *draw),
        Action::Backup => {
            *lock(&world.restores.backup) = Some((memory.source.backup(), memory.outbox.backup()));
            world.jetstream.backup();
        }
        Action::Restore => world.schedule_restore(now),
        Action::Silence(on) => world.silence.set(*on),
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
        _ => {}
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

/// Polls a memory port's future once, outside every host: they complete on their first
/// poll (`None` if one did not).
pub(super) fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(fut).as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}
