//! Throughput of the follower against a bare `HashMap`, measured in the same run.
//!
//! 5,000,000 put entries over 100,000 keys are pushed through the follower (input, then
//! drain every output), and the same entries are inserted into a bare `HashMap`. Prints
//! both rates and their ratio. Run with `cargo bench -p tidemark-core`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use tidemark_core::{
    Entry, FeedInfo, Follower, FollowerConfig, Input, Output, RawBytes, Request, Time,
};

const ENTRIES: u64 = 5_000_000;
const KEYS: u64 = 100_000;
const ROUNDS: usize = 3;

fn entries() -> Vec<Entry> {
    (1..=ENTRIES)
        .map(|seq| {
            Entry::put(
                seq,
                format!("pkg/{:06}", seq % KEYS),
                seq.to_le_bytes().repeat(2),
            )
        })
        .collect()
}

fn bare(entries: Vec<Entry>) -> Duration {
    let start = Instant::now();
    // The entries' own keys, moved in as the follower's index takes them.
    let mut map: HashMap<std::sync::Arc<str>, Vec<u8>> = HashMap::new();
    for e in entries {
        map.insert(e.key, e.value);
    }
    let elapsed = start.elapsed();
    black_box(map.len());
    elapsed
}

fn follower(entries: Vec<Entry>) -> Duration {
    let config = FollowerConfig::builder("bench")
        .build()
        .expect("valid config");
    let mut f = Follower::new(config, RawBytes);
    let now = Time::ZERO;
    let Some(Output::Request(Request::LookupSource { token })) = f.poll_output() else {
        panic!("lookup first")
    };
    f.handle_input(Input::SourceFound { token }, now);
    let Some(Output::Request(Request::OpenFeed { token, .. })) = f.poll_output() else {
        panic!("then open")
    };
    let info = FeedInfo::change_log(1, ENTRIES);
    f.handle_input(Input::FeedOpened { token, info }, now);
    let start = Instant::now();
    for entry in entries {
        f.handle_input(Input::Entry { token, entry }, now);
        while let Some(o) = f.poll_output() {
            black_box(o);
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(f.watermark(), ENTRIES, "every entry must have been applied");
    elapsed
}

fn rate(d: Duration) -> f64 {
    ENTRIES as f64 / d.as_secs_f64()
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not: keep that run short.
    if !std::env::args().any(|a| a == "--bench") {
        println!("follower bench: run with `cargo bench -p tidemark-core` for figures");
        return;
    }
    let mut best_bare = Duration::MAX;
    let mut best_core = Duration::MAX;
    for _ in 0..ROUNDS {
        best_bare = best_bare.min(bare(entries()));
        best_core = best_core.min(follower(entries()));
    }
    println!("entries: {ENTRIES} puts over {KEYS} keys, best of {ROUNDS}");
    println!("bare HashMap insert: {:>12.0} entries/s", rate(best_bare));
    println!("follower (in+drain): {:>12.0} entries/s", rate(best_core));
    println!(
        "ratio core/bare:     {:>12.2}",
        rate(best_core) / rate(best_bare)
    );
}
