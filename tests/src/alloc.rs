//! A global allocator that counts the bytes live and their peak, for the benches that
//! measure memory (never for library code). A bench installs it and reads the peak:
//!
//! ```
//! use tidemark_tests::alloc::{live, peak_above, reset_peak};
//!
//! #[global_allocator]
//! static GLOBAL: tidemark_tests::CountingAlloc = tidemark_tests::CountingAlloc;
//!
//! let before = live();
//! reset_peak();
//! let buffer = vec![0u8; 4096];
//! drop(buffer);
//! assert!(peak_above(before) >= 4096, "the buffer counted while it lived");
//! assert!(live() < before + 4096, "and no longer");
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Forwards to the system allocator and counts the bytes live now and the most live
/// since the last [`reset_peak`].
#[derive(Debug)]
pub struct CountingAlloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's layout; the counters are
// plain atomics.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAlloc {
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

/// Bytes live now (0 unless [`CountingAlloc`] is the global allocator).
#[must_use]
pub fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Starts a new peak from what is live now.
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// The most bytes live since the last [`reset_peak`], above `before` (what was live
/// when it was called).
#[must_use]
pub fn peak_above(before: usize) -> usize {
    PEAK.load(Ordering::Relaxed).saturating_sub(before)
}
