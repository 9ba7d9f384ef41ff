//! Retention: how far history may be cut, decided from values (the store's marks, the
//! positions known readers still need, now) with no clock read.
//!
//! Stores keep no timestamp on each row. Instead every sweep records a [`Mark`]: the head
//! position at that time. History at or below a mark taken at least `keep` ago is at least
//! `keep` old; below a mark taken `max_age` ago, at least `max_age` old.

use std::time::Duration;

use crate::error::ConfigError;

/// How long history is kept, and for whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// History nobody known still needs is kept at least this long, for readers the store
    /// cannot see (followers in memory, consumers not yet created); past it they resync.
    /// Default 1 minute.
    pub keep: Duration,
    /// History older than this goes even if a known reader (a durable cursor, a persisted
    /// follower) still needs it; that reader then resyncs. `None`: never forced. Default
    /// 7 days.
    pub max_age: Option<Duration>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy {
            keep: Duration::from_secs(60),
            max_age: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

/// The head position of a log at a time (since any epoch the store keeps to).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark {
    /// When.
    pub at: Duration,
    /// The highest position written by then.
    pub head: u64,
}

impl RetentionPolicy {
    /// A policy; `max_age`, when given, must not be below `keep`.
    ///
    /// # Errors
    /// [`ConfigError::ZeroDuration`] for a zero `max_age`.
    pub fn new(keep: Duration, max_age: Option<Duration>) -> Result<Self, ConfigError> {
        if max_age.is_some_and(|m| m.is_zero()) {
            return Err(ConfigError::ZeroDuration {
                field: "retention max_age",
            });
        }
        Ok(RetentionPolicy { keep, max_age })
    }

    /// The first position to keep: everything below it may go.
    ///
    /// `marks` are the store's marks in any order; `needed` is the lowest position a known
    /// reader still needs (its watermark or cursor + 1), if any reader is known; `now` is on
    /// the marks' clock. History goes once it is at least `keep` old and no known reader
    /// needs it, or once it is at least `max_age` old whatever readers need.
    #[must_use]
    pub fn horizon(&self, marks: &[Mark], needed: Option<u64>, now: Duration) -> u64 {
        let older_than = |age: Duration| {
            marks
                .iter()
                .filter(|m| now.checked_sub(age).is_some_and(|t| m.at <= t))
                .map(|m| m.head.saturating_add(1))
                .max()
                .unwrap_or(1)
        };
        let aged = older_than(self.keep);
        let mut horizon = needed.map_or(aged, |n| aged.min(n.max(1)));
        if let Some(max_age) = self.max_age {
            horizon = horizon.max(older_than(max_age));
        }
        horizon
    }

    /// The marks still worth keeping: every mark younger than the longest age the policy
    /// looks back to, and the newest one older than it.
    #[must_use]
    pub fn marks_to_keep(&self, marks: &[Mark], now: Duration) -> Vec<Mark> {
        let span = self.max_age.unwrap_or(self.keep).max(self.keep);
        let cutoff = now.checked_sub(span);
        let mut sorted = marks.to_vec();
        sorted.sort_unstable();
        let newest_old = sorted
            .iter()
            .rev()
            .find(|m| cutoff.is_some_and(|c| m.at <= c))
            .copied();
        sorted
            .into_iter()
            .filter(|m| cutoff.is_none_or(|c| m.at > c) || Some(*m) == newest_old)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn marks() -> Vec<Mark> {
        // One sweep a minute; 100 writes a minute.
        (0..=60)
            .map(|i| Mark {
                at: MIN * i,
                head: 100 * u64::from(i),
            })
            .collect()
    }

    fn policy(keep_min: u32, max_age_min: Option<u32>) -> RetentionPolicy {
        RetentionPolicy::new(MIN * keep_min, max_age_min.map(|m| MIN * m)).unwrap()
    }

    #[test]
    fn history_younger_than_keep_stays() {
        let p = policy(10, None);
        assert_eq!(
            p.horizon(&marks(), None, MIN * 60),
            5001,
            "what was written by minute 50 is ten minutes old"
        );
        assert_eq!(
            p.horizon(&marks(), None, MIN * 5),
            1,
            "nothing is old enough"
        );
        assert_eq!(
            p.horizon(&[], None, MIN * 60),
            1,
            "no marks: nothing known old"
        );
    }

    #[test]
    fn a_known_reader_holds_history_until_max_age_forces_it() {
        let p = policy(10, Some(30));
        assert_eq!(
            p.horizon(&marks(), Some(4000), MIN * 60),
            4000,
            "a reader at 3999 needs 4000 on"
        );
        assert_eq!(
            p.horizon(&marks(), Some(1000), MIN * 60),
            3001,
            "history thirty minutes old goes even though the reader needs it"
        );
        assert_eq!(
            policy(10, None).horizon(&marks(), Some(1), MIN * 60),
            1,
            "without max_age a reader holds everything"
        );
        assert_eq!(
            p.horizon(&marks(), Some(6000), MIN * 60),
            5001,
            "a reader ahead of the age cut does not make young history go"
        );
    }

    #[test]
    fn marks_older_than_the_span_are_dropped_but_the_newest_of_them() {
        let p = policy(10, Some(30));
        let kept = p.marks_to_keep(&marks(), MIN * 60);
        assert_eq!(kept.first().map(|m| m.at), Some(MIN * 30));
        assert_eq!(kept.len(), 31);
        assert_eq!(
            p.horizon(&kept, Some(1), MIN * 60),
            p.horizon(&marks(), Some(1), MIN * 60),
            "pruning marks changes no decision"
        );
    }

    #[test]
    fn a_zero_max_age_is_refused() {
        assert!(RetentionPolicy::new(MIN, Some(Duration::ZERO)).is_err());
    }
}
