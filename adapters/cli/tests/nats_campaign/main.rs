//! Issue 26's fault campaign against a real nats-server, first phase: seeded rounds on one
//! node. Each round starts a fresh server and bucket; three writers put, delete, purge,
//! overwrite one key rapidly and write values near the bucket's size limit, straight to
//! the server; two followers read it through a fault proxy — the runtime's cache over a
//! `KvBucket` in this process, and the built `tidemark mirror` binary into a SQLite file.
//! Faults drawn from the round's seed: kill -9 and restart of the server, SIGSTOP and
//! SIGCONT of it (by the PID the harness started), proxy latency, a stalled direction,
//! half-open and reset connections, kill -9 of the mirror, a cold restart of the cache;
//! the bucket deleted and made again by an operator (while the followers run, while the
//! mirror is down, or while the proxy holds them off) with the writers going on into the
//! new history; a follower's sink paused 6-8 s (or a cold start's first commit) and the
//! mirror stopped with SIGSTOP, the writers flooding it with values near the limit and
//! no server or proxy fault meanwhile, so the server waits on flow control.
//! One one-node round in three (drawn from the seed apart from the rest) makes its bucket
//! with limit markers, and its writers give one draw in ten a put with a TTL of 1 or 2 s:
//! the server's expiry markers are read back into the ledger (`writers.rs`).
//! Beside the followers run the drivers (`drivers.rs`), through the same proxy: a worker
//! under the runtime's `Supervisor` following the bucket (its handler made to fail, so
//! the supervisor restarts it), a `JobRunner` over a NATS job queue (crashed and started
//! again) fed by an enqueuer and by the relays' housekeeping jobs, and two outbox
//! `Relay`s of a SQLite registry into a NATS stream of their own (crashed and started
//! again under new owners); their faults are a fourth lane, drawn apart so a seed's
//! other lanes are what they were before.
//! Then everything heals and the checker judges (see `checker.rs`).
//!
//! With `--cluster` a round runs a 3-node JetStream cluster instead, the bucket and the
//! events stream at replicas 3, its routes through the harness's fault links; the server
//! lane kills (kill -9), stops (SIGSTOP) or cuts off (its route links stalled, or reset
//! and stalled) one node at a time, any node or the leader of a stream (`round.rs`).
//! `--cluster-share P` draws each round a cluster round with probability P from its seed
//! (`--cluster` is `--cluster-share 1`); without either, every round is on one node.
//!
//! A test without libtest's harness (`harness = false`): it takes arguments and prints its
//! table under plain `cargo test`, which runs a short fixed campaign (seeds 1..=3):
//!
//! ```text
//! cargo test -p tidemark-cli --test nats_campaign -- [--rounds N | --minutes M]
//!     [--seed N | --start-seed N] [--cluster | --cluster-share P] [--phase-secs S]
//!     [--no-markers] [--verbose]
//! ```
//!
//! The fault phase is 6 s on one node and 12 s on a cluster unless `--phase-secs` says.
//! `--seed N` runs the round of seed N (replaying its schedule); without it, rounds take
//! seeds from `--start-seed` (default 1) up. `TIDEMARK_CAMPAIGN_MINUTES`, `_ROUNDS`,
//! `_SEED`, `_PHASE_SECS` and `_CLUSTER_SHARE` set the same from the environment. A failing round prints its
//! seed, its schedule and the command that replays it; the exit code is 1. The writers
//! announce one put in eight as a bare mutation marker, racing the overwrites and removals
//! of its key (the defect that showed is fixed: CHANGELOG); `--no-markers` (or
//! `TIDEMARK_CAMPAIGN_MARKERS=0`) announces every put with its value, as the campaign did
//! before markers were on by default (`--markers` is accepted and is the default). `RUST_LOG`
//! (`tidemark=debug`, say) logs what the in-process follower does, to stderr.

