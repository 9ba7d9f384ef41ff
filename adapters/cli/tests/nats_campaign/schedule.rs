//! A round's faults, drawn from its seed: four lanes (the server, the proxy, the
//! followers, the drivers) that each run one fault at a time, concurrently with the
//! others. On a cluster the server lane acts on one node at a time: kill -9, SIGSTOP, or
//! its routes to the others cut, any node or the leader of a stream as it is when the
//! fault begins. The drivers' lane (the supervised worker, the job runner, the relays) is
//! drawn from a generator of its own, after the others, so a seed's first three lanes
//! are what they were before the drivers came.

use std::fmt;
use std::time::Duration;

use tidemark::tidemark_core::Rng;
use tidemark_tests::Direction;

/// Who a fault acts on; faults of one lane never overlap, faults of two lanes may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    Server,
    Proxy,
    Followers,
    /// The supervised worker, the job runner and the outbox relays (`drivers.rs`).
    Drivers,
    /// Bandwidth caps on the proxies, beside the proxy lane's faults.
    Bandwidth,
}

/// One fault, with how long it holds before it is undone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// kill -9 of nats-server; restarted on the same port and storage after `down`.
    ServerKill { down: Duration },
    /// SIGSTOP of nats-server; SIGCONT after `paused`.
    ServerPause { paused: Duration },
    /// Every chunk through the proxy held `latency` plus up to `jitter`.
    Latency {
        latency: Duration,
        jitter: Duration,
        lasting: Duration,
    },
    /// One direction through the proxy forwards nothing.
    Stall {
        direction: Direction,
        lasting: Duration,
    },
    /// The proxy's open connections go silent without closing; then they flow on, or are
    /// reset (as a client's pings would eventually find them dead).
    HalfOpen { lasting: Duration, then_reset: bool },
    /// Every connection through the proxy reset.
    Reset,
    /// Each direction of each connection through the proxy forwards at most
    /// `bytes_per_sec` (a slow link: a catch-up or a snapshot trickles).
    Bandwidth {
        bytes_per_sec: u64,
        lasting: Duration,
    },
    /// kill -9 of the `tidemark mirror` process; started again after `down`.
    MirrorKill { down: Duration },
    /// An in-process follower stopped and a new one started (a cold start; a durable
    /// consumer keeps its cursor).
    Restart(InProcess),
    /// An operator deletes the bucket and makes it again (same name and config); the
    /// writers go on into the new history. With `cut`, followers are held off it first
    /// and for `down` after (writes land meanwhile), so they meet a new history whose
    /// head is past their watermark, or inside it.
    Recreate { cut: Cut, down: Duration },
    /// An in-process follower's sink does not return from its commit for `paused`: its
    /// feed is not read meanwhile (a durable sink's long commit) while the writers write
    /// mostly values near the size limit, so the server waits on flow control and queues
    /// stalled heartbeats behind its request. With `cold`, the follower is restarted
    /// cold first and its first commit is the one held: a new consumer, whose window is
    /// the smallest (2 MB).
    SinkPause {
        which: InProcess,
        paused: Duration,
        cold: bool,
    },
    /// SIGSTOP of the `tidemark mirror` process, the writers flooding as for a sink pause;
    /// SIGCONT after `paused`.
    MirrorPause { paused: Duration },
    /// The supervised worker's next handler call fails: its run ends and the supervisor
    /// restarts it (keeping what it applied; the failed batch is delivered again).
    WorkerFails,
    /// The job runner's task ended at once, as a crash ends it (its handlers dropped, their
    /// jobs neither acked nor failed: delivered again when their leases run out); a new
    /// runner on the queue after `down`.
    RunnerCrash { down: Duration },
    /// Outbox relay `relay` (0 or 1) ended at once, its claims left to run out; a new
    /// relay under a new owner name after `down`, as a restarted process starts one.
    RelayCrash { relay: usize, down: Duration },
    /// kill -9 of one cluster node; restarted on its ports and storage after `down`.
    NodeKill { node: Node, down: Duration },
    /// SIGSTOP of one cluster node; SIGCONT after `paused`.
    NodePause { node: Node, paused: Duration },
    /// Every route link to and from one cluster node stalled both ways (its routes go
    /// silent); with `reset`, their connections reset too, so the routes drop and every
    /// new one hangs until healed.
    Partition {
        node: Node,
        lasting: Duration,
        reset: bool,
    },
}

