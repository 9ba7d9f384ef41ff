//! In-process durable schedules.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tidemark::tidemark_core::{Schedule, ScheduleClock};
use tidemark::{DueSchedule, Result, ScheduleStore};
use tokio::time::Instant;

use crate::clock::Now;
use crate::faults::{Faults, Port};

#[derive(Debug)]
struct Stored {
    schedule: Schedule,
    anchor: Duration,
    last_fired: Option<u64>,
    pending: Option<u64>,
}

/// In-process schedules. The store's clock, the one every runner in the process shares,
/// is tokio's (so paused time drives it), placed on the calendar (for cron expressions) at
/// the wall-clock time the store was made, or at an origin given in.
#[derive(Clone, Debug)]
pub struct MemorySchedules {
    state: Arc<Mutex<BTreeMap<String, Stored>>>,
    faults: Faults,
    /// Tokio's instant that stands for `calendar` since the unix epoch.
    origin: Instant,
    calendar: Duration,
    clock: Now,
}

impl Default for MemorySchedules {
    fn default() -> Self {
        MemorySchedules::new(Faults::default())
    }
}

impl MemorySchedules {
    /// No schedules; calls consult `faults`. Cron expressions are read on the wall-clock
    /// calendar of now.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        let calendar = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        MemorySchedules::with_calendar(faults, calendar)
    }

    /// No schedules; tokio's now stands for `calendar` (time since the unix epoch), so a
    /// simulation or a test reads cron expressions on a calendar of its choosing.
    #[must_use]
    pub fn with_calendar(faults: Faults, calendar: Duration) -> Self {
        MemorySchedules {
            state: Arc::default(),
            faults,
            origin: Instant::now(),
            calendar,
            clock: Now::default(),
        }
    }

    /// No schedules; `clock` instead of tokio's, its now at this call standing for
    /// `calendar` (a simulator's clock, which outlives the runtimes of hosts that restart).
    #[must_use]
    pub fn with_clock(
        faults: Faults,
        calendar: Duration,
        clock: impl Fn() -> Instant + Send + Sync + 'static,
    ) -> Self {
        let clock = Now::given(clock);
        MemorySchedules {
            state: Arc::default(),
            faults,
            origin: clock.now(),
            calendar,
            clock,
        }
    }

    /// Now on the store's calendar.
    fn now(&self) -> Duration {
        self.calendar + self.clock.now().saturating_duration_since(self.origin)
    }

    fn state(&self) -> MutexGuard<'_, BTreeMap<String, Stored>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ScheduleStore for MemorySchedules {
    async fn put_schedule(&self, schedule: Schedule) -> Result<()> {
        self.faults.check(Port::Schedule)?;
        self.state().insert(
            schedule.name().to_owned(),
            Stored {
                schedule,
                anchor: self.now(),
                last_fired: None,
                pending: None,
            },
        );
        Ok(())
    }

    async fn remove_schedule(&self, name: &str) -> Result<bool> {
        self.faults.check(Port::Schedule)?;
        Ok(self.state().remove(name).is_some())
    }

    async fn schedules(&self) -> Result<Vec<DueSchedule>> {
        self.faults.check(Port::Schedule)?;
        let now = self.now();
        Ok(self
            .state()
            .values()
            .map(|s| DueSchedule {
                schedule: s.schedule.clone(),
                last_fired: s.last_fired,
                pending: s.pending,
                clock: ScheduleClock {
                    anchor: s.anchor,
                    now,
                },
            })
            .collect())
    }

    async fn mark_fired(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.fire(read, tick, false)
    }

    async fn claim_for_job(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.fire(read, tick, true)
    }

    async fn job_enqueued(&self, name: &str, tick: u64) -> Result<()> {
        self.faults.check(Port::Schedule)?;
        if let Some(stored) = self.state().get_mut(name)
            && stored.pending == Some(tick)
        {
            stored.pending = None;
        }
        Ok(())
    }
}

impl MemorySchedules {
    /// The compare-and-set of the last fired tick; `for_job` records it as pending too.
    fn fire(&self, read: &DueSchedule, tick: u64, for_job: bool) -> Result<bool> {
        self.faults.check(Port::Schedule)?;
        let mut s = self.state();
        match s.get_mut(read.schedule.name()) {
            Some(stored)
                if stored.last_fired == read.last_fired
                    && stored.anchor == read.clock.anchor
                    && stored.schedule == read.schedule =>
            {
                stored.last_fired = Some(tick);
                if for_job {
                    stored.pending = Some(tick);
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
