//! In-process durable schedules.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::tidemark_core::Schedule;
use tidemark::{DueSchedule, Result, ScheduleStore};
use tokio::time::Instant;

use crate::faults::{Faults, Port};

#[derive(Debug)]
struct Stored {
    schedule: Schedule,
    anchor: Instant,
    last_fired: Option<u64>,
}

/// In-process schedules; the store's clock (tokio's) is the one every runner shares.
#[derive(Clone, Debug, Default)]
pub struct MemorySchedules {
    state: Arc<Mutex<BTreeMap<String, Stored>>>,
    faults: Faults,
}

impl MemorySchedules {
    /// No schedules; calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemorySchedules {
            state: Arc::default(),
            faults,
        }
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
                anchor: Instant::now(),
                last_fired: None,
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
        let now = Instant::now();
        Ok(self
            .state()
            .values()
            .map(|s| DueSchedule {
                schedule: s.schedule.clone(),
                last_fired: s.last_fired,
                since_anchor: now.saturating_duration_since(s.anchor),
            })
            .collect())
    }

    async fn mark_fired(&self, name: &str, expected: Option<u64>, tick: u64) -> Result<bool> {
        self.faults.check(Port::Schedule)?;
        let mut s = self.state();
        match s.get_mut(name) {
            Some(stored) if stored.last_fired == expected => {
                stored.last_fired = Some(tick);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