/// Which cluster node a fault acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// Node `n<i>`.
    At(usize),
    /// The leader of a stream when the fault begins (from its stream info), so leaders
    /// change; node `otherwise` if no leader is known then (an election under way).
    LeaderOf { stream: Led, otherwise: usize },
}

/// The streams whose leaders faults seek out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Led {
    /// The bucket's stream.
    Bucket,
    /// The events stream the writers announce on.
    Events,
}

/// Nodes in a cluster round.
pub const NODES: usize = 3;

/// What holds the followers off a recreated bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Nothing: running followers meet it as it happens.
    Nothing,
    /// The mirror killed with kill -9, started again `down` after the recreation.
    MirrorDown,
    /// The proxy's connections silent, flowing on `down` after the recreation.
    ProxyHalfOpen,
}

/// The in-process followers, numbered as the round keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProcess {
    /// The cache over the bucket's own history.
    Cache = 0,
    /// The cache following the events stream as announcements.
    EventsCache = 1,
    /// The durable consumer of the events stream.
    Consumer = 2,
}

/// Every fault kind, in the order the summary prints them: those of a one-node round, then
/// a cluster round's own ([`CLUSTER_KINDS`]).
pub const KINDS: [&str; 30] = [
    "server kill -9",
    "server SIGSTOP",
    "proxy latency",
    "proxy stall to server",
    "proxy stall to client",
    "proxy half-open, resumed",
    "proxy half-open, reset",
    "proxy reset",
    "mirror kill -9",
    "cache restart",
    "events cache restart",
    "consumer restart",
    "bucket recreated",
    "bucket recreated, mirror down",
    "bucket recreated, proxy cut",
    "sink paused (in-process)",
    "cold start, sink paused",
    "mirror SIGSTOP",
    "worker handler error",
    "job runner crash",
    "relay crash",
    "proxy bandwidth cap",
    "node kill -9",
    "node kill -9, stream leader",
    "node SIGSTOP",
    "node SIGSTOP, stream leader",
    "route cut, stalled",
    "route cut, stalled, stream leader",
    "route cut, reset",
    "route cut, reset, stream leader",
];

/// The kinds only a cluster round draws, the last of [`KINDS`].
pub const CLUSTER_KINDS: usize = 8;

