//! The same seed gives the same trace, bit for bit.

use tidemark_sim::scenario::Scenario;
use tidemark_sim::world::{Outcome, run};

fn run_on_fresh_thread(seed: u64, scenario: &Scenario) -> Outcome {
    let scenario = scenario.clone();
    std::thread::spawn(move || run(seed, &scenario))
        .join()
        .expect("the run must not panic")
}

#[test]
fn the_same_seed_gives_the_same_trace_hash() {
    same_trace_twice(&Scenario::default(), &[3, 11]);
}

/// JetStream followers wait on the source host for the bucket to change: their wake order
/// must not come from tokio's per-thread randomness (a `watch` spreads its waiters over
/// lists at random, and seed 16 took its followers in another order on another thread).
#[test]
fn jetstream_followers_give_the_same_trace_hash_on_any_thread() {
    let scenario = Scenario {
        strategy: tidemark_sim::scenario::Strategy::JetStream,
        ..Scenario::default()
    };
    same_trace_twice(&scenario, &[16, 31]);
}

/// Runs each of `seeds` twice, each on a fresh thread, and compares the traces line by
/// line.
fn same_trace_twice(scenario: &Scenario, seeds: &[u64]) {
    let scenario = Scenario {
        keep_trace: true,
        ..scenario.clone()
    };
    for &seed in seeds {
        let a = run_on_fresh_thread(seed, &scenario);
        let b = run_on_fresh_thread(seed, &scenario);
        if let Some((i, (x, y))) = a
            .trace
            .iter()
            .zip(&b.trace)
            .enumerate()
            .find(|(_, (x, y))| x != y)
        {
            panic!("seed {seed}: traces differ at line {i}:\n  {x}\n  {y}");
        }
        assert_eq!(
            a.trace.len(),
            b.trace.len(),
            "seed {seed}: one trace is longer"
        );
        assert_eq!(
            a.trace_hash, b.trace_hash,
            "seed {seed}: same lines, different hash?"
        );
        assert!(a.trace.len() > 100, "a trace this short proves nothing");
    }
}

/// Spawns `n` tasks that end at once: they only move tokio's process-wide task ids on.
fn spawn_throwaway_tasks(n: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime for throwaway tasks");
    rt.block_on(async {
        for _ in 0..n {
            tokio::spawn(async {}).await.expect("an empty task ends");
        }
    });
}

#[test]
fn a_seed_whose_worker_host_crashes_replays_the_same_in_one_process_whatever_was_spawned_before() {
    // Seeds 55 and 30 crash worker hosts (relay, job runner, sweeper) while they work. When
    // the runner spawned its handlers, a crash dropped them in an order that follows
    // tokio's task ids, which count across the process: a second run of the same seed
    // in the same process parted from the first.
    let scenario = Scenario {
        keep_trace: true,
        ..Scenario::default()
    };
    for seed in [55, 30] {
        let first = run(seed, &scenario);
        assert!(
            first.trace.iter().any(|l| [
                "fault CrashRelay",
                "fault CrashRunner",
                "fault CrashSweeper"
            ]
            .iter()
            .any(|c| l.contains(c))),
            "seed {seed} no longer crashes a worker host; pick another"
        );
        for extra in 1..=3 {
            spawn_throwaway_tasks(extra);
            let again = run(seed, &scenario);
            if let Some((i, (x, y))) = first
                .trace
                .iter()
                .zip(&again.trace)
                .enumerate()
                .find(|(_, (x, y))| x != y)
            {
                panic!(
                    "seed {seed}, run again after {extra} more tasks: traces differ at line {i}:\n  {x}\n  {y}"
                );
            }
            assert_eq!(first.trace_hash, again.trace_hash, "seed {seed}");
        }
    }
}
