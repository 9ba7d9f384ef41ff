//! What the drivers report beyond their logs: counters and gauges through the [`metrics`]
//! facade (the application installs the recorder and picks the exporter), and the health
//! a readiness probe asks for.
//!
//! Every series is named `tidemark_*` and labelled with the component it belongs to:
//!
//! | Series | Kind | Labels | What |
//! |---|---|---|---|
//! | `tidemark_follower_applied_total` | counter | `follower`, `source` | puts applied |
//! | `tidemark_follower_removed_total` | counter | `follower`, `source` | removals applied |
//! | `tidemark_follower_poison_total` | counter | `follower`, `source` | values the decoder rejected (skipped) |
//! | `tidemark_follower_invalid_total` | counter | `follower`, `source` | invalid entries skipped |
//! | `tidemark_follower_reopens_total` | counter | `follower`, `source` | feed reopenings |
//! | `tidemark_follower_resyncs_total` | counter | `follower`, `source` | full resyncs |
//! | `tidemark_follower_resets_total` | counter | `follower`, `source` | new histories taken (a source recreated or restored) |
//! | `tidemark_follower_watermark` | gauge | `follower`, `source` | applied watermark |
//! | `tidemark_follower_source_head` | gauge | `follower`, `source` | the source's head, as last learned |
//! | `tidemark_follower_lag` | gauge | `follower`, `source` | source head − watermark |
//! | `tidemark_follower_keys` | gauge | `follower`, `source` | keys held |
//! | `tidemark_follower_ready` | gauge | `follower`, `source` | 1 once the initial sync completed |
//! | `tidemark_outbox_pending` | gauge | `relay` | outbox rows not yet done |
//! | `tidemark_relay_done_total` | counter | `relay` | rows whose every leg landed |
//! | `tidemark_relay_failures_total` | counter | `relay` | legs and outbox calls that failed |
//! | `tidemark_queue_depth` | gauge | `runner` | jobs waiting or running (ready + leased) |
//! | `tidemark_queue_leased` | gauge | `runner` | jobs leased |
//! | `tidemark_dead_letters` | gauge | `runner` | dead-lettered jobs |
//! | `tidemark_jobs_acked_total` | counter | `runner` | jobs done by this runner |
//! | `tidemark_jobs_failed_total` | counter | `runner` | attempts that failed and were retried |
//! | `tidemark_jobs_dead_lettered_total` | counter | `runner` | jobs this runner dead-lettered |
//!
//! The queue's gauges are read from the queue (all runners' jobs) at most once per
//! [`QUEUE_COUNT_EVERY`] while the runner works.
//!
//! A supervised worker is a follower: its series carry its name in `follower`.

use std::sync::Mutex;
use std::time::Duration;

use metrics::{Counter, Gauge, counter, gauge};
use tidemark_core::{Phase, Status};
use tokio::time::Instant;

/// How long a follower may stay behind without its watermark moving (backing off, or
/// knowing of a head it does not reach) before [`FollowerHealth`] calls it stalled, by
/// default.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);

/// One follower's series.
#[derive(Debug)]
pub(crate) struct FollowerMetrics {
    applied: Counter,
    removed: Counter,
    poison: Counter,
    invalid: Counter,
    reopens: Counter,
    resyncs: Counter,
    resets: Counter,
    watermark: Gauge,
    head: Gauge,
    lag: Gauge,
    keys: Gauge,
    ready: Gauge,
}

#[allow(clippy::cast_precision_loss)] // Gauges are f64; seqs beyond 2^53 round.
fn f(v: u64) -> f64 {
    v as f64
}

