//! The job runner: leases jobs from any [`Queue`], runs the user's handler for each job's
//! kind, renews the lease while the handler runs, and acks, retries (with the core's
//! seeded, jittered backoff) or dead-letters.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use serde::de::DeserializeOwned;
use tidemark_core::{Backoff, BackoffPolicy, Job, JobId, Rng};
use tracing::{Instrument, debug, warn};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::ports::{JobCounts, JobState, Leased, Queue};
// A stable seed from the name: runners with different names do not retry in step.
use crate::relay::seed_of;
use crate::running::Running;
use crate::settle;
use crate::shutdown::{Shutdown, StopSignal};
use crate::telemetry::{JobMetrics, QUEUE_COUNT_EVERY};

/// How long a lease lasts before the job is delivered again, by default. The runner
/// renews it every third of that while the handler runs.
pub const DEFAULT_JOB_VISIBILITY: Duration = Duration::from_secs(30);
/// Jobs a runner runs at once, by default.
pub const DEFAULT_JOB_CONCURRENCY: usize = 4;
/// How long an idle runner waits before asking an empty queue again, by default.
pub const DEFAULT_JOB_IDLE_POLL: Duration = Duration::from_millis(250);

/// What a handler is told about the job it runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct JobContext {
    /// The job's id.
    pub id: JobId,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// The job's kind.
    pub kind: String,
    /// Fires when the runner is asked to stop. A long handler may watch it and end early
    /// (returning an error retries the job later); otherwise it runs on within the
    /// drain budget.
    pub stopping: StopSignal,
}

type HandlerFuture = Pin<Box<dyn Future<Output = std::result::Result<(), String>> + Send>>;
type Handler =
    Arc<dyn Fn(&Job, JobContext) -> std::result::Result<HandlerFuture, String> + Send + Sync>;

/// Handlers by job kind: what a [`JobRunner`] runs.
///
/// Each registration names the kinds it takes and the type their JSON decodes into: a
/// user's `#[derive(Deserialize)] #[serde(tag = "kind")]` enum, or [`Job`] itself for the
/// built-in `pack_housekeeping` and `sweep`. A job whose kind has no handler, or whose
/// payload does not decode into its handler's type, is dead-lettered at once with an
/// error saying so: no retry can help it.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tidemark::{Job, JobHandlers};
///
/// #[derive(Serialize, Deserialize)]
/// #[serde(tag = "kind", rename_all = "snake_case")]
/// enum Mail {
///     Welcome { to: String },
///     Digest { to: String, day: u32 },
/// }
///
/// let handlers = JobHandlers::new()
///     .on(["welcome", "digest"], |mail: Mail, _ctx| async move {
///         match mail {
///             Mail::Welcome { to } | Mail::Digest { to, .. } => println!("mail {to}"),
///         }
///         Ok::<(), std::io::Error>(())
///     })
///     .on(["pack_housekeeping", "sweep"], |job: Job, _ctx| async move {
///         println!("{job:?}");
///         Ok::<(), std::io::Error>(())
///     });
/// assert_eq!(handlers.kinds().count(), 4);
/// # let _ = Job::custom(&Mail::Welcome { to: "a".into() }).unwrap();
/// ```
#[derive(Clone, Default)]
pub struct JobHandlers {
    by_kind: BTreeMap<String, Handler>,
}

impl std::fmt::Debug for JobHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.by_kind.keys()).finish()
    }
}

impl JobHandlers {
    /// No handlers yet.
    #[must_use]
    pub fn new() -> Self {
        JobHandlers::default()
    }

    /// Runs jobs of `kinds` with `handler`, their JSON decoded as `T`. An `Err` from the
    /// handler fails the attempt (displayed as the job's last error): retried after a
    /// backoff, dead-lettered once its attempts are used up. A kind registered again is
    /// taken by the later handler.
    #[must_use]
    pub fn on<T, F, Fut, E>(
        mut self,
        kinds: impl IntoIterator<Item = impl Into<String>>,
        handler: F,
    ) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T, JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), E>> + Send + 'static,
        E: Display + 'static,
    {
        let handler = Arc::new(handler);
        let erased: Handler = Arc::new(move |job: &Job, ctx: JobContext| {
            let value: T = job.decode_as().map_err(|e| e.to_string())?;
            let fut = handler(value, ctx);
            Ok(Box::pin(async move { fut.await.map_err(|e| e.to_string()) }) as HandlerFuture)
        });
        for kind in kinds {
            self.by_kind.insert(kind.into(), Arc::clone(&erased));
        }
        self
    }

    /// The kinds it has handlers for, in order.
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.by_kind.keys().map(String::as_str)
    }
}

