//! The outbox relay: claims pending announcements from an [`Outbox`], runs their legs with
//! the shared [`Announcer`], records what landed, and waits for more — backing off with
//! the core's [`Backoff`] after failures.

use std::time::Duration;

use tidemark_core::{Backoff, BackoffPolicy, Rng};
use tracing::{debug, warn};

use crate::announce::Announcer;
use crate::clock::Clock;
use crate::error::Result;
use crate::ports::{Outbox, OutboxUpdate, OutboxWatch, Publish, Queue, Wake};
use crate::running::Running;
use crate::settle::settle;
use crate::shutdown::{Shutdown, StopSignal};
use crate::telemetry::RelayMetrics;

/// Rows a relay claims at a time, by default.
pub const DEFAULT_BATCH: usize = 256;
/// The most rows whose legs run as one batch (one publish batch, one notify batch, one
/// enqueue batch); the lease is checked between such chunks.
const LEGS_CHUNK: usize = 64;
/// How long a relay's claim on its rows lasts, by default: its legs for a batch must run
/// within it, or another relay takes the rows over and runs them again.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// What a relay did: one [`Relay::drain`], or a whole [`Relay::run`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayReport {
    /// Rows finished (every planned leg landed) and marked done.
    pub done: u64,
    /// Events published to the stream.
    pub published: u64,
    /// Wakes notified.
    pub notified: u64,
    /// Jobs enqueued.
    pub enqueued: u64,
    /// Failures: legs that failed (their rows stay pending and only those legs are retried)
    /// and outbox calls that failed.
    pub failures: u64,
    /// Rows whose claim was taken over by another relay before this one completed them:
    /// their legs may have run twice. A lease shorter than a batch's legs shows here.
    pub lost: u64,
}

/// Relays an [`Outbox`] into the announce legs, at least once per leg.
///
/// Each pass claims rows in id order (a batch at a time, under a lease, so relays in
/// several processes on one store never hold one row at once; rows a batch has not
/// reached by half the lease are released and claimed afresh), runs each row's legs that
/// have not landed yet through the [`Announcer`] — the same function, with the same
/// fail-soft rule, as the [`AnnouncingRegistry`](crate::AnnouncingRegistry): a failing leg
/// affects no other leg of the row and no other row — then records what landed. A row is
/// done when all its legs landed; a retry redoes only the failed legs.
///
/// The legs of a claimed batch run chunk by chunk, leg by leg
/// ([`Announcer::run_legs_batch`]): one publish batch, one notify batch and one enqueue
/// batch per chunk, so a backend that batches (SQLite: one transaction; NATS: publish
/// acks awaited together) pays per chunk, not per row. A chunk starts at one row and
/// doubles up to 64 while the time per row so far says it ends within half the lease.
/// With the claim and the completion (one transaction each), relaying a batch of 256 rows
/// on SQLite takes about 20 commits instead of about 770.
///
/// A complete that fails is tried again with what landed (the core's quick-reopen delays)
/// while the claim's lease lasts, so an outbox blip after the legs ran costs no second
/// publish. Delivery is at least once: a relay that dies after a leg landed but before it
/// completed the row, whose lease ran out, or whose outbox refused the complete for the
/// whole lease, has that leg run again. Readers are
/// idempotent per seq. The stream gets a pass's rows in outbox order, but a retried publish
/// lands after later rows and relays in several processes interleave: follow the events
/// stream in `Sync::Announcements` (per-key seqs decide), as with any announcements.
#[derive(Clone, Debug)]
pub struct Relay<O, P, W, Q> {
    outbox: O,
    announcer: Announcer<P, W, Q>,
    owner: String,
    batch: usize,
    lease: Duration,
    backoff: BackoffPolicy,
    seed: u64,
}