impl FollowerMetrics {
    /// Registers the series of follower `name` following `source` with the recorder
    /// installed now (none: they go nowhere).
    pub(crate) fn new(name: &str, source: &str) -> Self {
        let labels = [("follower", name.to_owned()), ("source", source.to_owned())];
        FollowerMetrics {
            applied: counter!("tidemark_follower_applied_total", &labels),
            removed: counter!("tidemark_follower_removed_total", &labels),
            poison: counter!("tidemark_follower_poison_total", &labels),
            invalid: counter!("tidemark_follower_invalid_total", &labels),
            reopens: counter!("tidemark_follower_reopens_total", &labels),
            resyncs: counter!("tidemark_follower_resyncs_total", &labels),
            resets: counter!("tidemark_follower_resets_total", &labels),
            watermark: gauge!("tidemark_follower_watermark", &labels),
            head: gauge!("tidemark_follower_source_head", &labels),
            lag: gauge!("tidemark_follower_lag", &labels),
            keys: gauge!("tidemark_follower_keys", &labels),
            ready: gauge!("tidemark_follower_ready", &labels),
        }
    }

    /// Sets every series from `status` and the source's `head`.
    pub(crate) fn record(&self, s: &Status, head: u64) {
        let c = &s.counters;
        // The core's counters are totals since it was made: set, never add, so a
        // restarted supervised run (the same core) does not count twice.
        self.applied.absolute(c.applied);
        self.removed.absolute(c.removed);
        self.poison.absolute(c.poison);
        self.invalid.absolute(c.invalid);
        self.reopens.absolute(c.reopens);
        self.resyncs.absolute(c.resyncs);
        self.resets.absolute(c.resets);
        self.watermark.set(f(s.watermark));
        self.head.set(f(head));
        self.lag.set(f(head.saturating_sub(s.watermark)));
        self.keys.set(f(u64::try_from(s.keys).unwrap_or(u64::MAX)));
        self.ready.set(if s.ready { 1.0 } else { 0.0 });
    }
}

/// A relay's series.
#[derive(Debug)]
pub(crate) struct RelayMetrics {
    pub(crate) pending: Gauge,
    pub(crate) done: Counter,
    pub(crate) failures: Counter,
}

impl RelayMetrics {
    pub(crate) fn new(owner: &str) -> Self {
        let labels = [("relay", owner.to_owned())];
        RelayMetrics {
            pending: gauge!("tidemark_outbox_pending", &labels),
            done: counter!("tidemark_relay_done_total", &labels),
            failures: counter!("tidemark_relay_failures_total", &labels),
        }
    }

    pub(crate) fn pending(&self, rows: u64) {
        self.pending.set(f(rows));
    }
}

/// How often a job runner reads the queue's counts for its gauges, at most.
pub const QUEUE_COUNT_EVERY: Duration = Duration::from_secs(1);

/// A job runner's series.
#[derive(Debug)]
pub(crate) struct JobMetrics {
    depth: Gauge,
    leased: Gauge,
    dead: Gauge,
    acked: Counter,
    failed: Counter,
    dead_lettered: Counter,
}

impl JobMetrics {
    pub(crate) fn new(runner: &str) -> Self {
        let labels = [("runner", runner.to_owned())];
        JobMetrics {
            depth: gauge!("tidemark_queue_depth", &labels),
            leased: gauge!("tidemark_queue_leased", &labels),
            dead: gauge!("tidemark_dead_letters", &labels),
            acked: counter!("tidemark_jobs_acked_total", &labels),
            failed: counter!("tidemark_jobs_failed_total", &labels),
            dead_lettered: counter!("tidemark_jobs_dead_lettered_total", &labels),
        }
    }

    /// The runner's totals so far: jobs acked, failed and dead-lettered.
    pub(crate) fn counters(&self, acked: u64, failed: u64, dead_lettered: u64) {
        self.acked.absolute(acked);
        self.failed.absolute(failed);
        self.dead_lettered.absolute(dead_lettered);
    }

    pub(crate) fn counts(&self, c: &crate::ports::JobCounts) {
        self.depth.set(f(c.ready.saturating_add(c.leased)));
        self.leased.set(f(c.leased));
        self.dead.set(f(c.dead));
    }
}

/// How far a follower is, shared between its task and whoever asks after its health.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    state: Mutex<ProgressState>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ProgressState {
    head: u64,
    watermark: u64,
    /// Since when it has been behind without its watermark moving.
    behind_since: Option<Instant>,
}

