//! When a value read from a bucket that drops aged values silently (a `max_age` and no
//! limit markers) expires, judged on the server's clock.
//!
//! The server stamps each message with its own clock and drops it once that clock says it
//! is `max_age` old. A client that compares the stamp with its own wall clock judges the
//! age on another clock: one ahead by `max_age` expires every value as it arrives, one
//! behind keeps values the server dropped. So the age is taken on the server's clock: a
//! reading of the server's time ([`ServerClock`], from the `ts` the server puts in a stream
//! info answer) carried forward by the local *monotonic* clock, whose rate is the server
//! clock's but whose origin does not matter. The local wall clock never enters.

use std::time::Duration;

/// The server's clock as a client can know it: one reading of the server's time, pinned
/// to a reading of the local monotonic clock, and carried forward by it.
///
/// Local readings are durations since any origin the caller keeps fixed (an `Instant` it
/// took once): only their differences count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerClock {
    /// The server's time at `anchor`, in nanoseconds since the Unix epoch.
    server_ns: u64,
    /// The local monotonic reading the server's reading is pinned to.
    anchor: Duration,
    /// How long the request that read it took: the server read its clock somewhere in it.
    round_trip: Duration,
}

impl ServerClock {
    /// The server's time `server_ns` (nanoseconds since the Unix epoch), read by a request
    /// sent when the local monotonic clock read `asked` and answered when it read
    /// `answered`.
    ///
    /// The server read its clock somewhere between the two; the reading is pinned to
    /// `answered`, the latest it can have been. The server's time carried forward from it
    /// is then never ahead of the server's own (at most the round trip behind): a value is
    /// never judged expired before the server would drop it, and at worst kept a round
    /// trip longer — the server itself drops aged values only when its expiry timer runs.
    #[must_use]
    pub fn from_reading(server_ns: u64, asked: Duration, answered: Duration) -> ServerClock {
        ServerClock {
            server_ns,
            anchor: answered,
            round_trip: answered.saturating_sub(asked),
        }
    }

    /// The server's time, in nanoseconds since the Unix epoch, when the local monotonic
    /// clock reads `local`. A reading before the anchor (from another origin: a misuse)
    /// counts as the anchor, so the server's time never goes back.
    #[must_use]
    pub fn server_now(&self, local: Duration) -> u64 {
        let since = local.saturating_sub(self.anchor);
        self.server_ns
            .saturating_add(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// How far behind the server's own clock [`server_now`](Self::server_now) may be: the
    /// round trip of the request that read it.
    #[must_use]
    pub fn uncertainty(&self) -> Duration {
        self.round_trip
    }
}

/// Whether something the server stored at `stored_ns` has been kept at least `keep` when the
/// server's clock reads `server_now_ns` (both nanoseconds since the Unix epoch): a
/// retention age judged on the server's clock, so the writer's and the sweeper's own
/// clocks do not enter it. A stamp of 0 (none) counts as stored long ago.
#[must_use]
pub fn kept_for(stored_ns: u64, server_now_ns: u64, keep: Duration) -> bool {
    stored_ns == 0 || Duration::from_nanos(server_now_ns.saturating_sub(stored_ns)) >= keep
}

/// The age limit of a bucket that drops values silently: its `max_age`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expiry {
    max_age: Duration,
}

impl Expiry {
    /// The limit `max_age`; `None` for zero, which the server reads as "no limit".
    #[must_use]
    pub fn new(max_age: Duration) -> Option<Expiry> {
        (!max_age.is_zero()).then_some(Expiry { max_age })
    }

    /// The expiry a follower must apply itself to a bucket whose age limit is `max_age`:
    /// none when the bucket writes limit markers (`markers`: the server announces each
    /// removal, and the follower sees it), nor without an age limit.
    #[must_use]
    pub fn silent(max_age: Duration, markers: bool) -> Option<Expiry> {
        if markers { None } else { Expiry::new(max_age) }
    }

    /// The limit.
    #[must_use]
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    /// What is left of the life of a value the server stored at `published_ns`, when the
    /// server's clock reads `server_now_ns` (both nanoseconds since the Unix epoch):
    /// `max_age` less its age by the server's clock, zero once it is due. A stamp after
    /// `server_now_ns` (a clock reading older than the message) is an age of zero.
    ///
    /// `None` for a stamp of 0: the server gave none, and the value's life is unknown.
    #[must_use]
    pub fn remaining(&self, published_ns: u64, server_now_ns: u64) -> Option<Duration> {
        if published_ns == 0 {
            return None;
        }
        let age = Duration::from_nanos(server_now_ns.saturating_sub(published_ns));
        Some(self.max_age.saturating_sub(age))
    }

