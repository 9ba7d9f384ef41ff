//! The sweeps' ledger: what the sweepers did, checked on the source host as each call
//! is served ([`crate::hosts::sweeps`] tells it).
//!
//! What it checks:
//! - two owners never hold the sweeper lock at once (a grant while another owner's lease
//!   is live and not released);
//! - a sweep never removes history younger than the policy's `keep`, from the change log
//!   or the events stream (after a restore, the seqs above the backup's head are young
//!   again: the new history reuses them);
//! - a sweep never removes events a durable cursor still needs unless the policy's
//!   `max_age` forces them out (then the cursor is counted as forced; the memory adapter
//!   passes over records retention dropped, and its follower finds what it missed by
//!   reconciling, which the oracle checks at every step);
//! - a sweep never removes an outbox row the relays have not finished;
//! - every tick claimed for its job gets one `sweep` job, and none gets two.
//!
//! What the memory adapter cannot promise is not checked: it does not see a persisted
//! follower's watermark (that lives in the follower's own store), so change-log history
//! older than `keep` may go while such a follower still needs it; that follower then
//! resyncs, and the oracle checks that it converges. A sweep served after its owner's lease
//! ran out (a request held on the wire past its lease) is counted, not failed, as long as
//! nobody took the lock since: its fence is still the newest. A sweep served under a fence
//! older than the newest grant (two sweepers sweeping at once) fails the ledger; the
//! source host's sweep refuses such fences (`MemorySweep::fenced_by` the host's lock).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::{LockLease, Swept};

use crate::scenario::{POLICY, SWEEP_EVERY};

/// What the source host saw around one sweep.
pub(crate) struct SweepSeen<'a> {
    pub(crate) by: &'a str,
    pub(crate) now: Duration,
    pub(crate) watermark: u64,
    pub(crate) first_log: u64,
    pub(crate) events_head: u64,
    pub(crate) cursors: BTreeMap<String, u64>,
    /// Outbox rows pending before the sweep and gone after it.
    pub(crate) lost: Vec<u64>,
    pub(crate) swept: Swept,
    /// The fencing token the sweep ran under.
    pub(crate) fencing: u64,
}

#[derive(Debug)]
struct Hold {
    owner: String,
    until: Duration,
    released: bool,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Grants of the sweeper lock by fencing token.
    holds: BTreeMap<u64, Hold>,
    /// (when, change-log head, events head) at each sweep, as the sweep's own marks.
    marks: Vec<(Duration, u64, u64)>,
    /// The first events position kept after the last sweep.
    first_event: u64,
    violations: Vec<String>,
    sweeps: u32,
    /// Sweeps served after their owner's lease had run out.
    late: u32,
    /// Grants after another owner's lease ran out unreleased (a crashed sweeper's).
    takeovers: u32,
    /// Rows removed: (change log, events, outbox).
    removed: (u64, u64, u64),
    /// Durable cursors the maximum age forced past.
    forced: BTreeSet<String>,
    /// A sweeper crash armed, with the host's time down.
    crash_armed: Option<Duration>,
    /// A scheduler crash armed: after the enqueue (or right after the claim), and the
    /// host's time down.
    scheduler_armed: Option<(bool, Duration)>,
    /// The scheduler host to crash now, with its time down: the source host serves it
    /// nothing more until it restarted.
    doomed: Option<(String, Duration)>,
    /// A sweeper stall armed, with how long it lasts.
    stall_armed: Option<Duration>,
    /// Ticks claimed for their job, and `sweep` jobs enqueued (by key or not).
    claimed_for_job: u64,
    tick_jobs: u64,
}

/// What the sweepers did, checked as the source host serves them.
#[derive(Clone, Debug, Default)]
pub struct SweepLedger {
    inner: Arc<Mutex<LedgerState>>,
    cursors: Arc<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first position to keep if everything at least `age` old went: one past the
/// newest mark's head at or before `now - age` (1 when there is none).
fn older_than(marks: &[(Duration, u64)], now: Duration, age: Duration) -> u64 {
    marks
        .iter()
        .filter(|(at, _)| now.checked_sub(age).is_some_and(|t| *at <= t))
        .map(|(_, head)| head + 1)
        .max()
        .unwrap_or(1)
}

impl SweepLedger {
    /// A ledger that checks the events of the durable consumers named in `cursors` are
    /// kept (up to the maximum age).
    #[must_use]
    pub fn watching(cursors: Vec<String>) -> Self {
        SweepLedger {
            inner: Arc::default(),
            cursors: Arc::new(cursors),
        }
    }

