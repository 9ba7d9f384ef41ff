//! One round: a fresh nats-server (or a 3-node cluster) and bucket, writers, the
//! followers behind the fault proxy, the schedule's faults for the fault phase, then heal,
//! converge and judge.
//!
//! On a cluster the bucket and the events stream have 3 replicas; every route between two
//! nodes goes through a fault proxy of its own (the harness's route links), so a node can
//! be cut from the others. The followers' client proxies are one per node and their
//! clients are given all three (they fail over when a node dies, as a client of a
//! replicated bucket is deployed); a proxy fault acts on all three at once, the client's
//! own network. Writers and the operator connect straight to every node.
//!
//! Beside the followers run the drivers (`drivers.rs`): a supervised worker following the
//! bucket (judged as a follower: sampled, converged, live), a job runner and two outbox
//! relays, judged once the round healed (every job acked or dead-lettered; no row
//! published under two owners' claims at once, every row published).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use futures::StreamExt as _;
use tidemark::Counters;
use tidemark::Cursors as _;
use tidemark_nats::{KvBucket, NatsEvents, NatsOptions};
use tidemark_tests::{Direction, FaultProxy, NatsCluster, NatsServer, wait_jetstream_ready};
use tokio::sync::{Mutex as AsyncMutex, RwLock, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::checker::{Checks, ReadyView, Watcher, judge, judge_jobs, judge_ready, judge_relays};
use crate::drivers::{Clients, DriverCounts, Drivers, WORKER};
use crate::followers::{
    CAPTURED, CacheFollower, Follows, Mirror, add_counters, key_trail, lock, prepare_mirror_file,
    read_file, ready_view, shown,
};
use crate::ledger::{Kind, Ledger, token};
use crate::schedule::{Cut, Fault, Lane, Led, NODES, Node, Planned, Schedule};
use crate::writers::{MARKER_TTL, VALUE_LIMIT, WriteCounts, Writer, Writes, kind_of};

const BUCKET: &str = "camp";
const MIRROR_NAME: &str = "mirror-camp";
/// The events stream the writers announce on, its subjects' prefix, and the durable
/// consumer's cursor name.
pub const EVENTS_STREAM: &str = "CAMP_EVENTS";
pub const EVENTS_PREFIX: &str = "camp.events";
const CONSUMER_CURSOR: &str = "camp-consumer";
/// The followers in the order reports give them: the in-process ones (as
/// [`InProcess`](crate::schedule::InProcess) numbers them), the mirror, then the
/// supervised worker (its handlers' map).
pub const FOLLOWERS: [&str; 5] = ["cache", "events cache", "consumer", "mirror", WORKER];
/// The mirror's watcher: one across its starts (its file is one).
const MIRROR_WATCHER: &str = "mirror file";
/// After healing, how long the followers have to equal the bucket.
const CONVERGE_WITHIN: Duration = Duration::from_secs(60);
/// After healing, how long every job has to end acked or dead-lettered, and the outbox
/// to be relayed: far past the runner's leases (1.5 s), its retries (up to 1 s, three
/// attempts) and the slowest job (2 s), and the relays' lease and backoff (5 s at most).
const DRIVERS_SETTLE_WITHIN: Duration = Duration::from_secs(30);
/// The liveness bound: how long after the round healed (or after the last write that
/// landed was sent, if later; for a follower of announcements, after its reconcile was
/// asked) each follower may take to come to hold what it ends with. Every fault is healed
/// by then: the client reconnects within 250 ms (`DEFAULT_MAX_RECONNECT_DELAY`), a
/// reconnect retries at once, the mirror is restarted within 200 ms. Measured over 115
/// rounds (460 followers) at load 5.6-7.5 on 2 cores: p50 0 ms, p99 399 ms, the slowest
/// healthy one 534 ms; 3 s is over 5 times that. A request waiting out a reply lost
/// with a reconnect took 3.4-8.9 s (the fix reverted), a grown backoff up to 30 s.
pub const LIVENESS: Duration = Duration::from_secs(3);
/// The liveness bound of a cluster round, measured from the same moments, where healing
/// ends only once the bucket's and the events stream's groups (and the durable
/// consumer's) have a leader with every replica current: an election (4-9 s of silence
/// in nats-server) is the cluster's time, not the follower's, so it is not in the bound.
/// What is left is the follower's own: a consumer that lived on a node that died or was
/// cut off, found gone and made again; a catch-up over three nodes and two proxies.
/// Measured over 40 cluster rounds (160 followers, load 1.5-3.2 on 2 cores): in the 22
/// rounds that passed at 3 s the followers held the bucket at p50 0 ms, p99 1,161 ms,
/// slowest 1,987 ms after healing; one more (seed 30038) took 3,090 ms catching up after
/// a 7.4 s sink pause with no failure logged. 5 s is 2.5 times the slowest healthy one
/// and half the client's 10 s request timeout, so a follower that waits out a request
/// lost with a node, or a backoff grown past its fourth attempt, still fails; milder
/// backoffs grown during an election (2.4-4.6 s, seeds 30012, 30019, 30020) pass.
pub const CLUSTER_LIVENESS: Duration = Duration::from_secs(5);
/// A node stopped or cut off this long holds a flow-control answer on its routes past
/// the stalled heartbeats a feed reads before it gives up (3, one a second).
const ANSWERS_HELD: Duration = Duration::from_secs(3);
/// How long healing waits for the cluster's streams to have a leader with every replica
/// current (elections take 4-9 s; a restarted node catches up).
const CLUSTER_CURRENT_WITHIN: Duration = Duration::from_secs(60);

/// What a round is run with.
#[derive(Debug, Clone)]
pub struct RoundConfig {
    pub phase: Duration,
    /// Writers announce one put in eight as a bare mutation marker.
    pub markers: bool,
    /// A 3-node cluster, not one node.
    pub cluster: bool,
    pub tidemark_bin: PathBuf,
}

/// What a round did and found.
#[derive(Debug)]
pub struct RoundReport {
    pub schedule: Schedule,
    pub faults: BTreeMap<&'static str, u64>,
    pub writes: WriteCounts,
    pub mirror_restarts: u64,
    pub mirror_exits: Vec<String>,
    /// Cold restarts of each in-process follower.
    pub restarts: [u64; 3],
    pub checks: Checks,
    pub counters: Counters,
    /// From healing to the first read equal to the bucket, per follower of
    /// [`FOLLOWERS`].
    pub converged_after: [Option<Duration>; FOLLOWERS.len()],
    /// From healing (or the last landed write's send, if later) to when each came to
    /// hold what it ends with, as sampled: what [`LIVENESS`] bounds.
    pub settled_after: [Option<Duration>; FOLLOWERS.len()],
    /// What the drivers did.
    pub drivers: DriverCounts,
    /// The seqs of the registry's writes (each an outbox row the relays must publish).
    pub registry_written: BTreeSet<u64>,
    /// When the followers of announcements were asked for their reconcile after healing:
    /// what their liveness is measured from (nothing tells them of a lost announcement
    /// before it).
    pub reconciled_at: Option<Instant>,
    pub took: Duration,
    pub failures: Vec<String>,
    pub mirror_log: Vec<String>,
    /// Times the bucket was deleted and made again.
    pub recreations: u32,
    /// Lines of the mirror saying it took a new history of the bucket.
    pub mirror_new_histories: u64,
    /// Heartbeats queued behind a flow-control request that a feed read on through
    /// (in-process, mirror).
    pub stale_heartbeats: [u64; 2],
    /// The liveness bound this round is judged by.
    pub liveness: Duration,
    /// Feeds that gave up on a consumer as stalled in a round where a node fault held
    /// flow-control answers on the routes past the heartbeats' patience.
    pub stalled_behind_node_fault: u64,
    /// On a cluster, the leader changes seen of the bucket's stream and the events stream
    /// (sampled every 250 ms; a recreated bucket's first leader counts when it differs).
    pub leader_changes: [u64; 2],
}

/// What the sampler reads of an in-process follower: its running start's name and cache,
/// and whether it replays the bucket (views at a watermark).
type Current = (crate::followers::Current, bool);

/// The servers a round runs.
enum Servers {
    One(Box<NatsServer>),
    /// Routed through the harness's links: a node can be cut from the others.
    Cluster(NatsCluster),
}

impl Servers {
    /// Fresh servers: one node, or a cluster of [`NODES`] whose links draw jitter from
    /// `seed`. One that cannot start is a panic that says how to get one.
    async fn start(cluster: bool, seed: u64) -> Servers {
        fn need<T>(e: tidemark_tests::HarnessError) -> T {
            panic!("the NATS campaign needs a real nats-server: {e}")
        }
        match cluster {
            false => Servers::One(Box::new(NatsServer::start().await.unwrap_or_else(need))),
            true => Servers::Cluster(
                NatsCluster::start_with_route_links(NODES, seed)
                    .await
                    .unwrap_or_else(need),
            ),
        }
    }

    fn nodes(&self) -> &[NatsServer] {
        match self {
            Servers::One(server) => std::slice::from_ref(server),
            Servers::Cluster(cluster) => &cluster.nodes,
        }
    }

    fn nodes_mut(&mut self) -> &mut [NatsServer] {
        match self {
            Servers::One(server) => std::slice::from_mut(server),
            Servers::Cluster(cluster) => &mut cluster.nodes,
        }
    }

    /// Every node's URL, straight (no proxy).
    fn urls(&self) -> Vec<String> {
        self.nodes().iter().map(NatsServer::url).collect()
    }

    fn cluster(&self) -> Option<&NatsCluster> {
        match self {
            Servers::One(_) => None,
            Servers::Cluster(cluster) => Some(cluster),
        }
    }
}

/// What the fault lanes act on.
struct Targets {
    server: AsyncMutex<Servers>,
    /// The followers' proxies, one per node; every proxy fault acts on all.
    proxies: Vec<FaultProxy>,
    /// The in-process followers, as [`FOLLOWERS`] lists them.
    caches: [AsyncMutex<CacheFollower>; 3],
    /// The same followers as the sampler reads them.
    current: [Current; 3],
    mirror: AsyncMutex<Mirror>,
    /// The supervised worker, the job runner and the relays.
    drivers: Drivers,
    /// A client straight to the server, for the operator's recreation of the bucket.
    admin: async_nats::Client,
    /// The bucket's history: every write holds it (read), a recreation takes it whole.
    gate: Arc<RwLock<u32>>,
    /// Set while writers mostly write values near the size limit.
    flood: Arc<AtomicBool>,
    /// On a cluster, set while a server-lane fault holds a node.
    node_fault: Option<Arc<AtomicBool>>,
    /// The bucket writes limit markers (a round with TTLs), as made again too.
    ttl: bool,
    /// Held (read) by each server and proxy fault, taken whole by a follower's pause: a
    /// server that waits on flow control is a healthy one, so no fault of theirs cuts a
    /// pause short (a killed server or a reset connection ends the consumer it waits
    /// with). They run late instead, in their order.
    calm: RwLock<()>,
    applied: Mutex<BTreeMap<&'static str, u64>>,
    /// The creation time of the bucket's stream in each history (by epoch), as the
    /// followers' lineages name it: which history a follower took.
    created: Mutex<Vec<Option<u64>>>,
    failures: Mutex<Vec<String>>,
}

/// Runs the round of `seed`. A nats-server that cannot start is a panic that says how to
/// get one (never a skip); everything else that breaks is in the report's failures.
pub async fn run(seed: u64, config: &RoundConfig) -> RoundReport {
    let started = Instant::now();
    let schedule = Schedule::draw(seed, config.phase, config.cluster);
    let mut report = RoundReport::new(schedule.clone());
    *lock(&CAPTURED) = Default::default();
    report.liveness = match config.cluster {
        true => CLUSTER_LIVENESS,
        false => LIVENESS,
    };
    let (server, admin) = start_server(config.cluster, schedule.proxy_seed, schedule.ttl).await;
    let gate = Arc::new(RwLock::new(0));
    let flood = Arc::new(AtomicBool::new(false));
    let node_fault = config.cluster.then(|| Arc::new(AtomicBool::new(false)));
    let shared = (gate, flood, node_fault);
    let writers = match preload(&server.urls(), &schedule, config.markers, &shared).await {
        Ok(writers) => writers,
        Err(e) => {
            report.failures.push(e);
            report.took = started.elapsed();
            return report;
        }
    };
    let mut round = Round::start(server, admin, shared, &schedule, config).await;
    let (ledger, healed) = round.fault_phase(writers, &schedule, &mut report).await;
    let now = round.bucket_after_healing(&ledger, &mut report).await;
    round.converge(&now, healed, &mut report).await;
    round.judge(&ledger, healed, &mut report).await;
    round.stop(&mut report).await;
    report.took = started.elapsed();
    report
}

impl RoundReport {
    fn new(schedule: Schedule) -> RoundReport {
        RoundReport {
            schedule,
            faults: BTreeMap::new(),
            writes: WriteCounts::default(),
            mirror_restarts: 0,
            mirror_exits: Vec::new(),
            restarts: [0; 3],
            checks: Checks::default(),
            counters: Counters::default(),
            converged_after: [None; FOLLOWERS.len()],
            settled_after: [None; FOLLOWERS.len()],
            drivers: DriverCounts::default(),
            registry_written: BTreeSet::new(),
            reconciled_at: None,
            took: Duration::ZERO,
            failures: Vec::new(),
            mirror_log: Vec::new(),
            recreations: 0,
            mirror_new_histories: 0,
            stale_heartbeats: [0; 2],
            liveness: LIVENESS,
            stalled_behind_node_fault: 0,
            leader_changes: [0; 2],
        }
    }
}

/// Fresh servers with the round's bucket and events stream (replicas 3 on a cluster), and
/// a client straight to every node.
async fn start_server(cluster: bool, seed: u64, ttl: bool) -> (Servers, async_nats::Client) {
    let servers = Servers::start(cluster, seed).await;
    let admin = match &servers {
        Servers::One(server) => server.connect().await,
        Servers::Cluster(cluster) => cluster.connect().await,
    };
    let admin = admin.unwrap_or_else(|e| panic!("{e}"));
    wait_jetstream_ready(&admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let replicas = servers.nodes().len();
    // A new cluster may still be placing its meta leader's first assignments.
    let js = jetstream::new(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = js.create_key_value(bucket_config(replicas, ttl)).await {
        if Instant::now() > deadline {
            panic!("creating the bucket: {e}");
        }
        sleep(Duration::from_millis(200)).await;
    }
    let events = NatsEvents::new(admin.clone(), EVENTS_STREAM, EVENTS_PREFIX)
        .unwrap_or_else(|e| panic!("{e}"));
    while let Err(e) = events.ensure(replicas).await {
        if Instant::now() > deadline {
            panic!("creating the events stream: {e}");
        }
        sleep(Duration::from_millis(200)).await;
    }
    (servers, admin)
}

/// The round's bucket, as first made and as made again: on every node of the round.
/// A round with TTLs has the bucket write limit markers (which allows a TTL per message).
fn bucket_config(replicas: usize, ttl: bool) -> kv::Config {
    kv::Config {
        bucket: BUCKET.into(),
        history: 1,
        max_value_size: VALUE_LIMIT as i32,
        num_replicas: replicas,
        limit_markers: ttl.then_some(MARKER_TTL),
        ..Default::default()
    }
}

/// What the writers and the fault lanes share: the bucket's gate, the flood flag, and on
/// a cluster the flag of a node fault in force.
type Shared = (Arc<RwLock<u32>>, Arc<AtomicBool>, Option<Arc<AtomicBool>>);

/// The writers, each having written the history the followers start on.
async fn preload(
    urls: &[String],
    schedule: &Schedule,
    markers: bool,
    (gate, flood, node_fault): &Shared,
) -> Result<Vec<Writer>, String> {
    let mut writers = Vec::new();
    for (id, seed) in schedule.writer_seeds.iter().enumerate() {
        let client = connect(urls, &format!("campaign-writer-{id}")).await;
        let keys = schedule.keys_per_writer;
        let to = Writes {
            bucket: BUCKET,
            events: EVENTS_PREFIX,
            markers,
            gate,
            flood,
            node_fault: node_fault.as_ref(),
        };
        let mut writer = Writer::new(id, *seed, keys, client, &to).await?;
        writer
            .preload()
            .await
            .map_err(|e| format!("preload: {e}"))?;
        writers.push(writer);
    }
    Ok(writers)
}

/// A round under way: the server, the proxy and the followers behind it, and the tasks
/// that watch the followers until the round is judged.
struct Round {
    targets: Arc<Targets>,
    admin: async_nats::Client,
    file: PathBuf,
    views: Arc<Mutex<Vec<ReadyView>>>,
    watchers: Arc<Mutex<Vec<Watcher>>>,
    done: watch::Sender<bool>,
    watching: [JoinHandle<()>; 2],
    /// On a cluster, the stream leaders' watcher: its counts of leader changes.
    leaders: Option<JoinHandle<[u64; 2]>>,
    /// Holds the mirror's file until the round ends.
    _dir: tempfile::TempDir,
}

impl Round {
    /// Puts the proxy before the server and starts both followers behind it, and the
    /// sampler of what they show.
    async fn start(
        server: Servers,
        admin: async_nats::Client,
        (gate, flood, node_fault): Shared,
        schedule: &Schedule,
        config: &RoundConfig,
    ) -> Round {
        let mut proxies = Vec::new();
        for (i, node) in server.nodes().iter().enumerate() {
            let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, node.port()));
            let seed = schedule.proxy_seed.wrapping_add(i as u64);
            let proxy = FaultProxy::start(upstream, seed)
                .await
                .unwrap_or_else(|e| panic!("starting the fault proxy: {e}"));
            proxies.push(proxy);
        }
        let proxied: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary directory: {e}"));
        let views = Arc::new(Mutex::new(Vec::new()));
        let follower_client = connect(&proxied, "campaign-cache").await;
        let bucket = KvBucket::new(follower_client, BUCKET).unwrap_or_else(|e| panic!("{e}"));
        let cache = CacheFollower::start(
            FOLLOWERS[0],
            Follows::Bucket,
            bucket,
            schedule.follower_seed,
            Arc::clone(&views),
        );
        // The followers of the events stream share a client of their own.
        let events_client = connect(&proxied, "campaign-events").await;
        let events = NatsEvents::new(events_client.clone(), EVENTS_STREAM, EVENTS_PREFIX)
            .unwrap_or_else(|e| panic!("{e}"));
        let bucket = KvBucket::new(events_client, BUCKET).unwrap_or_else(|e| panic!("{e}"));
        let announced = |i: usize, cursor| {
            let follows = Follows::Events {
                events: events.clone(),
                cursor,
            };
            // Seeds of their own, drawn from the round's: no two retry in lockstep.
            let seed = schedule.follower_seed.wrapping_add(0x1000 * i as u64);
            let views = Arc::clone(&views);
            CacheFollower::start(FOLLOWERS[i], follows, bucket.clone(), seed, views)
        };
        let events_cache = announced(1, None);
        let consumer = announced(2, Some(CONSUMER_CURSOR));
        // `nats://h1:p1,h2:p2/BUCKET`: the CLI's form for several servers.
        let hosts: Vec<&str> = proxied
            .iter()
            .map(|u| u.trim_start_matches("nats://"))
            .collect();
        let source = format!("nats://{}/{BUCKET}", hosts.join(","));
        let file = dir.path().join("mirror.db");
        prepare_mirror_file(&file)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut mirror = Mirror::new(config.tidemark_bin.clone(), source, file.clone());
        mirror.start().unwrap_or_else(|e| panic!("{e}"));
        let clients = Clients {
            worker: connect(&proxied, "campaign-worker").await,
            runner: connect(&proxied, "campaign-runner").await,
            relays: connect(&proxied, "campaign-relays").await,
            straight: admin.clone(),
        };
        let replicas = server.nodes().len();
        let drivers = Drivers::start(
            clients,
            BUCKET,
            dir.path(),
            replicas,
            schedule.follower_seed,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let current =
            [&cache, &events_cache, &consumer].map(|f| (Arc::clone(&f.current), f.replays()));
        let cluster = server.cluster().is_some();
        let targets = Arc::new(Targets {
            current,
            server: AsyncMutex::new(server),
            proxies,
            caches: [
                AsyncMutex::new(cache),
                AsyncMutex::new(events_cache),
                AsyncMutex::new(consumer),
            ],
            mirror: AsyncMutex::new(mirror),
            drivers,
            admin: admin.clone(),
            gate,
            flood,
            node_fault,
            ttl: schedule.ttl,
            calm: RwLock::new(()),
            applied: Mutex::new(BTreeMap::new()),
            created: Mutex::new(vec![created_at(&admin).await]),
            failures: Mutex::new(Vec::new()),
        });
        let watchers = Arc::new(Mutex::new(vec![
            Watcher::new(MIRROR_WATCHER, true),
            Watcher::of_handlers(WORKER),
        ]));
        let (done, until) = watch::channel(false);
        let sampler = sample(
            Arc::clone(&targets),
            Arc::clone(&watchers),
            file.clone(),
            until.clone(),
        );
        let keeper = keep_mirror_running(Arc::clone(&targets), until.clone());
        let leaders = cluster.then(|| tokio::spawn(watch_leaders(admin.clone(), until)));
        Round {
            targets,
            admin,
            file,
            views,
            watchers,
            done,
            watching: [tokio::spawn(sampler), tokio::spawn(keeper)],
            leaders,
            _dir: dir,
        }
    }

    /// Writers and the three fault lanes at once for the schedule's phase; then every
    /// fault healed and the writers' last writes settled. The complete ledger, and when
    /// the healing ended.
    async fn fault_phase(
        &self,
        writers: Vec<Writer>,
        schedule: &Schedule,
        report: &mut RoundReport,
    ) -> (Ledger, Instant) {
        let (stop_tx, stop) = watch::channel(false);
        let phase_start = Instant::now();
        // Puts with a TTL (of 1 or 2 s) stop 3 s before the phase ends: their markers
        // land within it.
        let ttl_until = schedule
            .ttl
            .then(|| phase_start + schedule.phase.saturating_sub(Duration::from_secs(3)));
        let running: Vec<JoinHandle<Result<Writer, String>>> = writers
            .into_iter()
            .map(|mut w| {
                w.ttl_until(ttl_until);
                tokio::spawn(w.run(stop.clone()))
            })
            .collect();
        let driven = self.targets.drivers.write(stop.clone());
        let lanes: Vec<JoinHandle<()>> = [
            Lane::Server,
            Lane::Proxy,
            Lane::Followers,
            Lane::Drivers,
            Lane::Bandwidth,
        ]
        .into_iter()
        .map(|lane| {
            let faults = schedule.lane(lane);
            tokio::spawn(run_lane(Arc::clone(&self.targets), faults, phase_start))
        })
        .collect();
        sleep_until(phase_start + schedule.phase).await;
        let _ = stop_tx.send(true);
        for lane in lanes {
            if let Err(e) = lane.await {
                report.failures.push(format!("a fault lane failed: {e}"));
            }
        }
        heal(&self.targets, &self.admin).await;
        let healed = Instant::now();
        report.recreations = *self.targets.gate.read().await;
        let mut ledger = Ledger::new(report.recreations + 1);
        for writer in running {
            match timeout(Duration::from_secs(150), writer).await {
                Ok(Ok(Ok(w))) => {
                    report.writes.add(&w.counts);
                    for landed in &w.landed {
                        if let Err(e) = ledger.record(landed) {
                            report.failures.push(e);
                        }
                    }
                    for unplaced in &w.unplaced {
                        ledger.record_unplaced(unplaced);
                    }
                    for unread in &w.unread {
                        ledger.record_expiry_unread(unread);
                    }
                }
                Ok(Ok(Err(e))) => report.failures.push(e),
                Ok(Err(e)) => report.failures.push(format!("a writer panicked: {e}")),
                Err(_) => report.failures.push("a writer did not finish".to_owned()),
            }
        }
        match timeout(Duration::from_secs(30), driven).await {
            Ok(Ok(Ok((written, counts)))) => {
                report.registry_written = written;
                report.drivers.add(&counts);
            }
            Ok(Ok(Err(e))) => report.failures.push(e),
            Ok(Err(e)) => report
                .failures
                .push(format!("the drivers' writers panicked: {e}")),
            Err(_) => report
                .failures
                .push("the drivers' writers did not finish".to_owned()),
        }
        (ledger, healed)
    }

    /// The bucket as it is after healing, which must be what the ledger says landed.
    async fn bucket_after_healing(
        &self,
        ledger: &Ledger,
        report: &mut RoundReport,
    ) -> BTreeMap<String, (u64, Bytes)> {
        let js = jetstream::new(self.admin.clone());
        let now = match bucket_now(&js, ledger).await {
            Ok(now) => now,
            Err(e) => {
                report.failures.push(e);
                BTreeMap::new()
            }
        };
        let expected = ledger.now();
        let read: BTreeMap<String, (u64, String)> = now
            .iter()
            .map(|(k, (s, v))| (k.clone(), (*s, token(v))))
            .collect();
        if read == expected {
            report.checks.ledger_matches += 1;
        } else {
            report.failures.push(format!(
                "the bucket read after healing is not what the writers' acknowledgements say \
                 landed (the server lost or invented a write, or the ledger is wrong): {}",
                describe_map_diff(&expected, &read)
            ));
        }
        now
    }

    /// Waits until every follower equals `now`, for [`CONVERGE_WITHIN`]; notes when each
    /// first did. The followers of announcements are asked for one reconcile first: an
    /// announcement lost after its write (a writer's publish into a killed server) is
    /// what that pass is for (SPEC §5), and nothing else would tell them.
    async fn converge(
        &self,
        now: &BTreeMap<String, (u64, Bytes)>,
        healed: Instant,
        report: &mut RoundReport,
    ) {
        report.reconciled_at = Some(Instant::now());
        for follower in &self.targets.caches {
            let follower = follower.lock().await;
            if !follower.replays()
                && let Err(e) = follower.reconcile(CONVERGE_WITHIN).await
            {
                report.failures.push(e);
            }
        }
        let converge_start = Instant::now();
        let mut equal = [false; FOLLOWERS.len()];
        loop {
            let mut diffs = Vec::new();
            for follower in &self.targets.caches {
                let follower = follower.lock().await;
                let entries = follower
                    .cache
                    .snapshot()
                    .into_iter()
                    .map(|(k, s, v)| (k, s, v.as_ref().clone()));
                diffs.push(diff(follower.label, entries, now));
            }
            let file = self.file.clone();
            let mirrored = tokio::task::spawn_blocking(move || read_file(&file, MIRROR_NAME, true))
                .await
                .ok()
                .flatten();
            diffs.push(match mirrored {
                Some((_, entries)) => diff("mirror file", entries.into_iter(), now),
                None => Some("mirror file: unreadable".to_owned()),
            });
            let worker = self.targets.drivers.worker_entries();
            diffs.push(diff(WORKER, worker.into_iter(), now));
            for (i, d) in diffs.iter().enumerate() {
                equal[i] = d.is_none();
                if equal[i] && report.converged_after[i].is_none() {
                    report.converged_after[i] = Some(healed.elapsed());
                }
            }
            if equal.iter().all(|e| *e) {
                report.checks.converged += equal.len() as u64;
                return;
            }
            if converge_start.elapsed() > CONVERGE_WITHIN {
                let last_diff = diffs.into_iter().flatten();
                let last_diff = last_diff.collect::<Vec<_>>().join("; ");
                report.failures.push(format!(
                    "not equal to the bucket {CONVERGE_WITHIN:?} after healing: {last_diff}"
                ));
                return;
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the sampling and judges everything seen against the complete ledger.
    async fn judge(&mut self, ledger: &Ledger, healed: Instant, report: &mut RoundReport) {
        let _ = self.done.send(true);
        for task in &self.watching {
            while !task.is_finished() {
                sleep(Duration::from_millis(10)).await;
            }
        }
        if let Some(leaders) = self.leaders.take() {
            match leaders.await {
                Ok(changes) => report.leader_changes = changes,
                Err(e) => report
                    .failures
                    .push(format!("the leaders' watcher failed: {e}")),
            }
        }
        for watcher in lock(&self.watchers).iter() {
            let mut failures = judge(ledger, watcher, &mut report.checks);
            if watcher.name == MIRROR_WATCHER {
                self.trail_keys(&mut failures);
            }
            report.failures.extend(failures);
        }
        self.judge_liveness(ledger, healed, report).await;
        self.judge_drivers(report).await;
        if let Err(e) = self.cursor_at_the_end(healed, report).await {
            report.failures.push(e);
        }
        match storage_within_limits(&self.admin).await {
            Ok(streams) => report.checks.storage += streams,
            Err(e) => report.failures.extend(e),
        }
        let mut views: Vec<ReadyView> = lock(&self.views).clone();
        match self.mirror_ready_views().await {
            Ok(mirror_views) => views.extend(mirror_views),
            Err(e) => report.failures.push(e),
        }
        for view in &views {
            report
                .failures
                .extend(judge_ready(ledger, view, &mut report.checks));
        }
        report
            .failures
            .extend(lock(&self.targets.failures).drain(..));
    }

    /// Each follower must have come to hold what it ends with within [`LIVENESS`] of the
    /// round healing (or of the last landed write's send, if later): one that got there
    /// only by waiting out a request timeout or a backoff fails the round. A round that
    /// did not converge has failed already.
    async fn judge_liveness(&self, ledger: &Ledger, healed: Instant, report: &mut RoundReport) {
        if report.converged_after.iter().any(Option::is_none) {
            return;
        }
        let healed_or_sent = ledger
            .last_sent()
            .map_or(healed.into_std(), |sent| sent.max(healed.into_std()));
        let mut names = Vec::new();
        for follower in &self.targets.caches {
            names.push(follower.lock().await.name());
        }
        names.push(MIRROR_WATCHER.to_owned());
        names.push(WORKER.to_owned());
        let watchers = lock(&self.watchers);
        for (i, name) in names.iter().enumerate() {
            let watcher = watchers.iter().find(|w| &w.name == name);
            let Some(since) = watcher.and_then(|w| w.holding_since()) else {
                continue;
            };
            let announced = self
                .targets
                .current
                .get(i)
                .is_some_and(|(_, replays)| !replays);
            let from = match report.reconciled_at {
                Some(at) if announced => healed_or_sent.max(at.into_std()),
                _ => healed_or_sent,
            };
            let after = since.saturating_duration_since(from);
            report.settled_after[i] = Some(after);
            if after <= report.liveness {
                report.checks.live += 1;
            } else {
                let name = watcher.map_or("?", |w| w.name.as_str());
                report.failures.push(format!(
                    "{name}: came to hold the bucket only {} ms after the round healed (and \
                     the last write was sent, and, following announcements, its reconcile \
                     was asked), past the liveness bound of {:?}: \
                     it waited out a timeout or a backoff instead of retrying when the \
                     server came back (SPEC §15)",
                    after.as_millis(),
                    report.liveness,
                ));
            }
        }
    }

    /// Every job of the queue ends acked or dead-lettered once healed; the relays drained
    /// the outbox into their stream, never both holding a row's claim (`checker.rs`).
    async fn judge_drivers(&self, report: &mut RoundReport) {
        let drivers = &self.targets.drivers;
        match drivers.job_ends(&self.admin, DRIVERS_SETTLE_WITHIN).await {
            Ok(ends) => {
                let runs = lock(&drivers.runs).clone();
                let (failures, unrecorded) =
                    judge_jobs(&ends, &runs, DRIVERS_SETTLE_WITHIN, &mut report.checks);
                report.failures.extend(failures);
                report.failures.extend(unrecorded);
            }
            Err(e) => report.failures.push(e),
        }
        match drivers.relayed(&self.admin, DRIVERS_SETTLE_WITHIN).await {
            Ok((pending, stream)) => {
                let log = lock(&drivers.relay_log);
                let failures = judge_relays(
                    &log,
                    &report.registry_written,
                    &stream,
                    pending,
                    DRIVERS_SETTLE_WITHIN,
                    &mut report.checks,
                );
                report.failures.extend(failures);
            }
            Err(e) => report.failures.push(e),
        }
    }

    /// The durable consumer saves its cursor after every entry it observed (SPEC §8): once
    /// the round healed, its saved position reaches the events stream's last entry within
    /// [`LIVENESS`] (of the round's end, by when it equals the bucket).
    async fn cursor_at_the_end(
        &self,
        healed: Instant,
        report: &mut RoundReport,
    ) -> Result<(), String> {
        let js = jetstream::new(self.admin.clone());
        let events = NatsEvents::new(self.admin.clone(), EVENTS_STREAM, EVENTS_PREFIX)
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + report.liveness;
        loop {
            let mut stream = js
                .get_stream(EVENTS_STREAM)
                .await
                .map_err(|e| format!("the events stream after healing: {e}"))?;
            let last = stream
                .info()
                .await
                .map_err(|e| format!("the events stream after healing: {e}"))?
                .state
                .last_sequence;
            let saved = events.load(CONSUMER_CURSOR).await.ok().flatten();
            if saved == Some(last) || last == 0 {
                report.checks.cursors += 1;
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "consumer: its saved cursor is {saved:?} {} ms after healing, but the \
                     events stream's last entry is {last}: an observed entry was not \
                     checkpointed (SPEC §8)",
                    healed.elapsed().as_millis()
                ));
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// Adds to each failure that names a key of the mirror's file how that key moved
    /// through the file's commits ([`key_trail`]).
    fn trail_keys(&self, failures: &mut [String]) {
        for failure in failures {
            let rest = failure.strip_prefix(MIRROR_WATCHER).unwrap_or_default();
            let key = ["showed ", "dropped "]
                .iter()
                .find_map(|word| rest.strip_prefix(&format!(": {word}")))
                .and_then(|r| r.split(' ').next());
            if let Some(key) = key {
                let trail = key_trail(&self.file, key).unwrap_or_else(|e| format!("unread: {e}"));
                failure.push_str(&format!("\n      its commits of {key}: {trail}"));
            }
        }
    }

    /// The view each start of the mirror said it was ready with, read exactly from its
    /// file's commit log.
    async fn mirror_ready_views(&self) -> Result<Vec<ReadyView>, String> {
        let ready = lock(&self.targets.mirror.lock().await.ready).clone();
        if ready.is_empty() {
            // Its file came to equal the bucket, so some start was ready: a line the
            // campaign no longer understands must not leave the mirror unchecked.
            return Err(
                "the mirror never said it was ready in a line the campaign reads \
                 (`ready worker=… watermark=N`)"
                    .to_owned(),
            );
        }
        let file = self.file.clone();
        let read = tokio::task::spawn_blocking(move || {
            ready
                .into_iter()
                .map(|(start, watermark)| {
                    Ok(ReadyView {
                        follower: format!("mirror (start {start})"),
                        watermark,
                        entries: ready_view(&file, start, watermark)?,
                    })
                })
                .collect::<Result<Vec<_>, String>>()
        });
        read.await
            .map_err(|e| format!("reading the mirror's ready views: {e}"))?
    }

    /// Stops the followers (the mirror by its PID) and takes their figures; the server
    /// and the proxy stop when the round is dropped.
    async fn stop(self, report: &mut RoundReport) {
        for (i, cache) in self.targets.caches.iter().enumerate() {
            let mut cache = cache.lock().await;
            cache.stop().await;
            add_counters(&mut report.counters, &cache.counters);
            report.restarts[i] = u64::from(cache.starts.saturating_sub(1));
            if cache.counters.resets > 0 && report.recreations == 0 {
                report.failures.push(format!(
                    "the {} counted {} reset(s) over its starts: it took the bucket for a \
                     new history, yet it was never recreated",
                    cache.label, cache.counters.resets
                ));
            }
        }
        report.drivers.add(&self.targets.drivers.stop().await);
        let mut mirror = self.targets.mirror.lock().await;
        if let Some(line) = mirror.panicked() {
            report.failures.push(format!("the mirror panicked: {line}"));
        }
        mirror.kill9().await;
        report.mirror_restarts = u64::from(mirror.starts.saturating_sub(1));
        report.mirror_exits = mirror.exits.clone();
        report.mirror_log = lock(&mirror.lines).iter().cloned().collect();
        report.stale_heartbeats[1] = mirror
            .stale_heartbeats
            .load(std::sync::atomic::Ordering::Relaxed);
        report.mirror_new_histories = mirror
            .new_histories
            .load(std::sync::atomic::Ordering::Relaxed);
        let captured = std::mem::take(&mut *lock(&CAPTURED));
        report.stale_heartbeats[0] = captured.stale_heartbeats;
        let mirror_gave_up = lock(&mirror.gave_up_stalled).clone();
        // On a cluster a stopped or cut-off node holds a follower's flow-control answer on
        // its routes while the leader's stalled heartbeats queue behind it: past
        // `MAX_STALLS` heartbeat intervals a feed rightly gives up (counted, not failed).
        let excused = report.schedule.faults.iter().any(|p| {
            matches!(p.fault, Fault::NodePause { .. } | Fault::Partition { .. })
                && p.fault.lasting() >= ANSWERS_HELD
        });
        report.faults = lock(&self.targets.applied).clone();
        if excused {
            let gave_up = mirror_gave_up.len() + captured.gave_up_stalled.len();
            report.stalled_behind_node_fault = gave_up as u64;
            return;
        }
        for line in mirror_gave_up {
            report.failures.push(format!(
                "the mirror gave up on its consumer as stalled, yet no fault keeps the server \
                 from its flow-control answers that long (a heartbeat queued behind a request \
                 it answered, misread after a pause?): {line}"
            ));
        }
        for line in captured.gave_up_stalled {
            report.failures.push(format!(
                "an in-process follower gave up on its consumer as stalled, yet no fault keeps \
                 the server from its flow-control answers that long (a heartbeat queued behind \
                 a request it answered, misread after a sink pause?):{line}"
            ));
        }
    }
}

/// A client of these servers (any one, failing over to the others).
async fn connect(urls: &[String], name: &str) -> async_nats::Client {
    NatsOptions::new(urls.iter().map(String::as_str))
        .name(name)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting {name} to {}: {e}", urls.join(",")))
}

/// Runs one lane's faults at their times, each undone before the next.
async fn run_lane(targets: Arc<Targets>, faults: Vec<Planned>, phase_start: Instant) {
    for Planned { at, fault, lane } in faults {
        sleep_until(phase_start + at).await;
        let _calm = match lane {
            Lane::Server | Lane::Proxy | Lane::Bandwidth => Some(targets.calm.read().await),
            Lane::Followers | Lane::Drivers => None,
        };
        *lock(&targets.applied).entry(fault.kind()).or_default() += 1;
        let node_fault = targets.node_fault.as_ref().filter(|_| lane == Lane::Server);
        node_fault.inspect(|f| f.store(true, Ordering::Relaxed));
        if let Err(e) = apply(&targets, &fault).await {
            lock(&targets.failures).push(format!("applying {fault}: {e}"));
        }
        node_fault.inspect(|f| f.store(false, Ordering::Relaxed));
    }
}

async fn apply(t: &Targets, fault: &Fault) -> Result<(), String> {
    let proxies = |act: &dyn Fn(&FaultProxy)| t.proxies.iter().for_each(act);
    match fault {
        Fault::ServerKill { down } => kill_node(t, 0, *down).await?,
        Fault::ServerPause { paused } => pause_node(t, 0, *paused).await?,
        Fault::NodeKill { node, down } => kill_node(t, t.node(node).await, *down).await?,
        Fault::NodePause { node, paused } => pause_node(t, t.node(node).await, *paused).await?,
        Fault::Partition {
            node,
            lasting,
            reset,
        } => {
            let i = t.node(node).await;
            t.on_links(i, |link| {
                link.stall(Direction::ToServer);
                link.stall(Direction::ToClient);
                if *reset {
                    link.reset_all();
                }
            })
            .await;
            sleep(*lasting).await;
            t.on_links(i, FaultProxy::heal).await;
        }
        Fault::Latency {
            latency,
            jitter,
            lasting,
        } => {
            proxies(&|p| p.set_latency(*latency, *jitter));
            sleep(*lasting).await;
            proxies(&FaultProxy::heal);
        }
        Fault::Bandwidth {
            bytes_per_sec,
            lasting,
        } => {
            proxies(&|p| p.cap_bandwidth(*bytes_per_sec));
            sleep(*lasting).await;
            proxies(&FaultProxy::uncap_bandwidth);
        }
        Fault::Stall { direction, lasting } => {
            proxies(&|p| p.stall(*direction));
            sleep(*lasting).await;
            proxies(&FaultProxy::heal);
        }
        Fault::HalfOpen {
            lasting,
            then_reset,
        } => {
            proxies(&FaultProxy::half_open);
            sleep(*lasting).await;
            if *then_reset {
                proxies(&FaultProxy::reset_all);
            }
            proxies(&FaultProxy::heal);
        }
        Fault::Reset => proxies(&FaultProxy::reset_all),
        Fault::MirrorKill { down } => {
            {
                let mut mirror = t.mirror.lock().await;
                mirror.held_down = true;
                mirror.kill9().await;
            }
            sleep(*down).await;
            let mut mirror = t.mirror.lock().await;
            mirror.held_down = false;
            mirror.start()?;
        }
        Fault::Restart(which) => t.caches[*which as usize].lock().await.restart().await,
        Fault::Recreate { cut, down } => {
            match cut {
                Cut::Nothing => {}
                Cut::MirrorDown => {
                    let mut mirror = t.mirror.lock().await;
                    mirror.held_down = true;
                    mirror.kill9().await;
                }
                Cut::ProxyHalfOpen => proxies(&FaultProxy::half_open),
            }
            let made = recreate(t).await;
            sleep(*down).await;
            match cut {
                Cut::Nothing => {}
                Cut::MirrorDown => {
                    let mut mirror = t.mirror.lock().await;
                    mirror.held_down = false;
                    mirror.start()?;
                }
                Cut::ProxyHalfOpen => proxies(&FaultProxy::heal),
            }
            made?;
        }
        Fault::SinkPause {
            which,
            paused,
            cold,
        } => {
            let _calm = t.calm.write().await;
            let held = {
                let mut follower = t.caches[*which as usize].lock().await;
                match cold {
                    true => follower.restart_paused().await,
                    false => Arc::clone(&follower.paused).write_owned().await,
                }
            };
            flood(t, *paused).await;
            drop(held);
        }
        Fault::WorkerFails => t.drivers.fail_worker(),
        Fault::RunnerCrash { down } => t.drivers.crash_runner(*down).await,
        Fault::RelayCrash { relay, down } => t.drivers.crash_relay(*relay, *down).await,
        Fault::MirrorPause { paused } => {
            let _calm = t.calm.write().await;
            t.mirror.lock().await.signal(true)?;
            flood(t, *paused).await;
            t.mirror.lock().await.signal(false)?;
        }
    }
    Ok(())
}

/// kill -9 of node `i` (by the PID the harness started), restarted on its ports and
/// storage after `down`.
async fn kill_node(t: &Targets, i: usize, down: Duration) -> Result<(), String> {
    let e = |e: tidemark_tests::HarnessError| e.to_string();
    t.server.lock().await.nodes_mut()[i]
        .kill9()
        .await
        .map_err(e)?;
    sleep(down).await;
    t.server.lock().await.nodes_mut()[i]
        .restart()
        .await
        .map_err(e)
}

/// SIGSTOP of node `i`, SIGCONT after `paused`.
async fn pause_node(t: &Targets, i: usize, paused: Duration) -> Result<(), String> {
    let e = |e: tidemark_tests::HarnessError| e.to_string();
    t.server.lock().await.nodes_mut()[i].pause().map_err(e)?;
    sleep(paused).await;
    t.server.lock().await.nodes_mut()[i].resume().map_err(e)
}

impl Targets {
    /// Acts on every route link to and from node `i`.
    async fn on_links(&self, i: usize, act: impl Fn(&FaultProxy)) {
        if let Some(cluster) = self.server.lock().await.cluster() {
            cluster.links_of(i).for_each(act);
        }
    }

    /// The index of the node a fault acts on: a stream's leader as its stream info names
    /// it now, or the schedule's fallback when no leader answers within 2 s (an election
    /// under way), counted apart.
    async fn node(&self, node: &Node) -> usize {
        let (stream, otherwise) = match *node {
            Node::At(i) => return i,
            Node::LeaderOf { stream, otherwise } => (stream, otherwise),
        };
        let leader = timeout(Duration::from_secs(2), leader_of(&self.admin, stream)).await;
        let found = match leader.ok().flatten() {
            Some(name) => self
                .server
                .lock()
                .await
                .cluster()
                .and_then(|c| c.index_of(&name)),
            None => None,
        };
        found.unwrap_or_else(|| {
            let mut applied = lock(&self.applied);
            *applied
                .entry("no stream leader known: fell back")
                .or_default() += 1;
            otherwise
        })
    }
}

/// The server name of `stream`'s leader as its stream info gives it, if it has one.
async fn leader_of(admin: &async_nats::Client, stream: Led) -> Option<String> {
    let name = match stream {
        Led::Bucket => format!("KV_{BUCKET}"),
        Led::Events => EVENTS_STREAM.to_owned(),
    };
    let mut js = jetstream::new(admin.clone());
    js.set_timeout(Duration::from_secs(1));
    let mut stream = js.get_stream(name).await.ok()?;
    let info = stream.info().await.ok()?;
    info.cluster.as_ref()?.leader.clone()
}

/// Samples both streams' leaders every 250 ms until `stop`; how many times each changed
/// from one known leader to another.
async fn watch_leaders(admin: async_nats::Client, mut stop: watch::Receiver<bool>) -> [u64; 2] {
    let mut last: [Option<String>; 2] = [None, None];
    let mut changes = [0; 2];
    loop {
        for (i, stream) in [Led::Bucket, Led::Events].into_iter().enumerate() {
            let leader = timeout(Duration::from_secs(2), leader_of(&admin, stream)).await;
            if let Some(leader) = leader.ok().flatten() {
                if last[i].as_ref().is_some_and(|l| *l != leader) {
                    changes[i] += 1;
                }
                last[i] = Some(leader);
            }
        }
        if timeout(Duration::from_millis(250), stop.changed())
            .await
            .is_ok()
        {
            return changes;
        }
    }
}

/// Holds a follower's pause for `paused`, the writers writing mostly values near the
/// size limit meanwhile: more bytes than the server's flow-control window (2 MB for a new
/// consumer, growing to 32 MB for one that keeps up), so it asks the paused reader for an
/// answer, stops, and sends a stalled heartbeat each second it waits: each a heartbeat
/// queued behind the request once the reader reads on.
async fn flood(t: &Targets, paused: Duration) {
    t.flood.store(true, Ordering::Relaxed);
    sleep(paused).await;
    t.flood.store(false, Ordering::Relaxed);
}

/// What an operator does: deletes the bucket and makes it again with the same name and
/// config, while no write is under way (each holds the gate); the writers then go on into
/// the new history. Retried while the server is killed or stopped.
async fn recreate(t: &Targets) -> Result<(), String> {
    let mut epoch = t.gate.write().await;
    let js = jetstream::new(t.admin.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match timeout(Duration::from_secs(3), js.delete_key_value(BUCKET)).await {
            Ok(Ok(_)) => break,
            // A delete whose reply a killed server lost, asked again.
            Ok(Err(e)) if e.to_string().contains("not found") => break,
            _ if Instant::now() > deadline => {
                return Err("deleting the bucket: the server did not answer in 60 s".into());
            }
            _ => sleep(Duration::from_millis(100)).await,
        }
    }
    loop {
        let replicas = t.server.lock().await.nodes().len();
        let made = timeout(
            Duration::from_secs(3),
            js.create_key_value(bucket_config(replicas, t.ttl)),
        );
        let made = made.await;
        if matches!(made, Ok(Ok(_))) {
            break;
        }
        // One whose reply was lost: made already (and after the delete, so the new one).
        if let Ok(Ok(_)) = timeout(Duration::from_secs(3), js.get_key_value(BUCKET)).await {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("making the bucket again: {made:?}"));
        }
        sleep(Duration::from_millis(100)).await;
    }
    *epoch += 1;
    let created = created_at(&t.admin).await;
    let mut all = lock(&t.created);
    all.resize(*epoch as usize, None);
    all.push(created);
    Ok(())
}

/// Storage bounded by the configured limits, after healing: every stream the round made
/// (the bucket's, the events stream, the job queue and its state bucket, the relayed
/// stream) holds no more messages and bytes than its `max_messages` and `max_bytes`, no
/// more messages than its per-subject limit allows for the subjects it holds, and no
/// message older than its `max_age` (and a little slack). Returns the streams checked.
async fn storage_within_limits(admin: &async_nats::Client) -> Result<u64, Vec<String>> {
    let mut js = jetstream::new(admin.clone());
    js.set_timeout(Duration::from_secs(5));
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut streams = js.streams();
    while let Some(info) = streams.next().await {
        let info = info.map_err(|e| vec![format!("listing the streams after healing: {e}")])?;
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        failures.extend(crate::checker::stream_within_limits(
            &info.config,
            crate::checker::StreamHeld::of(&info.state),
            now_ns,
        ));
        checked += 1;
    }
    if failures.is_empty() {
        Ok(checked)
    } else {
        Err(failures)
    }
}

/// The bucket stream's creation time (nanoseconds since the Unix epoch, as a follower's
/// lineage names its history); `None` when the server does not answer within a few tries.
async fn created_at(admin: &async_nats::Client) -> Option<u64> {
    let js = jetstream::new(admin.clone());
    for _ in 0..30 {
        let info = timeout(Duration::from_secs(2), async {
            let mut stream = js
                .get_stream(format!("KV_{BUCKET}"))
                .await
                .map_err(|e| e.to_string())?;
            stream
                .info()
                .await
                .map(|i| i.created)
                .map_err(|e| e.to_string())
        })
        .await;
        if let Ok(Ok(created)) = info {
            return u64::try_from(created.unix_timestamp_nanos()).ok();
        }
        sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Undoes whatever a lane left: every node running and answering, the route links and
/// the proxies clear, the mirror running. On a cluster, healing ends when both streams
/// (and the durable consumer) have a leader with every replica current.
async fn heal(t: &Targets, admin: &async_nats::Client) {
    {
        let mut server = t.server.lock().await;
        if let Some(cluster) = server.cluster() {
            cluster.links.iter().for_each(|l| l.proxy.heal());
        }
        for node in server.nodes_mut() {
            let _ = node.resume();
            if node.pid().is_none() {
                if let Err(e) = node.restart().await {
                    lock(&t.failures).push(format!("healing: restarting nats-server: {e}"));
                }
            }
        }
    }
    if let Err(e) = wait_jetstream_ready(admin).await {
        lock(&t.failures).push(format!("healing: {e}"));
    }
    t.proxies.iter().for_each(FaultProxy::heal);
    if t.server.lock().await.cluster().is_some() {
        // A replica still not current STUCK_REPLICA_AFTER into healing is restarted once,
        // as an operator restarts a server stuck behind its peers (seed 30006: replica n2
        // of CAMP_EVENTS not current 60 s after healing; the followers read the leader).
        // Anything else (no leader yet, no answer) is waited out to the full bound.
        let mut waited = wait_current(admin, STUCK_REPLICA_AFTER).await;
        if let Err(NotCurrent {
            replica: Some(name),
            ..
        }) = &waited
        {
            let mut server = t.server.lock().await;
            let index = server.cluster().and_then(|c| c.index_of(name));
            if let Some(node) = index.and_then(|i| server.nodes_mut().get_mut(i)) {
                *lock(&t.applied)
                    .entry("a replica stuck at healing: its node restarted")
                    .or_default() += 1;
                // A node fault while it restarts: the writers' read-backs wait it out.
                if let Some(fault) = &t.node_fault {
                    fault.store(true, Ordering::Relaxed);
                }
                if let Err(e) = node.restart().await {
                    lock(&t.failures).push(format!("healing: restarting {name}: {e}"));
                }
                if let Some(fault) = &t.node_fault {
                    fault.store(false, Ordering::Relaxed);
                }
            }
        }
        if waited.is_err() {
            waited = wait_current(admin, CLUSTER_CURRENT_WITHIN).await;
        }
        if let Err(e) = waited {
            lock(&t.failures).push(format!(
                "healing: the cluster's groups not current {:?} after healing: {e}",
                STUCK_REPLICA_AFTER + CLUSTER_CURRENT_WITHIN
            ));
        }
    }
    let mut mirror = t.mirror.lock().await;
    mirror.held_down = false;
    if !mirror.running() {
        if let Err(e) = mirror.start() {
            lock(&t.failures).push(format!("healing: {e}"));
        }
    }
}

/// How long healing waits for a cluster's groups to be current before it restarts a
/// replica that is not.
const STUCK_REPLICA_AFTER: Duration = Duration::from_secs(20);

/// Why a cluster's groups are not current: what says so, and the replica behind if one
/// is named.
#[derive(Debug)]
struct NotCurrent {
    why: String,
    replica: Option<String>,
}

impl std::fmt::Display for NotCurrent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl From<String> for NotCurrent {
    fn from(why: String) -> Self {
        NotCurrent { why, replica: None }
    }
}

/// Waits until the bucket's stream and the events stream each have a leader and every
/// replica is current, and so has every durable consumer of the events stream, for up to
/// `within`: reads from the leader then cannot race a replica behind it, and what is left
/// of the followers' recovery is theirs.
async fn wait_current(admin: &async_nats::Client, within: Duration) -> Result<(), NotCurrent> {
    let mut js = jetstream::new(admin.clone());
    js.set_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let mut named = None;
    loop {
        let last = match groups_current(&js).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if let Some(replica) = &last.replica {
            named = Some(replica.clone());
        }
        if started.elapsed() > within {
            // The last replica named behind, though the last answer named none.
            return Err(NotCurrent {
                why: last.why,
                replica: named,
            });
        }
        sleep(Duration::from_millis(100)).await;
    }
}

async fn groups_current(js: &jetstream::Context) -> Result<(), NotCurrent> {
    let current = |what: &str, cluster: Option<&jetstream::stream::ClusterInfo>| {
        let cluster = cluster.ok_or(format!("{what}: no cluster info"))?;
        if cluster.leader.is_none() {
            return Err(NotCurrent::from(format!("{what}: no leader")));
        }
        match cluster.replicas.iter().find(|r| !r.current) {
            Some(r) => Err(NotCurrent {
                why: format!("{what}: replica {} not current", r.name),
                replica: Some(r.name.clone()),
            }),
            None => Ok(()),
        }
    };
    for name in [format!("KV_{BUCKET}"), EVENTS_STREAM.to_owned()] {
        let mut stream = js.get_stream(&name).await.map_err(|e| e.to_string())?;
        let info = stream.info().await.map_err(|e| e.to_string())?;
        current(&name, info.cluster.as_ref())?;
        if name != EVENTS_STREAM {
            continue;
        }
        let mut consumers = stream.consumers();
        while let Some(consumer) = consumers.next().await {
            let consumer = consumer.map_err(|e| e.to_string())?;
            if consumer.config.durable_name.is_some() {
                let what = format!("consumer {}", consumer.name);
                current(&what, consumer.cluster.as_ref())?;
            }
        }
    }
    Ok(())
}

/// Restarts the mirror when it exits on its own (as a service manager would), unless a
/// fault holds it down.
async fn keep_mirror_running(t: Arc<Targets>, mut stop: watch::Receiver<bool>) {
    loop {
        if timeout(Duration::from_millis(200), stop.changed())
            .await
            .is_ok()
        {
            return;
        }
        let mut mirror = t.mirror.lock().await;
        if !mirror.held_down && !mirror.running() {
            if let Err(e) = mirror.start() {
                lock(&t.failures).push(e);
            }
        }
    }
}

/// Samples the in-process followers and the supervised worker every 20 ms and the
/// mirror's file every 100 ms into their watchers, from the followers' start until the round has converged (`stop`), and once more then.
async fn sample(
    t: Arc<Targets>,
    watchers: Arc<Mutex<Vec<Watcher>>>,
    file: PathBuf,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = 0u64;
    loop {
        let stopping = *stop.borrow_and_update();
        tick += 1;
        for (current, replays) in &t.current {
            let (name, cache, followed) = lock(current).clone();
            let (entries, at) = {
                let (before, ready) = (cache.watermark(), cache.is_ready());
                let entries = shown(&cache);
                // A batch lands with its watermark under the cache's lock: an unmoved
                // watermark around the read means the entries are exactly at it. A
                // follower of announcements holds claims above it: no view at a watermark.
                let at = (*replays && ready && cache.watermark() == before)
                    .then(|| (before, Instant::now()));
                (entries, at)
            };
            // Read after the entries: a commit names its history before its entries show.
            let follows = *lock(&followed);
            let epoch = follows.and_then(|h| {
                let created = lock(&t.created);
                created
                    .iter()
                    .position(|c| *c == Some(h))
                    .and_then(|e| u32::try_from(e).ok())
            });
            let mut watchers = lock(&watchers);
            let i = match watchers.iter().position(|w| w.name == name) {
                Some(i) => i,
                None => {
                    watchers.push(Watcher::new(name, *replays));
                    watchers.len() - 1
                }
            };
            watchers[i].follows(follows, epoch);
            watchers[i].observe(at.map(|(w, i)| (w, i.into_std())), &entries);
        }
        let worker = t.drivers.worker_shown();
        if let Some(w) = lock(&watchers).iter_mut().find(|w| w.name == WORKER) {
            w.observe(None, &worker);
        }
        if tick % 5 == 0 || stopping {
            let path = file.clone();
            let read = tokio::task::spawn_blocking(move || read_file(&path, MIRROR_NAME, false));
            if let Ok(Some((watermark, rows))) = read.await {
                let read_at = std::time::Instant::now();
                let entries: Vec<_> = rows
                    .into_iter()
                    .map(|(k, s, v)| (k, s, token(&v)))
                    .collect();
                lock(&watchers)[0].observe(Some((watermark, read_at)), &entries);
            }
        }
        if stopping {
            return;
        }
        let _ = timeout(Duration::from_millis(20), stop.changed()).await;
    }
}

/// Every live key of the bucket: revision and value, read from the stream after healing.
async fn bucket_now(
    js: &jetstream::Context,
    ledger: &Ledger,
) -> Result<BTreeMap<String, (u64, Bytes)>, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match try_bucket_now(js, ledger).await {
            Ok(now) => return Ok(now),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("reading the bucket after healing: {e}"));
            }
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn try_bucket_now(
    js: &jetstream::Context,
    ledger: &Ledger,
) -> Result<BTreeMap<String, (u64, Bytes)>, String> {
    let store = js.get_key_value(BUCKET).await.map_err(|e| e.to_string())?;
    let stream = js
        .get_stream(format!("KV_{BUCKET}"))
        .await
        .map_err(|e| e.to_string())?;
    let mut keys: BTreeSet<String> = ledger.all_keys();
    let mut listed = store.keys().await.map_err(|e| e.to_string())?;
    while let Some(key) = listed.next().await {
        keys.insert(key.map_err(|e| e.to_string())?);
    }
    let mut now = BTreeMap::new();
    for key in keys {
        let subject = format!("$KV.{BUCKET}.{key}");
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => {
                if let Kind::Put(_) = kind_of(&m.headers, &m.payload) {
                    now.insert(key, (m.sequence, m.payload));
                }
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(now)
}

/// `None` if `entries` are exactly the bucket's keys, revisions and bytes; else the first
/// differences.
fn diff(
    name: &str,
    entries: impl Iterator<Item = (String, u64, Vec<u8>)>,
    bucket: &BTreeMap<String, (u64, Bytes)>,
) -> Option<String> {
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for (key, seq, value) in entries {
        match bucket.get(&key) {
            None => problems.push(format!("{key}@{seq} is not in the bucket")),
            Some((s, v)) if *s != seq || v.as_ref() != value.as_slice() => problems.push(format!(
                "{key}@{seq} {:?}, bucket {key}@{s} {:?}",
                token(&value),
                token(v)
            )),
            Some(_) => {}
        }
        seen.insert(key);
    }
    for (key, (s, _)) in bucket {
        if !seen.contains(key) {
            problems.push(format!("lacks {key}@{s}"));
        }
    }
    match problems.len() {
        0 => None,
        n => Some(format!(
            "{name}: {n} difference(s): {}",
            problems.into_iter().take(5).collect::<Vec<_>>().join(", ")
        )),
    }
}

fn describe_map_diff(
    expected: &BTreeMap<String, (u64, String)>,
    read: &BTreeMap<String, (u64, String)>,
) -> String {
    let keys: BTreeSet<&String> = expected.keys().chain(read.keys()).collect();
    let problems: Vec<String> = keys
        .into_iter()
        .filter(|k| expected.get(*k) != read.get(*k))
        .take(5)
        .map(|k| {
            format!(
                "{k}: ledger {:?}, bucket {:?}",
                expected.get(k),
                read.get(k)
            )
        })
        .collect();
    problems.join(", ")
}