/// What a runner did, counted from its start. A metrics layer reads these.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobCounters {
    /// Leases taken.
    pub leased: u64,
    /// Jobs whose handler succeeded and that were acked.
    pub acked: u64,
    /// Attempts that failed and were put back for a retry.
    pub failed: u64,
    /// Jobs dead-lettered: attempts used up, no handler for their kind, or a payload that
    /// does not decode.
    pub dead_lettered: u64,
    /// Leases renewed while a handler ran.
    pub renewals: u64,
    /// Leases lost before the job was finished (renewal or ack refused): the job is
    /// someone else's now, and its handler was stopped or its result dropped.
    pub lost: u64,
    /// Queue calls that failed (the runner backs off and tries again).
    pub queue_errors: u64,
}

impl JobCounters {
    /// Sets the runner's counters in the metrics to these totals.
    fn publish(&self, metrics: &JobMetrics) {
        metrics.counters(self.acked, self.failed, self.dead_lettered);
    }
}

#[derive(Debug, Default)]
struct Counts {
    leased: AtomicU64,
    acked: AtomicU64,
    failed: AtomicU64,
    dead_lettered: AtomicU64,
    renewals: AtomicU64,
    lost: AtomicU64,
    queue_errors: AtomicU64,
    in_flight: AtomicU64,
}

impl Counts {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> JobCounters {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        JobCounters {
            leased: read(&self.leased),
            acked: read(&self.acked),
            failed: read(&self.failed),
            dead_lettered: read(&self.dead_lettered),
            renewals: read(&self.renewals),
            lost: read(&self.lost),
            queue_errors: read(&self.queue_errors),
        }
    }
}

/// Runs jobs from a [`Queue`]: the consumer half of the job system.
///
/// Each turn it leases a job (while fewer than its concurrency limit run), looks up the
/// handler for the job's kind, and runs it beside the others inside the runner's own
/// task (concurrently, not in parallel: nothing is spawned), renewing the lease every
/// third of the visibility timeout while it runs. Success acks the job; an error fails
/// the attempt with the error as the job's last error, ready again after a delay from the
/// core's [`BackoffPolicy`] (by attempt, jittered from the runner's seed); the queue
/// dead-letters it once its attempts are used up. A job of a kind without a handler, or
/// whose JSON does not decode, is dead-lettered at once. A handler that panics fails its
/// attempt like an error.
///
/// When the queue is empty it asks again after an idle poll; when a queue call fails it
/// backs off with the core's [`Backoff`]. It reads tokio's clock only, so paused time and
/// the simulator drive it. Delivery is at least once: a runner that dies mid-job leaves
/// the lease to expire, and the job is delivered again.
///
/// On stop it leases nothing more and lets the jobs in flight finish (still renewing
/// their leases); [`JobRunnerHandle::stop_within`] bounds that wait.
pub struct JobRunner<Q> {
    name: String,
    queue: Q,
    handlers: Arc<JobHandlers>,
    concurrency: usize,
    visibility: Duration,
    idle_poll: Duration,
    retry: BackoffPolicy,
    backoff: BackoffPolicy,
    seed: u64,
    counts: Arc<Counts>,
}

