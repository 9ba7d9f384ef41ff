//! Named locks on a KV bucket: revision compare-and-set, expiry by the server's clock.

use std::time::Duration;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use tidemark::{Error, Lock, LockLease, Result};

use tidemark_jetstream::{LockRecord, TAKE_ATTEMPTS, Take};

use crate::coord::{self, live, server_now, since_epoch};
use crate::error::unavailable;

const PORT: &str = "lock";

/// The default bucket of [`NatsLock::open`].
pub const DEFAULT_LOCK_BUCKET: &str = "tidemark_locks";

/// What a lock's key holds. A released lock keeps its record (owner `None`) so its fencing
/// token keeps growing across holders.
#[derive(Debug, Serialize, Deserialize)]
struct Held {
    owner: Option<String>,
    fencing: u64,
    ttl_ms: u64,
}

impl Held {
    /// The record as the decisions read it ([`tidemark_jetstream::take`] and the rest):
    /// stored when the server stored `entry`.
    fn record(&self, entry: &kv::Entry) -> LockRecord {
        LockRecord {
            owner: self.owner.clone(),
            fencing: self.fencing,
            ttl_ns: self.ttl_ms.saturating_mul(1_000_000),
            stored_ns: nanos(since_epoch(entry)),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Named, expiring locks on a NATS KV bucket, for every process that talks to the server.
///
/// Each lock is one key; every change is a compare-and-set on the key's revision, so of
/// several processes racing for a free lock exactly one wins. A lease runs from the
/// server's timestamp of the write that took or renewed it, and expiry is judged by the
/// server's clock too: processes whose own clocks disagree still agree on who holds it.
#[derive(Clone, Debug)]
pub struct NatsLock {
    store: kv::Store,
}

impl NatsLock {
    /// Opens (creating if absent) the lock bucket `bucket` with `replicas` copies.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a bad bucket name; [`Error::Unavailable`] if the server
    /// cannot open or create it.
    pub async fn open(client: async_nats::Client, bucket: &str, replicas: usize) -> Result<Self> {
        Ok(NatsLock {
            store: coord::bucket(client, bucket, replicas, PORT).await?,
        })
    }

    async fn read(&self, key: &str) -> Result<Option<(kv::Entry, Held)>> {
        let Some(entry) = live(&self.store, key, PORT).await? else {
            return Ok(None);
        };
        match serde_json::from_slice::<Held>(&entry.value) {
            Ok(held) => Ok(Some((entry, held))),
            Err(e) => {
                // Not ours (a foreign write): treated as a free lock whose next fencing
                // token still starts above anything handed out.
                tracing::warn!(key, error = %e, "lock record unreadable; treating it as free");
                let foreign = LockRecord::foreign(0);
                Ok(Some((
                    entry,
                    Held {
                        owner: foreign.owner,
                        fencing: foreign.fencing,
                        ttl_ms: 0,
                    },
                )))
            }
        }
    }

    async fn write(&self, key: &str, held: &Held, revision: Option<u64>) -> Result<bool> {
        let value = serde_json::to_vec(held)
            .map_err(|e| unavailable(PORT, e))?
            .into();
        let written = match revision {
            None => self
                .store
                .create(key, value)
                .await
                .map(|_| ())
                .map_err(|e| {
                    (e.kind() == kv::CreateErrorKind::AlreadyExists)
                        .then_some(())
                        .ok_or_else(|| unavailable(PORT, e))
                }),
            Some(rev) => self
                .store
                .update(key, value, rev)
                .await
                .map(|_| ())
                .map_err(|e| {
                    (e.kind() == kv::UpdateErrorKind::WrongLastRevision)
                        .then_some(())
                        .ok_or_else(|| unavailable(PORT, e))
                }),
        };
        match written {
            Ok(()) => Ok(true),
            // Someone else wrote first.
            Err(Ok(())) => Ok(false),
            Err(Err(e)) => Err(e),
        }
    }
}

impl NatsLock {
    /// The newest fencing token of the lock `name` (`None`: never taken), read from the
    /// bucket: what a store checks a fence against ([`LockLease::check_fence`]).
    ///
    /// # Errors
    /// [`Error::Unavailable`] if the bucket cannot be read.
    pub async fn fencing(&self, name: &str) -> Result<Option<u64>> {
        let key = coord::key("lock", name);
        Ok(self.read(&key).await?.map(|(_, held)| held.fencing))
    }
}

impl Lock for NatsLock {
    async fn try_lock(&self, name: &str, owner: &str, ttl: Duration) -> Result<Option<LockLease>> {
        let key = coord::key("lock", name);
        // A lost compare-and-set means someone else wrote meanwhile: look again, a few
        // times, then report the lock as held.
        for _ in 0..TAKE_ATTEMPTS {
            let read = self.read(&key).await?;
            let now = match &read {
                Some(_) => nanos(server_now(&self.store, PORT).await?),
                None => 0,
            };
            let record = read.as_ref().map(|(entry, held)| held.record(entry));
            let fencing = match tidemark_jetstream::take(record.as_ref(), owner, now) {
                Take::Held => return Ok(None),
                Take::Write { fencing } => fencing,
            };
            let held = Held {
                owner: Some(owner.to_owned()),
                fencing,
                ttl_ms: ms(ttl),
            };
            let revision = read.map(|(entry, _)| entry.revision);
            if self.write(&key, &held, revision).await? {
                return Ok(Some(LockLease {
                    name: name.to_owned(),
                    owner: owner.to_owned(),
                    fencing,
                }));
            }
        }
        Ok(None)
    }

    async fn renew(&self, lease: &LockLease, ttl: Duration) -> Result<()> {
        let key = coord::key("lock", &lease.name);
        let lost = || Error::LeaseLost(format!("lock {} (fencing {})", lease.name, lease.fencing));
        let Some((entry, held)) = self.read(&key).await? else {
            return Err(lost());
        };
        let now = nanos(server_now(&self.store, PORT).await?);
        let record = held.record(&entry);
        if !tidemark_jetstream::holds(Some(&record), &lease.owner, lease.fencing, now) {
            return Err(lost());
        }
        let renewed = Held {
            ttl_ms: ms(ttl),
            ..held
        };
        if self.write(&key, &renewed, Some(entry.revision)).await? {
            Ok(())
        } else {
            Err(lost())
        }
    }

    async fn release(&self, lease: &LockLease) -> Result<()> {
        let key = coord::key("lock", &lease.name);
        if let Some((entry, held)) = self.read(&key).await?
            && tidemark_jetstream::names(Some(&held.record(&entry)), &lease.owner, lease.fencing)
        {
            let free = Held {
                owner: None,
                fencing: held.fencing,
                ttl_ms: 0,
            };
            // A lost race means the lock changed hands already: nothing to release.
            self.write(&key, &free, Some(entry.revision)).await?;
        }
        Ok(())
    }
}
