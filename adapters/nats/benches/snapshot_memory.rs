//! Memory of what a KV bucket hands a follower, counted by a global allocator (here,
//! never in library code), on a bucket of 200,000 keys with 100-byte values
//! (`TIDEMARK_BENCH_SNAPSHOT_KEYS` for another count), each against a baseline measured
//! in the same run:
//!
//! - the peak heap while `Source::snapshot` reads it (what a resync reads), against the
//!   heap the snapshot it returns holds;
//! - the heap a ready cache (`spawn_cache`, `RawBytes`) fed by the bucket holds, against
//!   a bare `HashMap<String, Vec<u8>>` of the same entries.
//!
//! `cargo bench -p tidemark-nats --bench snapshot_memory`
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use bytes::Bytes;
use std::collections::HashMap;

use tidemark::tidemark_core::{FollowerConfig, RawBytes};
use tidemark::{Source, spawn_cache};
use tidemark_nats::KvBucket;
use tidemark_tests::alloc::{live, peak_above, reset_peak};

#[global_allocator]
static GLOBAL: tidemark_tests::CountingAlloc = tidemark_tests::CountingAlloc;

fn main() {
    common::run_bench(
        "snapshot_memory",
        "cargo bench -p tidemark-nats --bench snapshot_memory",
        run(),
    );
}

async fn run() {
    let n: u32 = std::env::var("TIDEMARK_BENCH_SNAPSHOT_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let (_server, client) = common::filled_bucket(
        "snap",
        n,
        |i| format!("k{i:07}"),
        |_| Bytes::from(vec![b'v'; 100]),
    )
    .await;
    let bucket = KvBucket::new(client.clone(), "snap").unwrap();
    // A first read warms the client's buffers, which stay: they are no part of a read.
    drop(bucket.snapshot().await.unwrap());
    for round in 1..=3 {
        let before = live();
        reset_peak();
        let snap = bucket.snapshot().await.unwrap();
        let held = live().saturating_sub(before);
        let peak = peak_above(before);
        assert_eq!(snap.entries.len(), n as usize);
        drop(snap);
        println!(
            "snapshot of {n} keys (100-byte values), round {round}: peak {:.1} MB ({} B/key) | the snapshot it returns {:.1} MB ({} B/key) | ratio peak/snapshot {:.2}",
            peak as f64 / 1e6,
            peak / n as usize,
            held as f64 / 1e6,
            held / n as usize,
            peak as f64 / held as f64
        );
    }

    let before = live();
    let bare: HashMap<String, Vec<u8>> = bucket
        .snapshot()
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| (e.key.to_string(), e.value.as_slice().to_vec()))
        .collect();
    let bare_bytes = live().saturating_sub(before);
    assert_eq!(bare.len(), n as usize);
    drop(bare);
    let before = live();
    let config = FollowerConfig::builder("mem").seed(1).build().unwrap();
    let (cache, follower) = spawn_cache(config, RawBytes, bucket.clone(), bucket.clone());
    cache.wait_ready().await.unwrap();
    let cache_bytes = live().saturating_sub(before);
    assert_eq!(cache.len(), n as usize);
    println!(
        "cache of {n} keys fed by the bucket: {} B/key | bare HashMap<String, Vec<u8>> {} B/key | ratio cache/bare {:.2}",
        cache_bytes / n as usize,
        bare_bytes / n as usize,
        cache_bytes as f64 / bare_bytes as f64
    );
    follower.stop();
}