impl<Q> std::fmt::Debug for JobRunner<Q> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobRunner")
            .field("name", &self.name)
            .field("handlers", &self.handlers)
            .field("concurrency", &self.concurrency)
            .field("visibility", &self.visibility)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl<Q: Queue + Clone + 'static> JobRunner<Q> {
    /// A runner named `name` (its tracing span and its seed's default) of `handlers` over
    /// `queue`, with the defaults: [`DEFAULT_JOB_CONCURRENCY`] jobs at once, leases of
    /// [`DEFAULT_JOB_VISIBILITY`] renewed every third of it, an idle poll of
    /// [`DEFAULT_JOB_IDLE_POLL`], retries after [`BackoffPolicy::job_retry`] (1 s doubling to
    /// 5 min, half jitter), queue failures backed off 50 ms doubling to 5 s.
    pub fn new(name: impl Into<String>, queue: Q, handlers: JobHandlers) -> Self {
        let name = name.into();
        JobRunner {
            seed: seed_of(&name),
            name,
            queue,
            handlers: Arc::new(handlers),
            concurrency: DEFAULT_JOB_CONCURRENCY,
            visibility: DEFAULT_JOB_VISIBILITY,
            idle_poll: DEFAULT_JOB_IDLE_POLL,
            retry: BackoffPolicy::job_retry(),
            backoff: BackoffPolicy::fast_reopen(),
            counts: Arc::default(),
        }
    }

    /// Runs at most `jobs` at once (at least 1).
    #[must_use]
    pub fn concurrency(mut self, jobs: usize) -> Self {
        self.concurrency = jobs.max(1);
        self
    }

    /// Leases jobs for `visibility` (at least 3 ms), renewed every third of it while a
    /// handler runs. On NATS use the visibility every runner of the queue uses: it is the
    /// consumer's ack wait.
    #[must_use]
    pub fn visibility(mut self, visibility: Duration) -> Self {
        self.visibility = visibility.max(Duration::from_millis(3));
        self
    }

    /// Waits `interval` before asking an empty queue again, unless the queue's
    /// [`ready_signal`](Queue::ready_signal) says jobs may be ready sooner (then this is
    /// only the backstop).
    #[must_use]
    pub fn idle_poll(mut self, interval: Duration) -> Self {
        self.idle_poll = interval;
        self
    }

    /// Delays a failed job's retry `n` (from 0) by `policy`'s delay for `n`, jittered.
    #[must_use]
    pub fn retry_backoff(mut self, policy: BackoffPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Backs off after failed queue calls under `policy`.
    #[must_use]
    pub fn queue_backoff(mut self, policy: BackoffPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// Seeds the jitter of its delays (default: derived from its name).
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Its name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The queue it consumes.
    #[must_use]
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// What it did so far.
    #[must_use]
    pub fn counters(&self) -> JobCounters {
        self.counts.snapshot()
    }

    /// Runs jobs until `stop`, then waits for the jobs in flight to finish. Returns its
    /// counters; only a queue error that is not retryable ends it early (after the jobs in
    /// flight finished).
    ///
    /// Everything runs inside the future this returns: the handlers in flight, their lease
    /// renewals and the queue count are polled beside the leasing, never spawned. So a
    /// runner spawns no tasks, dropping it drops every handler at once, and a simulation
    /// that crashes its host replays the same way whatever tasks the process spawned
    /// before. A handler that does blocking or CPU-heavy work should move it off the
    /// runner with `tokio::task::spawn_blocking`.
    pub async fn run(&self, mut stop: StopSignal) -> Result<JobCounters> {
        let clock = Clock::new();
        let mut rng = Rng::new(self.seed);
        let mut backoff = Backoff::new(self.backoff);
        let mut work = Beside::new(&self.name);
        let mut fatal = None;
        let mut counted: Option<tokio::time::Instant> = None;
        // Made before the first lease, so an enqueue during it is not missed.
        let mut ready = self.queue.ready_signal();
        while !stop.is_stopped() {
            self.counts.snapshot().publish(&work.metrics);
            // Counted beside the leasing, never in its way: a count can be slow (NATS
            // reads the state bucket), and the gauges can wait for it.
            if work.counting.is_none() && counted.is_none_or(|at| at.elapsed() >= QUEUE_COUNT_EVERY)
            {
                counted = Some(tokio::time::Instant::now());
                let queue = self.queue.clone();
                work.counting = Some(Box::pin(async move { queue.counts().await }));
            }
            if work.jobs.len() >= self.concurrency {
                tokio::select! {
                    biased;
                    () = stop.stopped() => break,
                    () = work.one_done() => {}
                }
                continue;
            }
            // The lease's end counts from before the request: the queue's starts later,
            // so this runner gives the job up no later than the queue does.
            let asked = tokio::time::Instant::now();
            match work.beside(self.queue.lease(self.visibility)).await {
                Ok(Some(lease)) => {
                    backoff.healthy(clock.now());
                    Counts::bump(&self.counts.leased);
                    // Drawn here, in lease order, so a seed replays the same delays.
                    let retry_after = self.retry.delay(lease.attempt.saturating_sub(1), &mut rng);
                    let job = RunJob {
                        stopping: stop.clone(),
                        queue: self.queue.clone(),
                        handlers: Arc::clone(&self.handlers),
                        counts: Arc::clone(&self.counts),
                        visibility: self.visibility,
                        retry_after,
                        held_until: crate::clock::instant_after(asked, self.visibility),
                    };
                    let span = tracing::debug_span!("job", id = %lease.id, kind = lease.job.kind(), attempt = lease.attempt);
                    work.jobs.push(Box::pin(job.run(lease).instrument(span)));
                }
                Ok(None) => {
                    backoff.healthy(clock.now());
                    let woken = async {
                        match ready.as_mut() {
                            Some(signal) => signal.changed().await,
                            None => std::future::pending().await,
                        }
                    };
                    let stopped = work
                        .beside(async {
                            tokio::select! {
                                biased;
                                () = stop.stopped() => true,
                                () = woken => false,
                                () = tokio::time::sleep(self.idle_poll) => false,
                            }
                        })
                        .await;
                    if stopped {
                        break;
                    }
                }
                Err(e) if e.is_retryable() => {
                    Counts::bump(&self.counts.queue_errors);
                    let delay = backoff.next_delay(clock.now(), &mut rng);
                    warn!(runner = %self.name, error = %e, ?delay, "leasing a job failed; will retry");
                    let stopped = work
                        .beside(async {
                            tokio::select! {
                                biased;
                                () = stop.stopped() => true,
                                () = tokio::time::sleep(delay) => false,
                            }
                        })
                        .await;
                    if stopped {
                        break;
                    }
                }
                Err(e) => {
                    Counts::bump(&self.counts.queue_errors);
                    fatal = Some(e);
                    break;
                }
            }
        }
        // Drain: the jobs in flight finish (renewing their leases) before it returns; a
        // count still going is not waited for.
        work.counting = None;
        let draining = work.jobs.len();
        if draining > 0 {
            debug!(runner = %self.name, draining, "waiting for jobs in flight");
        }
        while !work.jobs.is_empty() {
            work.one_done().await;
        }
        self.counts.snapshot().publish(&work.metrics);
        match fatal {
            Some(e) => Err(e),
            None => Ok(self.counts.snapshot()),
        }
    }

    /// Runs it as a task (inside a `job_runner` span naming it) until stopped through the
    /// handle.
    pub fn spawn(self) -> JobRunnerHandle {
        let seed = self.seed;
        let counts = Arc::clone(&self.counts);
        let span = tracing::info_span!("job_runner", name = %self.name);
        let running = Running::spawn("job runner", self.name.clone(), span, |stop| async move {
            self.run(stop).await
        });
        JobRunnerHandle {
            seed,
            counts,
            running,
        }
    }
}

type JobFuture = Pin<Box<dyn Future<Output = ()> + Send>>;
type CountFuture = Pin<Box<dyn Future<Output = Result<JobCounts>> + Send>>;

/// What a runner does beside leasing, polled inside its own task (as kube-runtime's
/// applier polls its reconcilers): the jobs in flight and the queue count. Nothing is
/// spawned, so nothing outlives the runner and a crash drops it all in one order.
struct Beside<'a> {
    runner: &'a str,
    jobs: FuturesUnordered<JobFuture>,
    counting: Option<CountFuture>,
    metrics: JobMetrics,
}

