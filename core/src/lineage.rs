//! Which history a source serves ([`Lineage`]): a follower keeps it with its watermark
//! and checks it on every read, so a source recreated or restored from a backup is noticed
//! even by a follower that was down while it happened, and even once the new history has
//! passed its watermark. The follower's side lives in `follower/lineage.rs`.

/// What a read of a source says of the history it came from: the source's history, and
/// the stamp of its entry at the seq the read names.
///
/// Two facts tell histories apart, each as far as a source can tell it:
/// - the **history**: made when the source was made (a registry file's id, a stream's
///   creation time). A source deleted and made again has another.
/// - the **stamp** of an entry: a value the source gives each mutation that no other
///   mutation at the same seq gets (a random number per change-log row, a message's
///   store time). A source restored from a backup keeps its history, but the mutations
///   written since the restore reuse the seqs of the ones it lost, with other stamps: the
///   entry at a follower's watermark is then not the one it applied.
///
/// A follower keeps both for its watermark (a durable sink persists them with it) and
/// checks them on every read that names its watermark or its source's history.
///
/// Each field is `None` where the source cannot tell: a source with no history id, an
/// entry it no longer holds (compacted, or a KV revision overwritten since), a read that
/// names no seq.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Lineage {
    /// The source's history: made when the source was made, kept for its life (and by a
    /// backup of it).
    pub history: Option<u64>,
    /// The stamp of the source's entry at the seq the read names.
    pub stamp: Option<u64>,
}

impl Lineage {
    /// A lineage with both facts.
    #[must_use]
    pub fn new(history: Option<u64>, stamp: Option<u64>) -> Self {
        Lineage { history, stamp }
    }

    /// The same lineage, with the stamp of the entry at the seq it names.
    #[must_use]
    pub fn stamped(mut self, stamp: Option<u64>) -> Self {
        self.stamp = stamp;
        self
    }

    /// Whether a read's lineage proves another history than this one, both naming the
    /// same seq: their histories differ, or their stamps do. What either cannot tell
    /// proves nothing.
    #[must_use]
    pub fn contradicts(self, read: Lineage) -> bool {
        let differ =
            |a: Option<u64>, b: Option<u64>| matches!((a, b), (Some(a), Some(b)) if a != b);
        differ(self.history, read.history) || differ(self.stamp, read.stamp)
    }

    /// Whether a read of the source's history alone (at another seq than this one names)
    /// proves another history.
    #[must_use]
    pub fn other_history(self, read: Lineage) -> bool {
        Lineage::new(self.history, None).contradicts(Lineage::new(read.history, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn what_a_source_cannot_tell_contradicts_nothing() {
        let held = Lineage::new(Some(1), Some(7));
        assert!(!held.contradicts(Lineage::default()));
        assert!(!held.contradicts(Lineage::new(Some(1), None)));
        assert!(!held.contradicts(Lineage::new(None, Some(7))));
        assert!(!Lineage::default().contradicts(Lineage::new(Some(2), Some(9))));
    }

    #[test]
    fn another_history_or_another_stamp_contradicts() {
        let held = Lineage::new(Some(1), Some(7));
        assert!(held.contradicts(Lineage::new(Some(2), Some(7))));
        assert!(held.contradicts(Lineage::new(Some(1), Some(8))));
        assert!(held.contradicts(Lineage::new(None, Some(8))));
        assert!(!held.other_history(Lineage::new(Some(1), Some(8))));
        assert!(held.other_history(Lineage::new(Some(2), None)));
    }

    proptest! {
        /// Contradiction is symmetric, and a lineage never contradicts itself.
        #[test]
        fn contradiction_is_symmetric_and_irreflexive(
            a in proptest::option::of(0u64..4), b in proptest::option::of(0u64..4),
            c in proptest::option::of(0u64..4), d in proptest::option::of(0u64..4),
        ) {
            let x = Lineage::new(a, b);
            let y = Lineage::new(c, d);
            prop_assert_eq!(x.contradicts(y), y.contradicts(x));
            prop_assert!(!x.contradicts(x));
            prop_assert!(!x.other_history(y) || x.contradicts(y));
        }
    }
}