mod checker;
mod drivers;
mod followers;
mod ledger;
mod round;
mod schedule;
mod writers;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use checker::Checks;
use drivers::DriverCounts;
use round::{RoundConfig, RoundReport};
use schedule::{CLUSTER_KINDS, KINDS, Schedule};
use tidemark::tidemark_core::Rng;
use writers::WriteCounts;

/// The campaign `cargo test` runs: short, fixed, well inside CI's time.
const DEFAULT_ROUNDS: u64 = 3;
const DEFAULT_PHASE_SECS: u64 = 6;
/// A cluster round's: faults on a node last up to 8 s (past an election's 4-9 s).
const DEFAULT_CLUSTER_PHASE_SECS: u64 = 12;
/// A follower that needs longer than this after healing is listed as a slow recovery
/// (a failure only past [`round::LIVENESS`]).
const SLOW_RECOVERY: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct Args {
    rounds: Option<u64>,
    minutes: Option<u64>,
    seed: Option<u64>,
    start_seed: u64,
    /// `None`: the default of each round's kind.
    phase_secs: Option<u64>,
    /// The share of rounds drawn as cluster rounds, in [0, 1].
    cluster_share: f64,
    markers: bool,
    /// Known defects fail their rounds.
    verbose: bool,
    /// libtest's `--list`, or a name filter this test does not match: run nothing.
    nothing: bool,
}

fn parse() -> Result<Args, String> {
    let env = |name: &str| std::env::var(format!("TIDEMARK_CAMPAIGN_{name}")).ok();
    let number = |what: &str, v: Option<String>| -> Result<Option<u64>, String> {
        v.map(|v| {
            v.parse()
                .map_err(|_| format!("{what} takes a whole number, not {v:?}"))
        })
        .transpose()
    };
    let mut args = Args {
        rounds: number("TIDEMARK_CAMPAIGN_ROUNDS", env("ROUNDS"))?,
        minutes: number("TIDEMARK_CAMPAIGN_MINUTES", env("MINUTES"))?,
        seed: number("TIDEMARK_CAMPAIGN_SEED", env("SEED"))?,
        start_seed: 1,
        phase_secs: number("TIDEMARK_CAMPAIGN_PHASE_SECS", env("PHASE_SECS"))?,
        cluster_share: share("TIDEMARK_CAMPAIGN_CLUSTER_SHARE", env("CLUSTER_SHARE"))?
            .unwrap_or(0.0),
        markers: env("MARKERS").is_none_or(|v| v != "0"),
        verbose: false,
        nothing: false,
    };
    fn share(what: &str, v: Option<String>) -> Result<Option<f64>, String> {
        let parsed = v.map(|v| match v.parse::<f64>() {
            Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
            _ => Err(format!("{what} takes a share from 0 to 1, not {v:?}")),
        });
        parsed.transpose()
    }
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value =
            |name: &str| number(name, it.next())?.ok_or(format!("{name} takes a value"));
        match arg.as_str() {
            "--rounds" => args.rounds = Some(value("--rounds")?),
            "--minutes" => args.minutes = Some(value("--minutes")?),
            "--seed" => args.seed = Some(value("--seed")?),
            "--start-seed" => args.start_seed = value("--start-seed")?,
            "--phase-secs" => args.phase_secs = Some(value("--phase-secs")?),
            "--cluster" => args.cluster_share = 1.0,
            "--cluster-share" => {
                args.cluster_share = share("--cluster-share", it.next())?
                    .ok_or("--cluster-share takes a value".to_owned())?;
            }
            "--verbose" => args.verbose = true,
            "--markers" => args.markers = true,
            "--no-markers" => args.markers = false,
            "--list" | "--ignored" => args.nothing = true,
            // What cargo test passes on to every test binary.
            a if a.starts_with('-') => {}
            filter => args.nothing |= !"nats_campaign".contains(filter),
        }
    }
    if args.phase_secs == Some(0) {
        return Err("--phase-secs must be at least 1".to_owned());
    }
    Ok(args)
}