impl Progress {
    fn lock(&self) -> std::sync::MutexGuard<'_, ProgressState> {
        // Plain data: a panic while it was held leaves nothing half-made.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The source's head as last learned.
    pub(crate) fn head(&self) -> u64 {
        self.lock().head
    }

    /// Takes in the status just published and the head known now, at `now`.
    pub(crate) fn observe(&self, s: &Status, head: u64, now: Instant) {
        let mut p = self.lock();
        let behind = !s.ready || s.phase == Phase::BackingOff || head > s.watermark;
        let moved = s.watermark != p.watermark;
        p.behind_since = match (behind, moved, p.behind_since) {
            (false, _, _) => None,
            // Progress: the stall clock starts again.
            (true, true, _) | (true, false, None) => Some(now),
            (true, false, Some(since)) => Some(since),
        };
        p.head = head;
        p.watermark = s.watermark;
    }

    /// The health of the follower whose status is `s`, judged at `now`.
    pub(crate) fn health(&self, s: &Status, stall_after: Duration, now: Instant) -> FollowerHealth {
        let p = *self.lock();
        let stalled_for = p
            .behind_since
            .map(|since| now.saturating_duration_since(since))
            .filter(|d| *d >= stall_after);
        FollowerHealth {
            name: s.name.clone(),
            phase: s.phase,
            ready: s.ready,
            watermark: s.watermark,
            head: p.head.max(s.watermark),
            stalled_for,
            down: (s.phase == Phase::Stopped).then(|| "stopped".to_owned()),
        }
    }
}

/// One follower's health: what a readiness probe asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FollowerHealth {
    /// Its name.
    pub name: String,
    /// Where it is.
    pub phase: Phase,
    /// Whether its initial sync completed.
    pub ready: bool,
    /// Its applied watermark.
    pub watermark: u64,
    /// The source's head, as the follower can reach it: what its feed said it will deliver
    /// up to when it opened, raised by the entries it receives (with the feed's pending
    /// count) and by reconciles; a snapshot sets it anew.
    pub head: u64,
    /// How long it has been behind (backing off, syncing, or short of a head it knows)
    /// without its watermark moving, once that is at least the stall threshold.
    pub stalled_for: Option<Duration>,
    /// Why it is not running, if it is not (stopped, waiting to restart, failed).
    pub down: Option<String>,
}

impl FollowerHealth {
    /// How far behind the source's head it is.
    #[must_use]
    pub fn lag(&self) -> u64 {
        self.head.saturating_sub(self.watermark)
    }

    /// Ready, running and not stalled.
    #[must_use]
    pub fn healthy(&self) -> bool {
        self.ready && self.stalled_for.is_none() && self.down.is_none()
    }
}

impl std::fmt::Display for FollowerHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: ", self.name)?;
        if let Some(why) = &self.down {
            return write!(f, "{why}");
        }
        if let Some(d) = self.stalled_for {
            write!(f, "stalled for {}s ({:?}, ", d.as_secs(), self.phase)?;
        } else if !self.ready {
            write!(f, "not ready ({:?}, ", self.phase)?;
        } else {
            write!(f, "healthy (")?;
        }
        write!(f, "watermark {}, lag {})", self.watermark, self.lag())
    }
}

/// The health of a set of followers: healthy when every one is ready, running and not
/// stalled. [`Supervisor::health`](crate::Supervisor::health) answers it for supervised
/// workers; [`Health::of`] gathers it for standalone followers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// Each follower's health, in the order given (supervised workers: name order).
    pub followers: Vec<FollowerHealth>,
}

impl Health {
    /// Every follower is ready, running and not stalled (and so is an empty set).
    #[must_use]
    pub fn healthy(&self) -> bool {
        self.followers.iter().all(FollowerHealth::healthy)
    }

    /// The followers that are not healthy.
    pub fn unhealthy(&self) -> impl Iterator<Item = &FollowerHealth> {
        self.followers.iter().filter(|f| !f.healthy())
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bad: Vec<String> = self.unhealthy().map(ToString::to_string).collect();
        if bad.is_empty() {
            write!(f, "{} followers healthy", self.followers.len())
        } else {
            write!(f, "unhealthy: {}", bad.join("; "))
        }
    }
}
