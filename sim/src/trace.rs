//! The run's trace: every line hashed (FNV-1a, stable across runs and platforms) so two
//! runs of a seed can be compared, and kept only when asked for.

use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct Inner {
    hash: u64,
    lines: Option<Vec<String>>,
    count: u64,
}

/// A shared trace.
#[derive(Clone, Debug)]
pub struct Trace {
    inner: Arc<Mutex<Inner>>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl Trace {
    /// A trace that keeps its lines if `keep`.
    #[must_use]
    pub fn new(keep: bool) -> Self {
        Trace {
            inner: Arc::new(Mutex::new(Inner {
                hash: FNV_OFFSET,
                lines: keep.then(Vec::new),
                count: 0,
            })),
        }
    }

    /// Adds a line, stamped with the simulated time (from inside a host).
    pub fn line(&self, line: String) {
        self.line_at(turmoil::sim_elapsed().unwrap_or_default(), line);
    }

    /// Adds a line stamped with `at` (from the orchestrator, outside every host).
    pub fn line_at(&self, at: std::time::Duration, line: String) {
        let line = format!("{:>9.3} {line}", at.as_secs_f64());
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            inner.hash = (inner.hash ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        inner.count += 1;
        if let Some(lines) = &mut inner.lines {
            lines.push(line);
        }
    }

    /// The hash of every line so far.
    #[must_use]
    pub fn hash(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).hash
    }

    /// How many lines so far.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    /// Whether no line was added.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kept lines (empty unless kept).
    #[must_use]
    pub fn lines(&self) -> Vec<String> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .lines
            .clone()
            .unwrap_or_default()
    }
}
