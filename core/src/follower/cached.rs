//! What the sink already holds, for a snapshot of a new history read in parts: an entry
//! whose value equals the one the sink holds for its key keeps that value (its key and seq
//! are kept, not its bytes), so taking a history restored from a backup of the same data
//! costs keys and seqs until the switch, not a second copy of every value.

use super::Follower;
use crate::decode::Decode;
use crate::entry::{Entry, Op};
use crate::follower::io::Input;
use crate::time::Time;

/// The values a sink holds, as a snapshot part of a new history compares its entries with
/// them ([`Follower::handle_input_with`]). Read only while the sink holds its last commit
/// and nothing since (between parts, nothing is applied), so the value compared with is
/// the one the sink still holds when the history switches.
pub trait Cached<V> {
    /// Whether the value held for `key` is `new`: by `same` (the decoder's
    /// [`Decode::same`]) against a held value, or by the sink's own means (a store that
    /// keeps bytes compares bytes). `false` when none is held.
    fn holds(&self, key: &str, new: &V, same: &dyn Fn(&V, &V) -> bool) -> bool;
}

impl<D: Decode> Follower<D> {
    /// A fact happened at `now`, as [`handle_input`](Self::handle_input), with what the
    /// sink holds: a part of a snapshot of a new history ([`Input::SnapshotPart`], or the
    /// last, [`Input::Snapshot`]) keeps of an entry whose value the sink holds already
    /// (equal by [`Decode::same`]) only its key and seq, and at the switch asks the sink
    /// to keep its value as of that seq ([`Apply::Restamp`](crate::Apply::Restamp)).
    ///
    /// A driver passes this only for a sink that can restamp. Nothing else differs:
    /// readers still see the new history at once, at the last part.
    pub fn handle_input_with(&mut self, input: Input, now: Time, cached: &dyn Cached<D::Value>) {
        self.handle(input, now, Some(cached));
    }

    /// Whether `entry`, of a new history, carries the value `cached` holds for its key and
    /// would be put by the switch (a put of a valid key the follower keeps, at a seq, of
    /// a value within the limit that decodes, with no expiry to schedule): then its key
    /// and seq stand for it.
    pub(super) fn same_as_cached(&self, entry: &Entry, cached: &dyn Cached<D::Value>) -> bool {
        if entry.op != Op::Put
            || entry.seq == 0
            || entry.expires_in.is_some()
            || entry.value.len() > self.config.max_value_bytes
            || !self.keeps(&entry.key)
            || self.check_key(&entry.key).is_err()
        {
            return false;
        }
        // A copy, since an entry that differs is kept whole and decoded again at the
        // switch (a poison one too: it is counted there).
        let Ok(new) = self.decoder.decode(&entry.key, entry.value.clone()) else {
            return false;
        };
        cached.holds(&entry.key, &new, &|held, new| self.decoder.same(held, new))
    }
}
