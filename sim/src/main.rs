//! The campaign CLI: run one seed with a readable trace, or a range of seeds with a
//! progress bar and a summary; every failure prints the exact command that replays it.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tidemark_sim::clients::remote::PartReads;
use tidemark_sim::scenario::{FaultKind, Scenario, Strategy, plan};
use tidemark_sim::world::{Outcome, run};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Simulate tidemark writers, a source host and followers under faults, and check that
/// every follower converges.
///
/// With `SIMLOG` set to a tracing filter (`SIMLOG=tidemark=debug`), the library's logs go
/// to standard error, stamped with the simulated time.
#[derive(Parser, Debug)]
#[command(name = "tidemark-sim", version)]
struct Args {
    /// Run this one seed and print its trace.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run a campaign over these seeds (`START..END`, end exclusive).
    #[arg(long, default_value = "0..300")]
    seeds: String,
    /// Followers per run (3 to 8).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(3..=8))]
    followers: u64,
    /// Writers per run.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=4))]
    writers: u64,
    /// Length of the fault phase in simulated seconds.
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Bound on convergence after healing, in simulated seconds.
    #[arg(long, default_value_t = 60)]
    liveness: u64,
    /// Fault kinds to draw from (default: every kind). Repeat or separate with commas.
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<FaultKind>,
    /// How followers are built (the naive strategies must be caught diverging).
    #[arg(long, value_enum, default_value_t = Strategy::Correct)]
    strategy: Strategy,
    /// Restore the source four times in every run from a backup taken shortly before,
    /// with the followers cut off meanwhile (the world `--strategy trusts-watermark` is
    /// caught in; implied by it).
    #[arg(long)]
    restores_while_cut: bool,
    /// Make the source anew four times in every run (a bucket deleted and created again:
    /// the backup taken before any write put back), the followers cut off from 1-3 s
    /// before to 3-5 s after, the writers going on: the old history's announcements wait
    /// on the events stream for followers that took the new one.
    #[arg(long)]
    recreations_while_cut: bool,
    /// Leave the source's reads unanswered four times in every run, 1-4 s each, the
    /// connections kept up (a stream with no leader, a node cut off from its cluster).
    #[arg(long)]
    silences: bool,
    /// Crash a sweep scheduler between claiming a tick and recording its job four times in
    /// every run (the world `--strategy naive-ticks` is caught in; implied by it).
    #[arg(long)]
    crashes_at_ticks: bool,
    /// Run every seed twice and fail if the trace hashes differ.
    #[arg(long)]
    check_determinism: bool,
    /// After a campaign, print one line per seed, `seed N trace HASH`, in seed order: two
    /// builds that hash every seed alike run the same simulation (a refactor's proof).
    #[arg(long)]
    print_hashes: bool,
    /// Simulated milliseconds per simulation step (the grain of message delivery).
    #[arg(long, default_value_t = tidemark_sim::scenario::DEFAULT_TICK.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..=20))]
    tick_ms: u64,
    /// Hot keys: a few keys written and removed often (the rest are cold keys, each
    /// written once and removed at most once).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    hot_keys: u64,
    /// The share of writes that go to hot keys (key skew), 0 to 1.
    #[arg(long, default_value_t = 0.6)]
    hot_share: f64,
    /// The share of cold-key writes that remove a cold key written earlier, 0 to 1.
    #[arg(long, default_value_t = 0.35)]
    cold_remove_share: f64,
    /// The share of an announcing writer's hot-key puts that are marker races (a marker
    /// whose key is overwritten and removed before any of the three is announced), 0 to
    /// 1; 0 (the default) leaves every seed as it was.
    #[arg(long, default_value_t = 0.0)]
    marker_races: f64,
    /// Relays draining the source's outbox (0 to 4; with none, every writer announces
    /// its own writes).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=4))]
    relays: u64,
    /// Worker threads for a campaign.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
}

