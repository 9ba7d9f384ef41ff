//! Memory of a follower's cache, counted by a global allocator (here, never in library
//! code): bytes per cached key at 1M keys with 100-byte values against a bare
//! `HashMap<String, Vec<u8>>` of the same entries, and the peak during a full resync
//! against the steady state (a relist that doubles memory is what kube-runtime users
//! complain of). The resync reads its snapshot in parts and keeps only what changed.
//!
//! Then the peak when the snapshot is of a new history, twice: a restore of the same data
//! (every value equal to the cached one: only keys and seqs are kept until the switch),
//! and a history whose every value differs, where both copies must live at the switch
//! instant (the old for readers until it, the new right after). Its floor is printed
//! beside it: the steady state plus each new value as the cache holds it.
//!
//! `cargo bench -p tidemark-memory --bench memory`
#![allow(clippy::unwrap_used)]

use std::alloc::Layout;
use std::collections::HashMap;

use tidemark::tidemark_core::{FollowerConfig, RawBytes};
use tidemark::{Source, spawn_cache};
use tidemark_memory::MemorySource;
use tidemark_tests::alloc::{live, reset_peak};

#[global_allocator]
static GLOBAL: tidemark_tests::CountingAlloc = tidemark_tests::CountingAlloc;

/// The most bytes live since the last [`reset_peak`].
fn peak() -> usize {
    tidemark_tests::alloc::peak_above(0)
}

const N: usize = 1_000_000;
const VALUE: usize = 100;

