//! Where a reader of a stream with durable cursors starts, and whether a cursor's floor
//! remembered from an earlier save still holds — across a stream deleted and made again.
//!
//! A stream made again under the same name starts its sequences at 1 again, and the
//! durable consumers that kept cursors went with the old one. A position saved or
//! checkpointed on the old stream means nothing on the new one: opened "after" it, a
//! reader skips the new stream's first events (all of them while the new stream is
//! shorter than the old position, and every event published until it passes it); a floor
//! remembered from it answers saves that were never stored. What tells the streams apart
//! is their identity, the time the server created them ([`Created`]), and, without one
//! remembered (a fresh process), a position past the stream's last sequence, which no
//! message of this stream ever had.

use crate::{Created, StreamState};

/// Where to start reading a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// At its first message: deliver everything it holds.
    First,
    /// After this position: the next message delivered is the first above it.
    After(u64),
}

/// What [`Resume::open`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opening {
    /// Where the reader starts.
    pub start: Start,
    /// Whether the caller's positions were found to be another stream's (the stream was
    /// made again, or lost its newest messages): the reader started at the stream's first
    /// event, and the count of positions delivered on this stream starts again from 0.
    pub new_stream: bool,
}

/// Where a reader resumes, one per reader (a follower's feed).
///
/// The caller's position can outlive the stream it came from: a follower keeps the
/// highest position it checkpointed for as long as it runs, and a persisted one across
/// restarts, and hands it back at every open. So once a reader finds the stream is not
/// the one its positions came from, it keeps trusting a caller's position only up to what
/// it delivered itself on the new stream (the `delivered` of [`open`](Self::open)): any
/// position the follower got from this stream is one of those, and anything above is the
/// old stream's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resume {
    /// The stream this reader's positions come from, once known.
    stream: Option<Created>,
    /// Whether this reader found the caller's positions to be another stream's: it trusts
    /// them only up to what it delivered on `stream` since.
    renewed: bool,
}

impl Resume {
    /// A reader whose positions come from `stream` (the stream its handle first saw), or
    /// from an unknown one.
    #[must_use]
    pub fn new(stream: Option<Created>) -> Resume {
        Resume {
            stream,
            renewed: false,
        }
    }

    /// The stream this reader's positions come from, once known.
    #[must_use]
    pub fn stream(&self) -> Option<Created> {
        self.stream
    }

    /// Opens the stream `stream`, whose state is `state`, for a caller whose last
    /// position is `after` (none: from the start). `delivered` is the highest position the
    /// reader delivered from `stream` since the last open that reported
    /// [`Opening::new_stream`] (0 if none): it only matters after one did.
    ///
    /// - A stream other than the one the positions came from: from its first event.
    /// - A position past the stream's last sequence, which no message of it ever had: the
    ///   position is another stream's (made again before this reader knew the old one, or
    ///   this one lost its newest messages) — from its first event. An announcement read
    ///   twice is harmless (followers apply by seq); one skipped is lost.
    /// - After either, the caller's position is trusted only up to `delivered`.
    pub fn open(
        &mut self,
        stream: Created,
        after: Option<u64>,
        delivered: u64,
        state: StreamState,
    ) -> Opening {
        let another = self.stream.is_some_and(|known| known != stream);
        self.stream = Some(stream);
        let after = match after {
            Some(a) if self.renewed && !another => Some(a.min(delivered)),
            a => a,
        };
        let past_end = after.is_some_and(|a| a > state.last_seq);
        if another || past_end {
            self.renewed = true;
            return Opening {
                start: Start::First,
                new_stream: true,
            };
        }
        let start = match after {
            // Nothing before the first message is left to skip.
            Some(a) if a > 0 && a.saturating_add(1) >= crate::first_available(&state) => {
                Start::After(a)
            }
            _ => Start::First,
        };
        Opening {
            start,
            new_stream: false,
        }
    }
}

/// A cursor's floor as a handle last set or read it, with the stream it holds on.
///
/// Saves are monotone: a save at or below the floor is answered with the floor, without
/// asking the server. That answer is true only on the stream the floor was read from: on
/// a stream made again the cursor's consumer is gone, and the floor must be read again
/// (the consumer made again) before a save is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Floor {
    /// The stream the floor was read from.
    pub stream: Created,
    /// The cursor's position: every position up to it is saved.
    pub position: u64,
}