/// A stable seed from the owner's name (FNV-1a): relays with different owners do not back
/// off in step, and one owner's run replays.
pub(crate) fn seed_of(owner: &str) -> u64 {
    owner.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What one pass over the outbox found.
struct Pass {
    failed: bool,
    held_by_others: Option<Duration>,
}

impl<O: Outbox, P: Publish, W: Wake, Q: Queue> Relay<O, P, W, Q> {
    /// A relay of `outbox` into `announcer`'s legs, claiming rows as `owner`. Every relay
    /// sharing a store needs its own owner name: claims by the same owner do not exclude
    /// each other (a relay restarted under its old name takes its rows back at once).
    pub fn new(outbox: O, announcer: Announcer<P, W, Q>, owner: impl Into<String>) -> Self {
        let owner = owner.into();
        Relay {
            seed: seed_of(&owner),
            outbox,
            announcer,
            owner,
            batch: DEFAULT_BATCH,
            lease: DEFAULT_LEASE,
            // 50 ms doubling to 5 s, half jitter, reset after 30 s healthy.
            backoff: BackoffPolicy::fast_reopen(),
        }
    }

    /// Claims at most `max` rows at a time (at least 1; default [`DEFAULT_BATCH`]).
    #[must_use]
    pub fn with_batch(mut self, max: usize) -> Self {
        self.batch = max.max(1);
        self
    }

    /// Holds claimed rows for `lease` (default [`DEFAULT_LEASE`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Backs off after failures under `policy` (default: 50 ms doubling to 5 s).
    #[must_use]
    pub fn with_backoff(mut self, policy: BackoffPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// Seeds the backoff jitter (default: derived from the owner name).
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The name its claims are made under.
    #[must_use]
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The seed of its backoff jitter, so a run can be replayed.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The outbox it relays.
    #[must_use]
    pub fn outbox(&self) -> &O {
        &self.outbox
    }

    /// The legs it runs.
    #[must_use]
    pub fn announcer(&self) -> &Announcer<P, W, Q> {
        &self.announcer
    }

    /// Outbox rows not yet done.
    pub async fn pending(&self) -> Result<u64> {
        self.outbox.pending().await
    }

    /// Relays every pending row once, in outbox order (rows another relay holds are left
    /// to it); rows whose legs fail stay pending.
    pub async fn drain(&self) -> Result<RelayReport> {
        let mut report = RelayReport::default();
        self.pass(&mut report, None).await?;
        Ok(report)
    }

    async fn pass(&self, report: &mut RelayReport, stop: Option<&StopSignal>) -> Result<Pass> {
        let failures = report.failures;
        let mut after = 0;
        // The chunk size and the time a row's legs took, carried from claim to claim.
        let (mut chunk, mut per_row) = (1, None);
        loop {
            let claimed_at = tokio::time::Instant::now();
            let claimed = self
                .outbox
                .claim(&self.owner, after, self.batch, self.lease)
                .await?;
            if claimed.rows.is_empty() {
                return Ok(Pass {
                    failed: report.failures > failures,
                    held_by_others: claimed.held_by_others,
                });
            }
            let mut full = claimed.rows.len() >= self.batch;
            let held_by_others = claimed.held_by_others;
            let mut updates = Vec::with_capacity(claimed.rows.len());
            let rows = claimed.rows;
            let mut at = 0;
            while at < rows.len() {
                let elapsed = claimed_at.elapsed();
                // Legs that would run into the lease's second half are left for a fresh
                // claim: past the lease another relay may take the rows and run them too.
                if at > 0 && elapsed >= self.lease / 2 {
                    updates.extend(rows[at..].iter().map(|row| OutboxUpdate {
                        id: row.id,
                        landed: row.landed,
                        done: false,
                    }));
                    full = true;
                    break;
                }
                // A chunk grows from one row while the legs are fast, and is cut to what
                // the time per row so far says fits in the lease's first half.
                let mut size = chunk.min(rows.len() - at);
                if let Some(per_row) = per_row.filter(|d: &Duration| !d.is_zero()) {
                    let left = (self.lease / 2).saturating_sub(elapsed);
                    let fit = left.as_nanos() / per_row.as_nanos();
                    size = size.min(usize::try_from(fit).unwrap_or(usize::MAX)).max(1);
                }
                let legs_started = tokio::time::Instant::now();
                let part = &rows[at..at + size];
                let legs: Vec<_> = part
                    .iter()
                    .map(|row| (row.seq, &row.plan, row.landed))
                    .collect();
                let landed = self.announcer.run_legs_batch(&legs).await;
                for (row, landed) in part.iter().zip(landed) {
                    let before = row.landed;
                    after = row.id;
                    report.published += u64::from(landed.published && !before.published);
                    report.notified += u64::from(landed.notified && !before.notified);
                    report.enqueued +=
                        u64::from(landed.enqueued.is_some() && before.enqueued.is_none());
                    let missing = landed.missing(&row.plan);
                    report.failures += u64::from(missing);
                    report.done += u64::from(missing == 0);
                    updates.push(OutboxUpdate {
                        id: row.id,
                        landed,
                        done: missing == 0,
                    });
                }
                at += size;
                per_row = legs_started
                    .elapsed()
                    .checked_div(u32::try_from(size).unwrap_or(u32::MAX));
                chunk = (chunk * 2).min(LEGS_CHUNK);
            }
            let claimed = updates.len() as u64;
            let recorded = self.complete(claimed_at, updates, report).await?;
            if recorded < claimed {
                let lost = claimed - recorded;
                report.lost += lost;
                warn!(
                    owner = %self.owner,
                    lost,
                    lease = ?self.lease,
                    "outbox claims were taken over before they completed; their legs may run twice"
                );
            }
            if !full || stop.is_some_and(StopSignal::is_stopped) {
                return Ok(Pass {
                    failed: report.failures > failures,
                    held_by_others,
                });
            }
        }
    }

    /// Records what landed for the rows claimed at `claimed_at`. A failed complete is tried
    /// again with the same updates while the claim's lease lasts: the legs already ran,
    /// and dropping what landed would have this relay claim its own rows back and run
    /// every leg again. Only once the lease is gone (another relay may take the rows over)
    /// does it give up, and then the rows' legs run again, at least once.
    async fn complete(
        &self,
        claimed_at: tokio::time::Instant,
        updates: Vec<OutboxUpdate>,
        report: &mut RelayReport,
    ) -> Result<u64> {
        let rows = updates.len();
        let recorded = settle(
            crate::clock::instant_after(claimed_at, self.lease),
            || self.outbox.complete(&self.owner, updates.clone()),
            |e, delay| {
                report.failures += 1;
                debug!(owner = %self.owner, rows, error = %e, ?delay, "completing outbox rows failed; trying again");
            },
        )
        .await;
        if let Err(e) = &recorded {
            warn!(
                owner = %self.owner,
                rows,
                lease = ?self.lease,
                error = %e,
                "completing outbox rows failed until their lease ran out; their legs will run again"
            );
        }
        recorded
    }

    /// Relays until `stop`: a pass over every pending row, then waits for new rows (or
    /// for another relay's lease to run out), or after a failure backs off (exponential,
    /// jittered from its seed, capped, reset after a healthy period) and retries. Reads
    /// tokio's clock only. Returns what it did; only a non-retryable outbox error ends it
    /// early.
    pub async fn run(&self, mut stop: StopSignal) -> Result<RelayReport> {
        let clock = Clock::new();
        let mut rng = Rng::new(self.seed);
        let mut backoff = Backoff::new(self.backoff);
        let mut watch = self.outbox.watch();
        let mut report = RelayReport::default();
        let metrics = RelayMetrics::new(&self.owner);
        while !stop.is_stopped() {
            let before = report;
            let pass = self.pass(&mut report, Some(&stop)).await;
            metrics.done.increment(report.done - before.done);
            metrics
                .failures
                .increment(report.failures - before.failures);
            // One count per pass, not per row: what an operator graphs.
            match self.outbox.pending().await {
                Ok(rows) => metrics.pending(rows),
                Err(e) => debug!(owner = %self.owner, error = %e, "could not count the outbox"),
            }
            let pass = match pass {
                Ok(pass) => pass,
                Err(e) if e.is_retryable() => {
                    warn!(owner = %self.owner, error = %e, "outbox relay failed; will retry");
                    report.failures += 1;
                    Pass {
                        failed: true,
                        held_by_others: None,
                    }
                }
                Err(e) => return Err(e),
            };
            if pass.failed {
                let delay = backoff.next_delay(clock.now(), &mut rng);
                debug!(owner = %self.owner, ?delay, attempt = backoff.attempt(), "relay backing off");
                tokio::select! {
                    biased;
                    () = stop.stopped() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            } else {
                backoff.healthy(clock.now());
                let expiry = async {
                    match pass.held_by_others {
                        Some(left) => tokio::time::sleep(left).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = stop.stopped() => break,
                    () = watch.changed() => {}
                    () = expiry => {}
                }
            }
        }
        Ok(report)
    }
}

impl<O, P, W, Q> Relay<O, P, W, Q>
where
    O: Outbox + 'static,
    P: Publish + 'static,
    W: Wake + 'static,
    Q: Queue + 'static,
{
    /// Runs it as a task (inside a `relay` span naming its owner) until stopped through
    /// the handle.
    pub fn spawn(self) -> RelayHandle {
        let owner = self.owner.clone();
        let seed = self.seed;
        let span = tracing::info_span!("relay", owner = %owner);
        let running = Running::spawn(
            "relay",
            owner,
            span,
            |stop| async move { self.run(stop).await },
        );
        RelayHandle { seed, running }
    }
}

/// A running relay's handle: stop it, wait for it.
#[derive(Debug)]
pub struct RelayHandle {
    seed: u64,
    running: Running<RelayReport>,
}

impl RelayHandle {
    /// The relay's owner name.
    #[must_use]
    pub fn owner(&self) -> &str {
        self.running.name()
    }

    /// The seed of its backoff jitter, so a run can be replayed.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Asks it to stop (after the batch in hand).
    pub fn stop(&self) {
        self.running.stop();
    }

    /// A trigger that stops it, for sharing.
    #[must_use]
    pub fn shutdown(&self) -> Shutdown {
        self.running.shutdown()
    }

    /// Whether the task has ended.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.running.is_finished()
    }

    /// Waits for the task to end; what it did, or why it failed.
    pub async fn join(self) -> Result<RelayReport> {
        self.running.join().await
    }

    /// Stops it and waits at most `budget` for it to finish its batch; aborts it after
    /// that (its claimed rows wait out their lease, then another relay takes them).
    pub async fn stop_within(self, budget: Duration) -> Result<RelayReport> {
        self.running.stop_within(budget).await
    }
}
