//! What the benches print beside their figures on a shared machine: a process's CPU
//! seconds (steadier than wall time), the load, and a switch for `perf` per contender.

/// CPU seconds (user + system) process `pid` used so far (`"self"`: this one), from
/// `/proc/<pid>/stat` (clock ticks of 10 ms); 0 where the kernel does not say.
#[must_use]
pub fn cpu_secs(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name (which may hold spaces): state is the first,
    // utime the 12th and stime the 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (tick(11) + tick(12)) as f64 / 100.0
}

/// The machine's 1-minute load average, as the kernel says it (`?` where it does not).
#[must_use]
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Profiles one contender of a bench: under `perf record --control fifo:<path> -D -1`,
/// with `TIDEMARK_BENCH_PERF_CTL=<path>` and `TIDEMARK_BENCH_PERF_WHAT` naming the
/// contender, perf records only while that one runs (`on` when it starts, off when it
/// ends). Does nothing without both variables.
///
/// # Panics
/// If the control fifo named cannot be written.
pub fn perf(contender: &str, on: bool) {
    let (Ok(ctl), Ok(what)) = (
        std::env::var("TIDEMARK_BENCH_PERF_CTL"),
        std::env::var("TIDEMARK_BENCH_PERF_WHAT"),
    ) else {
        return;
    };
    if what == contender {
        std::fs::write(ctl, if on { "enable\n" } else { "disable\n" }).expect("perf control");
    }
}