impl<'a> Beside<'a> {
    fn new(runner: &'a str) -> Self {
        Beside {
            runner,
            jobs: FuturesUnordered::new(),
            counting: None,
            metrics: JobMetrics::new(runner),
        }
    }

    /// Moves the jobs in flight and the count on; ready with how many jobs ended.
    fn poll_work(&mut self, cx: &mut Context<'_>) -> usize {
        // The count first: started at the top of a turn, it reads the queue as the turn
        // found it, before the jobs' own calls of this poll.
        if let Some(counting) = self.counting.as_mut()
            && let Poll::Ready(counted) = counting.as_mut().poll(cx)
        {
            self.counting = None;
            match counted {
                Ok(c) => self.metrics.counts(&c),
                Err(e) => debug!(runner = %self.runner, error = %e, "could not count the queue"),
            }
        }
        let mut ended = 0;
        // `FuturesUnordered` yields to the scheduler by itself after a long run of ready
        // jobs (it wakes the task and returns `Pending`), so this loop ends.
        while let Poll::Ready(Some(())) = self.jobs.poll_next_unpin(cx) {
            ended += 1;
        }
        ended
    }

    /// Runs `fut` to its end while the jobs in flight and the count go on beside it.
    async fn beside<T>(&mut self, fut: impl Future<Output = T>) -> T {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            self.poll_work(cx);
            Poll::Pending
        })
        .await
    }

    /// Waits until at least one job in flight ends (forever when none runs).
    async fn one_done(&mut self) {
        std::future::poll_fn(|cx| {
            if self.poll_work(cx) > 0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}

/// One leased job's run: handler, renewals, and the outcome recorded in the queue.
struct RunJob<Q> {
    stopping: StopSignal,
    queue: Q,
    handlers: Arc<JobHandlers>,
    counts: Arc<Counts>,
    visibility: Duration,
    retry_after: Duration,
    /// Until when the lease is surely held, by this runner's clock: from before the
    /// request that took or last renewed it.
    held_until: tokio::time::Instant,
}

impl<Q: Queue + 'static> RunJob<Q> {
    async fn run(mut self, lease: Leased) {
        let counts = Arc::clone(&self.counts);
        let _in_flight = InFlight::enter(&counts);
        // A panic outside the handler (in the queue's own code) ends this job's run, not
        // the runner: the job's lease runs out and it is delivered again.
        if let Err(panic) = AssertUnwindSafe(self.run_leased(&lease))
            .catch_unwind()
            .await
        {
            Counts::bump(&self.counts.queue_errors);
            warn!(
                panic = %panic_message(&*panic),
                "running a job panicked outside its handler; it will be delivered again"
            );
        }
    }

    async fn run_leased(&mut self, lease: &Leased) {
        let kind = lease.job.kind().to_owned();
        let ctx = JobContext {
            id: lease.id,
            attempt: lease.attempt,
            kind: kind.clone(),
            stopping: self.stopping.clone(),
        };
        let Some(handler) = self.handlers.by_kind.get(&kind) else {
            return self
                .bury(lease, &format!("no handler for job kind {kind:?}"))
                .await;
        };
        // The user's code, panics caught: a panic fails the attempt like an error.
        let work = match std::panic::catch_unwind(AssertUnwindSafe(|| handler(&lease.job, ctx))) {
            Ok(Ok(work)) => AssertUnwindSafe(work).catch_unwind().boxed(),
            Ok(Err(e)) => {
                return self
                    .bury(lease, &format!("job of kind {kind:?} does not decode: {e}"))
                    .await;
            }
            Err(panic) => futures::future::ready(Err(panic)).boxed(),
        };
        let mut work = work;
        let renew_every = self.visibility / 3;
        let outcome = loop {
            tokio::select! {
                biased;
                done = &mut work => break match done {
                    Ok(result) => result,
                    Err(panic) => Err(format!("handler panicked: {}", panic_message(&*panic))),
                },
                // The lease ends with no renewal through: the job may be another
                // runner's from now, so this run ends here (the handler is dropped).
                () = tokio::time::sleep_until(self.held_until) => {
                    Counts::bump(&self.counts.lost);
                    warn!("job lease ran out with no renewal through; stopping its handler");
                    return;
                }
                () = tokio::time::sleep(renew_every) => {
                    let asked = tokio::time::Instant::now();
                    // A renewal still unanswered when the lease ends ends the run too.
                    let renewed = tokio::select! {
                        biased;
                        r = self.queue.renew(lease, self.visibility) => Some(r),
                        () = tokio::time::sleep_until(self.held_until) => None,
                    };
                    match renewed {
                        None => {
                            Counts::bump(&self.counts.lost);
                            warn!("job lease ran out while its renewal was unanswered; stopping its handler");
                            return;
                        }
                        Some(Ok(())) => {
                            Counts::bump(&self.counts.renewals);
                            self.held_until = crate::clock::instant_after(asked, self.visibility);
                        }
                        Some(Err(Error::LeaseLost(why))) => {
                            // Someone else may run it now; this run's result would be refused.
                            Counts::bump(&self.counts.lost);
                            warn!(error = %why, "job lease lost while its handler ran; stopping it");
                            return;
                        }
                        Some(Err(e)) => {
                            Counts::bump(&self.counts.queue_errors);
                            warn!(error = %e, "renewing a job lease failed; will try again until it ends");
                        }
                    }
                }
            }
        };
        if tokio::time::Instant::now() >= self.held_until {
            // Finished as the lease ended: the result is not this runner's to record.
            Counts::bump(&self.counts.lost);
            warn!("job finished as its lease ran out; its result is dropped and it runs again");
            return;
        }
        match outcome {
            Ok(()) => match self.settle(|| self.queue.ack(lease)).await {
                Ok(()) => Counts::bump(&self.counts.acked),
                Err(e) => self.record_error(&e, "acking a job failed; it will be delivered again"),
            },
            Err(error) => match self
                .settle(|| self.queue.fail(lease, &error, self.retry_after))
                .await
            {
                Ok(JobState::DeadLettered) => {
                    Counts::bump(&self.counts.dead_lettered);
                    warn!(%error, "job failed its last attempt; dead-lettered");
                }
                Ok(_) => {
                    Counts::bump(&self.counts.failed);
                    debug!(%error, retry_after = ?self.retry_after, "job failed; will retry");
                }
                Err(e) => self.record_error(&e, "failing a job failed; it will be delivered again"),
            },
        }
    }

    async fn bury(&self, lease: &Leased, error: &str) {
        warn!(%error, "job cannot run; dead-lettered");
        match self.settle(|| self.queue.dead_letter(lease, error)).await {
            Ok(()) => Counts::bump(&self.counts.dead_lettered),
            Err(e) => self.record_error(&e, "dead-lettering a job failed"),
        }
    }

    /// Makes a call that records a job's outcome, trying again while it fails retryably
    /// (after the core's quick-reopen delays, 50 ms doubling) for up to a third of the
    /// visibility, and never past the lease's end: a blip must not cost a finished job a
    /// second run, and a lease that ended records nothing.
    async fn settle<T, F, Fut>(&self, call: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let deadline =
            crate::clock::instant_after(tokio::time::Instant::now(), self.visibility / 3)
                .min(self.held_until);
        settle::settle(deadline, call, |e, delay| {
            Counts::bump(&self.counts.queue_errors);
            debug!(error = %e, ?delay, "recording a job's outcome failed; trying again");
        })
        .await
    }

    fn record_error(&self, e: &Error, what: &str) {
        if matches!(e, Error::LeaseLost(_)) {
            Counts::bump(&self.counts.lost);
        } else {
            Counts::bump(&self.counts.queue_errors);
        }
        warn!(error = %e, "{what}");
    }
}

/// Keeps the in-flight gauge true however a job's run ends (finished, panicked, dropped).
struct InFlight<'a>(&'a Counts);

