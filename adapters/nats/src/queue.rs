//! Maintenance jobs on a JetStream work-queue stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::{AckPolicy, Consumer, pull};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::{self, RawMessageErrorKind, RetentionPolicy};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tidemark::instant_after;
use tidemark::tidemark_core::{Job, JobId};
use tidemark::{
    Error, JobCounts, JobRecord, JobRetention, JobState, Leased, Queue, Result, TickKey,
};
use tidemark_jetstream::job_delivery::{CLAIM_ATTEMPTS, Delivery, Recorded, delivery};
use tidemark_jetstream::{
    Coalesce, Found, KeyWrite, Named, ScanEnd, ScanStep, TickJob, TickRecord, coalesce, tick_job,
    tick_of_message_id,
};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::error::{check_name, unavailable};

/// How long a scan of the state bucket waits for its next entry before it reads the
/// bucket's newest message again: the one it waits for may have been removed. Never the
/// end of a scan by itself, so a short wait costs a read, not a short listing.
const SCAN_CONFIRM_AFTER: Duration = Duration::from_millis(200);

/// How long a lease waits for a job before answering "none ready".
const LEASE_WAIT: Duration = Duration::from_millis(300);

/// Jobs on a work-queue stream `<name>` (subject `tidemark.jobs.<name>`) consumed by the
/// durable pull consumer `workers`; each job's state (attempts, last error, done or
/// dead-lettered) in the KV bucket `<name>_state`.
///
/// A lease is the consumer's ack wait (set to the requested visibility); an expired lease
/// is redelivered by the server. The ack wait belongs to the consumer, which every worker
/// on the queue shares: use one visibility per queue, because a lease asked with another
/// one changes the ack wait of every lease still outstanding. `fail` naks with the retry
/// delay, or terminates the message and dead-letters the job once `max_attempts` are used
/// up, keeping its last error. The job id is the stream sequence of its message. A lease can be acked, renewed
/// or failed only by the process (the `NatsQueue` handle and its clones) that took it;
/// leases it took and never finished are forgotten once their ack wait has passed
/// (counted from before the lease was asked for, so never after the server's), and an
/// ack, fail or dead letter of a forgotten lease is [`Error::LeaseLost`], whether or not
/// the server has redelivered the job yet.
///
/// `renew` sends the server an in-progress ack, which restarts the ack wait (the
/// consumer's, whatever visibility is asked). Done and dead-lettered jobs keep their state
/// key, with the time they finished, until [`Queue::remove_finished`] purges it (the
/// key's messages are purged from the bucket's stream, leaving no delete marker behind).
/// A `pack_housekeeping` job waiting to be leased is named by a `pending.<key in hex>`
/// entry in the state bucket, written once the job is published: a later enqueue for the
/// key finds it and returns that job's id (coalescing) if the job's state, read after the
/// key, says it was never leased; the lease purges the key before the handler runs. A
/// runner can lease the job before its key is written, so a key may name a job already
/// leased or finished: the next enqueue for the key then publishes a new job and replaces
/// the key by compare-and-set ([`tidemark_jetstream::coalesce()`]). Sweeps are not leased
/// ahead of other jobs here (one consumer, in stream order).
///
/// Listing dead letters, counting and retention read the state bucket in one streamed pass
/// (the last value of each key): their cost grows with the jobs retention keeps, but not
/// by a round trip per job. The pass ends once the bucket's newest message, read again
/// after everything up to it was delivered, is no newer ([`ScanEnd`]); it holds every
/// job that existed throughout it, as of some moment during it. A requeued dead letter is
/// published again under a new id, and its old state key is purged.
#[derive(Clone)]
pub struct NatsQueue {
    inner: Arc<Inner>,
}

struct Inner {
    context: jetstream::Context,
    subject: String,
    consumer: Mutex<(Consumer<pull::Config>, Duration)>,
    state: kv::Store,
    /// The state bucket's stream, for purges that leave no marker.
    state_stream: stream::Stream,
    state_prefix: String,
    max_attempts: u32,
    leases: Mutex<HashMap<u64, Held>>,
    /// Holds a write of a job's state until the test lets it go: the unit tests' way to
    /// put another runner's write between a decision and its write.
    #[cfg(test)]
    gate: tests::Gate,
}

/// A lease this process took: its attempt, its message, and until when it holds.
struct Held {
    attempt: u32,
    message: jetstream::Message,
    until: Instant,
}

impl std::fmt::Debug for NatsQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsQueue")
            .field("subject", &self.inner.subject)
            .field("max_attempts", &self.inner.max_attempts)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct Stored {
    job: Job,
    state: Stage,
    attempts: u32,
    last_error: Option<String>,
    /// When it was done or dead-lettered, unix ms (absent in state written before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    finished_ms: Option<u64>,
}

/// Now, unix ms: retention ages are wall-clock, as the server's own are.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Stored {
    /// The bytes kept in the state bucket.
    fn encode(&self) -> Result<Bytes> {
        serde_json::to_vec(self)
            .map(Bytes::from)
            .map_err(|e| unavailable("queue", e))
    }
}

#[derive(Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Stage {
    Ready,
    Leased,
    Done,
    Dead,
}

