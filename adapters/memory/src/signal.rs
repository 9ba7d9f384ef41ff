//! "Something was appended": a change signal whose wake-ups are deterministic.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

/// A version counter and its waiters. tokio's `watch` wakes its receivers in a random
/// order (it spreads them over shards with the runtime's RNG), which made simulated runs of
/// one seed differ; `Notify` wakes its waiters in a fixed order.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    version: AtomicU64,
    notify: Notify,
}

impl Signal {
    /// Announces a change to every waiter.
    pub(crate) fn bump(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }

    /// The current version: read it before looking at the data, then wait for a change
    /// past it.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Waits until the version differs from `seen`.
    pub(crate) async fn changed_since(&self, seen: u64) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a bump in between is not missed.
            notified.as_mut().enable();
            if self.version() != seen {
                return;
            }
            notified.await;
        }
    }
}
