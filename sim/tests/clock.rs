//! A host's clock under the patched turmoil (`vendor/turmoil/TIDEMARK.md`): the timer that
//! ends a tick is reused and the host's clock is read as the tick starts, and neither may
//! move what a host sees of time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Runs one host that sleeps `nap` again and again and records, at each wake, turmoil's
/// elapsed time for the host and its runtime's own clock, for `steps` steps of `tick`.
fn wakes(tick: Duration, nap: Duration, steps: u32) -> Vec<(Duration, Duration, Duration)> {
    let mut sim = turmoil::Builder::new()
        .tick_duration(tick)
        .simulation_duration(Duration::from_secs(60))
        .build();
    let seen: Arc<Mutex<Vec<(Duration, Duration, Duration)>>> = Arc::default();
    let record = Arc::clone(&seen);
    sim.host("sleeper", move || {
        let record = Arc::clone(&record);
        async move {
            let start = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(nap).await;
                let sim_elapsed = turmoil::sim_elapsed().unwrap_or_default();
                record.lock().unwrap_or_else(|e| e.into_inner()).push((
                    turmoil::elapsed(),
                    sim_elapsed,
                    start.elapsed(),
                ));
            }
        }
    });
    for _ in 0..steps {
        sim.step().expect("the host runs");
    }
    seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

#[test]
fn timers_inside_a_tick_fire_at_their_own_instants_and_the_hosts_clock_agrees() {
    let (tick, nap) = (Duration::from_millis(10), Duration::from_millis(3));
    let seen = wakes(tick, nap, 20);
    // 20 steps of 10 ms: wakes at 3, 6, ..., 198 ms (198 is inside the last step).
    assert_eq!(seen.len(), 66, "{seen:?}");
    for (k, (elapsed, sim_elapsed, runtime)) in (1u32..).zip(&seen) {
        let want = nap * k;
        assert_eq!(
            (*elapsed, *sim_elapsed, *runtime),
            (want, want, want),
            "wake {k}"
        );
    }
}

#[test]
fn a_timer_due_exactly_at_a_ticks_end_wakes_its_task_when_the_next_tick_starts() {
    // Naps of exactly one tick: each wake is due as a tick ends, and runs at the start of
    // the next tick, at that instant, neither early nor a tick late.
    let tick = Duration::from_millis(10);
    let seen = wakes(tick, tick, 12);
    assert_eq!(seen.len(), 11, "{seen:?}");
    for (k, (elapsed, sim_elapsed, runtime)) in (1u32..).zip(&seen) {
        let want = tick * k;
        assert_eq!(
            (*elapsed, *sim_elapsed, *runtime),
            (want, want, want),
            "wake {k}"
        );
    }
}
