//! Maintenance jobs on a JetStream work-queue stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::{AckPolicy, Consumer, pull};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::{self, RetentionPolicy};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tidemark::tidemark_core::{Job, JobId};
use tidemark::{Error, JobRecord, JobState, Leased, Queue, Result};
use tokio::sync::Mutex;

use crate::error::{check_name, unavailable};

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
/// up, keeping its last error. The job id is the stream sequence of its message. A lease can be acked or failed
/// only by the process (the `NatsQueue` handle and its clones) that took it.
#[derive(Clone)]
pub struct NatsQueue {
    inner: Arc<Inner>,
}

struct Inner {
    context: jetstream::Context,
    subject: String,
    consumer: Mutex<(Consumer<pull::Config>, Duration)>,
    state: kv::Store,
    max_attempts: u32,
    leases: Mutex<HashMap<u64, (u32, jetstream::Message)>>,
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
        Ok(NatsQueue {
            inner: Arc::new(Inner {
                context,
                subject,
                consumer: Mutex::new((consumer, ack_wait)),
                state,
                max_attempts: max_attempts.max(1),
                leases: Mutex::new(HashMap::new()),
            }),
        })
    }

    async fn load(&self, id: u64) -> Result<Option<Stored>> {
        let Some(bytes) = self
            .inner
            .state
            .get(id.to_string())
            .await
            .map_err(|e| unavailable("queue", e))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| unavailable("queue", format!("job {id} state: {e}")))
    }

    async fn store(&self, id: u64, stored: &Stored) -> Result<()> {
        self.inner
            .state
            .put(id.to_string(), stored.encode()?)
            .await
            .map_err(|e| unavailable("queue", e))?;
        Ok(())
    }

    /// The message of a lease this handle still holds, or [`Error::LeaseLost`].
    async fn held(&self, lease: &Leased) -> Result<jetstream::Message> {
        let mut leases = self.inner.leases.lock().await;
        match leases.get(&lease.id.0) {
            Some((attempt, _)) if *attempt == lease.attempt => {}
            _ => {
                return Err(Error::LeaseLost(format!(
                    "{} attempt {}",
                    lease.id, lease.attempt
                )));
            }
        }
        let stored = self.load(lease.id.0).await?;
        if !stored.is_some_and(|s| s.state == Stage::Leased && s.attempts == lease.attempt) {
            leases.remove(&lease.id.0);
            return Err(Error::LeaseLost(format!(
                "{} attempt {}",
                lease.id, lease.attempt
            )));
        }
        leases
            .remove(&lease.id.0)
            .map(|(_, m)| m)
            .ok_or_else(|| Error::LeaseLost(lease.id.to_string()))
    }
}

impl Queue for NatsQueue {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
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
        Ok(JobId(ack.sequence))
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        Ok(self.load(id.0).await?.map(|s| JobRecord {
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
        }))
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
            let Ok(job) = Job::decode(&message.payload) else {
                // Not a job: nothing can run it.
                let _ = message.ack_with(AckKind::Term).await;
                continue;
            };
            let previous = self.load(id).await?;
            let last_error = match &previous {
                Some(p) if p.state == Stage::Leased => Some("lease expired".to_owned()),
                Some(p) => p.last_error.clone(),
                None => None,
            };
            if matches!(&previous, Some(p) if matches!(p.state, Stage::Done | Stage::Dead)) {
                let _ = message.ack_with(AckKind::Term).await;
                continue;
            }
            if attempt > self.inner.max_attempts {
                let _ = message.ack_with(AckKind::Term).await;
                let dead = Stored {
                    job,
                    state: Stage::Dead,
                    attempts: attempt - 1,
                    last_error,
                };
                self.store(id, &dead).await?;
                continue;
            }
            let stored = Stored {
                job: job.clone(),
                state: Stage::Leased,
                attempts: attempt,
                last_error,
            };
            self.store(id, &stored).await?;
            self.inner
                .leases
                .lock()
                .await
                .insert(id, (attempt, message));
            return Ok(Some(Leased {
                id: JobId(id),
                job,
                attempt,
                receipt: u64::from(attempt),
            }));
        }
    }

    async fn ack(&self, lease: &Leased) -> Result<()> {
        let message = self.held(lease).await?;
        message
            .double_ack()
            .await
            .map_err(|e| unavailable("queue", e))?;
        let done = Stored {
            job: lease.job.clone(),
            state: Stage::Done,
            attempts: lease.attempt,
            last_error: None,
        };
        self.store(lease.id.0, &done).await
    }

    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        let message = self.held(lease).await?;
        let dead = lease.attempt >= self.inner.max_attempts;
        let kind = if dead {
            AckKind::Term
        } else if retry_after.is_zero() {
            AckKind::Nak(None)
        } else {
            AckKind::Nak(Some(retry_after))
        };
        message
            .ack_with(kind)
            .await
            .map_err(|e| unavailable("queue", e))?;
        let stored = Stored {
            job: lease.job.clone(),
            state: if dead { Stage::Dead } else { Stage::Ready },
            attempts: lease.attempt,
            last_error: Some(error.to_owned()),
        };
        self.store(lease.id.0, &stored).await?;
        Ok(if dead {
            JobState::DeadLettered
        } else {
            JobState::Ready
        })
    }
}