impl Args {
    fn scenario(&self, keep_trace: bool) -> Scenario {
        let mut s = Scenario {
            followers: self.followers as usize,
            writers: self.writers as usize,
            fault_phase: Duration::from_secs(self.duration),
            liveness_bound: Duration::from_secs(self.liveness),
            strategy: self.strategy,
            keep_trace,
            tick: Duration::from_millis(self.tick_ms),
            relays: self.relays as usize,
            restores_while_cut: self.restores_while_cut,
            recreations_while_cut: self.recreations_while_cut,
            silences: self.silences,
            crashes_at_ticks: self.crashes_at_ticks,
            workload: tidemark_sim::scenario::Workload {
                hot_keys: self.hot_keys,
                hot_share: self.hot_share.clamp(0.0, 1.0),
                cold_remove_share: self.cold_remove_share.clamp(0.0, 1.0),
                marker_races: self.marker_races.clamp(0.0, 1.0),
                ..tidemark_sim::scenario::Workload::default()
            },
            ..Scenario::default()
        };
        if !self.faults.is_empty() {
            s.faults = self.faults.iter().copied().collect();
        }
        s
    }

    /// The command that replays `seed` with these settings.
    fn replay(&self, seed: u64) -> String {
        let mut cmd = format!(
            "cargo run -p tidemark-sim --release -- --seed {seed} --followers {} --writers {} --relays {} --duration {} --liveness {} --strategy {}",
            self.followers,
            self.writers,
            self.relays,
            self.duration,
            self.liveness,
            clap::ValueEnum::to_possible_value(&self.strategy)
                .map_or_else(String::new, |v| v.get_name().to_owned()),
        );
        if self.restores_while_cut {
            cmd.push_str(" --restores-while-cut");
        }
        if self.recreations_while_cut {
            cmd.push_str(" --recreations-while-cut");
        }
        if self.silences {
            cmd.push_str(" --silences");
        }
        if self.crashes_at_ticks {
            cmd.push_str(" --crashes-at-ticks");
        }
        let w = tidemark_sim::scenario::Workload::default();
        if (self.hot_keys, self.hot_share, self.cold_remove_share)
            != (w.hot_keys, w.hot_share, w.cold_remove_share)
        {
            cmd.push_str(&format!(
                " --hot-keys {} --hot-share {} --cold-remove-share {}",
                self.hot_keys, self.hot_share, self.cold_remove_share
            ));
        }
        if self.marker_races != w.marker_races {
            cmd.push_str(&format!(" --marker-races {}", self.marker_races));
        }
        if self.tick_ms != tidemark_sim::scenario::DEFAULT_TICK.as_millis() as u64 {
            cmd.push_str(&format!(" --tick-ms {}", self.tick_ms));
        }
        if !self.faults.is_empty() {
            let names: Vec<String> = self
                .faults
                .iter()
                .filter_map(|f| {
                    clap::ValueEnum::to_possible_value(f).map(|v| v.get_name().to_owned())
                })
                .collect();
            cmd.push_str(&format!(" --faults {}", names.join(",")));
        }
        cmd
    }
}

fn parse_range(s: &str) -> Result<std::ops::Range<u64>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("--seeds wants START..END, got {s:?}"))?;
    let a: u64 = a
        .trim()
        .parse()
        .map_err(|e| format!("bad start {a:?}: {e}"))?;
    let b: u64 = b
        .trim()
        .parse()
        .map_err(|e| format!("bad end {b:?}: {e}"))?;
    if b <= a {
        return Err(format!("--seeds {s}: the range is empty"));
    }
    Ok(a..b)
}

