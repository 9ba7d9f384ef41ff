//! Fault hooks shared by every memory port: what tests and the simulator switch on.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::Error;

/// A port whose calls can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Port {
    /// Every [`Source`](tidemark::Source) call.
    Source,
    /// Opening the source's change log, and each item read from it.
    Feed,
    /// Publishing to the events stream (announce leg 1).
    Publish,
    /// Opening the events stream, and each item read from it.
    Events,
    /// Loading and saving durable cursors.
    Cursor,
    /// Notifying a wake channel (announce leg 2).
    Notify,
    /// Subscribing to a wake channel.
    Listen,
    /// Every queue call; enqueue is announce leg 3.
    Queue,
    /// Every lock call.
    Lock,
    /// Every schedule store call.
    Schedule,
    /// Every outbox call (claim, complete, pending); not the rows a source appends.
    Outbox,
}

impl Port {
    fn name(self) -> &'static str {
        match self {
            Port::Source => "source",
            Port::Feed => "feed",
            Port::Publish => "publish",
            Port::Events => "events",
            Port::Cursor => "cursor",
            Port::Notify => "notify",
            Port::Listen => "listen",
            Port::Queue => "queue",
            Port::Lock => "lock",
            Port::Schedule => "schedule",
            Port::Outbox => "outbox",
        }
    }
}

/// What happens to the next announcement published to the events stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mangle {
    /// Delivered as published.
    #[default]
    Deliver,
    /// Lost: the publisher is told it landed, but no reader will see it.
    Drop,
    /// Delivered twice.
    Duplicate,
    /// Held back and delivered after the next announcement.
    Reorder,
}

#[derive(Debug, Default)]
struct State {
    fail_next: BTreeMap<Port, u32>,
    failing: BTreeSet<Port>,
    mangle_next: VecDeque<Mangle>,
    mangle_always: Mangle,
}

/// Switches for injected faults, shared (cheaply cloned) by every port of one
/// [`Memory`](crate::Memory). With nothing armed a check costs one atomic load.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    armed: Arc<AtomicBool>,
    state: Arc<Mutex<State>>,
}

impl Faults {
    /// No faults.
    #[must_use]
    pub fn new() -> Self {
        Faults::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the switches inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn rearm(&self, s: &State) {
        let armed = !s.fail_next.is_empty()
            || !s.failing.is_empty()
            || !s.mangle_next.is_empty()
            || s.mangle_always != Mangle::Deliver;
        self.armed.store(armed, Ordering::Release);
    }

    /// The next `n` calls of `port` fail with [`Error::Unavailable`].
    pub fn fail_next(&self, port: Port, n: u32) {
        let mut s = self.lock();
        if n == 0 {
            s.fail_next.remove(&port);
        } else {
            s.fail_next.insert(port, n);
        }
        self.rearm(&s);
    }

    /// Every call of `port` fails while `failing` is true (a partition, a dead leg).
    pub fn set_failing(&self, port: Port, failing: bool) {
        let mut s = self.lock();
        if failing {
            s.failing.insert(port);
        } else {
            s.failing.remove(&port);
        }
        self.rearm(&s);
    }

    /// The next announcement published is mangled so; later ones queue after it.
    pub fn mangle_next(&self, mangle: Mangle) {
        let mut s = self.lock();
        s.mangle_next.push_back(mangle);
        self.rearm(&s);
    }

    /// Every announcement is mangled so (until set back to [`Mangle::Deliver`]).
    pub fn set_mangle(&self, mangle: Mangle) {
        let mut s = self.lock();
        s.mangle_always = mangle;
        self.rearm(&s);
    }

    /// Disarms every fault.
    pub fn heal(&self) {
        let mut s = self.lock();
        *s = State::default();
        self.rearm(&s);
    }

    /// Fails if a fault is armed for `port` (consuming one of its "next N").
    pub fn check(&self, port: Port) -> Result<(), Error> {
        if !self.armed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut s = self.lock();
        if s.failing.contains(&port) {
            return Err(Error::unavailable(port.name(), "injected fault"));
        }
        if let Some(n) = s.fail_next.get_mut(&port) {
            *n -= 1;
            if *n == 0 {
                s.fail_next.remove(&port);
                self.rearm(&s);
            }
            return Err(Error::unavailable(port.name(), "injected fault"));
        }
        Ok(())
    }

    /// What happens to the announcement being published now.
    pub(crate) fn take_mangle(&self) -> Mangle {
        if !self.armed.load(Ordering::Acquire) {
            return Mangle::Deliver;
        }
        let mut s = self.lock();
        let m = s.mangle_next.pop_front().unwrap_or(s.mangle_always);
        self.rearm(&s);
        m
    }
}
