//! Named locks with an owner and a time to live: one sweeper at a time.

use std::future::Future;
use std::time::Duration;

use crate::error::Result;

/// A held lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockLease {
    /// The lock's name.
    pub name: String,
    /// Who holds it.
    pub owner: String,
    /// Grows with every acquisition of this lock: a fencing token a holder can pass to
    /// storage so that a holder whose lease expired cannot overwrite its successor.
    pub fencing: u64,
}

impl LockLease {
    /// Refuses work carrying this lease when the lock's newest fencing token is `current`
    /// (`None`: the lock was never taken): [`Error::LeaseLost`](crate::Error::LeaseLost) if
    /// a later acquisition exists, since its holder may be doing the same work now. A
    /// store calls it where it acts, with the token it reads there.
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) when `current` is newer than this
    /// lease's token.
    pub fn check_fence(&self, current: Option<u64>) -> crate::error::Result<()> {
        match current {
            Some(current) if current > self.fencing => {
                Err(crate::error::Error::LeaseLost(format!(
                    "lock {} fencing {} is older than its current token {current}",
                    self.name, self.fencing
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Named, expiring locks.
pub trait Lock: Send + Sync {
    /// Takes `name` for `owner` for `ttl`, if it is free or its holder's lease expired.
    /// `None` if someone else holds it. An owner that holds it already gets a new lease
    /// with a new fencing token, and its earlier lease is lost (renewing or releasing it
    /// does nothing to the new one): two tasks of one process under one owner name never
    /// both hold the lock.
    fn try_lock(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<LockLease>>> + Send;

    /// Extends a held lease to `ttl` from now. [`Error::LeaseLost`](crate::Error::LeaseLost)
    /// if it expired and someone else took the lock.
    fn renew(&self, lease: &LockLease, ttl: Duration) -> impl Future<Output = Result<()>> + Send;

    /// Releases a held lease (nothing happens if it was already lost).
    fn release(&self, lease: &LockLease) -> impl Future<Output = Result<()>> + Send;
}