    /// [`remaining`](Self::remaining) with the server's time carried forward by `clock` to
    /// the local monotonic reading `local` (when the value was read).
    #[must_use]
    pub fn remaining_at(
        &self,
        published_ns: u64,
        clock: &ServerClock,
        local: Duration,
    ) -> Option<Duration> {
        self.remaining(published_ns, clock.server_now(local))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retention_age_is_judged_on_the_servers_clock() {
        let second = 1_000_000_000;
        assert!(!kept_for(10 * second, 12 * second, Duration::from_secs(3)));
        assert!(kept_for(10 * second, 13 * second, Duration::from_secs(3)));
        assert!(kept_for(0, 1, Duration::from_secs(3)), "no stamp: long ago");
        assert!(
            !kept_for(10 * second, 9 * second, Duration::from_secs(1)),
            "a stamp after now"
        );
    }
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_value_lives_max_age_by_the_servers_clock() {
        let expiry = Expiry::new(Duration::from_secs(60)).unwrap();
        let published = 1_700_000_000 * SEC;
        assert_eq!(
            expiry.remaining(published, published + 20 * SEC),
            Some(Duration::from_secs(40)),
            "twenty seconds old by the server's clock: forty left"
        );
        assert_eq!(
            expiry.remaining(published, published + 61 * SEC),
            Some(Duration::ZERO),
            "past max_age: due now"
        );
        assert_eq!(
            expiry.remaining(published, published - 5 * SEC),
            Some(Duration::from_secs(60)),
            "a clock reading older than the message is an age of zero, never more life"
        );
        assert_eq!(
            expiry.remaining(0, published),
            None,
            "no stamp, no judgement"
        );
        assert_eq!(Expiry::new(Duration::ZERO), None, "zero is no limit");
    }

    #[test]
    fn the_clock_is_pinned_to_the_answer_and_carried_by_the_monotonic_clock() {
        let clock = ServerClock::from_reading(
            1_000 * SEC,
            Duration::from_millis(100),
            Duration::from_millis(300),
        );
        assert_eq!(clock.uncertainty(), Duration::from_millis(200));
        assert_eq!(
            clock.server_now(Duration::from_millis(300)),
            1_000 * SEC,
            "the reading stands for the moment the answer arrived"
        );
        assert_eq!(
            clock.server_now(Duration::from_millis(1_300)),
            1_001 * SEC,
            "a second later locally is a second later on the server"
        );
        assert_eq!(
            clock.server_now(Duration::from_millis(0)),
            1_000 * SEC,
            "a reading before the anchor never moves the server's clock back"
        );
    }

    /// One run of the world: true time is the server's clock; the client's monotonic
    /// clock is true time plus `skew` (any origin); the server answers the clock read
    /// `asked_before` after the client asked and `answered_after` before the answer
    /// arrived; the value is published at `published` and read `delivered_after` after the
    /// clock read (or later than its publication, whichever is later).
    #[derive(Clone, Debug)]
    struct World {
        max_age: Duration,
        skew: u64,
        read_at: u64,
        asked_before: u64,
        answered_after: u64,
        published: u64,
        delivered_after: u64,
    }

    fn world() -> impl Strategy<Value = World> {
        (
            1..10 * 24 * 3_600 * SEC,
            0..u64::MAX / 4,
            1_600_000_000 * SEC..1_900_000_000 * SEC,
            0..2 * SEC,
            0..2 * SEC,
            // Published up to a day before or after the clock was read.
            0..2 * 24 * 3_600 * SEC,
            0..20 * 24 * 3_600 * SEC,
        )
            .prop_map(
                |(
                    max_age,
                    skew,
                    read_at,
                    asked_before,
                    answered_after,
                    offset,
                    delivered_after,
                )| {
                    World {
                        max_age: Duration::from_nanos(max_age),
                        skew,
                        read_at,
                        asked_before,
                        answered_after,
                        published: read_at - 24 * 3_600 * SEC + offset,
                        delivered_after,
                    }
                },
            )
    }

    impl World {
        /// When the value is read, in true (server) time.
        fn delivered(&self) -> u64 {
            (self.read_at + self.answered_after + self.delivered_after).max(self.published)
        }

        /// The client's monotonic reading at true time `t`.
        fn local(&self, t: u64, skew: u64) -> Duration {
            Duration::from_nanos(t - (self.read_at - self.asked_before) + skew)
        }

        /// The remaining life the piece gives, with the client's clock skewed by `skew`.
        fn judged(&self, skew: u64) -> Duration {
            let clock = ServerClock::from_reading(
                self.read_at,
                self.local(self.read_at - self.asked_before, skew),
                self.local(self.read_at + self.answered_after, skew),
            );
            Expiry::new(self.max_age)
                .unwrap()
                .remaining_at(self.published, &clock, self.local(self.delivered(), skew))
                .unwrap()
        }

        /// `max_age` less the age by the server's clock when the value is read.
        fn truth(&self) -> Duration {
            self.max_age
                .saturating_sub(Duration::from_nanos(self.delivered() - self.published))
        }
    }

    proptest! {
        /// SPEC §17: expiry is judged on the server's clock. However far the client's
        /// clock is from the server's, the remaining life is `max_age` less the age by the
        /// server's clock — never less (a value dropped before the server drops it), and
        /// more only by the round trip of the clock read.
        #[test]
        fn remaining_life_is_max_age_less_the_age_by_the_servers_clock(w in world()) {
            let judged = w.judged(w.skew);
            let truth = w.truth();
            prop_assert!(
                judged >= truth,
                "judged {judged:?} below the server's {truth:?}: a value would expire early"
            );
            prop_assert!(
                judged <= truth + Duration::from_nanos(w.answered_after),
                "judged {judged:?} beyond the server's {truth:?} by more than the round trip"
            );
        }

        /// The client's clock does not enter the judgement at all: two clients whose
        /// clocks disagree by any amount judge one value alike.
        #[test]
        fn a_skewed_local_clock_changes_nothing(w in world(), other in 0..u64::MAX / 4) {
            prop_assert_eq!(w.judged(w.skew), w.judged(other));
        }

        /// With an instant answer the judgement is exact.
        #[test]
        fn an_instant_clock_read_judges_exactly(mut w in world()) {
            w.asked_before = 0;
            w.answered_after = 0;
            prop_assert_eq!(w.judged(w.skew), w.truth());
        }
    }
}