impl Fault {
    /// Its kind, one of [`KINDS`].
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::ServerKill { .. } => KINDS[0],
            Fault::ServerPause { .. } => KINDS[1],
            Fault::Latency { .. } => KINDS[2],
            Fault::Stall {
                direction: Direction::ToServer,
                ..
            } => KINDS[3],
            Fault::Stall { .. } => KINDS[4],
            Fault::HalfOpen {
                then_reset: false, ..
            } => KINDS[5],
            Fault::HalfOpen { .. } => KINDS[6],
            Fault::Reset => KINDS[7],
            Fault::MirrorKill { .. } => KINDS[8],
            Fault::Restart(InProcess::Cache) => KINDS[9],
            Fault::Restart(InProcess::EventsCache) => KINDS[10],
            Fault::Restart(InProcess::Consumer) => KINDS[11],
            Fault::Recreate {
                cut: Cut::Nothing, ..
            } => KINDS[12],
            Fault::Recreate {
                cut: Cut::MirrorDown,
                ..
            } => KINDS[13],
            Fault::Recreate {
                cut: Cut::ProxyHalfOpen,
                ..
            } => KINDS[14],
            Fault::SinkPause { cold: false, .. } => KINDS[15],
            Fault::SinkPause { cold: true, .. } => KINDS[16],
            Fault::MirrorPause { .. } => KINDS[17],
            Fault::WorkerFails => KINDS[18],
            Fault::RunnerCrash { .. } => KINDS[19],
            Fault::RelayCrash { .. } => KINDS[20],
            Fault::Bandwidth { .. } => KINDS[21],
            Fault::NodeKill { node, .. } => KINDS[22 + node.led()],
            Fault::NodePause { node, .. } => KINDS[24 + node.led()],
            Fault::Partition {
                node, reset: false, ..
            } => KINDS[26 + node.led()],
            Fault::Partition { node, .. } => KINDS[28 + node.led()],
        }
    }

    /// How long it holds.
    pub fn lasting(&self) -> Duration {
        match self {
            Fault::ServerKill { down }
            | Fault::MirrorKill { down }
            | Fault::RunnerCrash { down }
            | Fault::RelayCrash { down, .. } => *down,
            Fault::ServerPause { paused }
            | Fault::SinkPause { paused, .. }
            | Fault::MirrorPause { paused }
            | Fault::NodePause { paused, .. } => *paused,
            Fault::NodeKill { down, .. } => *down,
            Fault::Recreate { down, .. } => *down,
            Fault::Latency { lasting, .. }
            | Fault::Bandwidth { lasting, .. }
            | Fault::Stall { lasting, .. }
            | Fault::HalfOpen { lasting, .. }
            | Fault::Partition { lasting, .. } => *lasting,
            Fault::Reset | Fault::Restart(_) | Fault::WorkerFails => Duration::ZERO,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Latency {
                latency, jitter, ..
            } => write!(f, "{} {latency:?}+{jitter:?}", self.kind())?,
            Fault::Bandwidth { bytes_per_sec, .. } => {
                write!(f, "{} {} KiB/s", self.kind(), bytes_per_sec / 1024)?;
            }
            Fault::SinkPause { which, .. } => write!(f, "{} ({which:?})", self.kind())?,
            Fault::RelayCrash { relay, .. } => write!(f, "{} (relay {relay})", self.kind())?,
            Fault::NodeKill { node, .. }
            | Fault::NodePause { node, .. }
            | Fault::Partition { node, .. } => write!(f, "{} ({node})", self.kind())?,
            _ => f.write_str(self.kind())?,
        }
        match self.lasting() {
            Duration::ZERO => Ok(()),
            d => write!(f, " for {d:?}"),
        }
    }
}

impl Node {
    /// 1 for a stream's leader, 0 for a node named in the schedule: the offset of its
    /// fault's kind in [`KINDS`].
    fn led(&self) -> usize {
        match self {
            Node::At(_) => 0,
            Node::LeaderOf { .. } => 1,
        }
    }
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Node::At(i) => write!(f, "n{i}"),
            Node::LeaderOf { stream, otherwise } => {
                write!(f, "leader of the {stream:?} stream, else n{otherwise}")
            }
        }
    }
}

/// A fault at its time from the start of the round's fault phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub at: Duration,
    pub lane: Lane,
    pub fault: Fault,
}

/// Everything a round draws from its seed: faults, writers' seeds and keys, the proxy's
/// jitter, the followers' seeds. The same seed gives the same schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub phase: Duration,
    /// A 3-node cluster with the bucket and the events stream at replicas 3, not one node.
    pub cluster: bool,
    pub faults: Vec<Planned>,
    pub writer_seeds: Vec<u64>,
    pub keys_per_writer: usize,
    pub proxy_seed: u64,
    pub follower_seed: u64,
    /// The bucket writes limit markers and writers give some puts a TTL (one node only,
    /// one round in three, drawn apart so the rest of the round draws what it did).
    pub ttl: bool,
}

