//! The switch of a snapshot: its puts decided as the driver takes them, a few thousand
//! outputs at a time, rather than all at once. A new history whose values differ from the
//! cache's puts every key: deciding them at once held a queued output per key (72 bytes,
//! 72 MiB at 1M keys) beside the sink's own list of them, and the entries they came from
//! until the last was decided. Now each part's kept entries are freed as they are decided.
//! Nothing else can happen in between: any input, timeout or mutator first decides the
//! rest, so every decision and every state the driver can act on is the one deciding
//! everything at once gives.

use super::Follower;
use super::parts::Kept;
use crate::decode::Decode;
use crate::entry::{Entry, Op};
use crate::follower::status::InvalidReason;

/// How many outputs a switch decides ahead of the driver.
const SWITCH_AHEAD: usize = 4096;

/// The entries a switch has yet to decide, in the order they came.
#[derive(Debug)]
pub(super) enum Rest {
    /// A snapshot read whole.
    Whole(std::vec::IntoIter<Entry>),
    /// What a snapshot read in parts kept, part by part (each freed once passed).
    Parts {
        parts: std::vec::IntoIter<Vec<Kept>>,
        part: std::vec::IntoIter<Kept>,
    },
}

impl Iterator for Rest {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        match self {
            Rest::Whole(entries) => entries.next(),
            Rest::Parts { parts, part } => loop {
                if let Some(kept) = part.next() {
                    return Some(kept.into_entry());
                }
                *part = parts.next()?.into_iter();
            },
        }
    }
}

/// A snapshot being applied: what is left of its entries, and what its end reports.
#[derive(Debug)]
pub(super) struct Switch {
    pub(super) rest: Rest,
    /// Puts (and restamps) applied so far.
    pub(super) applied: usize,
    /// The highest seq named so far (at least the snapshot's watermark).
    pub(super) top: u64,
    /// The seq of the removals it makes.
    pub(super) removal_seq: u64,
    /// Keys it removed as gone.
    pub(super) removed: usize,
    /// The snapshot's watermark.
    pub(super) source_watermark: u64,
}

impl<D: Decode> Follower<D> {
    /// Starts applying a snapshot's entries (its removals and restamps are decided): the
    /// first outputs are decided now, the rest as the driver takes them.
    pub(super) fn start_switch(&mut self, switch: Switch) {
        debug_assert!(self.switch.is_none(), "one switch at a time");
        self.switch = Some(Box::new(switch));
        self.switch_more(SWITCH_AHEAD);
    }

    /// The driver took the last decided output: the next are decided.
    pub(super) fn switch_on(&mut self) {
        if self.out.is_empty() {
            self.switch_more(SWITCH_AHEAD);
        }
    }

    /// Decides the rest of a switch at once, before anything else changes the follower.
    pub(super) fn finish_switch(&mut self) {
        self.switch_more(usize::MAX);
    }

    /// Decides the switch's entries until `room` outputs wait, or all of them, then its
    /// end: an output always waits while a switch is under way.
    fn switch_more(&mut self, room: usize) {
        let Some(mut switch) = self.switch.take() else {
            return;
        };
        while self.out.len() < room {
            let Some(entry) = switch.rest.next() else {
                self.end_switch(*switch);
                return;
            };
            switch.top = switch.top.max(entry.seq);
            if entry.seq == 0 {
                self.invalid(0, &entry.key, InvalidReason::ZeroSeq);
            } else if entry.op != Op::Put {
                self.invalid(entry.seq, &entry.key, InvalidReason::UnexpectedInRows);
            } else if self.index.get(&entry.key) != Some(entry.seq) || self.put_again(&entry.key) {
                switch.applied += self
                    .apply(entry.seq, entry.key, Op::Put, entry.value, entry.expires_in)
                    .0;
            }
        }
        self.switch = Some(switch);
    }

    /// Every entry was decided: the keys no entry replaced go, the watermark catches up,
    /// and the follower reports the resync.
    fn end_switch(&mut self, switch: Switch) {
        let Switch {
            applied,
            top,
            removal_seq,
            removed,
            source_watermark,
            ..
        } = switch;
        let removed = removed + self.remove_unreplaced(removal_seq);
        self.advance(top);
        let read = self.read_lineage.take().map(|(_, l)| l);
        self.adopt_snapshot_lineage(source_watermark, read);
        self.caught_up(applied, removed, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FollowerConfig;
    use crate::decode::Utf8;
    use crate::follower::io::{FeedInfo, Input, Output, Request, Token};
    use crate::time::Time;

    /// Takes the outputs waiting, answering what a resync needs: the lookup, the open (a
    /// feed compacted past the watermark). Returns the snapshot's token once asked for.
    fn drive(f: &mut Follower<Utf8>, watermark: u64) -> Option<Token> {
        let mut asked = None;
        while let Some(out) = f.poll_output() {
            match out {
                Output::Request(Request::LookupSource { token }) => {
                    f.handle_input(Input::SourceFound { token }, Time::ZERO);
                }
                Output::Request(Request::OpenFeed { token, .. }) => {
                    let info = FeedInfo::kv(watermark + 6, watermark + 10);
                    f.handle_input(Input::FeedOpened { token, info }, Time::ZERO);
                }
                Output::Request(Request::Snapshot { token }) => asked = Some(token),
                _ => {}
            }
        }
        asked
    }

    /// A follower of `n` keys at seqs 1..=n handed a new history's snapshot, whole, of
    /// the same keys at other values.
    fn switching(n: u64) -> Follower<Utf8> {
        let config = FollowerConfig::builder("t").seed(1).build().expect("valid");
        let cache = (1..=n).map(|i| (format!("k{i:05}"), i));
        let mut f = Follower::resume(config, Utf8, n, cache);
        let token = drive(&mut f, n).expect("a resync");
        let entries = (1..n)
            .map(|i| Entry::put(i, format!("k{i:05}"), "new"))
            .collect();
        let answer = Input::Snapshot {
            token,
            entries,
            source_watermark: n - 1,
        };
        f.handle_input(answer, Time::ZERO);
        f
    }

    #[test]
    fn a_switch_decides_its_puts_as_they_are_taken_not_all_at_once() {
        let n = 4 * SWITCH_AHEAD as u64;
        let mut f = switching(n);
        assert!(
            f.out.len() <= SWITCH_AHEAD + 1,
            "{} outputs decided ahead of the driver",
            f.out.len()
        );
        let mut puts = 0;
        let mut last = None;
        while let Some(out) = f.poll_output() {
            assert!(f.out.len() <= SWITCH_AHEAD);
            puts += usize::from(matches!(out, Output::Apply(crate::Apply::Put { .. })));
            last = Some(out);
        }
        assert_eq!(puts as u64, n - 1, "every key of the new history put");
        assert!(matches!(
            last,
            Some(Output::Request(_)) | Some(Output::Notice(_))
        ));
        assert_eq!(f.watermark(), n - 1);
    }

    #[test]
    fn anything_else_that_happens_first_decides_the_rest_of_the_switch() {
        let n = 4 * SWITCH_AHEAD as u64;
        let mut f = switching(n);
        assert!(f.switch.is_some());
        f.handle_timeout(Time::ZERO);
        assert!(f.switch.is_none(), "decided whole before the timeout");
        assert_eq!(f.watermark(), n - 1);
        let puts = std::iter::from_fn(|| f.poll_output())
            .filter(|o| matches!(o, Output::Apply(crate::Apply::Put { .. })))
            .count();
        assert_eq!(puts as u64, n - 1);
    }
}