fn one(args: &Args, seed: u64) -> ExitCode {
    let scenario = args.scenario(true);
    println!(
        "seed {seed}: {} followers, {} writers, strategy {:?}",
        scenario.followers, scenario.writers, scenario.strategy
    );
    println!("fault plan:");
    for (at, action) in plan(seed, &scenario) {
        println!("  {:>7.3}s {action}", at.as_secs_f64());
    }
    let outcome = run(seed, &scenario);
    for line in &outcome.trace {
        println!("{line}");
    }
    report(args, &outcome);
    if args.check_determinism {
        let again = run(seed, &args.scenario(true));
        if again.trace_hash != outcome.trace_hash {
            println!(
                "NOT DETERMINISTIC: trace hash {:016x} then {:016x}",
                outcome.trace_hash, again.trace_hash
            );
            // Where the second run parted from the first.
            let first = outcome
                .trace
                .iter()
                .zip(&again.trace)
                .position(|(a, b)| a != b);
            if let Some(i) = first {
                println!("first difference at trace line {i}:");
                for (a, b) in outcome.trace[i..].iter().zip(&again.trace[i..]).take(8) {
                    println!("  first:  {a}\n  second: {b}");
                }
            }
            return ExitCode::FAILURE;
        }
        println!("deterministic: the same seed gave the same trace hash twice");
    }
    if outcome.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn report(args: &Args, o: &Outcome) {
    println!(
        "seed {}: {} · watermark {} · converged after {} · trace {:016x}",
        o.seed,
        if o.passed() { "passed" } else { "FAILED" },
        o.watermark,
        o.converged_after
            .map_or("never".to_owned(), |d| format!("{:.3}s", d.as_secs_f64())),
        o.trace_hash
    );
    for f in &o.failures {
        println!("  {f}");
    }
    if !o.passed() {
        println!("  replay: {}", args.replay(o.seed));
    }
}

fn campaign(args: &Args, seeds: std::ops::Range<u64>) -> ExitCode {
    let scenario = args.scenario(false);
    let total = seeds.end - seeds.start;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} seeds {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let outcomes = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..args.jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if seed >= seeds.end {
                        return;
                    }
                    let mut o = run(seed, &scenario);
                    if args.check_determinism {
                        let again = run(seed, &scenario);
                        if again.trace_hash != o.trace_hash {
                            o.failures.push(format!(
                                "not deterministic: trace hash {:016x} then {:016x}",
                                o.trace_hash, again.trace_hash
                            ));
                        }
                    }
                    if !o.passed() {
                        bar.println(format!("seed {seed} FAILED: {}", o.failures.join(" | ")));
                    }
                    outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(o);
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    let mut outcomes = outcomes.into_inner().unwrap_or_else(|e| e.into_inner());
    outcomes.sort_by_key(|o| o.seed);
    if args.print_hashes {
        for o in &outcomes {
            println!("seed {} trace {:016x}", o.seed, o.trace_hash);
        }
    }
    summary(args, &outcomes, elapsed)
}

fn summary(args: &Args, outcomes: &[Outcome], elapsed: Duration) -> ExitCode {
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.passed()).collect();
    let mut faults: BTreeMap<FaultKind, u64> = BTreeMap::new();
    for o in outcomes {
        for (k, n) in &o.faults {
            *faults.entry(*k).or_default() += u64::from(*n);
        }
    }
    let mut times: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.converged_after)
        .map(|d| d.as_secs_f64())
        .collect();
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        times
            .get(((times.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "strategy {:?}: {} seeds in {:.1}s ({:.1} seeds/s)",
        args.strategy,
        outcomes.len(),
        elapsed.as_secs_f64(),
        outcomes.len() as f64 / elapsed.as_secs_f64()
    );
    println!("faults injected:");
    for (k, n) in &faults {
        println!("  {:<20} {n}", format!("{k:?}"));
    }
    let sum = |f: fn(&Outcome) -> u32| outcomes.iter().map(|o| u64::from(f(o))).sum::<u64>();
    println!(
        "persisted commits interrupted by a crash {} · commits failed {} · warm restarts {} · supervised restarts {}",
        sum(|o| o.commit_crashes),
        sum(|o| o.failed_commits),
        sum(|o| o.warm_restarts),
        sum(|o| o.worker_restarts),
    );
    let (again, taken_over) = outcomes.iter().fold((0u64, 0u64), |(a, b), o| {
        (
            a + u64::from(o.relay_repeats.0),
            b + u64::from(o.relay_repeats.1),
        )
    });
    println!(
        "outbox rows published again by design: {again} by the same relay after a lost answer, {taken_over} by another relay after a lease ran out"
    );
    println!(
        "jobs handled {} · run again after a lease ran out {} · lease renewals {} · slow jobs delivered again while running {}",
        sum(|o| o.jobs.0),
        sum(|o| o.jobs.1),
        sum(|o| o.jobs.2),
        sum(|o| o.jobs.3),
    );
    let total = |f: fn(&Outcome) -> u64| outcomes.iter().map(f).sum::<u64>();
    println!(
        "sweeps {} · after their lease ran out {} · lock taken over from a crashed sweeper {} · removed: change log {}, events {}, outbox rows {}, finished jobs {} · durable cursors passed at the maximum age {}",
        sum(|o| o.sweeps.sweeps),
        sum(|o| o.sweeps.late),
        sum(|o| o.sweeps.takeovers),
        total(|o| o.sweeps.removed.0),
        total(|o| o.sweeps.removed.1),
        total(|o| o.sweeps.removed.2),
        total(|o| o.sweeps.jobs_removed),
        sum(|o| o.sweeps.forced),
    );
    let reads = outcomes.iter().fold(PartReads::default(), |mut all, o| {
        all.reads += o.part_reads.reads;
        all.split += o.part_reads.split;
        all.parts += o.part_reads.parts;
        all
    });
    println!(
        "resync snapshots read in parts {} · of more than one part {} · parts {} · seeds with a read of more than one part {}",
        reads.reads,
        reads.split,
        reads.parts,
        outcomes.iter().filter(|o| o.part_reads.split > 0).count(),
    );
    println!(
        "convergence after healing (simulated): p50 {:.2}s  p90 {:.2}s  p99 {:.2}s  max {:.2}s",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        times.last().copied().unwrap_or(f64::NAN)
    );
    println!(
        "failures: {} of {} ({:.1}%)",
        failed.len(),
        outcomes.len(),
        100.0 * failed.len() as f64 / outcomes.len().max(1) as f64
    );
    for o in &failed {
        println!(
            "  seed {}: {}",
            o.seed,
            o.failures.first().map_or("", String::as_str)
        );
        println!("    replay: {}", args.replay(o.seed));
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Stamps a log line with the simulated time, as the trace does, so the library's logs
/// line up with it.
struct SimTime;

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let t = turmoil::sim_elapsed().unwrap_or_default();
        write!(w, "{:>9.3}", t.as_secs_f64())
    }
}

fn main() -> ExitCode {
    // The library's own logs (a backoff and its cause, a feed opened, a checkpoint that
    // failed) say why a follower did what the trace shows: `SIMLOG=tidemark=debug`.
    if std::env::var_os("SIMLOG").is_some() {
        // `target=level` pairs and a bare default level (a `Targets` filter): the
        // simulator's build leaves out the regex an `EnvFilter` needs.
        let filter = std::env::var("SIMLOG").unwrap_or_default();
        let filter = match filter.parse::<tracing_subscriber::filter::Targets>() {
            Ok(filter) => filter,
            Err(e) => {
                eprintln!("SIMLOG={filter:?} is not a filter (`target=level,...`): {e}");
                return ExitCode::from(2);
            }
        };
        tracing_subscriber::fmt()
            // Every level reaches the filter, which alone decides.
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_timer(SimTime)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .finish()
            .with(filter)
            .init();
    }
    let args = Args::parse();
    if let Some(seed) = args.seed {
        return one(&args, seed);
    }
    match parse_range(&args.seeds) {
        Ok(range) => campaign(&args, range),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
