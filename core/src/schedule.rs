//! Schedules: which tick of an interval or a cron expression is due, decided from times
//! given in. Nothing here reads a clock: the store's clock arrives as a [`ScheduleClock`].

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::ConfigError;
use crate::job::Job;

/// When a schedule's ticks fall.
#[derive(Clone, Debug)]
pub enum Cadence {
    /// Every `interval` after the schedule's anchor: tick `n` is due at `anchor + n ×
    /// interval`.
    Every(Duration),
    /// At each time a cron expression matches (UTC; five fields, or six with seconds
    /// first), strictly after the anchor. A tick is the unix second it is due at.
    Cron(CronExpr),
}

impl PartialEq for Cadence {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Cadence::Every(a), Cadence::Every(b)) => a == b,
            (Cadence::Cron(a), Cadence::Cron(b)) => a.expr == b.expr,
            _ => false,
        }
    }
}

impl Eq for Cadence {}

/// A parsed cron expression and the text it came from.
#[derive(Clone, Debug)]
pub struct CronExpr {
    expr: String,
    // Boxed: a parsed expression is a few hundred bytes, an interval sixteen.
    cron: Box<croner::Cron>,
}

impl CronExpr {
    /// Parses `expr` (`"*/5 * * * *"`, `"0 3 * * SUN"`, or six fields with seconds first).
    ///
    /// # Errors
    /// [`ConfigError::InvalidCron`] if it does not parse.
    pub fn parse(expr: &str) -> Result<Self, ConfigError> {
        let cron = croner::Cron::from_str(expr).map_err(|e| ConfigError::InvalidCron {
            expr: expr.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(CronExpr {
            expr: expr.to_owned(),
            cron: Box::new(cron),
        })
    }

    /// The expression as given.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.expr
    }

    /// The latest matching unix second at or before `at`.
    fn at_or_before(&self, at: Duration) -> Option<u64> {
        let t = utc(at)?;
        let found = self.cron.find_previous_occurrence(&t, true).ok()?;
        u64::try_from(found.timestamp()).ok()
    }

    /// The first matching unix second strictly after `at`.
    fn after(&self, at: Duration) -> Option<u64> {
        let t = utc(at)?;
        let found = self.cron.find_next_occurrence(&t, false).ok()?;
        u64::try_from(found.timestamp()).ok()
    }
}

/// `at` (since the unix epoch) as a UTC time, to the whole second.
fn utc(at: Duration) -> Option<DateTime<Utc>> {
    DateTime::<Utc>::from_timestamp(i64::try_from(at.as_secs()).ok()?, 0)
}

/// Where a schedule stands by its store's clock: the one clock every runner shares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScheduleClock {
    /// When the schedule was stored (its anchor), as time since the unix epoch.
    pub anchor: Duration,
    /// Now, as time since the unix epoch.
    pub now: Duration,
}

impl ScheduleClock {
    /// Time since the anchor (zero if the store's clock went back).
    #[must_use]
    pub fn since_anchor(&self) -> Duration {
        self.now.saturating_sub(self.anchor)
    }
}

/// A named job enqueued on an interval or a cron expression (the periodic `sweep`).
///
/// A scheduler stores the last tick it fired and fires the latest due tick only if it is
/// newer, with a compare-and-set in its store so that several schedulers fire each tick
/// once. A tick missed while no scheduler ran fires once, not once per missed tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    name: String,
    cadence: Cadence,
    job: Job,
}

fn check_name(name: &str) -> Result<(), ConfigError> {
    if name.trim().is_empty() {
        return Err(ConfigError::EmptyName {
            field: "schedule name",
        });
    }
    Ok(())
}

