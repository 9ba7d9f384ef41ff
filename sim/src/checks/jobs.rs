//! The job runners' ledger: what they did, checked as they do it. No job runs on two
//! runners whose leases overlapped, and finished-job retention removes only what it may.
//! The source host's queue tells it of leases, renewals, acks and removals as it serves
//! them ([`crate::hosts::queue`]); a runner's handler tells it of each run it starts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::tidemark_core::JobId;
use tidemark::{JobRecord, JobRetention, JobState};

/// One handler run of a job, as the ledger saw it.
#[derive(Clone, Debug)]
struct Run {
    runner: String,
    started: Duration,
    ended: Option<Duration>,
    slow: bool,
}

#[derive(Debug, Default)]
struct JobEntry {
    /// Lease expiry by attempt, as the queue last granted or renewed it.
    leases: BTreeMap<u32, (String, Duration)>,
    /// Handler runs by attempt.
    runs: BTreeMap<u32, Run>,
}

#[derive(Debug, Default)]
struct LedgerState {
    jobs: BTreeMap<JobId, JobEntry>,
    /// When each job was acked, as the queue answered it.
    done_at: BTreeMap<JobId, Duration>,
    /// Finished jobs retention removed.
    removed: u64,
    violations: Vec<String>,
    takeovers: u32,
    renewals: u32,
    slow_redelivered: u32,
}

/// What the job runners did, checked as they do it: a handler that starts while another
/// runner's run of the same job still holds an unexpired lease is a violation (the lease
/// is the queue's promise of exclusivity, and a runner whose lease is lost must stop).
/// A start after another run's lease ran out is a takeover, counted and by design.
#[derive(Clone, Debug, Default)]
pub struct JobLedger {
    inner: Arc<Mutex<LedgerState>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl JobLedger {
    pub(crate) fn leased(&self, id: JobId, attempt: u32, by: &str, until: Duration) {
        let mut s = lock(&self.inner);
        s.jobs
            .entry(id)
            .or_default()
            .leases
            .insert(attempt, (by.to_owned(), until));
    }

    pub(crate) fn renewed(&self, id: JobId, attempt: u32, until: Duration) {
        let mut s = lock(&self.inner);
        s.renewals += 1;
        if let Some(l) = s.jobs.entry(id).or_default().leases.get_mut(&attempt) {
            l.1 = until;
        }
    }

    pub(crate) fn started(&self, id: JobId, attempt: u32, runner: &str, slow: bool) {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        let entry = s.jobs.entry(id).or_default();
        let mut found = Vec::new();
        let mut takeover = false;
        for (other, run) in &entry.runs {
            if *other == attempt || run.ended.is_some() {
                continue;
            }
            let until = entry.leases.get(other).map_or(Duration::ZERO, |l| l.1);
            if until > now {
                found.push(format!(
                    "job {id} attempt {attempt} started on {runner} at {now:?} while attempt {other} ran on {} since {:?} under a lease until {until:?}",
                    run.runner, run.started
                ));
            } else {
                takeover = true;
            }
        }
        let slow_taken = takeover && entry.runs.values().any(|r| r.slow && r.ended.is_none());
        entry.runs.insert(
            attempt,
            Run {
                runner: runner.to_owned(),
                started: now,
                ended: None,
                slow,
            },
        );
        s.takeovers += u32::from(takeover);
        s.slow_redelivered += u32::from(slow_taken);
        s.violations.extend(found);
    }

    pub(crate) fn ended(&self, id: JobId, attempt: u32) {
        let now = turmoil::sim_elapsed().unwrap_or_default();
        let mut s = lock(&self.inner);
        if let Some(run) = s.jobs.get_mut(&id).and_then(|e| e.runs.get_mut(&attempt)) {
            run.ended = Some(now);
        }
    }

    pub(crate) fn acked(&self, id: JobId, now: Duration) {
        lock(&self.inner).done_at.entry(id).or_insert(now);
    }

    /// Checks what finished-job retention removed: only jobs done at least `retention`'s
    /// `done` age ago, and dead letters only past its `dead` age.
    pub(crate) fn removed(
        &self,
        gone: &[JobRecord],
        retention: JobRetention,
        now: Duration,
        n: u64,
    ) {
        let mut s = lock(&self.inner);
        s.removed += n;
        let mut found = Vec::new();
        for r in gone {
            let ok = match r.state {
                JobState::Done => s
                    .done_at
                    .get(&r.id)
                    .is_some_and(|at| now.saturating_sub(*at) >= retention.done),
                // The queue's own dead-letter time is not seen here: only a retention that
                // never removes dead letters is checked exactly.
                JobState::DeadLettered => retention.dead.is_some(),
                _ => false,
            };
            if !ok {
                found.push(format!(
                    "job retention ({retention:?}) removed job {} ({:?}, acked at {:?}) at {now:?}",
                    r.id,
                    r.state,
                    s.done_at.get(&r.id)
                ));
            }
        }
        s.violations.extend(found);
    }

    /// Finished jobs removed by retention so far.
    #[must_use]
    pub fn jobs_removed(&self) -> u64 {
        lock(&self.inner).removed
    }

    /// Violations found so far.
    #[must_use]
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner).violations.clone()
    }

    /// (jobs handled at least once, runs started after another run's lease ran out,
    /// lease renewals, slow jobs delivered again while their first run went on).
    #[must_use]
    pub fn counts(&self) -> (u32, u32, u32, u32) {
        let s = lock(&self.inner);
        let handled = s.jobs.values().filter(|e| !e.runs.is_empty()).count();
        (
            u32::try_from(handled).unwrap_or(u32::MAX),
            s.takeovers,
            s.renewals,
            s.slow_redelivered,
        )
    }

    /// Whether a run of some job is going on on `runner` now.
    #[must_use]
    pub fn running_on(&self, runner: &str) -> bool {
        lock(&self.inner).jobs.values().any(|e| {
            e.runs
                .values()
                .any(|r| r.runner == runner && r.ended.is_none())
        })
    }
}

