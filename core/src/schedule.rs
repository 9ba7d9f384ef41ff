//! Schedules: which tick of a fixed interval is due, decided from times given in.

use std::time::Duration;

use crate::error::ConfigError;
use crate::job::Job;

/// A named job enqueued on a fixed interval (the periodic `sweep`).
///
/// Ticks are numbered from the schedule's anchor: tick `n` is due at `anchor + n ×
/// interval`. A scheduler stores the last tick it fired and fires the latest due tick
/// only if it is newer, with a compare-and-set in its store so that several schedulers
/// fire each tick once. A tick missed while no scheduler ran fires once, not once per
/// missed interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    name: String,
    interval: Duration,
    job: Job,
}

impl Schedule {
    /// A schedule; the name must not be empty and the interval must be positive.
    pub fn new(name: impl Into<String>, interval: Duration, job: Job) -> Result<Self, ConfigError> {
        let name = name.into();
        if name.trim().is_empty() {
            return Err(ConfigError::EmptyName {
                field: "schedule name",
            });
        }
        if interval.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "schedule interval",
            });
        }
        Ok(Schedule {
            name,
            interval,
            job,
        })
    }

    /// The schedule's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Time between ticks.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The job each tick enqueues.
    #[must_use]
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// The latest tick due at `now` (both as durations since the anchor), if any.
    #[must_use]
    pub fn latest_tick(&self, since_anchor: Duration) -> Option<u64> {
        let n = since_anchor.as_nanos() / self.interval.as_nanos();
        (n >= 1).then(|| u64::try_from(n).unwrap_or(u64::MAX))
    }

    /// The tick to fire now, given the last tick fired: the latest due tick if it is newer.
    #[must_use]
    pub fn tick_to_fire(&self, last_fired: Option<u64>, since_anchor: Duration) -> Option<u64> {
        let latest = self.latest_tick(since_anchor)?;
        match last_fired {
            Some(last) if last >= latest => None,
            _ => Some(latest),
        }
    }

    /// How long after the anchor the tick after `tick` is due.
    #[must_use]
    pub fn next_due(&self, tick: u64) -> Duration {
        self.interval
            .saturating_mul(u32::try_from(tick.saturating_add(1)).unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_minute() -> Schedule {
        Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap()
    }

    #[test]
    fn each_due_tick_fires_once() {
        let s = every_minute();
        assert_eq!(
            s.tick_to_fire(None, Duration::from_secs(59)),
            None,
            "nothing due yet"
        );
        assert_eq!(s.tick_to_fire(None, Duration::from_secs(60)), Some(1));
        assert_eq!(
            s.tick_to_fire(Some(1), Duration::from_secs(61)),
            None,
            "tick 1 already fired"
        );
        assert_eq!(s.tick_to_fire(Some(1), Duration::from_secs(120)), Some(2));
    }

    #[test]
    fn a_long_gap_fires_once_not_once_per_missed_interval() {
        let s = every_minute();
        assert_eq!(
            s.tick_to_fire(Some(1), Duration::from_secs(60 * 100 + 5)),
            Some(100)
        );
        assert_eq!(
            s.tick_to_fire(Some(100), Duration::from_secs(60 * 100 + 6)),
            None
        );
        assert_eq!(s.next_due(100), Duration::from_secs(60 * 101));
    }

    #[test]
    fn bad_schedules_are_refused() {
        assert!(Schedule::new("", Duration::from_secs(1), Job::Sweep).is_err());
        assert!(Schedule::new("s", Duration::ZERO, Job::Sweep).is_err());
    }
}
