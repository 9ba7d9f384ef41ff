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
    let scenario = Scenario {
        keep_trace: true,
        ..Scenario::default()
    };
    for seed in [3, 11] {
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