/// The campaign's totals.
#[derive(Default)]
struct Totals {
    rounds: u64,
    faults: BTreeMap<&'static str, u64>,
    writes: WriteCounts,
    mirror_restarts: u64,
    mirror_exits: u64,
    restarts: [u64; 3],
    drivers: DriverCounts,
    checks: Checks,
    /// Rounds on a cluster, and the stream leader changes seen in them (bucket, events).
    cluster_rounds: u64,
    /// Rounds whose bucket wrote limit markers, with puts given a TTL.
    ttl_rounds: u64,
    leader_changes: [u64; 2],
    stalled_behind_node_fault: u64,
    /// Every follower's settle time (what the liveness bound bounds), on one node and on a
    /// cluster, for the percentiles the bound is chosen from.
    settles: [Vec<Duration>; 2],
    resyncs: u64,
    reopens: u64,
    resets: u64,
    recreations: u64,
    mirror_new_histories: u64,
    stale_heartbeats: [u64; 2],
    slowest_converge: Duration,
    slowest_settle: Duration,
    slow: Vec<(u64, u128)>,
    failed: Vec<u64>,
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("nats_campaign: {e}");
            return ExitCode::from(2);
        }
    };
    if args.nothing {
        return ExitCode::SUCCESS;
    }
    // RUST_LOG=tidemark=debug shows what the in-process follower decided, to stderr; the
    // checker reads a few of its lines whatever RUST_LOG says.
    {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let shown = std::env::var_os("RUST_LOG").is_some().then(|| {
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(tracing_subscriber::EnvFilter::from_default_env())
        });
        let capture = followers::Capture.with_filter(tracing_subscriber::filter::filter_fn(
            followers::Capture::wants,
        ));
        tracing_subscriber::registry()
            .with(shown)
            .with(capture)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"));
    runtime.block_on(campaign(args))
}

/// Whether the round of `seed` runs on a cluster: drawn from its seed (apart from its
/// schedule) at the campaign's cluster share.
fn on_cluster(seed: u64, share: f64) -> bool {
    match share {
        s if s >= 1.0 => true,
        s if s <= 0.0 => false,
        s => (Rng::new(seed ^ 0x636c_7573_7465_7273).next_u64() % 10_000) < (s * 10_000.0) as u64,
    }
}

async fn campaign(args: Args) -> ExitCode {
    let base = RoundConfig {
        phase: Duration::ZERO,
        markers: args.markers,
        cluster: false,
        tidemark_bin: PathBuf::from(env!("CARGO_BIN_EXE_tidemark")),
    };
    let (first, rounds) = match (args.seed, args.rounds, args.minutes) {
        (Some(seed), rounds, None) => (seed, rounds.unwrap_or(1)),
        (seed, _, Some(_)) => (seed.unwrap_or(args.start_seed), u64::MAX),
        (None, rounds, None) => (args.start_seed, rounds.unwrap_or(DEFAULT_ROUNDS)),
    };
    let deadline = args
        .minutes
        .map(|m| Instant::now() + Duration::from_secs(m * 60));
    let load = loadavg();
    let started = Instant::now();
    let phase = |cluster| match (args.phase_secs, cluster) {
        (Some(s), _) => s,
        (None, false) => DEFAULT_PHASE_SECS,
        (None, true) => DEFAULT_CLUSTER_PHASE_SECS,
    };
    println!(
        "nats_campaign: seeds from {first}, {}, fault phase {}s per round{}, markers {} \
         (load {load})",
        match args.minutes {
            Some(m) => format!("for {m} min"),
            None => format!("{rounds} round(s)"),
        },
        phase(false),
        match args.cluster_share {
            s if s > 0.0 => format!(
                ", {:.0}% of rounds on a 3-node cluster ({}s)",
                s * 100.0,
                phase(true)
            ),
            _ => String::new(),
        },
        if args.markers { "on" } else { "off" },
    );
    checker::self_check();
    let mut totals = Totals::default();
    for seed in (first..).take(usize::try_from(rounds).unwrap_or(usize::MAX)) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let cluster = on_cluster(seed, args.cluster_share);
        let config = RoundConfig {
            phase: Duration::from_secs(phase(cluster)),
            cluster,
            ..base.clone()
        };
        // The schedule is all the seed decides: drawing it twice must give it twice.
        assert_eq!(
            Schedule::draw(seed, config.phase, cluster),
            Schedule::draw(seed, config.phase, cluster),
            "the schedule of seed {seed} must replay from its seed"
        );
        let report = round::run(seed, &config).await;
        print_round(seed, &report, args.verbose, phase(cluster), args.markers);
        add(&mut totals, seed, &report);
    }
    print_totals(&totals, started.elapsed(), &load);
    match totals.failed.is_empty() {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    }
}

