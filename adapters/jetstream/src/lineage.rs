//! Which history a stream serves, as the facts of a read say it: the stream's creation
//! time is its history, and a message's stored time is the stamp of the mutation at its
//! seq (tidemark's `Lineage`, which this crate cannot name: the adapter converts).
//!
//! What nats-server gives (read in its source, `server/stream.go`, `jetstream_cluster.go`,
//! `stream_backup.go`, `filestore.go`):
//! - a stream deleted and made again has a new creation time (`time.Now()` when it is
//!   added): another history, whatever its seqs;
//! - a stream restored from a backup of the first format (2.14 and before) on a single
//!   server keeps the backup's creation time (`Account::RestoreStream` sets it from the
//!   backup's metadata); in a cluster it gets the time of the restore request
//!   (`jsClusteredStreamRestoreRequest`, then `processClusterCreateStream`); from a
//!   backup of 2.15's format (`RestoreStreamV2`, `server/stream_backup.go`) the time it
//!   is added again — measured with 2.15.1 (`tidemark-nats`'s `one_history` tests);
//! - every restore keeps its messages' stored times (the message blocks are copied, or each
//!   message is stored again with its time), and a message stored after it is stamped
//!   with the server's clock then (`processJetStreamMsg`): later than the messages the
//!   restore lost, so the seq they reuse has another stamp.

use crate::stream::Created;

/// What a read of a stream says of its history at a seq: the history (the stream's
/// creation time) and the stamp of the mutation at that seq (its message's stored time),
/// each in nanoseconds since the Unix epoch, `None` where the read cannot tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamLineage {
    /// The stream's creation time: another stream (deleted and made again) has another.
    pub history: Option<u64>,
    /// The stored time of the stream's message at the seq the read names.
    pub stamp: Option<u64>,
}

impl StreamLineage {
    /// The same lineage, of a stream created at `created`.
    #[must_use]
    pub fn with_history(mut self, created: Created) -> Self {
        self.history = history(created);
        self
    }

    /// What a read of a stream created at `created` says, its message at the seq the read
    /// names stored at `stored_ns` (`None`: gone — overwritten, deleted, purged — or no
    /// seq named). A creation time the server leaves unset (zero, or out of range) and a
    /// stored time of zero tell nothing.
    #[must_use]
    pub fn read(created: Created, stored_ns: Option<u64>) -> Self {
        StreamLineage {
            history: history(created),
            stamp: stored_ns.and_then(stamp),
        }
    }
}

/// A stream's creation time as a history: `None` where the server gives none (zero, a
/// time before the epoch, or one past what 64 bits of nanoseconds hold).
#[must_use]
pub fn history(created: Created) -> Option<u64> {
    u64::try_from(created).ok().filter(|c| *c > 0)
}

/// A message's stored time as the stamp of its mutation: `None` where the server gives
/// none (zero).
#[must_use]
pub fn stamp(stored_ns: u64) -> Option<u64> {
    (stored_ns > 0).then_some(stored_ns)
}

/// The message of a replay with the highest seq, as the replay delivered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Its seq.
    pub seq: u64,
    /// Its stored time, in nanoseconds since the Unix epoch.
    pub stored_ns: u64,
}

/// Keeps, of a replay's messages, the one with the highest seq: the stamp a snapshot
/// reports at its watermark comes with its messages, never from a read after them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Highest(Option<Delivered>);

impl Highest {
    /// A message was delivered.
    pub fn on_message(&mut self, seq: u64, stored_ns: u64) {
        if self.0.is_none_or(|d| seq > d.seq) {
            self.0 = Some(Delivered { seq, stored_ns });
        }
    }

    /// The highest-seq message delivered, if any.
    #[must_use]
    pub fn get(self) -> Option<Delivered> {
        self.0
    }
}

/// Why a snapshot's lineage cannot be told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Remade {
    /// The stream read before the snapshot's messages is not the one read with them: it
    /// was deleted and made again (or restored) during the read. Read the snapshot again.
    During {
        /// The creation time read before.
        before: Created,
        /// The creation time read with the messages.
        after: Created,
    },
}

/// The lineage a snapshot at `watermark` reports: the stream's creation time read before
/// its messages (`before`), which must be the one read once its consumer existed
/// (`after`), and the stamp of the message at the watermark as the replay itself
/// delivered it (`highest`) — `None` when the watermark is not a delivered message's seq
/// (its message is gone, or outside the view). A stamp read after the messages could be a
/// restored stream's, kept beside the old stream's entries, and hide the restore for good.
///
/// # Errors
/// [`Remade::During`] when `before` and `after` differ.
pub fn snapshot_lineage(
    before: Created,
    after: Created,
    watermark: u64,
    highest: Highest,
) -> Result<StreamLineage, Remade> {
    if before != after {
        return Err(Remade::During { before, after });
    }
    let stored = highest
        .get()
        .filter(|d| d.seq == watermark && watermark > 0)
        .map(|d| d.stored_ns);
    Ok(StreamLineage::read(after, stored))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn what_the_server_leaves_unset_tells_nothing() {
        assert_eq!(StreamLineage::read(0, Some(0)), StreamLineage::default());
        assert_eq!(StreamLineage::read(-5, None).history, None);
        assert_eq!(StreamLineage::read(i128::MAX, None).history, None);
        assert_eq!(
            StreamLineage::read(7, Some(9)),
            StreamLineage {
                history: Some(7),
                stamp: Some(9)
            }
        );
    }

    #[test]
    fn a_snapshot_stamps_its_watermark_only_with_the_message_it_delivered_there() {
        let mut highest = Highest::default();
        highest.on_message(4, 40);
        highest.on_message(9, 90);
        highest.on_message(6, 60);
        assert_eq!(
            highest.get(),
            Some(Delivered {
                seq: 9,
                stored_ns: 90
            })
        );
        assert_eq!(
            snapshot_lineage(1, 1, 9, highest).map(|l| l.stamp),
            Ok(Some(90))
        );
        assert_eq!(
            snapshot_lineage(1, 1, 10, highest).map(|l| l.stamp),
            Ok(None),
            "the watermark's message was not delivered (purged, or another view's)"
        );
        assert_eq!(
            snapshot_lineage(1, 1, 0, Highest::default()),
            Ok(StreamLineage::read(1, None))
        );
        assert_eq!(
            snapshot_lineage(1, 2, 9, highest),
            Err(Remade::During {
                before: 1,
                after: 2
            }),
            "a stream made again during the read: no lineage to keep"
        );
    }

    proptest! {
        /// Whatever the order of delivery, the highest seq's time is kept, and the
        /// snapshot's stamp is that time exactly when it names the watermark.
        #[test]
        fn the_highest_message_wins_in_any_order(
            mut seqs in proptest::collection::vec(1u64..50, 1..20),
            watermark in 0u64..60,
        ) {
            seqs.sort_unstable();
            seqs.dedup();
            let top = *seqs.last().unwrap_or(&0);
            let mut shuffled = seqs.clone();
            shuffled.reverse();
            shuffled.rotate_left(seqs.len() / 2);
            let mut highest = Highest::default();
            for s in &shuffled {
                highest.on_message(*s, s * 10);
            }
            prop_assert_eq!(highest.get().map(|d| d.seq), Some(top));
            let l = snapshot_lineage(3, 3, watermark, highest).unwrap();
            prop_assert_eq!(l.history, Some(3));
            prop_assert_eq!(l.stamp, (watermark == top).then_some(top * 10));
        }
    }
}