    /// The durable consumers whose events the sweeps must keep.
    pub(crate) fn cursors(&self) -> &[String] {
        &self.cursors
    }

    /// Whether the scheduler crash armed falls on `by` now (`after_enqueue`: the moment
    /// after a tick's job was enqueued; otherwise, right after a tick's claim): if so, `by`
    /// is doomed, and the source host serves it nothing more until it restarted.
    pub(crate) fn doom_if_armed(&self, by: &str, after_enqueue: bool) -> bool {
        let mut s = lock(&self.inner);
        match s.scheduler_armed {
            Some((after, down)) if after == after_enqueue => {
                s.scheduler_armed = None;
                s.doomed = Some((by.to_owned(), down));
                true
            }
            _ => false,
        }
    }

    pub(crate) fn granted(&self, lease: &LockLease, now: Duration, until: Duration) {
        let mut s = lock(&self.inner);
        let mut found = Vec::new();
        let mut takeover = false;
        for (fencing, h) in &s.holds {
            if *fencing == lease.fencing || h.released || h.owner == lease.owner {
                continue;
            }
            if h.until > now {
                found.push(format!(
                    "{} got the sweeper lock (fencing {}) at {now:?} while {} held it (fencing {fencing}) until {:?}",
                    lease.owner, lease.fencing, h.owner, h.until
                ));
            } else {
                takeover = true;
            }
        }
        // Only the newest grant matters from here on.
        s.holds.retain(|f, _| *f >= lease.fencing);
        s.holds.insert(
            lease.fencing,
            Hold {
                owner: lease.owner.clone(),
                until,
                released: false,
            },
        );
        s.takeovers += u32::from(takeover);
        s.violations.extend(found);
    }

    pub(crate) fn renewed(&self, lease: &LockLease, until: Duration) {
        if let Some(h) = lock(&self.inner).holds.get_mut(&lease.fencing) {
            h.until = until;
        }
    }

    pub(crate) fn released(&self, lease: &LockLease) {
        if let Some(h) = lock(&self.inner).holds.get_mut(&lease.fencing) {
            h.released = true;
        }
    }

    /// The source was restored to a backup whose head is `head`: the seqs above it are
    /// reused by the new history's changes, younger than any mark taken before. A mark
    /// vouches from now on only for the seqs the backup kept, as the sweep's own marks do;
    /// left as they were, the marks let a sweep cut the new history's young changes unseen.
    pub fn restored(&self, head: u64) {
        for mark in &mut lock(&self.inner).marks {
            mark.1 = mark.1.min(head);
        }
    }