/// Writers per round: each owns its keys, so its acknowledgements order them.
pub const WRITERS: usize = 3;

fn between(rng: &mut Rng, lo_ms: u64, hi_ms: u64) -> Duration {
    Duration::from_millis(lo_ms + rng.next_u64() % (hi_ms - lo_ms + 1))
}

fn one_in(rng: &mut Rng, n: u64) -> bool {
    rng.next_u64() % n == 0
}

impl Schedule {
    /// The schedule of seed `seed` for a fault phase of `phase`, on one node or a cluster.
    /// A one-node round draws what it drew before cluster rounds existed.
    pub fn draw(seed: u64, phase: Duration, cluster: bool) -> Schedule {
        let mut rng = Rng::new(seed ^ 0x7469_6465_6d61_726b);
        let writer_seeds = (0..WRITERS).map(|_| rng.next_u64()).collect();
        let keys_per_writer = 4 + (rng.next_u64() % 13) as usize;
        let proxy_seed = rng.next_u64();
        let follower_seed = rng.next_u64();
        let mut faults = Vec::new();
        for lane in [Lane::Server, Lane::Proxy, Lane::Followers] {
            let mut at = between(&mut rng, 100, 1000);
            while at < phase {
                let fault = match (lane, cluster) {
                    (Lane::Server, true) => draw_node_fault(&mut rng),
                    _ => draw_fault(&mut rng, lane),
                };
                let gap = between(&mut rng, 200, 2000);
                let next = at + fault.lasting() + gap;
                faults.push(Planned { at, lane, fault });
                at = next;
            }
        }
        // Drawn apart, each from a stream of its own: the lanes above draw what they drew
        // before the drivers came, and the drivers what they drew before the caps.
        let apart = [
            (
                Lane::Drivers,
                0x6472_6976_6572_7321,
                (100, 1000),
                (300, 2000),
            ),
            (
                Lane::Bandwidth,
                0x6261_6e64_7769_6474,
                (300, 3000),
                (1000, 4000),
            ),
        ];
        for (lane, stream, (first, first_max), (gap, gap_max)) in apart {
            let mut rng = Rng::new(seed ^ stream);
            let mut at = between(&mut rng, first, first_max);
            while at < phase {
                let fault = draw_fault(&mut rng, lane);
                let next = at + fault.lasting() + between(&mut rng, gap, gap_max);
                faults.push(Planned { at, lane, fault });
                at = next;
            }
        }
        faults.sort_by_key(|p| (p.at, p.lane));
        let ttl = !cluster && Rng::new(seed ^ 0x7474_6c73_2174_746c).next_u64() % 3 == 0;
        Schedule {
            seed,
            phase,
            cluster,
            faults,
            writer_seeds,
            keys_per_writer,
            proxy_seed,
            follower_seed,
            ttl,
        }
    }

    /// The faults of one lane, in order.
    pub fn lane(&self, lane: Lane) -> Vec<Planned> {
        self.faults
            .iter()
            .filter(|p| p.lane == lane)
            .cloned()
            .collect()
    }
}