impl Floor {
    /// The floor's position if it holds on `stream`; `None` if it was read from another
    /// stream and must be read again.
    #[must_use]
    pub fn on(&self, stream: Created) -> Option<u64> {
        (self.stream == stream).then_some(self.position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OLD: Created = 1_000;
    const NEW: Created = 2_000;

    /// A stream holding every seq from `first` to `last` (none when `first > last`).
    fn seqs(first: u64, last: u64) -> StreamState {
        StreamState {
            messages: (last + 1).saturating_sub(first),
            first_seq: first,
            last_seq: last,
        }
    }

    #[test]
    fn the_same_stream_resumes_after_the_position() {
        let mut resume = Resume::new(Some(OLD));
        assert_eq!(
            resume.open(OLD, Some(8), 0, seqs(1, 10)),
            Opening {
                start: Start::After(8),
                new_stream: false
            }
        );
        assert_eq!(
            resume.open(OLD, None, 0, seqs(1, 10)).start,
            Start::First,
            "no position: everything"
        );
        assert_eq!(
            resume.open(OLD, Some(10), 0, seqs(11, 10)).start,
            Start::After(10),
            "at the end of a stream whose messages all aged out: what comes next"
        );
        assert_eq!(
            resume.open(OLD, Some(3), 0, seqs(6, 10)).start,
            Start::First,
            "below the first message: from the first"
        );
    }

    #[test]
    fn a_stream_made_again_is_read_from_its_first_event() {
        let mut resume = Resume::new(Some(OLD));
        assert_eq!(
            resume.open(NEW, Some(8), 0, seqs(1, 20)),
            Opening {
                start: Start::First,
                new_stream: true
            },
            "the new stream passed the old position: only its identity tells"
        );
        let mut resume = Resume::new(None);
        assert_eq!(
            resume.open(NEW, Some(8), 0, seqs(1, 5)),
            Opening {
                start: Start::First,
                new_stream: true
            },
            "no identity known (a fresh process): a position past the end is another stream's"
        );
    }

    #[test]
    fn after_a_new_stream_the_old_position_is_trusted_only_up_to_what_was_delivered() {
        let mut resume = Resume::new(Some(OLD));
        assert!(resume.open(NEW, Some(8), 0, seqs(1, 20)).new_stream);
        // The follower still hands back its old position 8; the reader delivered 1..=5.
        assert_eq!(
            resume.open(NEW, Some(8), 5, seqs(1, 20)),
            Opening {
                start: Start::After(5),
                new_stream: false
            },
            "events 6..=8 of the new stream were never delivered"
        );
        assert_eq!(
            resume.open(NEW, Some(8), 0, seqs(1, 20)).start,
            Start::First,
            "nothing delivered yet: from the first"
        );
        assert_eq!(
            resume.open(NEW, Some(12), 12, seqs(1, 20)).start,
            Start::After(12),
            "a position delivered on the new stream is trusted"
        );
    }

    #[test]
    fn a_floor_holds_only_on_its_stream() {
        let floor = Floor {
            stream: OLD,
            position: 8,
        };
        assert_eq!(floor.on(OLD), Some(8));
        assert_eq!(
            floor.on(NEW),
            None,
            "a stream made again has no saved cursor"
        );
    }

    /// A stream of `old_len` events read up to its end, made again with `new_len` events,
    /// and a reader of it that reopens after each of `reads` (how many events it read
    /// before the feed broke), handed back the follower's monotone position each time.
    fn run(old_len: u64, new_len: u64, reads: &[u64], known: bool) -> Result<(), TestCaseError> {
        let mut resume = Resume::new(known.then_some(OLD));
        // The follower's position: the highest it was delivered, never lowered.
        let mut position = Some(old_len);
        let (stream, len) = (NEW, new_len);
        let mut delivered = 0;
        // What the reader delivered on the current stream, every one of them.
        let mut seen = vec![false; usize::try_from(len).unwrap_or(0) + 1];
        for &read in reads {
            let opening = resume.open(stream, position, delivered, seqs(1, len));
            if opening.new_stream {
                delivered = 0;
            }
            let next = match opening.start {
                Start::First => 1,
                Start::After(a) => a + 1,
            };
            let skipped = (1..next.min(len + 1)).find(|&s| !seen[usize::try_from(s).unwrap_or(0)]);
            prop_assert!(
                skipped.is_none(),
                "opened at {} past event {:?} of the new stream, never delivered",
                next,
                skipped
            );
            let end = (next + read).min(len + 1);
            for seq in next..end {
                seen[usize::try_from(seq).unwrap_or(0)] = true;
                delivered = delivered.max(seq);
                position = position.max(Some(seq));
            }
        }
        Ok(())
    }

    proptest! {
        /// Whatever the follower hands back and however often it reopens, a reader on a
        /// stream made again never starts past an event of the new stream it did not
        /// deliver.
        #[test]
        fn no_event_of_a_new_stream_is_skipped(
            old_len in 0u64..40,
            new_len in 0u64..40,
            reads in proptest::collection::vec(0u64..10, 1..12),
            known in any::<bool>(),
        ) {
            // Unknown identity with a new stream that passed the old position is the one
            // case only a persisted identity could tell.
            prop_assume!(known || new_len < old_len);
            run(old_len, new_len, &reads, known)?;
        }
    }
}