fn add(t: &mut Totals, seed: u64, r: &RoundReport) {
    t.rounds += 1;
    for (kind, n) in &r.faults {
        *t.faults.entry(kind).or_default() += n;
    }
    t.writes.add(&r.writes);
    t.mirror_restarts += r.mirror_restarts;
    t.mirror_exits += r.mirror_exits.len() as u64;
    for (sum, n) in t.restarts.iter_mut().zip(r.restarts) {
        *sum += n;
    }
    t.checks.add(&r.checks);
    t.drivers.add(&r.drivers);
    let on = usize::from(r.schedule.cluster);
    t.cluster_rounds += on as u64;
    t.ttl_rounds += u64::from(r.schedule.ttl);
    for (sum, n) in t.leader_changes.iter_mut().zip(r.leader_changes) {
        *sum += n;
    }
    t.settles[on].extend(r.settled_after.into_iter().flatten());
    t.stalled_behind_node_fault += r.stalled_behind_node_fault;
    t.resyncs += r.counters.resyncs;
    t.reopens += r.counters.reopens;
    t.resets += r.counters.resets;
    t.recreations += u64::from(r.recreations);
    t.mirror_new_histories += r.mirror_new_histories;
    for (sum, n) in t.stale_heartbeats.iter_mut().zip(r.stale_heartbeats) {
        *sum += n;
    }
    if let Some(c) = r.converged_after.into_iter().flatten().max() {
        t.slowest_converge = t.slowest_converge.max(c);
    }
    if let Some(c) = r.settled_after.into_iter().flatten().max() {
        t.slowest_settle = t.slowest_settle.max(c);
        if c > SLOW_RECOVERY {
            t.slow.push((seed, c.as_millis()));
        }
    }
    if !r.failures.is_empty() {
        t.failed.push(seed);
    }
}