/// Marks a run ended when the handler's future ends or is dropped (its lease lost, its
/// host crashed).
pub(crate) struct RunGuard {
    pub(crate) ledger: JobLedger,
    pub(crate) id: JobId,
    pub(crate) attempt: u32,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.ledger.ended(self.id, self.attempt);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_started_while_another_runner_holds_a_live_lease_on_it_is_a_violation() {
        let ledger = JobLedger::default();
        let id = JobId(7);
        ledger.leased(id, 1, "relay-0", Duration::from_secs(2));
        ledger.started(id, 1, "relay-0", false);
        // A queue that handed the job out again under that lease.
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        let v = ledger.violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("relay-0") && v[0].contains("relay-1"),
            "{v:?}"
        );
    }

    #[test]
    fn a_job_started_after_the_other_runs_lease_ran_out_is_a_takeover_not_a_violation() {
        let ledger = JobLedger::default();
        let id = JobId(7);
        // Outside a simulation the clock reads zero: a lease until zero has run out.
        ledger.leased(id, 1, "relay-0", Duration::ZERO);
        ledger.started(id, 1, "relay-0", true);
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        assert!(ledger.violations().is_empty());
        assert_eq!(ledger.counts(), (1, 1, 0, 1));
        assert!(ledger.running_on("relay-0") && ledger.running_on("relay-1"));
    }

    #[test]
    fn a_run_whose_handler_is_dropped_has_ended() {
        let ledger = JobLedger::default();
        let id = JobId(3);
        ledger.leased(id, 1, "relay-0", Duration::from_secs(2));
        ledger.started(id, 1, "relay-0", false);
        drop(RunGuard {
            ledger: ledger.clone(),
            id,
            attempt: 1,
        });
        assert!(!ledger.running_on("relay-0"));
        // Ended: a later attempt on another runner is no overlap, whatever the lease said.
        ledger.leased(id, 2, "relay-1", Duration::from_secs(2));
        ledger.started(id, 2, "relay-1", false);
        assert!(ledger.violations().is_empty());
    }
}
