//! Durable schedules on a KV bucket: each tick claimed by a revision compare-and-set,
//! anchors and "now" by the server's clock.

use std::time::Duration;

use async_nats::jetstream::kv;
use futures::TryStreamExt as _;
use serde::{Deserialize, Serialize};
use tidemark::tidemark_core::{Job, Schedule, ScheduleClock};
use tidemark::{DueSchedule, Result, ScheduleStore};

use crate::coord::{self, live, server_now};
use crate::error::unavailable;

const PORT: &str = "schedule";

/// The default bucket of [`NatsSchedules::open`].
pub const DEFAULT_SCHEDULE_BUCKET: &str = "tidemark_schedules";

/// What a schedule's key holds.
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cron: Option<String>,
    job: serde_json::Value,
    /// When it was stored, by the server's clock (ns since the unix epoch).
    anchor_ns: u64,
    last_fired: Option<u64>,
    /// The last fired tick while its job is not known to be enqueued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pending: Option<u64>,
}

impl Stored {
    fn schedule(&self) -> std::result::Result<Schedule, String> {
        let job = serde_json::to_vec(&self.job)
            .ok()
            .and_then(|b| Job::decode(&b).ok())
            .ok_or_else(|| format!("unreadable job {}", self.job))?;
        match (&self.cron, self.interval_ns) {
            (Some(expr), _) => Schedule::cron(self.name.clone(), expr, job),
            (None, Some(ns)) => Schedule::new(self.name.clone(), Duration::from_nanos(ns), job),
            (None, None) => return Err("neither an interval nor a cron expression".into()),
        }
        .map_err(|e| e.to_string())
    }
}

/// Durable named schedules (intervals and cron expressions) on a NATS KV bucket, shared by
/// every process that talks to the server.
///
/// The store's clock is the server's: a schedule's anchor is the server's time when it
/// was stored and "now" is the server's time of a write made for the purpose, so runners
/// on machines whose clocks disagree still agree on which tick is due. Firing a tick is a
/// compare-and-set on the key's revision: of several runners exactly one wins it, and a
/// replaced schedule (a new revision) cannot be fired with the old one's tick.
#[derive(Clone, Debug)]
pub struct NatsSchedules {
    store: kv::Store,
}

impl NatsSchedules {
    /// Opens (creating if absent) the schedule bucket `bucket` with `replicas` copies.
    ///
    /// # Errors
    /// [`tidemark::Error::InvalidKey`] for a bad bucket name;
    /// [`tidemark::Error::Unavailable`] if the server cannot open or create it.
    pub async fn open(client: async_nats::Client, bucket: &str, replicas: usize) -> Result<Self> {
        Ok(NatsSchedules {
            store: coord::bucket(client, bucket, replicas, PORT).await?,
        })
    }

