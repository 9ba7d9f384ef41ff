//! A fixed seed range with every fault kind on: no safety violation, every follower
//! converges; and the deliberately naive strategies are caught diverging.

use tidemark_sim::scenario::{Scenario, Strategy};
use tidemark_sim::world::run;

/// Seeds checked on every CI run. Wider ranges are the campaign CLI's job.
const SEEDS: std::ops::Range<u64> = 1000..1032;

#[test]
fn correct_followers_converge_on_a_fixed_seed_range_under_every_fault() {
    let scenario = Scenario::default();
    let mut failures = Vec::new();
    let mut watermarks = 0;
    for seed in SEEDS {
        let o = run(seed, &scenario);
        watermarks += o.watermark;
        if !o.passed() {
            failures.push(format!("seed {seed}: {}", o.failures.join(" | ")));
        }
        assert!(
            !o.faults.is_empty(),
            "seed {seed} injected no fault: the run proves little"
        );
    }
    assert!(
        watermarks > 50 * (SEEDS.end - SEEDS.start),
        "writers must actually write"
    );
    assert!(
        failures.is_empty(),
        "replay with `cargo run -p tidemark-sim --release -- --seed N`:\n{}",
        failures.join("\n")
    );
}

fn divergence_rate(strategy: Strategy) -> (usize, usize) {
    let scenario = Scenario {
        strategy,
        ..Scenario::default()
    };
    let seeds = SEEDS.start..SEEDS.start + 12;
    let caught = seeds
        .clone()
        .filter(|&seed| !run(seed, &scenario).passed())
        .count();
    (caught, seeds.count())
}

#[test]
fn the_oracle_catches_a_follower_that_watches_only_new_changes() {
    let (caught, of) = divergence_rate(Strategy::WatchNewOnly);
    assert!(
        caught * 2 > of,
        "watch-new-only diverged in only {caught} of {of} seeds: the oracle has no teeth"
    );
}

#[test]
fn the_oracle_catches_a_follower_that_never_reconciles() {
    let (caught, of) = divergence_rate(Strategy::NoReconcile);
    assert!(
        caught * 2 > of,
        "no-reconcile diverged in only {caught} of {of} seeds: the oracle has no teeth"
    );
}
