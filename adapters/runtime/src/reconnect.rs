//! Reconnects of the client beneath a follower's source and feed, paced for the follower
//! task: each one becomes [`Input::Reconnected`](tidemark_core::Input::Reconnected), but
//! never more often than [`RECONNECT_GAP`], so a flapping connection cannot make the
//! follower retry in a tight loop.
//!
//! A server that accepts connections again may still refuse requests for a moment
//! (JetStream answers "no responders" right after a restart), and what was opened while
//! the connection was away fails once it is back. So for [`RECONNECT_SETTLE`] after a
//! reconnect, a follower that backs off is retried at the reconnect pace instead of after
//! a backoff that grew during the outage: at most `RECONNECT_SETTLE / RECONNECT_GAP`
//! attempts more per reconnect. A request to a port that is out when a reconnect comes is
//! abandoned and answered as failed (its reply may have gone with the old connection), so
//! the reconnect's retry does not wait out the client's request timeout first.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// The shortest time between two reconnects the follower task acts on. One arriving sooner
/// is acted on when the gap has passed (coalesced with any others meanwhile), never lost.
pub const RECONNECT_GAP: Duration = Duration::from_millis(250);

/// How long after a reconnect a follower that backs off is retried every
/// [`RECONNECT_GAP`] rather than after its backoff.
pub const RECONNECT_SETTLE: Duration = Duration::from_secs(2);

/// The reconnect counters of a source and a feed (one, if they share a client), and when
/// the task last acted on a reconnect.
#[derive(Debug, Default)]
pub(crate) struct Reconnects {
    watches: [Option<watch::Receiver<u64>>; 2],
    last: Option<Instant>,
    /// When a reconnect was last heard: the settle window starts there.
    heard: Option<Instant>,
    /// A reconnect arrived within the gap: act on it at `last + RECONNECT_GAP`.
    deferred: bool,
}

impl Reconnects {
    /// Watches `source` and `feed` from now on (reconnects before now are not news).
    pub(crate) fn new(
        source: Option<watch::Receiver<u64>>,
        feed: Option<watch::Receiver<u64>>,
    ) -> Self {
        let feed = feed.filter(|f| !source.as_ref().is_some_and(|s| s.same_channel(f)));
        let mut watches = [source, feed];
        for w in watches.iter_mut().flatten() {
            w.mark_unchanged();
        }
        Reconnects {
            watches,
            ..Reconnects::default()
        }
    }

    /// The same counters watched from now on, with no pacing of their own: what a request
    /// in flight listens to, so that a reconnect while it waits abandons it.
    pub(crate) fn listen_from_now(&self) -> Reconnects {
        let [source, feed] = &self.watches;
        Reconnects::new(source.clone(), feed.clone())
    }

    /// Whether anything is watched.
    pub(crate) fn watching(&self) -> bool {
        self.watches.iter().any(Option::is_some)
    }

    /// `request`'s result, or `None` if a counter moves first (the request is dropped):
    /// a reply due on a connection that went is lost with it.
    pub(crate) async fn unless_reconnected<T>(
        &mut self,
        request: impl Future<Output = T>,
    ) -> Option<T> {
        let watching = self.watching();
        tokio::select! {
            biased;
            () = self.next(), if watching => None,
            result = request => Some(result),
        }
    }

    /// Resolves when a counter moved. A counter whose client is gone is dropped; with
    /// none left this never resolves. Cancel-safe.
    pub(crate) async fn next(&mut self) {
        loop {
            let [a, b] = &mut self.watches;
            let (closed, slot) = tokio::select! {
                biased;
                r = changed(a) => (r.is_err(), 0),
                r = changed(b) => (r.is_err(), 1),
            };
            if !closed {
                return;
            }
            self.watches[slot] = None;
        }
    }

    /// A reconnect arrived at `now`: whether to act on it now. If not, it waits for
    /// [`deferred_until`](Self::deferred_until).
    pub(crate) fn arrived(&mut self, now: Instant) -> bool {
        self.heard = Some(now);
        match self.last {
            Some(last) if now < last + RECONNECT_GAP => {
                self.deferred = true;
                false
            }
            _ => {
                self.acted(now);
                true
            }
        }
    }

    /// When a deferred reconnect is due.
    pub(crate) fn deferred_until(&self) -> Option<Instant> {
        self.deferred
            .then(|| self.last.map(|l| l + RECONNECT_GAP))
            .flatten()
    }

    /// Whether a deferred reconnect is due at `now` (then it counts as acted on).
    pub(crate) fn take_due(&mut self, now: Instant) -> bool {
        if self.deferred_until().is_some_and(|at| at <= now) {
            self.acted(now);
            true
        } else {
            false
        }
    }

    /// The follower backs off at `now`: within the settle window of the last reconnect,
    /// it is retried [`RECONNECT_GAP`] after the last retry instead.
    pub(crate) fn backing_off(&mut self, now: Instant) {
        if self.heard.is_some_and(|h| now < h + RECONNECT_SETTLE) {
            self.deferred = true;
        }
    }

    /// The task acted on a reconnect (or a restart, which is one) at `now`.
    pub(crate) fn acted(&mut self, now: Instant) {
        self.last = Some(now);
        self.deferred = false;
    }
}

async fn changed(watch: &mut Option<watch::Receiver<u64>>) -> Result<(), watch::error::RecvError> {
    match watch {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reconnect_within_the_gap_is_deferred_not_lost() {
        let (tx, rx) = watch::channel(0u64);
        let mut r = Reconnects::new(Some(rx.clone()), Some(rx));
        assert!(r.watching());
        tx.send_modify(|n| *n += 1);
        r.next().await;
        let t0 = Instant::now();
        assert!(r.arrived(t0), "the first reconnect is acted on at once");
        tx.send_modify(|n| *n += 1);
        r.next().await;
        assert!(
            !r.arrived(t0 + RECONNECT_GAP / 2),
            "a second within the gap waits"
        );
        assert_eq!(r.deferred_until(), Some(t0 + RECONNECT_GAP));
        assert!(!r.take_due(t0 + RECONNECT_GAP / 2));
        assert!(
            r.take_due(t0 + RECONNECT_GAP),
            "and is acted on when the gap ends"
        );
        assert_eq!(r.deferred_until(), None);
        drop(tx);
        tokio::select! {
            biased;
            () = r.next() => panic!("a closed counter is no reconnect"),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        assert!(!r.watching(), "a counter whose client is gone is dropped");
    }

    #[test]
    fn a_failure_soon_after_a_reconnect_is_retried_at_the_reconnect_pace_for_a_while() {
        let mut r = Reconnects::default();
        let t0 = Instant::now();
        r.backing_off(t0);
        assert_eq!(
            r.deferred_until(),
            None,
            "no reconnect heard: the backoff rules"
        );
        assert!(r.arrived(t0));
        let mut retries = 0;
        let mut now = t0;
        loop {
            r.backing_off(now);
            let Some(at) = r.deferred_until() else { break };
            assert_eq!(at, now + RECONNECT_GAP, "retried at the reconnect pace");
            now = at;
            assert!(r.take_due(now));
            retries += 1;
        }
        assert!(now >= t0 + RECONNECT_SETTLE - RECONNECT_GAP);
        assert_eq!(
            retries,
            RECONNECT_SETTLE.as_millis() / RECONNECT_GAP.as_millis(),
            "bounded: a server that stays away is left to the backoff after the window"
        );
    }
}
