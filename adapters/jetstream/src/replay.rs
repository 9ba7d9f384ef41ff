//! When a replay is complete, and when an initial sync may say ready.
//!
//! A consumer's pending count is an estimate: nats-server decrements it at once when an
//! overwrite removes a revision the consumer has not delivered, but counts the new message
//! only from a queued signal, so for a moment it reads one low. A replay that stops on
//! "reached the head and pending is 0" can then miss a key overwritten just then: its old
//! revision is gone and its new one is above the stop. So neither a pending count of 0 nor
//! an idle heartbeat ends a replay: each asks for a read that cannot race — the last
//! message present now — and the replay ends only when that read, made after the consumer
//! delivered up to `seen`, finds nothing above `seen`.
//!
//! Why that suffices: the consumer delivers in stream order every message still present
//! when its cursor passes it. A key present when the confirming read ran has a revision at
//! or below what the read found, so at or below `seen`; its cursor passed that revision
//! before the read, while the revision was present (it still was at the read): delivered.

/// What to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read the next message (or heartbeat).
    Read,
    /// Read the last message present now, then report it with
    /// [`Replay::on_confirmed`]; the messages read meanwhile wait in order.
    Confirm,
    /// Complete: every key present at the confirming read was delivered, and nothing
    /// present then is above `through`.
    Done {
        /// The highest seq delivered.
        through: u64,
    },
    /// The consumer went quiet below what the stream holds, twice in a row with nothing
    /// delivered between: it cannot be trusted (a fresh consumer on a just-restarted
    /// server); reopen.
    Stalled {
        /// The highest seq delivered.
        seen: u64,
        /// The last message present.
        head: u64,
    },
}

/// How many times in a row an idle consumer may be found below the stream's last message
/// with nothing delivered between before it is taken for stalled. The first may be a race
/// (the message above was removed by an overwrite whose new revision is on its way).
const IDLE_BELOW_HEAD: u32 = 2;

/// The end of one replay: a consumer's deliveries from `from`, complete when a read that
/// cannot race confirms it.
#[derive(Clone, Debug)]
pub struct Replay {
    head: u64,
    seen: u64,
    /// Seen when the pending confirmation was asked for.
    asked_at: Option<u64>,
    /// Whether the pending confirmation follows an idle heartbeat.
    asked_idle: bool,
    /// Idle confirmations in a row that found the stream above `seen` with no progress.
    idle_below: u32,
    /// `seen` at the last idle confirmation.
    idle_seen: u64,
}

impl Replay {
    /// A replay whose consumer delivers from `from`; `head` is the last message present,
    /// read once the consumer existed (see [`head`](crate::head)).
    #[must_use]
    pub fn new(from: u64, head: u64) -> Self {
        Replay {
            head,
            seen: from.saturating_sub(1),
            asked_at: None,
            asked_idle: false,
            idle_below: 0,
            idle_seen: 0,
        }
    }

    /// What to do before reading anything: done at once when nothing at or after `from`
    /// was present once the consumer existed (an empty bucket, nothing after the start).
    #[must_use]
    pub fn start(&self) -> Step {
        if self.head <= self.seen {
            Step::Done { through: self.seen }
        } else {
            Step::Read
        }
    }

    /// The highest seq delivered so far.
    #[must_use]
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The head the replay reads towards.
    #[must_use]
    pub fn head(&self) -> u64 {
        self.head
    }

    /// A message at stream seq `seq`, with the consumer's `pending` count.
    pub fn on_message(&mut self, seq: u64, pending: u64) -> Step {
        self.seen = self.seen.max(seq);
        if self.seen >= self.head && pending == 0 {
            return self.ask(false);
        }
        Step::Read
    }

    /// An idle heartbeat: the consumer had nothing to send for a while.
    pub fn on_idle(&mut self) -> Step {
        self.ask(true)
    }

    fn ask(&mut self, idle: bool) -> Step {
        self.asked_at = Some(self.seen);
        self.asked_idle = idle;
        Step::Confirm
    }

    /// The read asked for by [`Step::Confirm`] found the last message present at `last`
    /// (0: none).
    pub fn on_confirmed(&mut self, last: u64) -> Step {
        let Some(asked_at) = self.asked_at.take() else {
            return Step::Read;
        };
        if last <= asked_at {
            return Step::Done { through: asked_at };
        }
        self.head = self.head.max(last);
        if self.asked_idle {
            if self.idle_below > 0 && self.idle_seen == asked_at {
                self.idle_below += 1;
            } else {
                self.idle_below = 1;
            }
            self.idle_seen = asked_at;
            if self.idle_below >= IDLE_BELOW_HEAD {
                return Step::Stalled {
                    seen: asked_at,
                    head: self.head,
                };
            }
        }
        Step::Read
    }
}