fn print_round(seed: u64, r: &RoundReport, verbose: bool, phase_secs: u64, markers: bool) {
    // Faults applied, not the note of a leader not found.
    let faults: u64 = r
        .faults
        .iter()
        .filter(|(kind, _)| KINDS.contains(kind))
        .map(|(_, n)| n)
        .sum();
    let after = |d: Option<Duration>| match d {
        Some(d) => format!("{} ms", d.as_millis()),
        None => "never".to_owned(),
    };
    let converged = round::FOLLOWERS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            format!(
                "{name} {} (holding it since {})",
                after(r.converged_after[i]),
                after(r.settled_after[i])
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let verdict = match r.failures.is_empty() {
        false => "FAILED",
        true => "ok",
    };
    let cluster = match r.schedule.cluster {
        true => format!(
            " (cluster: {} + {} leader changes)",
            r.leader_changes[0], r.leader_changes[1]
        ),
        false => String::new(),
    };
    println!(
        "round seed {seed}{cluster}: {verdict} in {:.1}s: {faults} faults, {} writes, {} \
         mirror / {} in-process restarts; equal to the bucket after healing: {converged}",
        r.took.as_secs_f64(),
        r.writes.landed(),
        r.mirror_restarts,
        r.restarts.iter().sum::<u64>(),
    );
    let shown = !r.failures.is_empty();
    if verbose || shown {
        print!("{}", r.schedule);
        for exit in &r.mirror_exits {
            println!("  the mirror exited on its own: {exit}");
        }
    }
    if verbose || shown {
        for f in &r.failures {
            println!("  FAILED: {f}");
        }
        println!("  the mirror's last lines:");
        // All it kept when the mirror's own file failed a check, else its last few.
        let mirrored = r.failures.iter().any(|f| f.starts_with("mirror"));
        let last = if mirrored { r.mirror_log.len() } else { 15 };
        for line in r.mirror_log.iter().rev().take(last).rev() {
            println!("    {line}");
        }
    }
    if shown {
        println!(
            "  replay: cargo test -p tidemark-cli --test nats_campaign -- --seed {seed} \
             --phase-secs {phase_secs}{}{}",
            if r.schedule.cluster { " --cluster" } else { "" },
            if markers { "" } else { " --no-markers" },
        );
    }
}

fn print_totals(t: &Totals, took: Duration, load_at_start: &str) {
    let w = &t.writes;
    let c = &t.checks;
    println!();
    println!(
        "nats_campaign: {} round(s) in {:.1} min (load {load_at_start} at start, {} at end)",
        t.rounds,
        took.as_secs_f64() / 60.0,
        loadavg()
    );
    println!("  faults:");
    let kinds = match t.cluster_rounds {
        0 => &KINDS[..KINDS.len() - CLUSTER_KINDS],
        _ => &KINDS[..],
    };
    let width = kinds.iter().map(|k| k.len()).max().unwrap_or(0);
    for kind in kinds {
        println!(
            "    {kind:<width$} {:>7}",
            t.faults.get(kind).copied().unwrap_or(0)
        );
    }
    println!(
        "  writes landed: {} ({} puts of which {} rapid overwrites and {} near the size \
         limit, {} deletes, {} purges); acknowledgements lost: {} landed, {} did not; {} \
         announcements sent",
        w.landed(),
        w.puts,
        w.overwrites,
        w.big,
        w.deletes,
        w.purges,
        w.unacked_landed,
        w.unacked_lost,
        w.announced
    );
    println!(
        "  rounds with TTLs (limit markers): {} ({} puts with a TTL, {} expiry markers read \
         back, {} of them of a put that expired before its lost acknowledgement was read \
         back; {} left unread as the bucket was made again)",
        t.ttl_rounds, w.ttl_puts, w.expired, w.ttl_unplaced, w.expiry_unread
    );
    println!(
        "  follower restarts: mirror {} killed + {} exited on its own; cold restarts: cache \
         {}, events cache {}, consumer {} (in-process resyncs {}, feed reopens {})",
        t.mirror_restarts.saturating_sub(t.mirror_exits),
        t.mirror_exits,
        t.restarts[0],
        t.restarts[1],
        t.restarts[2],
        t.resyncs,
        t.reopens
    );
    println!(
        "  the bucket deleted and made again {} times: the in-process followers took a new \
         history {} times, the mirror {} times; heartbeats queued behind a flow-control \
         request read on through: {} in-process, {} by the mirror",
        t.recreations,
        t.resets,
        t.mirror_new_histories,
        t.stale_heartbeats[0],
        t.stale_heartbeats[1]
    );
    println!(
        "  checks passed: {} samples never older, {} values shown found in the ledger, {} \
         drops and returns matched to a removal, {} keys of views at a watermark as the \
         bucket held them there, {} first ready views of the cache's and the mirror's \
         starts ({} key checks), {} bucket reads equal to the ledger, {} followers equal \
         to the bucket (slowest {} ms after healing), {} holding it within the liveness \
         bound ({:?} on one node, {:?} on a cluster; slowest {} ms), {} durable cursors \
         saved up to the stream's last event, {} streams within their configured limits \
         (messages, bytes, per subject, age)",
        c.samples,
        c.values,
        c.flips,
        c.current,
        c.ready_views,
        c.ready_keys,
        c.ledger_matches,
        c.converged,
        t.slowest_converge.as_millis(),
        c.live,
        round::LIVENESS,
        round::CLUSTER_LIVENESS,
        t.slowest_settle.as_millis(),
        c.cursors,
        c.storage
    );
    let d = &t.drivers;
    println!(
        "  drivers: the worker restarted by its supervisor {} times; the job runner crashed \
         {} times, the relays {} times; {} jobs enqueued ({} enqueues failed), {} registry \
         writes; the runners leased {}, acked {}, failed {} (retried), dead-lettered {}, \
         lost {} leases; the relays finished {} rows, published {} events, enqueued {} \
         jobs, lost {} claims",
        d.worker_restarts,
        d.runner_restarts,
        d.relay_restarts,
        d.enqueued,
        d.enqueue_failed,
        d.registry_writes,
        d.leased,
        d.acked,
        d.failed,
        d.dead_lettered,
        d.lost,
        d.relayed,
        d.relay_published,
        d.relay_enqueued,
        d.relay_lost
    );
    println!(
        "  drivers' checks passed: {} jobs acked (each after a handler run that succeeded) \
         and {} dead-lettered of every job the queue held, no other job lost, waiting or \
         left leased ({} handler runs); {} outbox rows found in the relayed stream, {} claims on rows held \
         by no other owner at once, {} publishes made under their relay's own claim; not \
         failures: {} rows published by both relays under claims that did not overlap, {} \
         rows in the stream more than once, {} publishes begun after their claim ran out \
         while no other relay held the row",
        c.jobs_acked,
        c.jobs_dead,
        c.job_runs,
        c.relay_rows,
        c.relay_claims,
        c.relay_publishes,
        c.relay_republished,
        c.relay_duplicates,
        c.relay_late
    );
    for (on, settles) in t.settles.iter().enumerate() {
        let mut settles = settles.clone();
        settles.sort();
        let at = |q: f64| settles[((settles.len() - 1) as f64 * q) as usize].as_millis();
        if !settles.is_empty() {
            println!(
                "  settle times on {} ({} followers): p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
                if on == 1 { "a cluster" } else { "one node" },
                settles.len(),
                at(0.5),
                at(0.9),
                at(0.99),
                at(1.0)
            );
        }
    }
    if t.cluster_rounds > 0 {
        println!(
            "  cluster rounds: {}; stream leader changes seen: {} of the bucket's, {} of the \
             events stream's; faults on a leader that fell back to a named node (no leader \
             known): {}; feeds that gave up on a consumer as stalled behind a node stopped \
             or cut off for 3 s or more (not failures): {}; replicas stuck behind their \
             peers 20 s into healing, their node restarted: {}; liveness bound on a cluster {:?}",
            t.cluster_rounds,
            t.leader_changes[0],
            t.leader_changes[1],
            t.faults
                .get("no stream leader known: fell back")
                .copied()
                .unwrap_or(0),
            t.stalled_behind_node_fault,
            t.faults
                .get("a replica stuck at healing: its node restarted")
                .copied()
                .unwrap_or(0),
            round::CLUSTER_LIVENESS
        );
    }
    if c.old_after_new > 0 {
        println!(
            "  not judged: {} older values, drops and returns shown by followers of \
             announcements once they had shown two histories of the bucket (an announcement \
             carries no history: an old one still in the events stream when the follower took \
             the new history is applied as new); convergence after healing still judged",
            c.old_after_new
        );
    }
    if !t.slow.is_empty() {
        println!(
            "  slow recoveries (a follower equal to the bucket only > {SLOW_RECOVERY:?} after \
             healing), seed and ms: {:?}",
            t.slow
        );
    }
    match t.failed.as_slice() {
        [] => println!("  failures: none"),
        seeds => println!("  failed seeds: {seeds:?}"),
    }
}

/// The 1-minute load average, for the figures' context.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}
