//! One round: a fresh nats-server and bucket, writers, the two followers behind the fault
//! proxy, the schedule's faults for the fault phase, then heal, converge and judge.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use futures::StreamExt as _;
use tidemark::Counters;
use tidemark_nats::{KvBucket, NatsOptions};
use tidemark_tests::{FaultProxy, NatsServer, wait_jetstream_ready};
use tokio::sync::{Mutex as AsyncMutex, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::checker::{Checks, ReadyView, Watcher, judge, judge_ready};
use crate::followers::{CacheFollower, Mirror, lock, read_file, shown};
use crate::ledger::{Kind, Ledger, token};
use crate::schedule::{Fault, Lane, Planned, Schedule};
use crate::writers::{VALUE_LIMIT, WriteCounts, Writer, kind_of};

const BUCKET: &str = "camp";
const MIRROR_NAME: &str = "mirror-camp";
/// After healing, how long the followers have to equal the bucket.
const CONVERGE_WITHIN: Duration = Duration::from_secs(60);

/// What a round is run with.
#[derive(Debug, Clone)]
pub struct RoundConfig {
    pub phase: Duration,
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
    pub cache_restarts: u64,
    pub checks: Checks,
    pub counters: Counters,
    /// From healing to the first read equal to the bucket: the cache, the mirror's file.
    pub converged_after: [Option<Duration>; 2],
    pub took: Duration,
    pub failures: Vec<String>,
    pub mirror_log: Vec<String>,
}

/// What the fault lanes act on.
struct Targets {
    server: AsyncMutex<NatsServer>,
    proxy: FaultProxy,
    cache: AsyncMutex<CacheFollower>,
    mirror: AsyncMutex<Mirror>,
    applied: Mutex<BTreeMap<&'static str, u64>>,
    failures: Mutex<Vec<String>>,
}

/// Runs the round of `seed`. A nats-server that cannot start is a panic that says how to
/// get one (never a skip); everything else that breaks is in the report's failures.
pub async fn run(seed: u64, config: &RoundConfig) -> RoundReport {
    let started = Instant::now();
    let schedule = Schedule::draw(seed, config.phase);
    let server = NatsServer::start()
        .await
        .unwrap_or_else(|e| panic!("the NATS campaign needs a real nats-server: {e}"));
    let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()));
    let url = server.url();
    let admin = server.connect().await.unwrap_or_else(|e| panic!("{e}"));
    wait_jetstream_ready(&admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let js = jetstream::new(admin.clone());
    js.create_key_value(kv::Config {
        bucket: BUCKET.into(),
        history: 1,
        max_value_size: VALUE_LIMIT as i32,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("creating the bucket: {e}"));
    let proxy = FaultProxy::start(upstream, schedule.proxy_seed)
        .await
        .unwrap_or_else(|e| panic!("starting the fault proxy: {e}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary directory: {e}"));

    let mut report = RoundReport {
        schedule: schedule.clone(),
        faults: BTreeMap::new(),
        writes: WriteCounts::default(),
        mirror_restarts: 0,
        mirror_exits: Vec::new(),
        cache_restarts: 0,
        checks: Checks::default(),
        counters: Counters::default(),
        converged_after: [None; 2],
        took: Duration::ZERO,
        failures: Vec::new(),
        mirror_log: Vec::new(),
    };

    // Writers, and the history the followers start on.
    let mut writers = Vec::new();
    for (id, writer_seed) in schedule.writer_seeds.iter().enumerate() {
        let client = connect(&url, &format!("campaign-writer-{id}")).await;
        match Writer::new(id, *writer_seed, schedule.keys_per_writer, client, BUCKET).await {
            Ok(mut writer) => match writer.preload().await {
                Ok(()) => writers.push(writer),
                Err(e) => report.failures.push(format!("preload: {e}")),
            },
            Err(e) => report.failures.push(e),
        }
    }
    if !report.failures.is_empty() {
        report.took = started.elapsed();
        return report;
    }

    // The followers, both through the proxy.
    let views = Arc::new(Mutex::new(Vec::new()));
    let follower_client = connect(&proxy.url(), "campaign-cache").await;
    let bucket = KvBucket::new(follower_client, BUCKET).unwrap_or_else(|e| panic!("{e}"));
    let cache = CacheFollower::start(bucket, schedule.follower_seed, Arc::clone(&views));
    let source = format!("{}/{BUCKET}", proxy.url());
    let mut mirror = Mirror::new(
        config.tidemark_bin.clone(),
        source,
        dir.path().join("mirror.db"),
    );
    if let Err(e) = mirror.start() {
        panic!("{e}");
    }
    let file = mirror.file.clone();
    let targets = Arc::new(Targets {
        server: AsyncMutex::new(server),
        proxy,
        cache: AsyncMutex::new(cache),
        mirror: AsyncMutex::new(mirror),
        applied: Mutex::new(BTreeMap::new()),
        failures: Mutex::new(Vec::new()),
    });
    let watchers = Arc::new(Mutex::new(vec![Watcher::new("mirror file")]));
    let (stop_tx, stop) = watch::channel(false);
    let (done_tx, done) = watch::channel(false);
    let sampler = tokio::spawn(sample(
        Arc::clone(&targets),
        Arc::clone(&watchers),
        file.clone(),
        done.clone(),
    ));
    let keeper = tokio::spawn(keep_mirror_running(Arc::clone(&targets), done));

    // The fault phase: writers and the three lanes at once.
    let phase_start = Instant::now();
    let running: Vec<JoinHandle<Result<Writer, String>>> = writers
        .into_iter()
        .map(|w| tokio::spawn(w.run(stop.clone())))
        .collect();
    let lanes: Vec<JoinHandle<()>> = [Lane::Server, Lane::Proxy, Lane::Followers]
        .into_iter()
        .map(|lane| {
            let faults = schedule.lane(lane);
            tokio::spawn(run_lane(Arc::clone(&targets), faults, phase_start))
        })
        .collect();
    sleep_until(phase_start + schedule.phase).await;
    let _ = stop_tx.send(true);
    for lane in lanes {
        if let Err(e) = lane.await {
            report.failures.push(format!("a fault lane failed: {e}"));
        }
    }

    // Heal everything, then let the writers learn where their last writes landed.
    heal(&targets, &admin).await;
    let healed = Instant::now();
    let mut ledger = Ledger::default();
    for writer in running {
        match timeout(Duration::from_secs(150), writer).await {
            Ok(Ok(Ok(w))) => {
                report.writes.add(&w.counts);
                for landed in &w.landed {
                    if let Err(e) = ledger.record(landed) {
                        report.failures.push(e);
                    }
                }
            }
            Ok(Ok(Err(e))) => report.failures.push(e),
            Ok(Err(e)) => report.failures.push(format!("a writer panicked: {e}")),
            Err(_) => report.failures.push("a writer did not finish".to_owned()),
        }
    }

    // The bucket as it is now, which must be what the ledger says landed.
    let now = match bucket_now(&js, &ledger).await {
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

    // Every follower must come to equal that read.
    let converge_start = Instant::now();
    let mut equal = [false; 2];
    loop {
        let cache_diff = {
            let follower = targets.cache.lock().await;
            let entries = follower
                .cache
                .snapshot()
                .into_iter()
                .map(|(k, s, v)| (k, s, v.as_ref().clone()));
            diff("cache", entries, &now)
        };
        let file_for_read = file.clone();
        let mirrored =
            tokio::task::spawn_blocking(move || read_file(&file_for_read, MIRROR_NAME, true))
                .await
                .ok()
                .flatten();
        let mirror_diff = match mirrored {
            Some((_, entries)) => diff("mirror file", entries.into_iter(), &now),
            None => Some("mirror file: unreadable".to_owned()),
        };
        for (i, d) in [&cache_diff, &mirror_diff].into_iter().enumerate() {
            equal[i] = d.is_none();
            if equal[i] && report.converged_after[i].is_none() {
                report.converged_after[i] = Some(healed.elapsed());
            }
        }
        if equal == [true, true] {
            report.checks.converged += 2;
            break;
        }
        if converge_start.elapsed() > CONVERGE_WITHIN {
            let last_diff = [cache_diff, mirror_diff].into_iter().flatten();
            let last_diff = last_diff.collect::<Vec<_>>().join("; ");
            report.failures.push(format!(
                "not equal to the bucket {CONVERGE_WITHIN:?} after healing: {last_diff}"
            ));
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }

    // Stop sampling; judge what was seen.
    let _ = done_tx.send(true);
    let _ = sampler.await;
    let _ = keeper.await;
    for watcher in lock(&watchers).iter() {
        report
            .failures
            .extend(judge(&ledger, watcher, &mut report.checks));
    }
    let views: Vec<ReadyView> = lock(&views).clone();
    for view in &views {
        report
            .failures
            .extend(judge_ready(&ledger, view, &mut report.checks));
    }
    report.failures.extend(lock(&targets.failures).drain(..));

    // Stop every process this round started.
    {
        let mut cache = targets.cache.lock().await;
        if let Some(c) = cache.running_counters() {
            if c.resets > 0 {
                report.failures.push(format!(
                    "{}: counted {} reset(s): it took the bucket for a new history, yet it \
                     was never recreated",
                    cache.name(),
                    c.resets
                ));
            }
        }
        cache.stop().await;
        report.counters = cache.counters;
        report.cache_restarts = u64::from(cache.starts.saturating_sub(1));
        if cache.counters.resets > 0 && !report.failures.iter().any(|f| f.contains("reset(s)")) {
            report.failures.push(format!(
                "the cache counted {} reset(s) over its starts: it took the bucket for a new \
                 history, yet it was never recreated",
                cache.counters.resets
            ));
        }
    }
    {
        let mut mirror = targets.mirror.lock().await;
        if let Some(line) = mirror.panicked() {
            report.failures.push(format!("the mirror panicked: {line}"));
        }
        mirror.kill9().await;
        report.mirror_restarts = u64::from(mirror.starts.saturating_sub(1));
        report.mirror_exits = mirror.exits.clone();
        report.mirror_log = lock(&mirror.lines).iter().cloned().collect();
    }
    report.faults = lock(&targets.applied).clone();
    report.took = started.elapsed();
    report
}

async fn connect(url: &str, name: &str) -> async_nats::Client {
    NatsOptions::new([url])
        .name(name)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting {name} to {url}: {e}"))
}

/// Runs one lane's faults at their times, each undone before the next.
async fn run_lane(targets: Arc<Targets>, faults: Vec<Planned>, phase_start: Instant) {
    for Planned { at, fault, .. } in faults {
        sleep_until(phase_start + at).await;
        *lock(&targets.applied).entry(fault.kind()).or_default() += 1;
        if let Err(e) = apply(&targets, &fault).await {
            lock(&targets.failures).push(format!("applying {fault}: {e}"));
        }
    }
}

async fn apply(t: &Targets, fault: &Fault) -> Result<(), String> {
    let e = |e: tidemark_tests::HarnessError| e.to_string();
    match fault {
        Fault::ServerKill { down } => {
            t.server.lock().await.kill9().await.map_err(e)?;
            sleep(*down).await;
            t.server.lock().await.restart().await.map_err(e)?;
        }
        Fault::ServerPause { paused } => {
            t.server.lock().await.pause().map_err(e)?;
            sleep(*paused).await;
            t.server.lock().await.resume().map_err(e)?;
        }
        Fault::Latency {
            latency,
            jitter,
            lasting,
        } => {
            t.proxy.set_latency(*latency, *jitter);
            sleep(*lasting).await;
            t.proxy.heal();
        }
        Fault::Stall { direction, lasting } => {
            t.proxy.stall(*direction);
            sleep(*lasting).await;
            t.proxy.heal();
        }
        Fault::HalfOpen {
            lasting,
            then_reset,
        } => {
            t.proxy.half_open();
            sleep(*lasting).await;
            if *then_reset {
                t.proxy.reset_all();
            }
            t.proxy.heal();
        }
        Fault::Reset => t.proxy.reset_all(),
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
        Fault::CacheRestart => t.cache.lock().await.restart().await,
    }
    Ok(())
}

/// Undoes whatever a lane left: the server running and answering, the proxy clear, the
/// mirror running.
async fn heal(t: &Targets, admin: &async_nats::Client) {
    {
        let mut server = t.server.lock().await;
        let _ = server.resume();
        if server.pid().is_none() {
            if let Err(e) = server.restart().await {
                lock(&t.failures).push(format!("healing: restarting nats-server: {e}"));
            }
        }
    }
    if let Err(e) = wait_jetstream_ready(admin).await {
        lock(&t.failures).push(format!("healing: {e}"));
    }
    t.proxy.heal();
    let mut mirror = t.mirror.lock().await;
    mirror.held_down = false;
    if !mirror.running() {
        if let Err(e) = mirror.start() {
            lock(&t.failures).push(format!("healing: {e}"));
        }
    }
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

/// Samples the cache every 20 ms and the mirror's file every 100 ms into their watchers,
/// from the followers' start until the round has converged (`stop`), and once more then.
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
        let (name, entries, at) = {
            let follower = t.cache.lock().await;
            let cache = &follower.cache;
            let (before, ready) = (cache.watermark(), cache.is_ready());
            let entries = shown(cache);
            // A batch lands with its watermark under the cache's lock: an unmoved
            // watermark around the read means the entries are exactly at it.
            let at = (ready && cache.watermark() == before).then(|| (before, Instant::now()));
            (follower.name(), entries, at)
        };
        {
            let mut watchers = lock(&watchers);
            if watchers.last().is_none_or(|w| w.name != name) {
                watchers.push(Watcher::new(name));
            }
            if let Some(w) = watchers.last_mut() {
                w.observe(at.map(|(w, i)| (w, i.into_std())), &entries);
            }
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
    let mut keys: BTreeSet<String> = ledger.keys().cloned().collect();
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
