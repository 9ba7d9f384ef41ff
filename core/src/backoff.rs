//! Where backoff is decided: exponential, jittered from a seeded generator, capped, and
//! reset after a healthy period.

use std::time::Duration;

use crate::error::ConfigError;
use crate::rng::Rng;
use crate::time::Time;

/// How delays grow between attempts.
///
/// The delay for attempt `n` (from 0) is `min(first × factorⁿ, cap)`, then shortened by a
/// random fraction of at most `jitter` so that many followers failing together do not retry
/// together. After `reset_after` of health the next failure starts again from `first`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackoffPolicy {
    first: Duration,
    factor: f64,
    cap: Duration,
    reset_after: Duration,
    jitter: f64,
}

impl Default for BackoffPolicy {
    /// The defaults of kube-runtime's watcher: 800 ms, ×2, capped at 30 s, reset after
    /// 120 s healthy, up to half of each delay taken off at random.
    fn default() -> Self {
        BackoffPolicy {
            first: Duration::from_millis(800),
            factor: 2.0,
            cap: Duration::from_secs(30),
            reset_after: Duration::from_secs(120),
            jitter: 0.5,
        }
    }
}

impl BackoffPolicy {
    /// A validated policy: `first`, `cap` and `reset_after` positive, `factor ≥ 1`,
    /// `cap ≥ first`, `jitter` in `[0, 1]`.
    pub fn new(
        first: Duration,
        factor: f64,
        cap: Duration,
        reset_after: Duration,
        jitter: f64,
    ) -> Result<Self, ConfigError> {
        if first.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "backoff first delay",
            });
        }
        if cap.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "backoff cap",
            });
        }
        if reset_after.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "backoff reset period",
            });
        }
        // Written so that NaN is refused too.
        if !(factor >= 1.0 && factor.is_finite()) {
            return Err(ConfigError::FactorBelowOne { factor });
        }
        if cap < first {
            return Err(ConfigError::CapBelowFirst { first, cap });
        }
        if !(0.0..=1.0).contains(&jitter) {
            return Err(ConfigError::JitterOutOfRange { jitter });
        }
        Ok(BackoffPolicy {
            first,
            factor,
            cap,
            reset_after,
            jitter,
        })
    }

    /// For a feed that ended cleanly (a server restart): reopen quickly — 50 ms, ×2, capped
    /// at 5 s — yet never in a tight loop if it keeps ending.
    #[must_use]
    pub fn fast_reopen() -> Self {
        BackoffPolicy {
            first: Duration::from_millis(50),
            factor: 2.0,
            cap: Duration::from_secs(5),
            reset_after: Duration::from_secs(30),
            jitter: 0.5,
        }
    }

    /// For a failed job's retries: 1 s, ×2, capped at 5 minutes, half jitter. A job is
    /// retried by its own attempt count, so the reset period plays no part.
    #[must_use]
    pub fn job_retry() -> Self {
        BackoffPolicy {
            first: Duration::from_secs(1),
            factor: 2.0,
            cap: Duration::from_secs(5 * 60),
            reset_after: Duration::from_secs(5 * 60),
            jitter: 0.5,
        }
    }

    /// The first delay.
    #[must_use]
    pub fn first(&self) -> Duration {
        self.first
    }

    /// The growth factor.
    #[must_use]
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// The largest delay.
    #[must_use]
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// How long without failure resets the delay to `first`.
    #[must_use]
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// The largest fraction of a delay taken off at random.
    #[must_use]
    pub fn jitter(&self) -> f64 {
        self.jitter
    }

    /// The delay before retry `attempt` (from 0), jittered by `rng` as [`Backoff`] does:
    /// for things retried by their own count (a job's attempts) rather than in a row.
    pub fn delay(&self, attempt: u32, rng: &mut Rng) -> Duration {
        self.base_delay(attempt)
            .mul_f64(1.0 - self.jitter * rng.next_f64())
    }

    /// The delay before attempt `attempt` (from 0) without jitter.
    #[must_use]
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let grown = self.first.as_secs_f64() * self.factor.powi(attempt.min(1_000) as i32);
        if !grown.is_finite() || grown >= self.cap.as_secs_f64() {
            self.cap
        } else {
            Duration::from_secs_f64(grown)
        }
    }
}

