//! Where a follower that backs off decides to ask whether its source answers again, and
//! what the answers mean.
//!
//! A reconnect of the client beneath a source ends a backoff grown during an outage
//! ([`Input::Reconnected`](crate::Input::Reconnected)). A server that stalls and goes on
//! (a process paused and continued, a link that held its packets) gives no reconnect: the
//! connection never dropped. So while a follower backs off, its driver sends a cheap
//! question down the same path now and then (a probe: it changes nothing on the server),
//! and an answer after a probe that went unanswered means the path stalled and is back:
//! [`Probed::Resumed`], which the driver reports as
//! [`Input::Resumed`](crate::Input::Resumed). An answer with none missed before says
//! nothing: the backoff has another cause (a refused request), which probing must not
//! turn into a tight loop.
//!
//! A probe fails, as one unanswered does, when the server answers that the source is not
//! there (a bucket deleted): the follower cannot read it either way. So the first answer
//! that finds it again (made again) is [`Probed::Resumed`] too, and ends a backoff its
//! absence grew.
//!
//! A request out while the path is cut may never get its reply, with the connection up
//! all along; [`Asking`] probes beside a request that takes long and says when to give it
//! up.
//!
//! Probes are bounded: one out at a time, one sent per [`ProbePolicy::interval`] at most,
//! each given up after [`ProbePolicy::timeout`], and only while the follower has more
//! than an interval left to wait (a retry due sooner is its own probe).

use std::time::Duration;

use crate::error::ConfigError;
use crate::time::Time;

/// How often and how long a follower that backs off probes its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbePolicy {
    interval: Duration,
    timeout: Duration,
}

impl Default for ProbePolicy {
    /// A probe every 500 ms at most, each given up after 1 s: a source that stalls is
    /// asked about once a second, and one that comes back is noticed within about a
    /// second.
    fn default() -> Self {
        ProbePolicy {
            interval: Duration::from_millis(500),
            timeout: Duration::from_secs(1),
        }
    }
}

impl ProbePolicy {
    /// A validated policy: both durations positive.
    pub fn new(interval: Duration, timeout: Duration) -> Result<Self, ConfigError> {
        if interval.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "probe interval",
            });
        }
        if timeout.is_zero() {
            return Err(ConfigError::ZeroDuration {
                field: "probe timeout",
            });
        }
        Ok(ProbePolicy { interval, timeout })
    }

    /// The shortest time between the starts of two probes.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// How long a probe may go unanswered before it counts as missed.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// What a probe's outcome means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    /// Nothing to act on: the path answers as it did, or still does not.
    Nothing,
    /// The source answered after a probe went unanswered: the path stalled and is back
    /// (or the source, missing, was made again). Whatever waits out a backoff may be
    /// tried now.
    Resumed,
}

/// The probes of one follower: when to send one, and what each outcome means. Getters
/// and [`poll_probe`](Self::poll_probe) / [`poll_timeout`](Self::poll_timeout) tell the
/// driver what to do; [`handle_answer`](Self::handle_answer),
/// [`handle_missed`](Self::handle_missed) and [`reset`](Self::reset) report what happened.
///
/// The driver calls [`poll_probe`](Self::poll_probe) whenever its follower's state may
/// have changed, with the time the follower waits until (`None` when it is not backing
/// off); it sends a probe when told to, gives it up at the deadline it was given, and
/// wakes at [`poll_timeout`](Self::poll_timeout) to ask again.
#[derive(Clone, Debug)]
pub struct Probes {
    policy: ProbePolicy,
    /// The deadline of the probe that is out.
    out: Option<Time>,
    /// When the last probe was sent.
    sent: Option<Time>,
    /// A probe went unanswered since the last answer.
    missed: bool,
}