impl<'a> InFlight<'a> {
    fn enter(counts: &'a Counts) -> Self {
        counts.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(counts)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// A running [`JobRunner`]'s handle: read its counters, stop it, wait for it.
#[derive(Debug)]
pub struct JobRunnerHandle {
    seed: u64,
    counts: Arc<Counts>,
    running: Running<JobCounters>,
}

impl JobRunnerHandle {
    /// The runner's name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.running.name()
    }

    /// The seed of its jitter, so a run can be replayed.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// What it did so far.
    #[must_use]
    pub fn counters(&self) -> JobCounters {
        self.counts.snapshot()
    }

    /// Jobs whose handlers run now.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.counts.in_flight.load(Ordering::Relaxed)
    }

    /// Asks it to stop: it leases nothing more and finishes the jobs in flight.
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

    /// Ends it now, handlers and all, as a crash would: the jobs in flight are neither
    /// acked nor failed and are delivered again when their leases expire.
    pub fn abort(self) {
        self.running.abort();
    }

    /// Waits for the task to end; its counters, or why it failed.
    pub async fn join(self) -> Result<JobCounters> {
        self.running.join().await
    }

    /// Stops it and waits at most `budget` for the jobs in flight to finish; aborts it
    /// after that (those jobs are delivered again when their leases expire).
    pub async fn stop_within(self, budget: Duration) -> Result<JobCounters> {
        self.running.stop_within(budget).await
    }
}