/// The state of one backoff: which attempt comes next and since when things are healthy.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: BackoffPolicy,
    attempt: u32,
    healthy_since: Option<Time>,
    /// The outage that grew the count is over: the next success forgets it.
    outage_over: bool,
}

impl Backoff {
    /// A fresh backoff under `policy`.
    #[must_use]
    pub fn new(policy: BackoffPolicy) -> Self {
        Backoff {
            policy,
            attempt: 0,
            healthy_since: None,
            outage_over: false,
        }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &BackoffPolicy {
        &self.policy
    }

    /// How many failures in a row so far (since the last reset).
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Things work as of `now` (a feed opened, a request succeeded). If they keep working
    /// for the policy's reset period, the next failure starts from the first delay.
    pub fn healthy(&mut self, now: Time) {
        if std::mem::take(&mut self.outage_over) {
            self.attempt = 0;
        }
        self.healthy_since.get_or_insert(now);
    }

    /// The outage that grew the count is over (the client reconnected, the source answers
    /// again): the next success ([`healthy`](Self::healthy)) forgets the failures before
    /// it at once, not after the reset period, so a failure soon after the source came
    /// back is not spaced by a backoff the outage grew.
    ///
    /// The next failure, of the attempt the return hastened, waits what the last one did
    /// and does not grow the count: a source that flaps (a cluster electing a leader, a
    /// link going up and down) is retried at each return, which its caller paces, and
    /// once it holds the backoff is the one the outage grew, not one grown by each
    /// return's failed attempt (a 3-node cluster's election left a follower 28 s of
    /// backoff from eight such attempts in 2 s). The failures after that one count: a
    /// source that is still away is not hammered.
    pub fn outage_over(&mut self) {
        if self.attempt > 0 {
            self.outage_over = true;
        }
    }

    /// A failure at `now`: the delay to wait before the next attempt, jittered by `rng`.
    pub fn next_delay(&mut self, now: Time, rng: &mut Rng) -> Duration {
        if let Some(since) = self.healthy_since.take()
            && now.saturating_since(since) >= self.policy.reset_after
        {
            self.attempt = 0;
        }
        if std::mem::take(&mut self.outage_over) && self.attempt > 0 {
            // The attempt the return hastened failed: wait what the last failure did.
            return self.policy.delay(self.attempt - 1, rng);
        }
        let delay = self.policy.delay(self.attempt, rng);
        self.attempt = self.attempt.saturating_add(1);
        delay
    }

    /// Forgets every failure.
    pub fn reset(&mut self) {
        self.attempt = 0;
        self.healthy_since = None;
        self.outage_over = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_success_after_an_outage_forgets_its_failures_and_failures_before_it_count() {
        let mut rng = Rng::new(1);
        let mut b = Backoff::new(BackoffPolicy::default());
        for _ in 0..5 {
            let _ = b.next_delay(Time::ZERO, &mut rng);
        }
        b.outage_over();
        let _ = b.next_delay(Time::ZERO, &mut rng);
        assert_eq!(
            b.attempt(),
            5,
            "the attempt the return hastened does not grow the count"
        );
        let _ = b.next_delay(Time::ZERO, &mut rng);
        assert_eq!(
            b.attempt(),
            6,
            "a failure after it, before any success, counts"
        );
        b.outage_over();
        b.healthy(Time::ZERO);
        assert_eq!(b.attempt(), 0, "the first success forgets the outage");
        let _ = b.next_delay(Time::ZERO, &mut rng);
        let _ = b.next_delay(Time::ZERO, &mut rng);
        b.healthy(Time::ZERO);
        assert_eq!(
            b.attempt(),
            2,
            "once: a success without a new outage over waits for the reset period"
        );
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_source_that_flaps_leaves_the_backoff_its_outage_grew_not_one_per_return() {
        let p = BackoffPolicy::new(secs(1), 2.0, secs(30), secs(120), 0.0).unwrap();
        let mut b = Backoff::new(p);
        let mut rng = Rng::new(0);
        for _ in 0..3 {
            let _ = b.next_delay(Time::ZERO, &mut rng);
        }
        // Eight returns in a row, each hastening an attempt that fails (an election).
        for _ in 0..8 {
            b.outage_over();
            assert_eq!(
                b.next_delay(Time::ZERO, &mut rng),
                secs(4),
                "each waits what the last failure before the returns did"
            );
        }
        assert_eq!(b.attempt(), 3);
        assert_eq!(
            b.next_delay(Time::ZERO, &mut rng),
            secs(8),
            "a failure with no return before it grows the count again"
        );
    }

    #[test]
    fn defaults_are_kube_runtimes() {
        let p = BackoffPolicy::default();
        assert_eq!(
            (p.first(), p.factor(), p.cap(), p.reset_after()),
            (Duration::from_millis(800), 2.0, secs(30), secs(120))
        );
    }

    #[test]
    fn delays_grow_exponentially_up_to_the_cap() {
        let p = BackoffPolicy::default();
        let got: Vec<_> = (0..8).map(|a| p.base_delay(a).as_millis()).collect();
        assert_eq!(got, [800, 1600, 3200, 6400, 12800, 25600, 30000, 30000]);
        assert_eq!(
            p.base_delay(u32::MAX),
            secs(30),
            "huge attempts must not overflow"
        );
    }

    #[test]
    fn jitter_stays_within_its_fraction_and_below_the_cap() {
        let mut b = Backoff::new(BackoffPolicy::default());
        let mut rng = Rng::new(3);
        let mut distinct = std::collections::BTreeSet::new();
        for attempt in 0..50u32 {
            let base = BackoffPolicy::default().base_delay(attempt);
            let d = b.next_delay(Time::ZERO, &mut rng);
            assert!(
                d <= base && d >= base.mul_f64(0.5),
                "attempt {attempt}: {d:?} vs {base:?}"
            );
            distinct.insert(d);
        }
        assert!(distinct.len() > 10, "jitter must actually vary delays");
    }

    #[test]
    fn the_same_seed_replays_the_same_delays() {
        let run = |seed| {
            let mut b = Backoff::new(BackoffPolicy::default());
            let mut rng = Rng::new(seed);
            (0..20)
                .map(|_| b.next_delay(Time::ZERO, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn resets_after_a_healthy_period_but_not_before() {
        let p = BackoffPolicy::new(secs(1), 2.0, secs(60), secs(120), 0.0).unwrap();
        let mut b = Backoff::new(p);
        let mut rng = Rng::new(0);
        for _ in 0..4 {
            b.next_delay(Time::ZERO, &mut rng);
        }
        b.healthy(Time::from_millis(1_000));
        let short = b.next_delay(Time::from_millis(60_000), &mut rng);
        assert_eq!(short, secs(16), "59 s of health is not enough to reset");
        b.healthy(Time::from_millis(61_000));
        let reset = b.next_delay(Time::from_millis(181_000), &mut rng);
        assert_eq!(reset, secs(1), "120 s of health resets to the first delay");
    }

    #[test]
    fn constructor_refuses_bad_values_with_typed_errors() {
        let ok = |f, x, c, r, j| BackoffPolicy::new(f, x, c, r, j);
        assert!(matches!(
            ok(Duration::ZERO, 2.0, secs(1), secs(1), 0.5),
            Err(ConfigError::ZeroDuration { .. })
        ));
        assert!(matches!(
            ok(secs(1), 2.0, Duration::ZERO, secs(1), 0.5),
            Err(ConfigError::ZeroDuration { .. })
        ));
        assert!(matches!(
            ok(secs(1), 2.0, secs(1), Duration::ZERO, 0.5),
            Err(ConfigError::ZeroDuration { .. })
        ));
        assert!(matches!(
            ok(secs(1), 0.5, secs(2), secs(1), 0.5),
            Err(ConfigError::FactorBelowOne { .. })
        ));
        assert!(matches!(
            ok(secs(1), f64::NAN, secs(2), secs(1), 0.5),
            Err(ConfigError::FactorBelowOne { .. })
        ));
        assert!(matches!(
            ok(secs(2), 2.0, secs(1), secs(1), 0.5),
            Err(ConfigError::CapBelowFirst { .. })
        ));
        assert!(matches!(
            ok(secs(1), 2.0, secs(2), secs(1), 1.5),
            Err(ConfigError::JitterOutOfRange { .. })
        ));
        assert!(ok(secs(1), 1.0, secs(1), secs(1), 0.0).is_ok());
    }
}