    pub(crate) fn check_sweep(&self, seen: &SweepSeen<'_>) {
        let mut s = lock(&self.inner);
        let now = seen.now;
        s.sweeps += 1;
        let held = s
            .holds
            .values()
            .any(|h| h.owner == seen.by && !h.released && h.until > now);
        s.late += u32::from(!held);
        let newest = s.holds.keys().next_back().copied();
        if let Some(newest) = newest.filter(|&n| n > seen.fencing) {
            s.violations.push(format!(
                "a sweep by {} at {now:?} ran under fencing {} while the sweeper lock was granted again (fencing {newest}): two sweeps at once",
                seen.by, seen.fencing
            ));
        }
        s.marks.push((now, seen.watermark, seen.events_head));
        let log: Vec<(Duration, u64)> = s.marks.iter().map(|m| (m.0, m.1)).collect();
        let events: Vec<(Duration, u64)> = s.marks.iter().map(|m| (m.0, m.2)).collect();
        let mut found = Vec::new();
        let kept_log = older_than(&log, now, POLICY.keep).max(seen.first_log);
        if seen.swept.first_available > kept_log {
            found.push(format!(
                "a sweep by {} at {now:?} cut the change log to {} where history younger than {:?} starts at {kept_log}",
                seen.by, seen.swept.first_available, POLICY.keep
            ));
        }
        let before = s.first_event.max(1);
        let kept_events = older_than(&events, now, POLICY.keep).max(before);
        if seen.swept.first_event > kept_events {
            found.push(format!(
                "a sweep by {} at {now:?} cut the events stream to {} where records younger than {:?} start at {kept_events}",
                seen.by, seen.swept.first_event, POLICY.keep
            ));
        }
        let forced = POLICY
            .max_age
            .map_or(1, |age| older_than(&events, now, age));
        for (name, at) in &seen.cursors {
            if seen.swept.first_event > at + 1 {
                if seen.swept.first_event > forced.max(before) {
                    found.push(format!(
                        "a sweep by {} at {now:?} cut the events stream to {} past durable cursor {name} at {at}, with no maximum age forcing it (forced up to {forced})",
                        seen.by, seen.swept.first_event
                    ));
                } else {
                    s.forced.insert(name.clone());
                }
            }
        }
        if !seen.lost.is_empty() {
            found.push(format!(
                "a sweep by {} at {now:?} removed outbox rows the relays had not finished: {:?}",
                seen.by, seen.lost
            ));
        }
        s.first_event = s.first_event.max(seen.swept.first_event);
        s.removed.0 += seen.swept.log_rows;
        s.removed.1 += seen.swept.events;
        s.removed.2 += seen.swept.outbox_rows;
        // The policy's marks reach back at most its maximum age, and one before it: the
        // newest mark older than that still vouches that its history is old. Dropping it
        // too forgot what an earlier sweep had proven, and history a restore put back
        // was taken for young (seed 85219939: a mark at 4.39s showed the change log up to
        // 56, the restore at 17.03s put back 45..56, and the ledger then said history
        // younger than 2s started at 45 when the sweep at 17.84s cut it again).
        if let Some(age) = POLICY.max_age
            && let Some(cut) = now.checked_sub(age + SWEEP_EVERY * 4)
        {
            let newest_old = s.marks.iter().map(|m| m.0).filter(|&at| at < cut).max();
            s.marks.retain(|m| m.0 >= cut || Some(m.0) == newest_old);
        }
        s.violations.extend(found);
    }

    /// Arms a stall of the next worker host seen holding the sweeper lock, for `stall`.
    pub fn arm_stall(&self, stall: Duration) {
        lock(&self.inner).stall_armed = Some(stall);
    }

    /// The host holding the sweeper lock now, if a stall is armed (disarming it), with how
    /// long the stall lasts.
    #[must_use]
    pub fn stalled_holder(&self) -> Option<(String, Duration)> {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let stall = s.stall_armed?;
        let holder = s
            .holds
            .values()
            .find(|h| !h.released && h.until > now)?
            .owner
            .clone();
        s.stall_armed = None;
        Some((holder, stall))
    }

    /// Arms a crash of the next sweep scheduler that claims a tick for its job: right after
    /// the claim, or (`after_enqueue`) when it records the job enqueued; it comes back
    /// after `down`.
    pub fn arm_scheduler_crash(&self, after_enqueue: bool, down: Duration) {
        lock(&self.inner).scheduler_armed = Some((after_enqueue, down));
    }

    /// The scheduler host to crash now, if one is doomed, with its time down (taken: the
    /// world crashes it once).
    #[must_use]
    pub fn doomed_scheduler(&self) -> Option<(String, Duration)> {
        lock(&self.inner).doomed.take()
    }

    /// Whether `host` is a scheduler doomed to crash (served nothing more).
    pub(crate) fn is_doomed(&self, host: Option<&str>) -> bool {
        let s = lock(&self.inner);
        host.is_some_and(|h| s.doomed.as_ref().is_some_and(|(d, _)| d == h))
    }

    /// A tick was claimed for its job: every tick claimed before must have its job by now
    /// (a scheduler enqueues a pending tick's job before it claims a newer one).
    pub(crate) fn claimed_for_job(&self, by: &str, tick: u64) {
        let mut s = lock(&self.inner);
        if s.tick_jobs < s.claimed_for_job {
            let (claimed, jobs) = (s.claimed_for_job, s.tick_jobs);
            s.violations.push(format!(
                "{by} claimed tick {tick} while {} of {claimed} ticks claimed for their job had none: a tick never fired",
                claimed - jobs
            ));
        }
        s.claimed_for_job += 1;
    }