fn draw_fault(rng: &mut Rng, lane: Lane) -> Fault {
    match lane {
        Lane::Server if one_in(rng, 2) => Fault::ServerKill {
            down: between(rng, 50, 2000),
        },
        Lane::Server => Fault::ServerPause {
            paused: between(rng, 100, 3000),
        },
        Lane::Proxy => match rng.next_u64() % 5 {
            0 => Fault::Latency {
                latency: between(rng, 1, 150),
                jitter: between(rng, 0, 80),
                lasting: between(rng, 300, 2500),
            },
            1 => Fault::Stall {
                direction: if one_in(rng, 2) {
                    Direction::ToServer
                } else {
                    Direction::ToClient
                },
                lasting: between(rng, 200, 2500),
            },
            2 => Fault::HalfOpen {
                lasting: between(rng, 200, 2500),
                then_reset: one_in(rng, 2),
            },
            _ => Fault::Reset,
        },
        Lane::Followers => match rng.next_u64() % 12 {
            0..4 => Fault::MirrorKill {
                down: between(rng, 0, 1500),
            },
            4..7 => Fault::Restart(in_process(rng)),
            7..9 => Fault::Recreate {
                cut: match rng.next_u64() % 3 {
                    0 => Cut::Nothing,
                    1 => Cut::MirrorDown,
                    _ => Cut::ProxyHalfOpen,
                },
                down: between(rng, 200, 2500),
            },
            // Writers flood it meanwhile: past the flow-control window within 1-2 s,
            // then four stalled heartbeats (1 s apart) or more, what a reader that
            // misjudged the ones queued behind the request gave up after.
            9..11 => Fault::SinkPause {
                which: in_process(rng),
                paused: between(rng, 6000, 8000),
                cold: one_in(rng, 2),
            },
            _ => Fault::MirrorPause {
                paused: between(rng, 1000, 6000),
            },
        },
        Lane::Drivers => draw_driver_fault(rng),
        Lane::Bandwidth => draw_cap(rng),
    }
}

/// A bandwidth cap of 8-256 KiB/s for 0.5-3 s.
fn draw_cap(rng: &mut Rng) -> Fault {
    Fault::Bandwidth {
        bytes_per_sec: 1024 * (8 + rng.next_u64() % 249),
        lasting: between(rng, 500, 3000),
    }
}

/// A fault on one cluster node, its leader one time in two. Longer than on one node: a
/// stream leader away for less than the election timeout (4-9 s in nats-server) is waited
/// for, not replaced, so some last past it and leaders change.
fn draw_node_fault(rng: &mut Rng) -> Fault {
    let node = match one_in(rng, 2) {
        true => Node::At((rng.next_u64() % NODES as u64) as usize),
        false => Node::LeaderOf {
            stream: match one_in(rng, 3) {
                true => Led::Events,
                false => Led::Bucket,
            },
            otherwise: (rng.next_u64() % NODES as u64) as usize,
        },
    };
    match rng.next_u64() % 3 {
        0 => Fault::NodeKill {
            node,
            down: between(rng, 50, 6000),
        },
        1 => Fault::NodePause {
            node,
            paused: between(rng, 100, 8000),
        },
        _ => Fault::Partition {
            node,
            lasting: between(rng, 300, 8000),
            reset: one_in(rng, 2),
        },
    }
}

/// A fault of the drivers' lane: the worker's handler failing, the job runner or a relay
/// crashing and started again.
fn draw_driver_fault(rng: &mut Rng) -> Fault {
    match rng.next_u64() % 3 {
        0 => Fault::WorkerFails,
        1 => Fault::RunnerCrash {
            down: between(rng, 0, 1500),
        },
        _ => Fault::RelayCrash {
            relay: (rng.next_u64() % 2) as usize,
            down: between(rng, 0, 1500),
        },
    }
}

fn in_process(rng: &mut Rng) -> InProcess {
    match rng.next_u64() % 3 {
        0 => InProcess::Cache,
        1 => InProcess::EventsCache,
        _ => InProcess::Consumer,
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule of seed {}{}{} (fault phase {:?}, {} writers x {} keys):",
            self.seed,
            if self.cluster {
                ", a 3-node cluster"
            } else {
                ""
            },
            if self.ttl {
                ", puts with TTLs (limit markers)"
            } else {
                ""
            },
            self.phase,
            WRITERS,
            self.keys_per_writer
        )?;
        for p in &self.faults {
            let lane = format!("{:?}", p.lane).to_lowercase();
            writeln!(f, "  +{:>6.3}s  {lane:<9}  {}", p.at.as_secs_f64(), p.fault)?;
        }
        Ok(())
    }
}
