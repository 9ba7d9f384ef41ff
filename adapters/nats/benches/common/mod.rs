//! What every NATS bench shares: run only under `cargo bench` (a plain `cargo test`
//! builds and runs bench targets too, and must not start a server), on a two-worker
//! runtime like the machines the figures are measured on.

use std::future::Future;

/// Runs `bench` on a two-worker tokio runtime when the process was started by `cargo
/// bench` (`--bench`); otherwise prints that `name` was skipped and how to run it.
pub fn run_bench<F: Future<Output = ()>>(name: &str, how: &str, bench: F) {
    if !std::env::args().any(|a| a == "--bench") {
        println!("tidemark-nats {name} bench: skipped (run `{how}`)");
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(bench);
}