fn key(i: usize) -> String {
    format!("key-{i:07}")
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() {
    // The baseline: the same entries in a bare map.
    let before = live();
    let bare: HashMap<String, Vec<u8>> = (0..N).map(|i| (key(i), vec![b'x'; VALUE])).collect();
    let bare_bytes = live() - before;
    assert_eq!(bare.len(), N);
    drop(bare);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let source = MemorySource::default();
        for i in 0..N {
            source.put(&key(i), vec![b'x'; VALUE]).await.unwrap();
        }
        // Restored at the end, for a resync from a new history (counted in `before`).
        let backup = source.backup();
        // Another history of the same keys, every value different (counted in `before`).
        let other = MemorySource::default();
        for i in 0..N {
            other.put(&key(i), vec![b'z'; VALUE]).await.unwrap();
        }
        let differing = other.backup();
        drop(other);
        // The follower's share: what is live once it is ready, less what was live before
        // (the source's own copy of the entries).
        let before = live();
        let config = FollowerConfig::builder("memory").seed(1).build().unwrap();
        let (cache, handle) = spawn_cache(config, RawBytes, source.clone(), source.clone());
        cache.wait_ready().await.unwrap();
        assert_eq!(cache.len(), N);
        // The cache's keys are the very `Arc<str>`s of the source's own log (its feed
        // clones entries), allocated before `before`: count them as the follower's, as a
        // follower over NATS or SQLite allocates its keys itself.
        let shared_keys: usize = (0..N)
            .map(|i| {
                let (inner, _) = Layout::new::<[usize; 2]>()
                    .extend(Layout::array::<u8>(key(i).len()).unwrap())
                    .unwrap();
                inner.pad_to_align().size()
            })
            .sum();
        let steady = live() - before + shared_keys;

        // A full resync: the feed ends, a change lands and the log is compacted past the
        // follower's watermark before it reopens, so it must reload from a snapshot.
        // The compaction frees the source's log (counted in `before`): measured here, so
        // that the peak is the follower's alone, not lowered by what the source let go.
        let mut status = handle.watch_status();
        source.end_feeds();
        let ahead = live();
        source.put(&key(N), vec![b'y'; VALUE]).await.unwrap();
        source.compact_below(source.current_watermark() + 1);
        let freed = ahead.saturating_sub(live());
        reset_peak();
        status
            .wait_for(|s| s.counters.resyncs == 1 && s.watermark == source.current_watermark())
            .await
            .unwrap();
        // The old keys stay in the cache (an unchanged entry is not applied again).
        let resync_peak = peak() + freed + shared_keys - before;
        let after = live() + freed + shared_keys - before;

        // A new history: the source restored from the backup taken before the follower
        // started. Its snapshot is below the follower's watermark, so every entry of it is
        // kept until the last part: the worst case, printed for honesty. What the restore
        // itself allocates or frees is the source's, measured here.
        let mut status = handle.watch_status();
        let ahead = live();
        source.restore(&backup);
        let grown = live() as isize - ahead as isize;
        reset_peak();
        status
            .wait_for(|s| s.counters.resets == 1 && s.watermark == source.current_watermark())
            .await
            .unwrap();
        let source_now = (before - freed) as isize + grown;
        let reset_peak_bytes = (peak() as isize - source_now) as usize + shared_keys;
        assert_eq!(cache.len(), N);
        let settled = live();

        // A new history where every value differs: one more write takes the follower past
        // the other history's head, which is then restored (its keys and values are the
        // backup's own, allocated before `before`: the restore allocates the source's copy).
        let mut status = handle.watch_status();
        source.put(&key(N), vec![b'y'; VALUE]).await.unwrap();
        status
            .wait_for(|s| s.watermark == source.current_watermark())
            .await
            .unwrap();
        let ahead = live();
        source.restore(&differing);
        let grown = live() as isize - ahead as isize;
        reset_peak();
        status
            .wait_for(|s| s.counters.resets == 2 && s.watermark == source.current_watermark())
            .await
            .unwrap();
        // The source's share: as after the restore above, plus the write (the follower's
        // few hundred bytes of it counted as the source's) and this restore.
        let source_now = source_now + (ahead as isize - settled as isize) + grown;
        let differing_peak = (peak() as isize - source_now) as usize + shared_keys;
        let differing_after = (live() as isize - source_now) as usize + shared_keys;
        assert_eq!(cache.len(), N);
        assert_eq!(cache.get(&key(0)).unwrap().as_slice(), &[b'z'; VALUE][..]);
        // The floor: both copies of every value at the switch instant, each new one as
        // the cache holds it (its bytes, and the `Arc` of its `Vec` header), nothing else.
        let new_value = VALUE + std::mem::size_of::<[usize; 2]>() + std::mem::size_of::<Vec<u8>>();
        let floor = steady + N * new_value;

        println!(
            "bare HashMap<String, Vec<u8>>: {:.1} MiB, {:.0} bytes/key",
            mib(bare_bytes),
            bare_bytes as f64 / N as f64
        );
        println!(
            "follower + cache:              {:.1} MiB, {:.0} bytes/key = {:.2}x the bare map (goal <= 1.5x)",
            mib(steady),
            steady as f64 / N as f64,
            steady as f64 / bare_bytes as f64
        );
        println!(
            "resync peak: {:.1} MiB = {:.2}x the steady state (goal <= 1.5x); after it {:.1} MiB",
            mib(resync_peak),
            resync_peak as f64 / steady as f64,
            mib(after)
        );
        println!(
            "resync peak from a new history, same values (a restore): {:.1} MiB = {:.2}x the steady state (goal <= 1.5x)",
            mib(reset_peak_bytes),
            reset_peak_bytes as f64 / steady as f64
        );
        println!(
            "resync peak from a new history, every value different: {:.1} MiB = {:.2}x the steady state; after it {:.1} MiB",
            mib(differing_peak),
            differing_peak as f64 / steady as f64,
            mib(differing_after)
        );
        println!(
            "resync peak floor, every value different (both copies at the switch): steady {:.1} MiB + {N} x {new_value} bytes (a {VALUE}-byte value in its Arc'd Vec) = {:.1} MiB = {:.2}x",
            mib(steady),
            mib(floor),
            floor as f64 / steady as f64
        );
        handle
            .stop_within(std::time::Duration::from_secs(60))
            .await
            .unwrap();
    });
}