    async fn read(&self, key: &str) -> Result<Option<(u64, Stored)>> {
        let Some(entry) = live(&self.store, key, PORT).await? else {
            return Ok(None);
        };
        match serde_json::from_slice::<Stored>(&entry.value) {
            Ok(stored) => Ok(Some((entry.revision, stored))),
            Err(e) => {
                tracing::warn!(key, error = %e, "skipping an unreadable schedule");
                Ok(None)
            }
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl ScheduleStore for NatsSchedules {
    async fn put_schedule(&self, schedule: Schedule) -> Result<()> {
        let job = schedule
            .job()
            .encode()
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| unavailable(PORT, "the job cannot be encoded"))?;
        let now = server_now(&self.store, PORT).await?;
        let stored = Stored {
            name: schedule.name().to_owned(),
            interval_ns: schedule.interval().map(nanos),
            cron: schedule.cron_expr().map(str::to_owned),
            job,
            anchor_ns: nanos(now),
            last_fired: None,
            pending: None,
        };
        let value = serde_json::to_vec(&stored).map_err(|e| unavailable(PORT, e))?;
        self.store
            .put(coord::key("schedule", schedule.name()), value.into())
            .await
            .map_err(|e| unavailable(PORT, e))?;
        Ok(())
    }

    async fn remove_schedule(&self, name: &str) -> Result<bool> {
        let key = coord::key("schedule", name);
        if live(&self.store, &key, PORT).await?.is_none() {
            return Ok(false);
        }
        self.store
            .purge(&key)
            .await
            .map_err(|e| unavailable(PORT, e))?;
        Ok(true)
    }

    async fn schedules(&self) -> Result<Vec<DueSchedule>> {
        let now = server_now(&self.store, PORT).await?;
        // The stream's subject list, one request: a key-listing consumer can end early
        // while other runners write the clock key of the same bucket.
        let prefix = self.store.prefix.clone();
        let mut keys: Vec<String> = self
            .store
            .stream
            .info_with_subjects(format!("{prefix}schedule.>"))
            .await
            .map_err(|e| unavailable(PORT, e))?
            .map_ok(|(subject, _)| subject.strip_prefix(&prefix).unwrap_or(&subject).to_owned())
            .try_collect()
            .await
            .map_err(|e| unavailable(PORT, e))?;
        keys.sort_unstable();
        let mut out = Vec::new();
        for key in keys {
            let Some((_, stored)) = self.read(&key).await? else {
                continue;
            };
            match stored.schedule() {
                Ok(schedule) => out.push(DueSchedule {
                    schedule,
                    last_fired: stored.last_fired,
                    pending: stored.pending,
                    clock: ScheduleClock {
                        anchor: Duration::from_nanos(stored.anchor_ns),
                        now,
                    },
                }),
                Err(reason) => {
                    tracing::warn!(
                        schedule = stored.name,
                        reason,
                        "skipping an unreadable schedule"
                    );
                }
            }
        }
        out.sort_by(|a, b| a.schedule.name().cmp(b.schedule.name()));
        Ok(out)
    }

    async fn mark_fired(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.fire(read, tick, false).await
    }

    async fn claim_for_job(&self, read: &DueSchedule, tick: u64) -> Result<bool> {
        self.fire(read, tick, true).await
    }

    async fn job_enqueued(&self, name: &str, tick: u64) -> Result<()> {
        let key = coord::key("schedule", name);
        // A lost compare-and-set means the schedule moved on (another settle, a claim, a
        // replacement): look again, a few times.
        for _ in 0..4 {
            let Some((revision, stored)) = self.read(&key).await? else {
                return Ok(());
            };
            if stored.pending != Some(tick) {
                return Ok(());
            }
            let settled = Stored {
                pending: None,
                ..stored
            };
            let value = serde_json::to_vec(&settled).map_err(|e| unavailable(PORT, e))?;
            match self.store.update(&key, value.into(), revision).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                Err(e) => return Err(unavailable(PORT, e)),
            }
        }
        Err(unavailable(
            PORT,
            "the schedule kept changing while its tick was settled",
        ))
    }
}

impl NatsSchedules {
    /// The compare-and-set of the last fired tick; `for_job` records it as pending too.
    async fn fire(&self, read: &DueSchedule, tick: u64, for_job: bool) -> Result<bool> {
        let key = coord::key("schedule", read.schedule.name());
        let Some((revision, stored)) = self.read(&key).await? else {
            return Ok(false);
        };
        // Still the schedule as read: a replacement has a new anchor (and maybe another
        // interval or job), and its last fired tick reset.
        if stored.last_fired != read.last_fired
            || stored.anchor_ns != nanos(read.clock.anchor)
            || stored.schedule().as_ref() != Ok(&read.schedule)
        {
            return Ok(false);
        }
        let fired = Stored {
            last_fired: Some(tick),
            pending: if for_job { Some(tick) } else { stored.pending },
            ..stored
        };
        let value = serde_json::to_vec(&fired).map_err(|e| unavailable(PORT, e))?;
        match self.store.update(&key, value.into(), revision).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(e) => Err(unavailable(PORT, e)),
        }
    }
}
