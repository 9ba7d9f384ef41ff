//! When a listing of a stream is complete.
//!
//! A listing (the NATS queue's `counts`, `dead_letters`, `remove_finished`) reads the last
//! message of every subject of a stream through a consumer that delivers them in stream
//! order, and goes on delivering what is written after. The consumer's pending count
//! cannot say when to stop: nats-server takes a removed message off it at once but adds a
//! new one from a queued signal, so while a writer overwrites keys the count can read 0
//! with a message still to come — the one that moved a key out from ahead of the reader.
//! Silence cannot say it either: it only says nothing arrived lately.
//!
//! [`ScanEnd`] ends a listing on stream sequences instead. It asks for the sequence of
//! the newest message the stream holds (a read of the stream itself, which cannot race),
//! reads until the consumer has delivered up to it, and then asks again: the listing is
//! complete once a read taken after every delivery so far finds nothing newer than what
//! was delivered. Then every key the stream held at that read had its message delivered
//! — in particular every key that existed throughout the listing, however often it was
//! overwritten meanwhile. (The message was present at the read and sits at or below the
//! delivered sequence; the consumer passed its sequence earlier, and a message present
//! later was present then.) An idle spell only prompts another read: the newest message
//! may have been removed and will never be delivered.

/// What a listing does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanStep {
    /// Take the consumer's next message and hand its stream sequence to
    /// [`ScanEnd::delivered`], or report a spell without one to [`ScanEnd::idle`].
    ReadOn,
    /// Read the stream sequence of the newest message the stream holds now (on NATS a
    /// message get of the last message for the stream's whole subject filter, from the
    /// stream leader) and hand it to [`ScanEnd::confirmed`]. Not the stream info's last
    /// sequence: that may name a message since removed, which no consumer will deliver.
    Confirm,
    /// The listing is complete: stop reading. What was delivered holds the message every
    /// key had at the last confirmation (or a later one).
    Done,
}

/// Decides when a listing of a stream is complete, from stream sequences only (see the
/// [module docs](self)). A listing starts with [`ScanStep::Confirm`]: the adapter reads
/// the newest message before it creates the consumer, and needs none if the stream holds
/// nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanEnd {
    /// The highest stream sequence delivered so far (0: none).
    delivered: u64,
    /// The newest sequence the last confirmation found, still to be delivered; `None`
    /// while a confirmation is due.
    target: Option<u64>,
    done: bool,
}

impl ScanEnd {
    /// A listing that has read nothing yet; its first step is [`ScanStep::Confirm`].
    #[must_use]
    pub fn new() -> ScanEnd {
        ScanEnd::default()
    }

    /// The step this listing is at: [`ScanStep::Done`] once complete,
    /// [`ScanStep::Confirm`] while a confirmation is due, else [`ScanStep::ReadOn`].
    #[must_use]
    pub fn step(&self) -> ScanStep {
        match (self.done, self.target) {
            (true, _) => ScanStep::Done,
            (false, None) => ScanStep::Confirm,
            (false, Some(_)) => ScanStep::ReadOn,
        }
    }

    /// The highest stream sequence delivered so far (0: none).
    #[must_use]
    pub fn delivered_through(&self) -> u64 {
        self.delivered
    }

    /// A confirmation read, taken after every delivery handed in so far: the stream
    /// sequence of the newest message the stream holds, or `None` if it holds none.
    /// Nothing newer than what was delivered means the listing is complete.
    pub fn confirmed(&mut self, newest: Option<u64>) -> ScanStep {
        if self.done {
            return ScanStep::Done;
        }
        match newest {
            Some(newest) if newest > self.delivered => self.target = Some(newest),
            _ => {
                self.done = true;
                self.target = None;
            }
        }
        self.step()
    }

    /// The consumer delivered the message at `stream_seq`. Once the sequence the last
    /// confirmation found is reached, the next step is another confirmation: messages
    /// written meanwhile may hold keys that moved out from ahead of the reader.
    pub fn delivered(&mut self, stream_seq: u64) -> ScanStep {
        if self.done {
            return ScanStep::Done;
        }
        // A consumer that recreates itself may deliver again from an earlier sequence.
        self.delivered = self.delivered.max(stream_seq);
        if self.target.is_some_and(|target| self.delivered >= target) {
            self.target = None;
        }
        self.step()
    }

    /// Nothing was delivered for a while. Never the end by itself: the newest message may
    /// have been removed before it was delivered (a purge, an overwrite), so confirm
    /// again; an early idle costs one read, never a short listing.
    pub fn idle(&mut self) -> ScanStep {
        if !self.done {
            self.target = None;
        }
        self.step()
    }
}

#[cfg(test)]
mod tests {
    //! The cases by hand; `tests/queue_scan.rs` drives the piece against the JetStream
    //! model over random interleavings.
    use super::*;

    #[test]
    fn an_empty_stream_is_listed_without_a_consumer() {
        let mut scan = ScanEnd::new();
        assert_eq!(
            scan.step(),
            ScanStep::Confirm,
            "a listing starts by confirming"
        );
        assert_eq!(
            scan.confirmed(None),
            ScanStep::Done,
            "a stream that holds no message has nothing to list"
        );
    }

    #[test]
    fn reaching_the_confirmed_sequence_asks_for_another_confirmation() {
        let mut scan = ScanEnd::new();
        assert_eq!(scan.confirmed(Some(3)), ScanStep::ReadOn);
        assert_eq!(scan.delivered(1), ScanStep::ReadOn);
        assert_eq!(
            scan.delivered(3),
            ScanStep::Confirm,
            "a key overwritten from ahead of the reader is only in what was written after \
             the first confirmation: reaching it is not the end"
        );
        assert_eq!(
            scan.confirmed(Some(5)),
            ScanStep::ReadOn,
            "two messages came since"
        );
        assert_eq!(scan.delivered(5), ScanStep::Confirm);
        assert_eq!(
            scan.confirmed(Some(5)),
            ScanStep::Done,
            "nothing newer than what was delivered: complete"
        );
        assert_eq!(scan.delivered(6), ScanStep::Done, "done stays done");
    }

    #[test]
    fn an_idle_spell_confirms_and_never_ends_a_listing_alone() {
        let mut scan = ScanEnd::new();
        scan.confirmed(Some(9));
        scan.delivered(4);
        assert_eq!(
            scan.idle(),
            ScanStep::Confirm,
            "silence is no proof: the newest message may be gone, or only late"
        );
        assert_eq!(
            scan.confirmed(Some(9)),
            ScanStep::ReadOn,
            "still there: read on (it is only late)"
        );
        scan.idle();
        assert_eq!(
            scan.confirmed(Some(4)),
            ScanStep::Done,
            "the message at 9 was removed, and every message the stream holds was delivered"
        );
    }

    #[test]
    fn a_consumer_that_delivers_again_from_earlier_does_not_move_the_listing_back() {
        let mut scan = ScanEnd::new();
        scan.confirmed(Some(5));
        scan.delivered(4);
        scan.delivered(2);
        assert_eq!(scan.delivered_through(), 4);
        assert_eq!(scan.delivered(5), ScanStep::Confirm);
    }
}