fn consumer_config(ack_wait: Duration) -> pull::Config {
    pull::Config {
        durable_name: Some("workers".into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        // Attempts are counted here, so a job past its last lease is dead-lettered with
        // its last error rather than parked by the server.
        max_deliver: -1,
        ..Default::default()
    }
}

impl NatsQueue {
    /// Opens (creating if needed) the queue `name`, dead-lettering jobs after
    /// `max_attempts` leases.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a bad name; [`Error::Unavailable`] if the server cannot
    /// create the stream, consumer or state bucket.
    pub async fn open(client: Client, name: &str, max_attempts: u32) -> Result<NatsQueue> {
        check_name(name)?;
        let context = jetstream::new(client);
        let subject = format!("tidemark.jobs.{name}");
        let stream = context
            .get_or_create_stream(stream::Config {
                name: name.to_owned(),
                subjects: vec![subject.clone()],
                retention: RetentionPolicy::WorkQueue,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable("queue", e))?;
        let ack_wait = Duration::from_secs(30);
        let consumer = stream
            .get_or_create_consumer("workers", consumer_config(ack_wait))
            .await
            .map_err(|e| unavailable("queue", e))?;
        let bucket = format!("{name}_state");
        let state = match context.get_key_value(bucket.clone()).await {
            Ok(s) => s,
            Err(_) => context
                .create_key_value(kv::Config {
                    bucket,
                    history: 1,
                    ..Default::default()
                })
                .await
                .map_err(|e| unavailable("queue", e))?,
        };
        let state_stream = context
            .get_stream(format!("KV_{name}_state"))
            .await
            .map_err(|e| unavailable("queue", e))?;
        Ok(NatsQueue {
            inner: Arc::new(Inner {
                context,
                subject,
                consumer: Mutex::new((consumer, ack_wait)),
                state,
                state_stream,
                state_prefix: format!("$KV.{name}_state."),
                max_attempts: max_attempts.max(1),
                leases: Mutex::new(HashMap::new()),
                #[cfg(test)]
                gate: tests::Gate::default(),
            }),
        })
    }

    /// For a job message of a schedule's tick (see [`tick_job`]): `Some(job)` when `job`
    /// is the tick's and this one (`id`) is a second; `None` when this one runs — it was
    /// the tick's already, it claimed the tick by compare-and-set on the schedule's record,
    /// or it is not a tick's job at all.
    async fn tick_taken(&self, message: &jetstream::Message, id: u64) -> Result<Option<u64>> {
        let Some((key, anchor_ms, tick)) = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .and_then(|v| tick_of_message_id(v.as_str()))
        else {
            return Ok(None);
        };
        for _ in 0..TICK_CLAIM_ATTEMPTS {
            let entry = self
                .inner
                .state
                .entry(key)
                .await
                .map_err(|e| unavailable("queue", e))?;
            let record = tick_mark(entry.as_ref()).map(|m| m.record());
            match tick_job(record, anchor_ms, tick, id) {
                TickJob::Run => return Ok(None),
                TickJob::Duplicate { of } => return Ok(Some(of)),
                TickJob::Claim => {}
            }
            let mark = serde_json::to_vec(&TickMark {
                anchor_ms,
                tick,
                job: Some(id),
            })
            .map_err(|e| unavailable("queue", e))?;
            let write = KeyWrite::of(entry.map(|e| e.revision));
            if self.compare_and_put(key, mark.into(), write).await? {
                return Ok(None);
            }
        }
        Err(unavailable(
            "queue",
            "a schedule's tick record kept changing while a runner claimed its tick",
        ))
    }

    async fn load(&self, id: u64) -> Result<Option<Stored>> {
        self.load_bytes(id)
            .await?
            .map(|bytes| decode_state(id, &bytes))
            .transpose()
    }

    async fn load_bytes(&self, id: u64) -> Result<Option<Bytes>> {
        self.inner
            .state
            .get(id.to_string())
            .await
            .map_err(|e| unavailable("queue", e))
    }

    async fn store(&self, id: u64, stored: &Stored) -> Result<()> {
        self.inner
            .state
            .put(id.to_string(), stored.encode()?)
            .await
            .map_err(|e| unavailable("queue", e))?;
        Ok(())
    }

    /// The message of a lease this handle still holds, with the write that records its
    /// end only if no other runner's lease came first; or [`Error::LeaseLost`].
    async fn held(&self, lease: &Leased) -> Result<(jetstream::Message, KeyWrite)> {
        let mut leases = self.inner.leases.lock().await;
        Self::forget_expired(&mut leases, Instant::now());
        match leases.get(&lease.id.0) {
            Some(held) if held.attempt == lease.attempt => {}
            _ => {
                return Err(Error::LeaseLost(format!(
                    "{} attempt {}",
                    lease.id, lease.attempt
                )));
            }
        }
        let (stored, write) = self.state_for_write(lease.id.0).await?;
        if !stored.is_some_and(|s| s.state == Stage::Leased && s.attempts == lease.attempt) {
            leases.remove(&lease.id.0);
            return Err(Error::LeaseLost(format!(
                "{} attempt {}",
                lease.id, lease.attempt
            )));
        }
        leases
            .remove(&lease.id.0)
            .map(|held| (held.message, write))
            .ok_or_else(|| Error::LeaseLost(lease.id.to_string()))
    }

    /// Records the end (or retry) of a lease held, by compare-and-set on the state
    /// [`held`](Self::held) read: a runner that leased the job since (its lease expired
    /// while this one finished) makes it [`Error::LeaseLost`], and the job is that
    /// runner's.
    async fn record_held(&self, lease: &Leased, write: KeyWrite, stored: &Stored) -> Result<()> {
        if self.write_state(lease.id.0, write, stored).await? {
            Ok(())
        } else {
            Err(Error::LeaseLost(format!(
                "{} attempt {}: leased again meanwhile",
                lease.id, lease.attempt
            )))
        }
    }

    /// Every job's state, in id order: one pass over the state bucket's stream (the last
    /// message of each key, streamed by one consumer), not a request per key. [`ScanEnd`]
    /// says when the pass is complete; a job whose state moved on during the pass is
    /// delivered again and listed as last delivered.
    async fn scan(&self) -> Result<Vec<(u64, Stored)>> {
        Ok(self
            .scan_stamped()
            .await?
            .into_iter()
            .map(|(id, stored, _)| (id, stored))
            .collect())
    }

    /// [`scan`](Self::scan), with when the server stored each job's state.
    async fn scan_stamped(&self) -> Result<Vec<(u64, Stored, u64)>> {
        let mut end = ScanEnd::new();
        if end.confirmed(self.newest_state().await?) == ScanStep::Done {
            return Ok(Vec::new());
        }
        let mut entries = self
            .inner
            .state
            .watch_with_history(">")
            .await
            .map_err(|e| unavailable("queue", e))?;
        // Each key's last delivered message.
        let mut latest: HashMap<String, Latest> = HashMap::new();
        loop {
            match end.step() {
                ScanStep::Done => break,
                ScanStep::Confirm => {
                    end.confirmed(self.newest_state().await?);
                }
                ScanStep::ReadOn => {
                    match tokio::time::timeout(SCAN_CONFIRM_AFTER, entries.next()).await {
                        Ok(Some(entry)) => {
                            let entry = entry.map_err(|e| unavailable("queue", e))?;
                            end.delivered(entry.revision);
                            keep_latest(&mut latest, entry);
                        }
                        Ok(None) => {
                            return Err(unavailable("queue", "the state bucket's watch ended"));
                        }
                        Err(_) => {
                            end.idle();
                        }
                    }
                }
            }
        }
        let mut out = Vec::new();
        for (key, last) in latest {
            let Some(value) = last.value else { continue };
            if key.starts_with(PENDING) || key.starts_with(TICKS) {
                continue;
            }
            match key.parse::<u64>() {
                Ok(id) => match decode_state(id, &value) {
                    Ok(stored) => out.push((id, stored, last.stored_ns)),
                    Err(e) => warn!(id, error = %e, "unreadable job state; left alone"),
                },
                Err(_) => warn!(key, "state key that names no job; left alone"),
            }
        }
        out.sort_unstable_by_key(|(id, _, _)| *id);
        Ok(out)
    }

    /// The stream sequence of the newest message the state bucket holds now, from the
    /// stream leader (not the stream info's last sequence, which may name a message since
    /// purged, nor a direct get a lagging replica may answer).
    async fn newest_state(&self) -> Result<Option<u64>> {
        let filter = format!("{}>", self.inner.state_prefix);
        let last = crate::kv::last_present(&self.inner.state_stream, &filter, "queue").await?;
        Ok(match last {
            tidemark_jetstream::LastPresent::At(seq) => Some(seq),
            tidemark_jetstream::LastPresent::None => None,
        })
    }

    /// Removes a job's state key with its history, leaving no delete marker.
    async fn purge(&self, id: u64) -> Result<()> {
        self.inner
            .state_stream
            .purge()
            .filter(format!("{}{id}", self.inner.state_prefix))
            .await
            .map_err(|e| unavailable("queue", e))?;
        Ok(())
    }

    /// Forgets leases whose ack wait has passed: the server has redelivered their jobs.
    fn forget_expired(leases: &mut HashMap<u64, Held>, now: Instant) {
        leases.retain(|_, held| held.until > now);
    }
}

/// The state key that names the pending (ready, never leased) job of a coalesce key: the
/// key's bytes in hex, so any key makes a valid KV key.
fn pending_key(coalesce: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(PENDING.len() + coalesce.len() * 2);
    out.push_str(PENDING);
    for b in coalesce.bytes() {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The prefix of pending-job keys in the state bucket (job ids are bare numbers).
const PENDING: &str = "pending.";

/// The prefix of the keys that hold each schedule's newest enqueued tick.
const TICKS: &str = "tick.";

/// How many compare-and-sets a runner tries on a schedule's tick record before it gives
/// the lease up for now: each loss means a scheduler or runner wrote the record meanwhile.
const TICK_CLAIM_ATTEMPTS: usize = 8;

/// A schedule's name in hex: any name makes a valid KV key and message id.
fn hex(name: &str) -> String {
    use std::fmt::Write as _;
    name.bytes()
        .fold(String::with_capacity(name.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// A schedule's newest enqueued tick, as the state bucket keeps it, with the job that is
/// the tick's once known (absent from records written before it was kept).
#[derive(Serialize, Deserialize)]
struct TickMark {
    anchor_ms: u64,
    tick: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    job: Option<u64>,
}

impl TickMark {
    fn record(&self) -> TickRecord {
        TickRecord {
            anchor_ms: self.anchor_ms,
            tick: self.tick,
            job: self.job,
        }
    }
}

/// The tick a record entry of the state bucket holds (`None`: none, or a removal).
fn tick_mark(entry: Option<&kv::Entry>) -> Option<TickMark> {
    entry
        .filter(|e| e.operation == kv::Operation::Put)
        .and_then(|e| serde_json::from_slice::<TickMark>(&e.value).ok())
}

/// Keeps `entry` as its key's state if it is newer than the one kept: a scan may deliver
/// a key twice, before and after it moved on.
fn keep_latest(latest: &mut HashMap<String, Latest>, entry: kv::Entry) {
    if latest
        .get(&entry.key)
        .is_some_and(|l| l.revision >= entry.revision)
    {
        return;
    }
    let value = (entry.operation == kv::Operation::Put).then_some(entry.value);
    let stored_ns = u64::try_from(entry.created.unix_timestamp_nanos()).unwrap_or(0);
    latest.insert(
        entry.key,
        Latest {
            revision: entry.revision,
            value,
            stored_ns,
        },
    );
}

/// A state key's last message delivered to a scan: its revision, its value if a put, and
/// when the server stored it.
struct Latest {
    revision: u64,
    value: Option<Bytes>,
    stored_ns: u64,
}

/// What deciding a delivery needs of a job's state.
fn recorded(stage: Stage) -> Recorded {
    match stage {
        Stage::Ready => Recorded::Ready,
        Stage::Leased => Recorded::Leased,
        Stage::Done | Stage::Dead => Recorded::Ended,
    }
}

/// A job's state as the state stream's leader holds it: its bytes (`None`: no state, or a
/// marker) and the revision a compare-and-set names (`None`: no message under its key).
struct StateAt {
    bytes: Option<Bytes>,
    revision: Option<u64>,
}

/// What coalescing needs of a job's state.
fn named(stored: &Stored) -> Named {
    match stored.state {
        Stage::Ready => Named::Ready {
            attempts: stored.attempts,
        },
        Stage::Leased => Named::Leased,
        Stage::Done | Stage::Dead => Named::Finished,
    }
}

impl NatsQueue {
    /// What the pending key `key` holds: nothing, or the job it names with that job's
    /// state, read after the key.
    async fn find_pending(&self, key: &str) -> Result<Found> {
        let Some(entry) = self
            .inner
            .state
            .entry(key)
            .await
            .map_err(|e| unavailable("queue", e))?
        else {
            return Ok(Found::Nothing);
        };
        let revision = entry.revision;
        let job = (entry.operation == kv::Operation::Put)
            .then(|| std::str::from_utf8(&entry.value).ok()?.parse::<u64>().ok())
            .flatten();
        let Some(job) = job else {
            return Ok(Found::Unreadable { revision });
        };
        let state = self
            .load_from_leader(job)
            .await?
            .and_then(|bytes| decode_state(job, &bytes).ok())
            .map_or(Named::Missing, |stored| named(&stored));
        Ok(Found::Job {
            job,
            revision,
            state,
        })
    }

    /// A job's state bytes from the state stream's leader: a replica answering a direct
    /// get may not have the lease's "leased" yet, and coalescing rests on seeing it.
    async fn load_from_leader(&self, id: u64) -> Result<Option<Bytes>> {
        Ok(self.state_from_leader(id).await?.bytes)
    }

    /// A job's state bytes and the revision they are at, from the state stream's leader
    /// (a compare-and-set on a revision a lagging replica answered would only fail).
    async fn state_from_leader(&self, id: u64) -> Result<StateAt> {
        match self
            .inner
            .state_stream
            .raw_message_builder()
            .last_by_subject(format!("{}{id}", self.inner.state_prefix))
            .send()
            .await
        {
            // State keys are put and purged, never deleted; a marker is no state.
            Ok(message) if message.headers.get("KV-Operation").is_none() => Ok(StateAt {
                bytes: Some(message.payload),
                revision: Some(message.sequence),
            }),
            Ok(message) => Ok(StateAt {
                bytes: None,
                revision: Some(message.sequence),
            }),
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(StateAt {
                bytes: None,
                revision: None,
            }),
            Err(e) => Err(unavailable("queue", e)),
        }
    }

    /// Job `id`'s state, decoded, and the write that replaces it only if no other write
    /// came first ([`tidemark_jetstream::job_delivery`]).
    async fn state_for_write(&self, id: u64) -> Result<(Option<Stored>, KeyWrite)> {
        let at = self.state_from_leader(id).await?;
        let stored = at.bytes.map(|bytes| decode_state(id, &bytes)).transpose()?;
        Ok((stored, KeyWrite::of(at.revision)))
    }

    /// Writes job `id`'s state by compare-and-set on the state its writer decided from:
    /// `false` when another write (another runner's) came in between, and nothing was
    /// written.
    async fn write_state(&self, id: u64, write: KeyWrite, stored: &Stored) -> Result<bool> {
        #[cfg(test)]
        self.inner.gate.pass(id).await;
        self.compare_and_put(&id.to_string(), stored.encode()?, write)
            .await
    }

    /// Points the pending key at job `id`, just published. A failed compare-and-set
    /// means an enqueue or a lease changed the key meanwhile; the job runs all the same.
    async fn point_pending(&self, key: String, write: KeyWrite, id: u64) -> Result<()> {
        self.compare_and_put(&key, Bytes::from(id.to_string()), write)
            .await
            .map(drop)
    }

    /// Writes `value` under `key` of the state bucket by compare-and-set: `false` when
    /// another write came first ([`KeyWrite`]), and nothing was written.
    async fn compare_and_put(&self, key: &str, value: Bytes, write: KeyWrite) -> Result<bool> {
        match write {
            KeyWrite::Create => match self.inner.state.create(key, value).await {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(unavailable("queue", e)),
            },
            KeyWrite::Replace { revision } => {
                match self.inner.state.update(key, value, revision).await {
                    Ok(_) => Ok(true),
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
                    Err(e) => Err(unavailable("queue", e)),
                }
            }
        }
    }

    /// Ends the pending state of job `id` under its coalesce key before its handler runs,
    /// so an enqueue that found it pending is covered by this run; a later enqueue makes a
    /// new job. Only the key still naming `id` is removed.
    async fn unpend(&self, id: u64, job: &Job) -> Result<()> {
        let Some(coalesce) = job.coalesce_key() else {
            return Ok(());
        };
        let key = pending_key(&coalesce);
        let entry = self
            .inner
            .state
            .entry(key.as_str())
            .await
            .map_err(|e| unavailable("queue", e))?;
        if !entry.is_some_and(|e| {
            e.operation == kv::Operation::Put && e.value[..] == *id.to_string().as_bytes()
        }) {
            // It names another job now (or none), which stays as it is.
            return Ok(());
        }
        // Purged, not deleted: no marker is left behind, so the bucket's stream holds a
        // message per pending key and no more. Only this job's lease gets here; the key
        // can only have gone since, and a purge of an absent key changes nothing.
        self.inner
            .state_stream
            .purge()
            .filter(format!("{}{key}", self.inner.state_prefix))
            .await
            .map_err(|e| unavailable("queue", e))?;
        Ok(())
    }
}

impl Queue for NatsQueue {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        let mut pending = None;
        if let Some(key) = job.coalesce_key().map(|k| pending_key(&k)) {
            match coalesce(self.find_pending(&key).await?) {
                Coalesce::Absorb { job } => return Ok(JobId(job)),
                Coalesce::Publish { key: write } => pending = Some((key, write)),
            }
        }
        let payload = job.encode().map_err(|e| unavailable("queue", e))?;
        let ack = self
            .inner
            .context
            .publish(self.inner.subject.clone(), payload.into())
            .await
            .map_err(|e| unavailable("queue", e))?
            .await
            .map_err(|e| unavailable("queue", e))?;
        let stored = Stored {
            job,
            state: Stage::Ready,
            attempts: 0,
            last_error: None,
            finished_ms: None,
        };
        // Created, not put: a worker may already have leased the job and recorded that,
        // and "ready" must not overwrite it.
        match self
            .inner
            .state
            .create(ack.sequence.to_string(), stored.encode()?)
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(unavailable("queue", e)),
        }
        if let Some((key, write)) = pending {
            // Written after the job's state, so a key naming a job with no state names
            // one removed since.
            self.point_pending(key, write, ack.sequence).await?;
        }
        Ok(JobId(ack.sequence))
    }

    /// The tick's message carries `Nats-Msg-Id: tick.<name in hex>.<anchor ms>.<tick>`, so
    /// racing schedulers (and one that died after the publish, within the stream's
    /// duplicate window) publish one message; the schedule's newest tick is then recorded
    /// under `tick.<name in hex>` in the state bucket by compare-and-set.
    async fn enqueue_tick(&self, tick: &TickKey, job: Job) -> Result<Option<JobId>> {
        let name = hex(&tick.schedule);
        let key = format!("{TICKS}{name}");
        let entry = self
            .inner
            .state
            .entry(key.as_str())
            .await
            .map_err(|e| unavailable("queue", e))?;
        let anchor_ms = u64::try_from(tick.anchor.as_millis()).unwrap_or(u64::MAX);
        let enqueued =
            tick_mark(entry.as_ref()).map(|m| (Duration::from_millis(m.anchor_ms), m.tick));
        if !tick.is_due_after(enqueued) {
            return Ok(None);
        }
        let payload = job.encode().map_err(|e| unavailable("queue", e))?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            format!("{TICKS}{name}.{anchor_ms}.{}", tick.tick).as_str(),
        );
        let ack = self
            .inner
            .context
            .publish_with_headers(self.inner.subject.clone(), headers, payload.into())
            .await
            .map_err(|e| unavailable("queue", e))?
            .await
            .map_err(|e| unavailable("queue", e))?;
        let stored = Stored {
            job,
            state: Stage::Ready,
            attempts: 0,
            last_error: None,
            finished_ms: None,
        };
        match self
            .inner
            .state
            .create(ack.sequence.to_string(), stored.encode()?)
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(unavailable("queue", e)),
        }
        let mark = serde_json::to_vec(&TickMark {
            anchor_ms,
            tick: tick.tick,
            job: Some(ack.sequence),
        })
        .map_err(|e| unavailable("queue", e))?;
        // A failed compare-and-set: another scheduler recorded this tick (or a later one)
        // meanwhile; the message id kept the job single.
        self.compare_and_put(&key, mark.into(), KeyWrite::of(entry.map(|e| e.revision)))
            .await?;
        Ok((!ack.duplicate).then_some(JobId(ack.sequence)))
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        Ok(self.load(id.0).await?.map(|s| record(id, s)))
    }

    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        let mut guard = self.inner.consumer.lock().await;
        if guard.1 != visibility {
            // The lease is the consumer's ack wait.
            let config = consumer_config(visibility);
            let stream = self
                .inner
                .context
                .get_stream(guard.0.cached_info().stream_name.clone())
                .await
                .map_err(|e| unavailable("queue", e))?;
            guard.0 = stream
                .update_consumer(config)
                .await
                .map_err(|e| unavailable("queue", e))?;
            guard.1 = visibility;
        }
        loop {
            // The lease's end counts from before the request: the server's ack wait starts
            // at its delivery, later, so this process gives the job up no later than the
            // server does.
            let asked = Instant::now();
            let mut batch = guard
                .0
                .batch()
                .max_messages(1)
                .expires(LEASE_WAIT)
                .messages()
                .await
                .map_err(|e| unavailable("queue", e))?;
            let message = match batch.next().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(unavailable("queue", e)),
                Some(Ok(m)) => m,
            };
            let (id, attempt) = {
                let info = message.info().map_err(|e| unavailable("queue", e))?;
                (
                    info.stream_sequence,
                    u32::try_from(info.delivered).unwrap_or(u32::MAX),
                )
            };
            let job = match Job::decode(&message.payload) {
                Ok(job) => job,
                Err(e) => {
                    // No handler could run it: kept as a dead letter an operator can see.
                    warn!(id, error = %e, "message on the job stream is not a job; dead-lettered");
                    let dead = Stored {
                        job: Job::undecodable(&message.payload),
                        state: Stage::Dead,
                        attempts: attempt,
                        last_error: Some(format!("not a job: {e}")),
                        finished_ms: Some(now_ms()),
                    };
                    self.store(id, &dead).await?;
                    let _ = message.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            // Decided from the state read with its revision and written by compare-and-set
            // on it: the runner whose lease expired may be recording the job's end right
            // now, and "leased" written over it would leave the job leased with its
            // message gone (tidemark_jetstream::job_delivery). A lost compare-and-set is
            // decided again from the state read anew.
            let mut claimed = None;
            for _ in 0..CLAIM_ATTEMPTS {
                let (previous, write) = self.state_for_write(id).await?;
                let last_error = match &previous {
                    Some(p) if p.state == Stage::Leased => Some("lease expired".to_owned()),
                    Some(p) => p.last_error.clone(),
                    None => None,
                };
                match delivery(
                    previous.as_ref().map(|p| recorded(p.state)),
                    attempt,
                    self.inner.max_attempts,
                ) {
                    Delivery::Terminate => {
                        claimed = Some(false);
                        break;
                    }
                    Delivery::DeadLetter => {
                        // The end recorded first (see `ack`).
                        let dead = Stored {
                            job: job.clone(),
                            state: Stage::Dead,
                            attempts: attempt - 1,
                            last_error,
                            finished_ms: Some(now_ms()),
                        };
                        if self.write_state(id, write, &dead).await? {
                            claimed = Some(false);
                            break;
                        }
                        continue;
                    }
                    Delivery::Run => {}
                }
                // A tick's second message (its scheduler died between the publish and the
                // record, and published again after the duplicate window): the first
                // leased is the tick's job, this one is finished without running.
                if let Some(of) = self.tick_taken(&message, id).await? {
                    warn!(
                        id,
                        of, "a second job of one schedule tick; finished without running"
                    );
                    let done = Stored {
                        job: job.clone(),
                        state: Stage::Done,
                        attempts: attempt,
                        last_error: Some(format!(
                            "a second job of one schedule tick (its job is {of}): not run"
                        )),
                        finished_ms: Some(now_ms()),
                    };
                    if self.write_state(id, write, &done).await? {
                        claimed = Some(false);
                        break;
                    }
                    continue;
                }
                // Before the handler can run: an enqueue that still finds the job pending
                // is then covered by this run.
                self.unpend(id, &job).await?;
                let stored = Stored {
                    job: job.clone(),
                    state: Stage::Leased,
                    attempts: attempt,
                    last_error,
                    finished_ms: None,
                };
                if self.write_state(id, write, &stored).await? {
                    claimed = Some(true);
                    break;
                }
            }
            match claimed {
                Some(true) => {}
                Some(false) => {
                    let _ = message.ack_with(AckKind::Term).await;
                    continue;
                }
                None => {
                    // Left unacked: the server delivers it again after its ack wait.
                    return Err(unavailable(
                        "queue",
                        format!("job {id}'s state kept changing while this runner leased it"),
                    ));
                }
            }
            let mut leases = self.inner.leases.lock().await;
            Self::forget_expired(&mut leases, Instant::now());
            leases.insert(
                id,
                Held {
                    attempt,
                    message,
                    until: instant_after(asked, guard.1),
                },
            );
            return Ok(Some(Leased {
                id: JobId(id),
                job,
                attempt,
                receipt: u64::from(attempt),
            }));
        }
    }

    /// The job's end is recorded in the state bucket before its message is acked: the
    /// other order lost jobs for good (the NATS campaign, seeds 40000, 40004, 40014): an
    /// ack the server took whose confirmation was lost, or a runner that died between the
    /// two, left the message gone and the state leased, so no runner could ever lease the
    /// job again and it never ended. Recorded first, an ack that is lost or never sent
    /// leaves the message to be delivered again, and [`lease`](Queue::lease) terminates a
    /// message whose job has ended; a record that fails leaves the message unacked, and
    /// the job runs again (at least once).
    async fn ack(&self, lease: &Leased) -> Result<()> {
        let (message, write) = self.held(lease).await?;
        let done = Stored {
            job: lease.job.clone(),
            state: Stage::Done,
            attempts: lease.attempt,
            last_error: None,
            finished_ms: Some(now_ms()),
        };
        self.record_held(lease, write, &done).await?;
        settle(&message, AckKind::Ack, lease).await;
        Ok(())
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        let (message, write) = self.held(lease).await?;
        let dead = lease.attempt >= self.inner.max_attempts;
        let kind = if dead {
            AckKind::Term
        } else if retry_after.is_zero() {
            AckKind::Nak(None)
        } else {
            AckKind::Nak(Some(retry_after))
        };
        // Recorded first, as in `ack`: a dead letter's Term lost or never sent leaves a
        // message the next lease terminates; a retry's Nak lost leaves the message to come
        // back after its ack wait, ready.
        let stored = Stored {
            job: lease.job.clone(),
            state: if dead { Stage::Dead } else { Stage::Ready },
            attempts: lease.attempt,
            last_error: Some(error.to_owned()),
            finished_ms: dead.then(now_ms),
        };
        self.record_held(lease, write, &stored).await?;
        settle(&message, kind, lease).await;
        Ok(if dead {
            JobState::DeadLettered
        } else {
            JobState::Ready
        })
    }

    async fn renew(&self, lease: &Leased, _visibility: Duration) -> Result<()> {
        let ack_wait = self.inner.consumer.lock().await.1;
        let mut leases = self.inner.leases.lock().await;
        let now = Instant::now();
        Self::forget_expired(&mut leases, now);
        let Some(held) = leases
            .get_mut(&lease.id.0)
            .filter(|held| held.attempt == lease.attempt)
        else {
            return Err(Error::LeaseLost(format!(
                "{} attempt {}",
                lease.id, lease.attempt
            )));
        };
        held.message
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| unavailable("queue", e))?;
        held.until = instant_after(now, ack_wait);
        Ok(())
    }

    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        let (message, write) = self.held(lease).await?;
        // Recorded first, as in `ack`.
        let dead = Stored {
            job: lease.job.clone(),
            state: Stage::Dead,
            attempts: lease.attempt,
            last_error: Some(error.to_owned()),
            finished_ms: Some(now_ms()),
        };
        self.record_held(lease, write, &dead).await?;
        settle(&message, AckKind::Term, lease).await;
        Ok(())
    }

    async fn dead_letters(&self, after: Option<JobId>, limit: usize) -> Result<Vec<JobRecord>> {
        let after = after.map_or(0, |id| id.0);
        Ok(self
            .scan()
            .await?
            .into_iter()
            .filter(|(id, s)| *id > after && s.state == Stage::Dead)
            .take(limit)
            .map(|(id, s)| record(JobId(id), s))
            .collect())
    }

    async fn requeue(&self, id: JobId) -> Result<JobId> {
        let Some(stored) = self.load(id.0).await?.filter(|s| s.state == Stage::Dead) else {
            return Err(Error::NotFound(format!("dead letter {id}")));
        };
        // Published first: a crash between the two leaves the dead letter and a new job,
        // never neither.
        let new = self.enqueue(stored.job).await?;
        self.purge(id.0).await?;
        Ok(new)
    }

    async fn counts(&self) -> Result<JobCounts> {
        let mut counts = JobCounts::default();
        for (_, stored) in self.scan().await? {
            *match stored.state {
                Stage::Ready => &mut counts.ready,
                Stage::Leased => &mut counts.leased,
                Stage::Done => &mut counts.done,
                Stage::Dead => &mut counts.dead,
            } += 1;
        }
        Ok(counts)
    }

    /// Ages are judged on the server's clock (SPEC §17): a finished job's age is the time
    /// since the server stored its finished state, by the server's clock read from the
    /// state stream's info ([`tidemark_jetstream::kept_for`]), so neither the runner's nor
    /// the sweeper's own clock enters it. A server that does not stamp its answers
    /// (before 2.10) falls back to the finish time the runner wrote and this clock.
    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        let origin = Instant::now();
        let name = self.inner.state_stream.cached_info().config.name.clone();
        let clock = crate::clock::stream_info(&self.inner.context, &name, origin, "queue")
            .await?
            .clock;
        let jobs = self.scan_stamped().await?;
        let older = |keep: Duration, stored: &Stored, stored_ns: u64| match clock {
            Some(clock) => {
                tidemark_jetstream::kept_for(stored_ns, clock.server_now(origin.elapsed()), keep)
            }
            None => {
                let keep = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX);
                // State written before finish times were kept counts as finished long ago.
                stored
                    .finished_ms
                    .is_none_or(|at| now_ms().saturating_sub(at) >= keep)
            }
        };
        let mut removed = 0;
        for (id, stored, stored_ns) in jobs {
            let remove = match stored.state {
                Stage::Done => older(retention.done, &stored, stored_ns),
                Stage::Dead => retention.dead.is_some_and(|d| older(d, &stored, stored_ns)),
                Stage::Ready | Stage::Leased => false,
            };
            if remove {
                self.purge(id).await?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

fn decode_state(id: u64, bytes: &[u8]) -> Result<Stored> {
    serde_json::from_slice(bytes).map_err(|e| unavailable("queue", format!("job {id} state: {e}")))
}

/// Tells the server what became of a leased job's message whose state is already
/// recorded: `kind` (a double ack for [`AckKind::Ack`], which waits for the server's
/// confirmation). A failure is logged and otherwise ignored: the state says what became
/// of the job, and the message, delivered again, is terminated by the next lease (an end)
/// or leased again (a retry).
async fn settle(message: &jetstream::Message, kind: AckKind, lease: &Leased) {
    let sent = match kind {
        AckKind::Ack => message.double_ack().await,
        kind => message.ack_with(kind).await,
    };
    if let Err(e) = sent {
        debug!(id = %lease.id, attempt = lease.attempt, ?kind, error = %e, "the job's state is recorded; its message will be settled when delivered again");
    }
}

fn record(id: JobId, s: Stored) -> JobRecord {
    JobRecord {
        id,
        job: s.job,
        state: match s.state {
            Stage::Ready => JobState::Ready,
            Stage::Leased => JobState::Leased,
            Stage::Done => JobState::Done,
            Stage::Dead => JobState::DeadLettered,
        },
        attempts: s.attempts,
        last_error: s.last_error,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex as StdMutex, PoisonError};

    use tokio::sync::oneshot;

    use super::*;

    /// Holds one write of a job's state, armed for that job, until the test lets it go.
    #[derive(Default)]
    pub(super) struct Gate {
        armed: StdMutex<Option<Armed>>,
        passed: AtomicBool,
    }

    struct Armed {
        id: u64,
        reached: oneshot::Sender<()>,
        go: oneshot::Receiver<()>,
    }

    impl Gate {
        /// The next write of job `id`'s state through this handle says so on the first
        /// channel and waits for the second.
        fn arm(&self, id: u64) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
            let (reached, reached_rx) = oneshot::channel();
            let (go_tx, go) = oneshot::channel();
            *self.armed.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Armed { id, reached, go });
            (reached_rx, go_tx)
        }

        pub(super) async fn pass(&self, id: u64) {
            let armed = {
                let mut armed = self.armed.lock().unwrap_or_else(PoisonError::into_inner);
                if armed.as_ref().is_some_and(|a| a.id == id) {
                    armed.take()
                } else {
                    None
                }
            };
            if let Some(armed) = armed {
                let _ = armed.reached.send(());
                let _ = armed.go.await;
                self.passed.store(true, Ordering::SeqCst);
            }
        }

        fn passed(&self) -> bool {
            self.passed.load(Ordering::SeqCst)
        }
    }

    const VISIBILITY: Duration = Duration::from_secs(1);

    /// Two runners' handles (each its own connection) on queue `name` of one server, a
    /// job enqueued and leased by the first, and the first's lease held on past the
    /// server's ack wait, so the server delivers the job again while the first runner is
    /// still recording its end (its check that it held the lease passed in time; the test
    /// holds it on by hand).
    async fn raced(
        server: &tidemark_tests::NatsServer,
        name: &str,
    ) -> (NatsQueue, NatsQueue, Leased) {
        let mut queues = Vec::new();
        for _ in 0..2 {
            let client = server.connect().await.expect("connect");
            tidemark_tests::wait_jetstream_ready(&client)
                .await
                .expect("jetstream ready");
            queues.push(NatsQueue::open(client, name, 5).await.expect("queue"));
        }
        let (first, second) = (queues.remove(0), queues.remove(0));
        let id = first.enqueue(Job::Sweep).await.expect("enqueue");
        let lease = first
            .lease(VISIBILITY)
            .await
            .expect("lease")
            .expect("the job");
        assert_eq!((lease.id, lease.attempt), (id, 1));
        first
            .inner
            .leases
            .lock()
            .await
            .get_mut(&id.0)
            .expect("held")
            .until = Instant::now() + Duration::from_secs(60);
        tokio::time::sleep(VISIBILITY + Duration::from_millis(200)).await;
        (first, second, lease)
    }

    /// Leases on `queue` until it takes a job, or its gate was passed and a lease after
    /// it found none (ten seconds at most).
    async fn lease_through_gate(queue: NatsQueue) -> Result<Option<Leased>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match queue.lease(VISIBILITY).await? {
                Some(lease) => return Ok(Some(lease)),
                None if queue.inner.gate.passed() || Instant::now() > deadline => {
                    return Ok(None);
                }
                None => {}
            }
        }
    }

    async fn server_for_test() -> tidemark_tests::NatsServer {
        tidemark_tests::NatsServer::start()
            .await
            .unwrap_or_else(|e| panic!("a real nats-server is required for this test: {e}"))
    }

    /// SPEC §9 "every job ends": a job's end recorded by the runner whose lease expired,
    /// between another runner's read of the job's state ("leased") and its write, is not
    /// overwritten: the other runner's write loses its compare-and-set, it reads the end
    /// and terminates the delivery instead of running it. Written with a plain put, as the
    /// queue did, "leased" went over "done" while the first runner's ack removed the
    /// message: a crash of the second runner then left the job leased for good (the NATS
    /// campaign's "job left leased", seeds 60104, 60113, 70028).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_whose_job_ended_meanwhile_terminates_the_delivery_not_leases_it() {
        let server = server_for_test().await;
        let (first, second, lease) = raced(&server, "RACED_LEASE").await;
        let (reached, go) = second.inner.gate.arm(lease.id.0);
        let leasing = tokio::spawn(lease_through_gate(second.clone()));
        tokio::time::timeout(Duration::from_secs(10), reached)
            .await
            .expect("the job is delivered again to the second runner")
            .expect("gate");
        first
            .ack(&lease)
            .await
            .expect("the first runner records the end before the second writes");
        go.send(()).expect("the second runner waits");
        let taken = leasing.await.expect("lease task").expect("lease");
        assert!(
            taken.is_none(),
            "the job ended before the second runner's write: its delivery is terminated, \
             not leased again: {taken:?}"
        );
        let record = second.get(lease.id).await.unwrap().expect("state");
        assert_eq!(
            (record.state, record.attempts),
            (JobState::Done, 1),
            "the end the first runner recorded stands"
        );
        assert!(
            second.lease(VISIBILITY).await.unwrap().is_none(),
            "the job's message is gone"
        );
    }

    /// The other order: a runner whose lease expired finishes after another runner
    /// leased the job again, between its check that it held the lease and its record of
    /// the end. Its record loses the compare-and-set ([`Error::LeaseLost`]) instead of
    /// writing "done" over the other runner's lease, and the job ends by the other
    /// runner's ack, its second attempt. Written with a plain put, the other runner's ack
    /// found "done" and was refused as a lost lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ack_raced_by_a_lease_of_the_job_delivered_again_leaves_it_to_that_lease() {
        let server = server_for_test().await;
        let (first, second, lease) = raced(&server, "RACED_ACK").await;
        let (reached, go) = first.inner.gate.arm(lease.id.0);
        let acking = tokio::spawn({
            let first = first.clone();
            let lease = lease.clone();
            async move { first.ack(&lease).await }
        });
        tokio::time::timeout(Duration::from_secs(10), reached)
            .await
            .expect("the first runner's ack reaches its write")
            .expect("gate");
        let again = lease_through_gate(second.clone())
            .await
            .unwrap()
            .expect("the job, delivered again to the second runner");
        assert_eq!((again.id, again.attempt), (lease.id, 2));
        go.send(()).expect("the first runner waits");
        let acked = acking.await.expect("ack task");
        assert!(
            matches!(acked, Err(Error::LeaseLost(_))),
            "the first runner's lease was taken over before its record: {acked:?}"
        );
        second
            .ack(&again)
            .await
            .expect("the second runner's lease stands");
        let record = first.get(lease.id).await.unwrap().expect("state");
        assert_eq!((record.state, record.attempts), (JobState::Done, 2));
    }
}