impl Probes {
    /// No probe out, none missed.
    #[must_use]
    pub fn new(policy: ProbePolicy) -> Self {
        Probes {
            policy,
            out: None,
            sent: None,
            missed: false,
        }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> ProbePolicy {
        self.policy
    }

    /// The deadline of the probe that is out, if one is.
    #[must_use]
    pub fn out(&self) -> Option<Time> {
        self.out
    }

    /// Whether a probe went unanswered since the last answer.
    #[must_use]
    pub fn missed(&self) -> bool {
        self.missed
    }

    /// Whether to send a probe at `now`, for a follower that waits until `retry_at`
    /// (`None`: it is not backing off). `Some(deadline)`: send one and give it up at
    /// `deadline` ([`handle_missed`](Self::handle_missed)); it counts as out from now.
    ///
    /// A follower that no longer backs off has what it needed: a probe out is forgotten
    /// (the driver drops it), and so is a probe missed before, since a retry that
    /// succeeded says more than any probe.
    #[must_use]
    pub fn poll_probe(&mut self, now: Time, retry_at: Option<Time>) -> Option<Time> {
        let Some(retry_at) = retry_at else {
            self.reset();
            return None;
        };
        if self.out.is_some() || self.due(now, retry_at) != Some(now) {
            return None;
        }
        let deadline = now.saturating_add(self.policy.timeout);
        self.out = Some(deadline);
        self.sent = Some(now);
        Some(deadline)
    }

    /// When the next probe may be sent (`now` at the earliest), for a follower that
    /// waits until `retry_at`: `None` while one is out (its deadline is the driver's to
    /// keep), or when the retry is due within an interval of that time anyway. At the
    /// time it returns, [`poll_probe`](Self::poll_probe) with the same `retry_at` sends
    /// one: a driver that wakes then never finds nothing to do.
    #[must_use]
    pub fn poll_timeout(&self, now: Time, retry_at: Option<Time>) -> Option<Time> {
        if self.out.is_some() {
            return None;
        }
        self.due(now, retry_at?)
    }

    fn due(&self, now: Time, retry_at: Time) -> Option<Time> {
        let paced = self
            .sent
            .map_or(now, |s| s.saturating_add(self.policy.interval));
        let due = paced.max(now);
        (retry_at.saturating_since(due) > self.policy.interval).then_some(due)
    }

    /// The probe that was out was answered at `now` (whatever the server said: an answer
    /// shows the path works). [`Probed::Resumed`] if one went unanswered before it.
    #[must_use]
    pub fn handle_answer(&mut self, _now: Time) -> Probed {
        if self.out.take().is_none() {
            return Probed::Nothing;
        }
        if std::mem::take(&mut self.missed) {
            Probed::Resumed
        } else {
            Probed::Nothing
        }
    }

    /// The probe that was out failed at `now`, or reached its deadline unanswered (the
    /// driver gives it up). The next answer will mean the path is back.
    pub fn handle_missed(&mut self, _now: Time) {
        if self.out.take().is_some() {
            self.missed = true;
        }
    }

    /// Forgets the probe out and any missed: the path is known to be back another way (a
    /// reconnect, a retry that got through). The pacing of sends is kept.
    pub fn reset(&mut self) {
        self.out = None;
        self.missed = false;
    }
}

/// The probes of one request while it is out, and when to give it up: what a driver asks
/// beside a request that takes long.
///
/// A request sent while the path to the source was cut (a server node cut off from its
/// cluster, a stream with no leader) may get no reply at all, and the connection stays
/// up, so no reconnect abandons it: it would wait out the client's whole request timeout
/// (10 s on NATS) after the source is back. So once a request has been out for a probe
/// interval, the driver probes the source beside it; when a probe that went unanswered
/// (or found the source missing) is followed by an answer, the path is back
/// ([`Probed::Resumed`]), and a request still out a grace of one more probe interval
/// later is given up ([`cut_due`](Self::cut_due)): its reply, if one was ever coming,
/// would have come with the answers. A request that is only slow, with the source
/// answering probes throughout, is never cut — unless it is [`single`](Self::single).
///
/// A request of one round trip (a lookup, a feed's open, a read of one key) can be lost
/// with the path answering throughout: sent to a cluster node that died or lost its
/// lead a moment later, while the new leader answers the probes. Such a request still
/// out after [`SINGLE_ANSWERS`] probes were answered beside it, each a round trip of its
/// own, is given up the same grace later. A request whose reply is a long read (a
/// reconcile, a snapshot, a listing) is never cut that way: it may be slow for good
/// reasons, and cutting it would read it again from the start.
#[derive(Clone, Debug)]
pub struct Asking {
    probes: Probes,
    /// When the request went out.
    asked_at: Time,
    /// When the path came back with the request still out.
    back_at: Option<Time>,
    /// A request of one round trip: cut once enough probes were answered beside it.
    single: bool,
    /// Probes answered while the request was out.
    answered: u32,
}

/// How many probes answered beside a request of one round trip ([`Asking::single`])
/// show its reply is not coming: with the default policy, about 2 s after it was sent
/// (probes from 500 ms, one each 500 ms, and the grace), where the client's own timeout
/// is 10 s.
pub const SINGLE_ANSWERS: u32 = 3;

impl Asking {
    /// A request sent at `now`, probed by `policy`.
    #[must_use]
    pub fn new(policy: ProbePolicy, now: Time) -> Self {
        Asking {
            probes: Probes::new(policy),
            asked_at: now,
            back_at: None,
            single: false,
            answered: 0,
        }
    }

