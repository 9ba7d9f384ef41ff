//! The probes a follower task sends while its follower backs off, carried out for the
//! core's [`Probes`], which decides when to send one and what its outcome means: an
//! answer after a probe went unanswered ends the backoff
//! ([`Input::Resumed`](tidemark_core::Input::Resumed)) where no reconnect will (a server
//! paused and continued keeps its connections, a cluster's stream elects a leader, a
//! bucket deleted is made again). Unlike a reconnect, a resume cuts no request that is
//! out at once: a read that waited through a stall gets its answer. One still out a
//! grace later is cut ([`Asking`](tidemark_core::Asking), carried out by the follower
//! task's `Cut` with a [`ProbeOut`] of its own).

use std::future::Future;
use std::pin::Pin;

use tidemark_core::{ProbePolicy, Probed, Probes, Time};
use tokio::time::Instant;

use crate::clock::Clock;
use crate::error::Result;
use crate::ports::{Feed, Source};

pub(crate) type Probe = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// The probe of a follower's path: its source's ([`Source::probe`]) and its feed's
/// ([`Feed::probe`]), answered when both are. A follower of announcements reads the source
/// and opens the feed on two streams, which on a cluster elect their leaders apart: a
/// backoff that the events stream's election grew must end when that stream answers,
/// though the bucket's answered all along.
pub(crate) fn probe_of<S: Source, F: Feed>(source: &S, feed: &F) -> Option<Probe> {
    match (source.probe(), feed.probe()) {
        (Some(s), Some(f)) => Some(Box::pin(async move {
            let (s, f) = tokio::join!(s, f);
            s.and(f)
        })),
        (Some(s), None) => Some(Box::pin(s)),
        (None, Some(f)) => Some(Box::pin(f)),
        (None, None) => None,
    }
}

/// A probe out and its deadline, if one is.
#[derive(Default)]
pub(crate) struct ProbeOut(Option<(Probe, Instant)>);

impl ProbeOut {
    /// Sends `probe`, given up at `deadline`; `false` if there is none.
    pub(crate) fn send(&mut self, probe: Option<Probe>, deadline: Instant) -> bool {
        self.0 = probe.map(|probe| (probe, deadline));
        self.0.is_some()
    }

    /// Whether a probe is out.
    pub(crate) fn is_out(&self) -> bool {
        self.0.is_some()
    }

    /// Drops the probe out, if one is.
    pub(crate) fn drop_it(&mut self) {
        self.0 = None;
    }

    /// Resolves when the probe out is answered (`true`) or fails or reaches its deadline
    /// (`false`); never without one. Cancel-safe: the probe stays out until it resolves.
    pub(crate) async fn outcome(&mut self) -> bool {
        let Some((probe, deadline)) = &mut self.0 else {
            return std::future::pending().await;
        };
        let answered = tokio::select! {
            biased;
            result = probe => result.is_ok(),
            () = tokio::time::sleep_until(*deadline) => false,
        };
        self.0 = None;
        answered
    }
}

/// A follower task's probes: the core's decisions, the probe out and its deadline.
pub(crate) struct Prober {
    probes: Probes,
    /// Whether the source can be probed at all.
    probing: bool,
    out: ProbeOut,
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober")
            .field("probes", &self.probes)
            .field("probing", &self.probing)
            .field("out", &self.out.0.as_ref().map(|(_, deadline)| deadline))
            .finish()
    }
}

impl Prober {
    /// Probes of the path of a follower of `source` and `feed`, if it can be probed
    /// ([`probe_of`]).
    pub(crate) fn new<S: Source, F: Feed>(source: &S, feed: &F, policy: ProbePolicy) -> Self {
        Prober {
            probes: Probes::new(policy),
            probing: probe_of(source, feed).is_some(),
            out: ProbeOut::default(),
        }
    }

    /// Sends a probe (made by `probe`) if one is due at `now` for a follower that waits
    /// until `retry_at` (`None`: it is not backing off); drops the one out if the core
    /// forgot it.
    pub(crate) fn poll(
        &mut self,
        probe: impl FnOnce() -> Option<Probe>,
        clock: &Clock,
        now: Time,
        retry_at: Option<Time>,
    ) {
        if !self.probing {
            return;
        }
        if let Some(deadline) = self.probes.poll_probe(now, retry_at)
            && !self.out.send(probe(), clock.instant(deadline))
        {
            self.probes.handle_missed(now);
        }
        if self.probes.out().is_none() {
            self.out.drop_it();
        }
    }

    /// When the next probe is due, for a follower that waits until `retry_at`.
    pub(crate) fn due(&self, clock: &Clock, retry_at: Option<Time>) -> Option<Instant> {
        if !self.probing {
            return None;
        }
        self.probes
            .poll_timeout(clock.now(), retry_at)
            .map(|t| clock.instant(t))
    }

    /// Whether the source can be probed at all.
    pub(crate) fn probing(&self) -> bool {
        self.probing
    }

    /// Whether a probe is out.
    pub(crate) fn is_out(&self) -> bool {
        self.out.is_out()
    }

    /// Resolves when the probe out is answered (`true`) or fails or reaches its deadline
    /// (`false`); never without one. Cancel-safe: the probe stays out until it resolves.
    pub(crate) async fn outcome(&mut self) -> bool {
        self.out.outcome().await
    }

    /// What an outcome [`outcome`](Self::outcome) gave at `now` means.
    pub(crate) fn judge(&mut self, now: Time, answered: bool) -> Probed {
        if answered {
            self.probes.handle_answer(now)
        } else {
            self.probes.handle_missed(now);
            Probed::Nothing
        }
    }

    /// The path is known to be back another way (a reconnect, a restart): the probe out
    /// is dropped and a missed one forgotten.
    pub(crate) fn reset(&mut self) {
        self.probes.reset();
        self.out.drop_it();
    }
}
