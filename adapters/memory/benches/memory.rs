//! Memory of a follower's cache, counted by a global allocator (here, never in library
//! code): bytes per cached key at 1M keys with 100-byte values against a bare
//! `HashMap<String, Vec<u8>>` of the same entries, and the peak during a full resync
//! against the steady state (a relist that doubles memory is what kube-runtime users
//! complain of). The resync reads its snapshot in parts and keeps only what changed; the
//! peak when the snapshot is of a new history (every entry kept) is printed too.
//!
//! `cargo bench -p tidemark-memory --bench memory`
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use tidemark::tidemark_core::{FollowerConfig, RawBytes};
use tidemark::{Source, spawn_cache};
use tidemark_memory::MemorySource;

/// Counts the bytes live now and the most live since the last [`reset_peak`].
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's layout; the counters are
// plain atomics.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size
                    - layout.size();
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
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
            "resync peak from a new history (every entry kept): {:.1} MiB = {:.2}x the steady state",
            mib(reset_peak_bytes),
            reset_peak_bytes as f64 / steady as f64
        );
        handle
            .stop_within(std::time::Duration::from_secs(60))
            .await
            .unwrap();
    });
}