    /// A `sweep` job was enqueued for a tick (by the source host's queue): never more of
    /// them than ticks claimed for their job.
    pub fn tick_job_enqueued(&self, by: Option<&str>) {
        let mut s = lock(&self.inner);
        s.tick_jobs += 1;
        if s.tick_jobs > s.claimed_for_job {
            let (claimed, jobs) = (s.claimed_for_job, s.tick_jobs);
            s.violations.push(format!(
                "{jobs} sweep jobs enqueued for {claimed} ticks claimed for their job (the last by {}): a tick fired twice",
                by.unwrap_or("?")
            ));
        }
    }

    /// Arms a crash of the next worker host seen holding the sweeper lock; it comes back
    /// after `down`.
    pub fn arm_crash(&self, down: Duration) {
        lock(&self.inner).crash_armed = Some(down);
    }

    /// The host holding the sweeper lock now, if a crash is armed (disarming it), with its
    /// time down.
    #[must_use]
    pub fn armed_holder(&self) -> Option<(String, Duration)> {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let down = s.crash_armed?;
        let holder = s
            .holds
            .values()
            .find(|h| !h.released && h.until > now)?
            .owner
            .clone();
        s.crash_armed = None;
        Some((holder, down))
    }

    /// Violations found so far.
    #[must_use]
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner).violations.clone()
    }

    /// Whether `owner` holds the sweeper lock now (its lease live and not released).
    #[must_use]
    pub fn holding(&self, owner: &str) -> bool {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        lock(&self.inner)
            .holds
            .values()
            .any(|h| h.owner == owner && !h.released && h.until > now)
    }

    /// What the sweepers did (finished jobs removed are the job ledger's to count).
    #[must_use]
    pub fn counts(&self) -> SweepCounts {
        let s = lock(&self.inner);
        SweepCounts {
            sweeps: s.sweeps,
            late: s.late,
            takeovers: s.takeovers,
            removed: s.removed,
            jobs_removed: 0,
            forced: u32::try_from(s.forced.len()).unwrap_or(u32::MAX),
        }
    }
}

