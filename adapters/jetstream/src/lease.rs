//! Who holds a named lock kept in a KV key, judged on the server's clock: whether a lease
//! still runs, what a caller asking for the lock may write, whether a renewal or release
//! names the lease that holds it, and how often a lost compare-and-set is tried again.
//!
//! Every write to the key is a compare-and-set on the revision read, so of several
//! processes racing for a free lock exactly one wins; a lease runs from the server's
//! timestamp of the write that took or renewed it, and is judged against the server's
//! time (SPEC §17), so processes whose clocks disagree still agree on who holds it.

/// How many times a caller whose compare-and-set lost (someone else wrote meanwhile) reads
/// the key again before it reports the lock as held.
pub const TAKE_ATTEMPTS: u32 = 3;

/// A lock's record as read from its key: its holder (none once released: the record stays,
/// so the fencing token keeps growing across holders), its fencing token, its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockRecord {
    /// The holder, if any.
    pub owner: Option<String>,
    /// The fencing token of the lease that wrote it.
    pub fencing: u64,
    /// The lease's length, in nanoseconds.
    pub ttl_ns: u64,
    /// When the server stored the record (nanoseconds since the Unix epoch): the lease
    /// runs from there.
    pub stored_ns: u64,
}

impl LockRecord {
    /// A record nobody wrote as a lock (a foreign write): a free lock whose next fencing
    /// token still starts above anything a small counter handed out.
    #[must_use]
    pub fn foreign(stored_ns: u64) -> Self {
        LockRecord {
            owner: None,
            fencing: u64::from(u32::MAX),
            ttl_ns: 0,
            stored_ns,
        }
    }

    /// Whether its lease still runs at `server_now_ns` (the server's time).
    #[must_use]
    pub fn running(&self, server_now_ns: u64) -> bool {
        self.owner.is_some() && self.stored_ns.saturating_add(self.ttl_ns) > server_now_ns
    }
}

/// What a caller asking for the lock may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Another owner's lease runs: the lock is held.
    Held,
    /// Write a lease with this fencing token (compare-and-set on the revision read; a
    /// create when the key had no record).
    Write {
        /// The new lease's fencing token.
        fencing: u64,
    },
}

/// What `owner` asking for the lock may do, given the record read (`None`: no record) and
/// the server's time. Free, expired, or its own holder asking again: a new lease with a new
/// fencing token (the holder's earlier lease is lost).
#[must_use]
pub fn take(record: Option<&LockRecord>, owner: &str, server_now_ns: u64) -> Take {
    let Some(record) = record else {
        return Take::Write { fencing: 1 };
    };
    match record.owner.as_deref() {
        Some(holder) if holder != owner && record.running(server_now_ns) => Take::Held,
        _ => Take::Write {
            fencing: record.fencing.saturating_add(1),
        },
    }
}

/// Whether the lease (`owner`, `fencing`) still holds the lock whose record was read, at
/// the server's time: a renewal may be written only then.
#[must_use]
pub fn holds(record: Option<&LockRecord>, owner: &str, fencing: u64, server_now_ns: u64) -> bool {
    record.is_some_and(|r| {
        r.owner.as_deref() == Some(owner) && r.fencing == fencing && r.running(server_now_ns)
    })
}

/// Whether the lease (`owner`, `fencing`) is the one the record names, running or not: a
/// release writes the record free only then (a lock that changed hands is not released).
#[must_use]
pub fn names(record: Option<&LockRecord>, owner: &str, fencing: u64) -> bool {
    record.is_some_and(|r| r.owner.as_deref() == Some(owner) && r.fencing == fencing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(owner: Option<&str>, fencing: u64, stored_ns: u64) -> LockRecord {
        LockRecord {
            owner: owner.map(str::to_owned),
            fencing,
            ttl_ns: 10,
            stored_ns,
        }
    }

    #[test]
    fn a_running_lease_of_another_owner_holds_the_lock() {
        let r = record(Some("a"), 4, 100);
        assert_eq!(take(Some(&r), "b", 105), Take::Held);
        assert_eq!(
            take(Some(&r), "b", 110),
            Take::Write { fencing: 5 },
            "expired"
        );
        assert_eq!(
            take(Some(&r), "a", 105),
            Take::Write { fencing: 5 },
            "its holder again"
        );
        assert_eq!(take(None, "b", 0), Take::Write { fencing: 1 });
        let free = record(None, 7, 100);
        assert_eq!(take(Some(&free), "b", 101), Take::Write { fencing: 8 });
        assert_eq!(
            take(Some(&LockRecord::foreign(0)), "b", 1),
            Take::Write {
                fencing: u64::from(u32::MAX) + 1
            }
        );
    }

    #[test]
    fn only_the_running_lease_renews_and_only_the_named_one_releases() {
        let r = record(Some("a"), 4, 100);
        assert!(holds(Some(&r), "a", 4, 105));
        assert!(
            !holds(Some(&r), "a", 3, 105),
            "an older lease of the same owner"
        );
        assert!(
            !holds(Some(&r), "a", 4, 110),
            "expired by the server's clock"
        );
        assert!(names(Some(&r), "a", 4));
        assert!(!names(Some(&r), "b", 4));
        assert!(!names(None, "a", 4));
    }

    proptest! {
        /// Two owners judging one record at one server time never both get to write a
        /// lease unless the record's lease is not running; fencing tokens only grow.
        #[test]
        fn fencing_grows_and_a_running_lease_excludes_others(
            holder in proptest::option::of("[ab]"),
            fencing in 0u64..1_000,
            stored in 0u64..1_000,
            now in 0u64..1_100,
        ) {
            let r = record(holder.as_deref(), fencing, stored);
            for asker in ["a", "b"] {
                match take(Some(&r), asker, now) {
                    Take::Write { fencing: f } => prop_assert!(f > fencing),
                    Take::Held => {
                        prop_assert!(r.running(now) && holder.as_deref() != Some(asker));
                    }
                }
            }
        }
    }
}