impl Schedule {
    /// A schedule on a fixed interval; the name must not be empty and the interval must be
    /// positive.
    pub fn new(name: impl Into<String>, interval: Duration, job: Job) -> Result<Self, ConfigError> {
        let name = name.into();
        check_name(&name)?;
        if interval.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "schedule interval",
            });
        }
        Ok(Schedule {
            name,
            cadence: Cadence::Every(interval),
            job,
        })
    }

    /// A schedule on a cron expression (UTC), e.g. `"*/5 * * * *"` for every five minutes.
    ///
    /// # Errors
    /// [`ConfigError::EmptyName`] or [`ConfigError::InvalidCron`].
    pub fn cron(name: impl Into<String>, expr: &str, job: Job) -> Result<Self, ConfigError> {
        let name = name.into();
        check_name(&name)?;
        Ok(Schedule {
            name,
            cadence: Cadence::Cron(CronExpr::parse(expr)?),
            job,
        })
    }

    /// The schedule's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// When its ticks fall.
    #[must_use]
    pub fn cadence(&self) -> &Cadence {
        &self.cadence
    }

    /// Time between ticks, for an interval schedule.
    #[must_use]
    pub fn interval(&self) -> Option<Duration> {
        match &self.cadence {
            Cadence::Every(d) => Some(*d),
            Cadence::Cron(_) => None,
        }
    }

    /// The cron expression, for a cron schedule.
    #[must_use]
    pub fn cron_expr(&self) -> Option<&str> {
        match &self.cadence {
            Cadence::Every(_) => None,
            Cadence::Cron(c) => Some(c.as_str()),
        }
    }

    /// The job each tick enqueues.
    #[must_use]
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// The latest tick due at `clock.now`, if any is due since the anchor.
    #[must_use]
    pub fn latest_tick(&self, clock: ScheduleClock) -> Option<u64> {
        match &self.cadence {
            Cadence::Every(interval) => {
                let n = clock.since_anchor().as_nanos() / interval.as_nanos();
                (n >= 1).then(|| u64::try_from(n).unwrap_or(u64::MAX))
            }
            Cadence::Cron(c) => c
                .at_or_before(clock.now)
                .filter(|&t| Duration::from_secs(t) > clock.anchor),
        }
    }

    /// The tick to fire now, given the last tick fired: the latest due tick if it is newer.
    #[must_use]
    pub fn tick_to_fire(&self, last_fired: Option<u64>, clock: ScheduleClock) -> Option<u64> {
        let latest = self.latest_tick(clock)?;
        match last_fired {
            Some(last) if last >= latest => None,
            _ => Some(latest),
        }
    }

    /// How long from `clock.now` until the next tick after now is due (`None` for a cron
    /// expression that never matches again).
    #[must_use]
    pub fn until_next(&self, clock: ScheduleClock) -> Option<Duration> {
        match &self.cadence {
            Cadence::Every(interval) => {
                let since = clock.since_anchor();
                let n = since.as_nanos() / interval.as_nanos() + 1;
                let due = interval.as_nanos().saturating_mul(n);
                let wait = due.saturating_sub(since.as_nanos());
                Some(Duration::from_nanos(
                    u64::try_from(wait).unwrap_or(u64::MAX),
                ))
            }
            Cadence::Cron(c) => {
                let next = c.after(clock.now.max(clock.anchor))?;
                Some(Duration::from_secs(next).saturating_sub(clock.now))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_minute() -> Schedule {
        Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap()
    }

    fn at(since_anchor: u64) -> ScheduleClock {
        ScheduleClock {
            anchor: Duration::from_secs(1_000_000),
            now: Duration::from_secs(1_000_000 + since_anchor),
        }
    }

    #[test]
    fn each_due_tick_fires_once() {
        let s = every_minute();
        assert_eq!(s.tick_to_fire(None, at(59)), None, "nothing due yet");
        assert_eq!(s.tick_to_fire(None, at(60)), Some(1));
        assert_eq!(
            s.tick_to_fire(Some(1), at(61)),
            None,
            "tick 1 already fired"
        );
        assert_eq!(s.tick_to_fire(Some(1), at(120)), Some(2));
    }

    #[test]
    fn a_long_gap_fires_once_not_once_per_missed_interval() {
        let s = every_minute();
        assert_eq!(s.tick_to_fire(Some(1), at(60 * 100 + 5)), Some(100));
        assert_eq!(s.tick_to_fire(Some(100), at(60 * 100 + 6)), None);
        assert_eq!(
            s.until_next(at(60 * 100 + 6)),
            Some(Duration::from_secs(54))
        );
    }

    #[test]
    fn bad_schedules_are_refused() {
        assert!(Schedule::new("", Duration::from_secs(1), Job::Sweep).is_err());
        assert!(Schedule::new("s", Duration::ZERO, Job::Sweep).is_err());
        assert!(matches!(
            Schedule::cron("s", "61 * * * *", Job::Sweep),
            Err(ConfigError::InvalidCron { .. })
        ));
        assert!(Schedule::cron("s", "not cron", Job::Sweep).is_err());
        assert!(Schedule::cron(" ", "* * * * *", Job::Sweep).is_err());
    }

    // 2026-01-01T00:00:00Z, a Thursday.
    const NEW_YEAR: u64 = 1_767_225_600;

    fn clock(anchor: u64, now: u64) -> ScheduleClock {
        ScheduleClock {
            anchor: Duration::from_secs(anchor),
            now: Duration::from_secs(now),
        }
    }

    #[test]
    fn a_cron_tick_is_the_second_it_falls_on_and_only_after_the_anchor() {
        let s = Schedule::cron("hourly", "0 * * * *", Job::Sweep).unwrap();
        // Stored at 00:10: the 00:00 match lies before the anchor and is not due.
        let anchor = NEW_YEAR + 600;
        assert_eq!(s.tick_to_fire(None, clock(anchor, NEW_YEAR + 3599)), None);
        assert_eq!(
            s.until_next(clock(anchor, NEW_YEAR + 3599)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            s.tick_to_fire(None, clock(anchor, NEW_YEAR + 3600)),
            Some(NEW_YEAR + 3600),
            "01:00 is due at 01:00"
        );
        assert_eq!(
            s.tick_to_fire(Some(NEW_YEAR + 3600), clock(anchor, NEW_YEAR + 3700)),
            None,
            "fired once"
        );
    }

    #[test]
    fn a_missed_cron_stretch_fires_once_at_the_latest_match() {
        let s = Schedule::cron("nightly", "30 3 * * *", Job::Sweep).unwrap();
        // Last fired on Jan 1 at 03:30; nobody ran until Jan 5 at 12:00.
        let last = NEW_YEAR + 3 * 3600 + 1800;
        let now = NEW_YEAR + 4 * 86_400 + 12 * 3600;
        let tick = s.tick_to_fire(Some(last), clock(NEW_YEAR, now));
        assert_eq!(
            tick,
            Some(NEW_YEAR + 4 * 86_400 + 3 * 3600 + 1800),
            "one firing, for Jan 5 03:30, not four"
        );
        assert_eq!(s.tick_to_fire(tick, clock(NEW_YEAR, now)), None);
        assert_eq!(
            s.until_next(clock(NEW_YEAR, now)),
            Some(Duration::from_secs(15 * 3600 + 1800)),
            "next: Jan 6 03:30"
        );
    }

    #[test]
    fn cron_with_seconds_and_weekdays() {
        let s = Schedule::cron("s", "*/10 * * * * *", Job::Sweep).unwrap();
        assert_eq!(
            s.latest_tick(clock(NEW_YEAR, NEW_YEAR + 25)),
            Some(NEW_YEAR + 20)
        );
        // Sundays at 00:00: the first after Thursday Jan 1 is Jan 4.
        let s = Schedule::cron("s", "0 0 * * SUN", Job::Sweep).unwrap();
        assert_eq!(
            s.until_next(clock(NEW_YEAR, NEW_YEAR)),
            Some(Duration::from_secs(3 * 86_400))
        );
        assert_eq!(s.cron_expr(), Some("0 0 * * SUN"));
        assert_eq!(s.interval(), None);
    }
}
