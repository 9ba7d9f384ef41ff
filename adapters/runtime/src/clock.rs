//! The drivers' clock: tokio time, as the core's [`Time`].

use std::time::Duration;

use tidemark_core::Time;
use tokio::time::Instant;

/// The instant `d` after `at`, or one about 30 years after `at` (tokio's own far future)
/// when `at + d` is past what an [`Instant`] can hold: a lease, TTL, backoff or budget of
/// [`Duration::MAX`] means "for ever", never an overflow panic.
#[must_use]
pub fn instant_after(at: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    at.checked_add(d)
        .unwrap_or_else(|| at.checked_add(FAR).unwrap_or(at))
}

/// Converts between tokio's [`Instant`] and the core's [`Time`] (nanoseconds since the
/// clock was made). Reading tokio's clock, never std's, is what lets paused time and
/// simulators drive the drivers.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    start: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    /// A clock whose origin is now.
    #[must_use]
    pub fn new() -> Self {
        Clock {
            start: Instant::now(),
        }
    }

    /// Now, as a [`Time`].
    #[must_use]
    pub fn now(&self) -> Time {
        self.time(Instant::now())
    }

    /// The [`Time`] an instant stands for (the clock's origin for one before it).
    #[must_use]
    pub fn time(&self, at: Instant) -> Time {
        let since = at.saturating_duration_since(self.start);
        Time::from_nanos(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// The instant a [`Time`] stands for.
    #[must_use]
    pub fn instant(&self, t: Time) -> Instant {
        instant_after(self.start, Duration::from_nanos(t.as_nanos()))
    }
}