/// What the sweepers did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepCounts {
    /// Sweeps served.
    pub sweeps: u32,
    /// Sweeps served after their owner's lease ran out (a request held past it).
    pub late: u32,
    /// Lock grants after another owner's lease ran out unreleased.
    pub takeovers: u32,
    /// Rows removed: (change log, events, outbox).
    pub removed: (u64, u64, u64),
    /// Finished jobs removed.
    pub jobs_removed: u64,
    /// Durable cursors the maximum age forced past.
    pub forced: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(owner: &str, fencing: u64) -> LockLease {
        LockLease {
            name: "tidemark.sweep".into(),
            owner: owner.into(),
            fencing,
        }
    }

    #[test]
    fn a_grant_while_another_owner_holds_a_live_lease_is_a_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.granted(&lease("relay-1", 2), s(1), s(3));
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("relay-0") && v[0].contains("relay-1"),
            "{v:?}"
        );
    }

    #[test]
    fn a_grant_after_a_lease_ran_out_or_was_released_is_no_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.granted(&lease("relay-1", 2), s(3), s(5));
        ledger.released(&lease("relay-1", 2));
        ledger.granted(&lease("relay-0", 3), s(4), s(6));
        assert!(ledger.violations().is_empty());
        assert_eq!(ledger.counts().takeovers, 1);
    }

    fn seen(now: u64, swept: Swept, cursors: &[(&str, u64)]) -> SweepSeen<'static> {
        SweepSeen {
            by: "relay-0",
            now: Duration::from_secs(now),
            watermark: now * 10,
            first_log: 1,
            events_head: now * 10,
            cursors: cursors.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect(),
            lost: Vec::new(),
            swept,
            fencing: 0,
        }
    }

    #[test]
    fn a_sweep_under_a_fence_older_than_the_newest_grant_is_a_violation() {
        let ledger = SweepLedger::default();
        let s = Duration::from_secs;
        ledger.granted(&lease("relay-0", 1), s(0), s(2));
        ledger.check_sweep(&SweepSeen {
            fencing: 1,
            ..seen(1, Swept::default(), &[])
        });
        assert!(ledger.violations().is_empty(), "the holder sweeps");
        ledger.granted(&lease("relay-1", 2), s(3), s(5));
        ledger.check_sweep(&SweepSeen {
            fencing: 1,
            ..seen(4, Swept::default(), &[])
        });
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("two sweeps at once"), "{v:?}");
    }

    #[test]
    fn a_sweep_that_cuts_history_younger_than_keep_or_a_cursors_events_is_a_violation() {
        let ledger = SweepLedger::default();
        // Marks at 0..=4 s, ten writes and ten records a second.
        for t in 0..4 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        assert!(ledger.violations().is_empty());
        // At 4 s, what was written by 2 s (head 20) may go: from 21 on stays.
        let fine = Swept {
            first_available: 21,
            first_event: 11,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(4, fine, &[("follower-2", 10)]));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // At 5 s only what was written by 3 s (head 30) may go.
        let young = Swept {
            first_available: 41,
            first_event: 11,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(5, young, &[("follower-2", 10)]));
        let cursor = Swept {
            first_available: 21,
            first_event: 21,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(6, cursor, &[("follower-2", 10)]));
        let v = ledger.violations();
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("change log"), "{v:?}");
        assert!(v[1].contains("follower-2"), "{v:?}");
    }

    #[test]
    fn history_a_sweep_long_ago_proved_old_may_go_again_after_a_restore_put_it_back() {
        // Seed 85219939: a sweep at 3 s saw the change log up to 56; the next came 13 s
        // later, past the marks' reach, and cut to 57; a restore then put back 45..56.
        let ledger = SweepLedger::default();
        let at = |now: u64, first_log: u64, first_available: u64| SweepSeen {
            watermark: if now < 5 { 56 } else { 118 },
            first_log,
            events_head: 0,
            ..seen(
                now,
                Swept {
                    first_available,
                    ..Swept::default()
                },
                &[],
            )
        };
        ledger.check_sweep(&at(3, 45, 45));
        ledger.check_sweep(&at(16, 45, 57));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // After the restore the log starts at 45 again: 45..56 are 14 s old, not young.
        ledger.check_sweep(&at(17, 45, 57));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // The old mark vouches for nothing newer: cutting past 56 is still caught.
        ledger.check_sweep(&at(17, 45, 58));
        assert_eq!(ledger.violations().len(), 1, "{:?}", ledger.violations());
    }

    #[test]
    fn a_sweep_that_cuts_the_seqs_a_restore_gave_back_to_young_changes_is_a_violation() {
        // Marks at 0..=3 s (ten writes a second), a restore at 3.5 s to a backup at 15,
        // and the new history written on from 16 to 25 by 5 s: the old marks vouch for
        // 15 at most, so a sweep at 5 s may cut below 16 but no further.
        let ledger = SweepLedger::default();
        for t in 0..4 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        ledger.restored(15);
        let at = |first_available: u64| SweepSeen {
            watermark: 25,
            events_head: 0,
            ..seen(
                5,
                Swept {
                    first_available,
                    ..Swept::default()
                },
                &[],
            )
        };
        ledger.check_sweep(&at(16));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        // 16..25 were written after the restore, within the last 2 s.
        ledger.check_sweep(&at(26));
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("change log to 26"), "{v:?}");
    }

    #[test]
    fn events_a_cursor_needs_may_go_once_the_maximum_age_forces_them() {
        let ledger = SweepLedger::default();
        for t in 0..12 {
            ledger.check_sweep(&seen(t, Swept::default(), &[]));
        }
        // At 12 s, records up to the 4 s mark (head 40) are 8 s old.
        let forced = Swept {
            first_available: 41,
            first_event: 41,
            ..Swept::default()
        };
        ledger.check_sweep(&seen(12, forced, &[("follower-2", 10)]));
        assert!(ledger.violations().is_empty(), "{:?}", ledger.violations());
        assert_eq!(ledger.counts().forced, 1);
    }
}