    /// A request of one round trip sent at `now`, probed by `policy`: also given up once
    /// [`SINGLE_ANSWERS`] probes were answered beside it.
    #[must_use]
    pub fn single(policy: ProbePolicy, now: Time) -> Self {
        Asking {
            single: true,
            ..Asking::new(policy, now)
        }
    }

    /// When the path came back with the request still out, if it did.
    #[must_use]
    pub fn back_at(&self) -> Option<Time> {
        self.back_at
    }

    /// Whether to send a probe at `now`: `Some(deadline)` as
    /// [`Probes::poll_probe`] gives it. None before the request has been out an interval,
    /// none while one is out, and none once the path is known to be back.
    #[must_use]
    pub fn poll_probe(&mut self, now: Time) -> Option<Time> {
        if self.back_at.is_some() || now < self.first_probe() {
            return None;
        }
        self.probes.poll_probe(now, Some(self.horizon(now)))
    }

    /// When the driver must wake next for this request (a probe due, or the cut due);
    /// `None` while a probe is out and nothing else is due (its deadline is the driver's
    /// to keep). At the time it returns, [`poll_probe`](Self::poll_probe) sends a probe or
    /// [`cut_due`](Self::cut_due) holds.
    #[must_use]
    pub fn poll_timeout(&self, now: Time) -> Option<Time> {
        if let Some(back) = self.back_at {
            return Some(self.cut_at(back).max(now));
        }
        let now = now.max(self.first_probe());
        self.probes.poll_timeout(now, Some(self.horizon(now)))
    }

    /// Whether the request, still out at `now`, is to be given up: the path came back a
    /// grace of one probe interval ago.
    #[must_use]
    pub fn cut_due(&self, now: Time) -> bool {
        self.back_at.is_some_and(|back| now >= self.cut_at(back))
    }

    /// The probe out was answered at `now` and the source is there.
    pub fn handle_answer(&mut self, now: Time) {
        let was_out = self.probes.out().is_some();
        let resumed = self.probes.handle_answer(now) == Probed::Resumed;
        if was_out {
            self.answered = self.answered.saturating_add(1);
        }
        let lost = self.single && self.answered >= SINGLE_ANSWERS;
        if (resumed || lost) && self.back_at.is_none() {
            self.back_at = Some(now);
        }
    }

    /// The probe out failed at `now`, or reached its deadline unanswered.
    pub fn handle_missed(&mut self, now: Time) {
        self.probes.handle_missed(now);
    }

    fn first_probe(&self) -> Time {
        self.asked_at
            .saturating_add(self.probes.policy().interval())
    }

    fn cut_at(&self, back: Time) -> Time {
        back.saturating_add(self.probes.policy().interval())
    }

