//! Memory of a resync over SQLite, counted by a global allocator (here, never in library
//! code), each figure against a baseline measured in the same run:
//!
//! - the registry's snapshot read whole (`Source::snapshot`) against read in parts
//!   (`Source::snapshot_parts`, each part dropped as the next comes): the peak heap above
//!   what was live before the read;
//! - a persisted follower (`PersistedCache`) resyncing onto a compacted registry, once
//!   after one key changed and once after every value changed: the peak heap above what
//!   was live before it started, per registry key, against the whole snapshot's.
//!
//! `cargo bench -p tidemark-sqlite --bench resync_memory` (1,000,000 keys with 100-byte
//! values). Without `--bench` (as under `cargo test --benches`) a smoke run of 2,000.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use futures::StreamExt;
use tidemark::tidemark_core::FollowerConfig;
use tidemark::{FollowerTask, NoFeed, RawBytes, Source};
use tidemark_sqlite::{Options, SqliteDb, SqliteSource, Synchronous, Write};
use tidemark_tests::alloc::{live, peak_above, reset_peak};

#[global_allocator]
static GLOBAL: tidemark_tests::CountingAlloc = tidemark_tests::CountingAlloc;

const VALUE: usize = 100;
const PART: usize = 1024;

fn key(i: usize) -> String {
    format!("key-{i:07}")
}

/// Puts every key with a 100-byte value made of `fill`, 10,000 to a transaction.
async fn write_all(src: &SqliteSource, n: usize, fill: u8) {
    for start in (0..n).step_by(10_000) {
        let writes = (start..n.min(start + 10_000))
            .map(|i| Write::Put(key(i), vec![fill; VALUE]))
            .collect();
        src.write_batch(writes).await.unwrap();
    }
}

/// Peak heap of a whole snapshot, and of one read in parts dropped as they come.
async fn source_reads(src: &SqliteSource, n: usize) -> usize {
    let before = live();
    reset_peak();
    let snap = src.snapshot().await.unwrap();
    assert_eq!(snap.entries.len(), n);
    drop(snap);
    let whole = peak_above(before);

    let before = live();
    reset_peak();
    let mut read = src.snapshot_parts(PART).await.unwrap();
    let mut got = 0;
    while let Some(part) = read.parts.next().await {
        got += part.unwrap().len();
    }
    drop(read);
    assert_eq!(got, n);
    let parts = peak_above(before);
    println!(
        "snapshot of {n} keys ({VALUE}-byte values): whole {:.1} MB ({} B/key) | in parts of {PART}: {:.2} MB | ratio parts/whole {:.4}",
        whole as f64 / 1e6,
        whole / n,
        parts as f64 / 1e6,
        parts as f64 / whole as f64
    );
    whole
}

/// Runs a wake-only persisted follower called `name` until it reached the registry's
/// watermark; the peak heap above what was live before it started.
async fn follow(db: &SqliteDb, name: &str) -> (tidemark::Status, usize) {
    let target = db.source().watermark().await.unwrap();
    let before = live();
    reset_peak();
    let h = FollowerTask::new(
        FollowerConfig::builder(name).seed(1).build().unwrap(),
        RawBytes,
        db.source(),
        NoFeed,
        db.follower_cache(name),
    )
    .spawn();
    let mut status = h.watch_status();
    status
        .wait_for(|s| s.ready && s.watermark >= target)
        .await
        .unwrap();
    let s = h.stop_within(Duration::from_secs(120)).await.unwrap();
    (s, peak_above(before))
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full {
        1_000_000
    } else {
        println!("smoke run (pass --bench, as `cargo bench` does, for the real figures)");
        2_000
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let options = Options {
            synchronous: Synchronous::Normal,
            ..Options::default()
        };
        let db = SqliteDb::open_with(dir.path().join("resync.db"), options)
            .await
            .unwrap();
        let src = db.source();
        write_all(&src, n, b'a').await;
        let whole = source_reads(&src, n).await;

        let (cold, cold_peak) = follow(&db, "p").await;
        assert_eq!(cold.keys, n);
        // Each case: writes while the follower is away, then a compaction past them, so
        // its warm restart finds its watermark + 1 gone and resyncs from a snapshot.
        for (case, fill) in [("one key changed", None), ("every value changed", Some(b'b'))] {
            match fill {
                None => {
                    src.put(&key(0), vec![b'z'; VALUE]).await.unwrap();
                }
                Some(fill) => write_all(&src, n, fill).await,
            }
            let horizon = src.watermark().await.unwrap() + 1;
            src.compact_below(horizon).await.unwrap();
            let (s, peak) = follow(&db, "p").await;
            assert!(s.counters.resyncs >= 1, "{case}: it resynced");
            println!(
                "persisted follower resync of {n} keys, {case}: peak {:.1} MB ({} B/key) | ratio to a whole snapshot {:.2} (cold sync peak {:.1} MB)",
                peak as f64 / 1e6,
                peak / n,
                peak as f64 / whole as f64,
                cold_peak as f64 / 1e6,
            );
        }
    });
}