/// What an initial sync does with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Hand it on.
    Pass,
    /// It reaches the head the follower was told: hold it, read the last message present
    /// now, and report it with [`ReadyGate::on_confirmed`] before handing it on.
    Confirm,
}

/// What the confirming read of an initial sync decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirmed {
    /// Nothing present is above the held message: hand it on; the follower is ready at
    /// it.
    Ready,
    /// The stream moved past the held message: tell the follower its head is now `head`,
    /// then hand the message on. It is not ready until it reaches that head (and a read
    /// confirms again).
    Raise {
        /// The new head.
        head: u64,
    },
}

/// Keeps an initial sync from saying ready until a read that cannot race confirms that
/// nothing present is above what was delivered (see the module's doc): a follower ready at
/// watermark W then holds every key the source held at W.
#[derive(Clone, Debug)]
pub struct ReadyGate {
    head: u64,
    open: bool,
}

impl ReadyGate {
    /// A gate for a feed opened at `head` (the last message present once its consumer
    /// existed). The feed cannot know whether its follower is ready yet (a resume after a
    /// failed initial sync is not), so every feed confirms once, when it first reaches
    /// its head: a round trip per open.
    #[must_use]
    pub fn new(head: u64) -> Self {
        ReadyGate {
            head,
            open: head == 0,
        }
    }

    /// The head the follower is told.
    #[must_use]
    pub fn head(&self) -> u64 {
        self.head
    }

    /// A message at stream seq `seq`.
    #[must_use]
    pub fn on_message(&self, seq: u64) -> Gate {
        if !self.open && seq >= self.head {
            Gate::Confirm
        } else {
            Gate::Pass
        }
    }

    /// An idle heartbeat after the feed delivered up to `seen`: the server has nothing more
    /// to send now. Below the head it was told, the consumer cannot be trusted (a fresh
    /// consumer on a just-restarted server can report nothing pending while the stream
    /// holds messages): `Err` — end the feed, and the follower reopens from its watermark.
    ///
    /// # Errors
    /// The head not reached, when the consumer went idle below it.
    pub fn on_idle(&self, seen: u64) -> Result<(), u64> {
        if seen < self.head {
            Err(self.head)
        } else {
            Ok(())
        }
    }

    /// The confirming read for a held message at `seq` found the last message present at
    /// `last`.
    pub fn on_confirmed(&mut self, seq: u64, last: u64) -> Confirmed {
        if last <= seq {
            self.open = true;
            Confirmed::Ready
        } else {
            self.head = self.head.max(last);
            Confirmed::Raise { head: self.head }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_zero_at_the_head_asks_for_a_confirmation() {
        let mut r = Replay::new(1, 5);
        assert_eq!(r.start(), Step::Read);
        assert_eq!(r.on_message(3, 1), Step::Read);
        assert_eq!(r.on_message(5, 0), Step::Confirm, "never done on a count");
        assert_eq!(r.on_confirmed(7), Step::Read, "the stream moved: read on");
        assert_eq!(r.on_message(7, 0), Step::Confirm);
        assert_eq!(r.on_confirmed(7), Step::Done { through: 7 });
    }

    #[test]
    fn an_idle_consumer_below_the_stream_twice_without_progress_is_stalled() {
        let mut r = Replay::new(1, 5);
        assert_eq!(r.on_message(2, 9), Step::Read);
        assert_eq!(r.on_idle(), Step::Confirm);
        assert_eq!(r.on_confirmed(5), Step::Read, "once may be a race");
        assert_eq!(r.on_idle(), Step::Confirm);
        assert_eq!(r.on_confirmed(5), Step::Stalled { seen: 2, head: 5 });
    }

    #[test]
    fn an_empty_replay_is_done_at_once() {
        assert_eq!(Replay::new(4, 3).start(), Step::Done { through: 3 });
        assert_eq!(Replay::new(1, 0).start(), Step::Done { through: 0 });
    }

    #[test]
    fn the_gate_opens_only_on_a_confirmation() {
        let mut g = ReadyGate::new(5);
        assert_eq!(g.on_message(4), Gate::Pass);
        assert_eq!(g.on_message(5), Gate::Confirm);
        assert_eq!(g.on_confirmed(5, 8), Confirmed::Raise { head: 8 });
        assert_eq!(g.on_message(6), Gate::Pass);
        assert_eq!(g.on_message(8), Gate::Confirm);
        assert_eq!(g.on_confirmed(8, 8), Confirmed::Ready);
        assert_eq!(g.on_message(9), Gate::Pass);
        assert_eq!(ReadyGate::new(0).on_message(1), Gate::Pass);
        assert_eq!(g.on_idle(9), Ok(()));
        assert_eq!(ReadyGate::new(5).on_idle(4), Err(5), "idle below the head");
    }
}
