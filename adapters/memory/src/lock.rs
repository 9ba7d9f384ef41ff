//! In-process named locks with a time to live.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidemark::instant_after;
use tidemark::{Error, Lock, LockLease, Result};
use tokio::time::Instant;

use crate::clock::Now;
use crate::faults::{Faults, Port};

#[derive(Debug)]
struct Held {
    owner: String,
    fencing: u64,
    expires: Instant,
}

#[derive(Debug, Default)]
struct State {
    held: BTreeMap<String, Held>,
    fencing: BTreeMap<String, u64>,
}

/// In-process named locks. Time is tokio's, so paused time drives expiry.
#[derive(Clone, Debug, Default)]
pub struct MemoryLock {
    state: Arc<Mutex<State>>,
    faults: Faults,
    clock: Now,
}

impl MemoryLock {
    /// No lock held; calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemoryLock {
            state: Arc::default(),
            faults,
            clock: Now::default(),
        }
    }

    /// No lock held; calls consult `faults`, and leases expire by `clock` instead of
    /// tokio's (a simulator's host that crashes and comes back runs on a new runtime,
    /// whose `Instant`s start from a new base).
    #[must_use]
    pub fn with_clock(faults: Faults, clock: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        MemoryLock {
            state: Arc::default(),
            faults,
            clock: Now::given(clock),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses work carrying `fence` if the lock it names has been taken since with a
    /// newer fencing token ([`LockLease::check_fence`]).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] for a fence older than the lock's current token.
    pub fn check_fence(&self, fence: &LockLease) -> Result<()> {
        fence.check_fence(self.state().fencing.get(&fence.name).copied())
    }
}

impl Lock for MemoryLock {
    async fn try_lock(&self, name: &str, owner: &str, ttl: Duration) -> Result<Option<LockLease>> {
        self.faults.check(Port::Lock)?;
        let now = self.clock.now();
        let mut s = self.state();
        // Free, expired, or its holder asking again: a new lease with a new fencing token,
        // as on SQLite. The holder's earlier lease is lost, so a second sweep of one
        // process cannot release the lock from under the first, and a token grows with
        // every acquisition.
        if s.held
            .get(name)
            .is_some_and(|h| h.expires > now && h.owner != owner)
        {
            return Ok(None);
        }
        let fencing = {
            let f = s.fencing.entry(name.to_owned()).or_insert(0);
            *f += 1;
            *f
        };
        s.held.insert(
            name.to_owned(),
            Held {
                owner: owner.to_owned(),
                fencing,
                expires: instant_after(now, ttl),
            },
        );
        Ok(Some(LockLease {
            name: name.to_owned(),
            owner: owner.to_owned(),
            fencing,
        }))
    }

    async fn renew(&self, lease: &LockLease, ttl: Duration) -> Result<()> {
        self.faults.check(Port::Lock)?;
        let now = self.clock.now();
        let mut s = self.state();
        match s.held.get_mut(&lease.name) {
            Some(h) if h.fencing == lease.fencing && h.expires > now => {
                h.expires = instant_after(now, ttl);
                Ok(())
            }
            _ => Err(Error::LeaseLost(format!(
                "lock {} (fencing {})",
                lease.name, lease.fencing
            ))),
        }
    }

    async fn release(&self, lease: &LockLease) -> Result<()> {
        self.faults.check(Port::Lock)?;
        let mut s = self.state();
        if s.held
            .get(&lease.name)
            .is_some_and(|h| h.fencing == lease.fencing)
        {
            s.held.remove(&lease.name);
        }
        Ok(())
    }
}