    /// A retry time far enough off that [`Probes`] paces sends by the interval alone.
    fn horizon(&self, now: Time) -> Time {
        now.saturating_add(self.probes.policy().interval() * 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    fn at(ms: u64) -> Time {
        Time::ZERO.saturating_add(MS * u32::try_from(ms).unwrap())
    }

    #[test]
    fn an_answer_after_a_missed_probe_resumes_once() {
        let mut p = Probes::new(ProbePolicy::default());
        let retry_at = Some(at(20_000));
        let deadline = p
            .poll_probe(at(0), retry_at)
            .expect("a long wait is probed");
        assert_eq!(deadline, at(1_000));
        assert_eq!(
            p.poll_probe(at(10), retry_at),
            None,
            "one probe out at a time"
        );
        p.handle_missed(deadline);
        assert!(p.missed());
        let deadline = p.poll_probe(at(1_000), retry_at).expect("the next is due");
        assert_eq!(p.handle_answer(at(1_100)), Probed::Resumed);
        let _ = deadline;
        assert!(p.poll_probe(at(1_500), retry_at).is_some());
        assert_eq!(
            p.handle_answer(at(1_501)),
            Probed::Nothing,
            "the path was already back: one resume a stall"
        );
    }

    #[test]
    fn answers_with_none_missed_never_resume() {
        // A follower that backs off for a refused request: the server answers every
        // probe, and probing must not cut that backoff short.
        let mut p = Probes::new(ProbePolicy::default());
        let retry_at = Some(at(30_000));
        let mut now = at(0);
        while let Some(due) = p.poll_timeout(now, retry_at) {
            now = due;
            assert!(p.poll_probe(now, retry_at).is_some());
            assert_eq!(p.handle_answer(now), Probed::Nothing);
        }
        assert!(now <= at(30_000));
    }

    #[test]
    fn a_retry_due_within_an_interval_is_not_probed() {
        let mut p = Probes::new(ProbePolicy::default());
        assert_eq!(p.poll_probe(at(0), Some(at(400))), None);
        assert_eq!(p.poll_timeout(at(0), Some(at(400))), None);
        assert_eq!(p.poll_probe(at(0), None), None, "not backing off");
    }

    #[test]
    fn leaving_the_backoff_forgets_a_missed_probe() {
        let mut p = Probes::new(ProbePolicy::default());
        let retry_at = Some(at(20_000));
        assert!(p.poll_probe(at(0), retry_at).is_some());
        p.handle_missed(at(1_000));
        assert_eq!(p.poll_probe(at(1_200), None), None);
        assert!(
            !p.missed(),
            "a retry that got through says the path is back"
        );
        assert!(p.poll_probe(at(2_000), retry_at).is_some());
        assert_eq!(p.handle_answer(at(2_010)), Probed::Nothing);
    }

    #[test]
    fn a_late_answer_to_a_probe_given_up_is_ignored() {
        let mut p = Probes::new(ProbePolicy::default());
        assert!(p.poll_probe(at(0), Some(at(20_000))).is_some());
        p.handle_missed(at(1_000));
        assert_eq!(p.handle_answer(at(1_001)), Probed::Nothing);
        assert!(p.missed(), "the next probe's answer is the one that counts");
    }

    #[test]
    fn a_due_time_past_is_never_one_with_nothing_to_send() {
        // Woken late, with the retry now within an interval: no due time in the past
        // (a driver would wake at once, find nothing to send, and spin).
        let mut p = Probes::new(ProbePolicy::default());
        let retry_at = Some(at(2_000));
        assert!(p.poll_probe(at(0), retry_at).is_some());
        assert_eq!(p.handle_answer(at(10)), Probed::Nothing);
        assert_eq!(p.poll_timeout(at(10), retry_at), Some(at(500)));
        assert_eq!(p.poll_timeout(at(1_600), retry_at), None);
        assert_eq!(p.poll_probe(at(1_600), retry_at), None);
    }

    #[test]
    fn a_quick_request_is_never_probed() {
        let mut a = Asking::new(ProbePolicy::default(), at(1_000));
        assert_eq!(a.poll_probe(at(1_000)), None);
        assert_eq!(a.poll_probe(at(1_499)), None);
        assert_eq!(a.poll_timeout(at(1_000)), Some(at(1_500)));
        assert!(a.poll_probe(at(1_500)).is_some(), "out an interval: probed");
    }

    #[test]
    fn a_request_out_across_a_stall_is_cut_a_grace_after_the_path_is_back() {
        let mut a = Asking::new(ProbePolicy::default(), at(0));
        assert_eq!(a.poll_probe(at(500)), Some(at(1_500)));
        a.handle_missed(at(1_500));
        assert!(a.poll_probe(at(1_500)).is_some());
        a.handle_answer(at(1_600));
        assert_eq!(a.back_at(), Some(at(1_600)));
        assert!(
            !a.cut_due(at(2_000)),
            "the grace: a reply held up by the stall comes now"
        );
        assert_eq!(a.poll_probe(at(2_000)), None, "nothing more to learn");
        assert_eq!(a.poll_timeout(at(2_000)), Some(at(2_100)));
        assert!(a.cut_due(at(2_100)));
    }

    #[test]
    fn a_slow_request_with_the_source_answering_is_never_cut() {
        let mut a = Asking::new(ProbePolicy::default(), at(0));
        let mut now = at(0);
        for _ in 0..100 {
            let due = a.poll_timeout(now).expect("probed while out");
            now = due;
            assert!(a.poll_probe(now).is_some());
            a.handle_answer(now.saturating_add(MS));
            assert!(!a.cut_due(now));
        }
        assert_eq!(a.back_at(), None);
    }

    #[test]
    fn a_request_of_one_round_trip_is_cut_once_probes_answered_beside_it() {
        // Sent to a node that lost its lead a moment later; the new leader answers.
        let mut a = Asking::single(ProbePolicy::default(), at(0));
        let mut now = at(0);
        for n in 1..=SINGLE_ANSWERS {
            now = a.poll_timeout(now).expect("probed while out");
            assert!(a.poll_probe(now).is_some());
            a.handle_answer(now.saturating_add(MS));
            assert_eq!(
                a.back_at().is_some(),
                n == SINGLE_ANSWERS,
                "given up after {SINGLE_ANSWERS} answers, not {n}"
            );
        }
        assert_eq!(a.back_at(), Some(at(1_501)));
        assert!(!a.cut_due(at(1_600)), "the grace");
        assert!(a.cut_due(at(2_001)), "about 2 s after it was sent");
    }

    #[test]
    fn a_late_answer_to_a_probe_given_up_does_not_count_towards_a_single_requests_cut() {
        let mut a = Asking::single(ProbePolicy::default(), at(0));
        for _ in 0..5 {
            a.handle_answer(at(600));
        }
        assert_eq!(a.back_at(), None, "no probe was out: nothing was answered");
    }

    proptest! {
        /// Whenever a due time is given, asking at that time (or later, with the due time
        /// asked again) sends a probe: the driver is never woken for nothing.
        #[test]
        fn a_due_time_always_sends(
            steps in proptest::collection::vec((0u64..3_000, any::<bool>(), 0u64..40_000), 1..100)
        ) {
            let mut p = Probes::new(ProbePolicy::default());
            let mut now = at(0);
            for (advance, answered, wait) in steps {
                now = now.saturating_add(MS * u32::try_from(advance).unwrap());
                let retry_at = Some(now.saturating_add(MS * u32::try_from(wait).unwrap()));
                if let Some(due) = p.poll_timeout(now, retry_at) {
                    prop_assert!(due >= now, "a due time in the past");
                    prop_assert!(p.poll_probe(due, retry_at).is_some(), "woken for nothing at {due:?}");
                    now = due;
                    if answered {
                        let _ = p.handle_answer(now);
                    } else {
                        p.handle_missed(now);
                    }
                }
            }
        }

        /// Whatever the outcomes, probes are paced: no two sends closer than the
        /// interval, never two out at once, none when the retry is within an interval,
        /// and a resume only after a miss.
        #[test]
        fn probes_stay_paced_and_resume_only_after_a_miss(
            steps in proptest::collection::vec((0u64..3_000, 0u8..4, 0u64..40_000), 1..200)
        ) {
            let policy = ProbePolicy::default();
            let mut p = Probes::new(policy);
            let mut now = at(0);
            let mut last_sent: Option<Time> = None;
            let mut missed_since_answer = false;
            for (advance, outcome, wait) in steps {
                now = now.saturating_add(MS * u32::try_from(advance).unwrap());
                let retry_at = (outcome != 3).then(|| now.saturating_add(MS * u32::try_from(wait).unwrap()));
                let was_out = p.out().is_some();
                if let Some(deadline) = p.poll_probe(now, retry_at) {
                    prop_assert!(!was_out, "two probes out at once");
                    prop_assert_eq!(deadline, now.saturating_add(policy.timeout()));
                    let retry_at = retry_at.unwrap();
                    prop_assert!(retry_at.saturating_since(now) > policy.interval());
                    if let Some(last) = last_sent {
                        prop_assert!(now.saturating_since(last) >= policy.interval());
                    }
                    last_sent = Some(now);
                }
                if retry_at.is_none() {
                    missed_since_answer = false;
                }
                if p.out().is_some() {
                    match outcome {
                        0 => {
                            p.handle_missed(now);
                            missed_since_answer = true;
                        }
                        1 => {
                            let resumed = p.handle_answer(now) == Probed::Resumed;
                            prop_assert_eq!(resumed, missed_since_answer);
                            missed_since_answer = false;
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}
