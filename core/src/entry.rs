//! Feed entries and how their operations map to cache changes.

use std::sync::Arc;

/// What a feed entry says happened to its key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// A new value for the key.
    Put,
    /// The key was deleted (a NATS KV `DEL`, a SQL row removal, a `removed` event).
    Delete,
    /// The key was purged (a NATS KV `PURGE`, or an expiry marker). To a cache, the same
    /// as a delete.
    Purge,
    /// A marker: the key changed at this seq; its value must be fetched from the source.
    Mutation,
    /// An operation this version does not know. Never treated as a put: it is a counted
    /// skip.
    Unknown(String),
}

/// The change an operation makes to a cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheChange {
    /// Insert or replace the key's value.
    Upsert,
    /// Remove the key.
    Remove,
    /// Fetch the key's current value from the source, then upsert or remove.
    Fetch,
    /// Do nothing (count and skip the entry).
    Skip,
}

impl Op {
    /// The cache change this operation stands for: put → upsert; delete and purge →
    /// remove (the distinction is invisible to a cache); a marker → fetch; unknown → skip.
    #[must_use]
    pub fn cache_change(&self) -> CacheChange {
        match self {
            Op::Put => CacheChange::Upsert,
            Op::Delete | Op::Purge => CacheChange::Remove,
            Op::Mutation => CacheChange::Fetch,
            Op::Unknown(_) => CacheChange::Skip,
        }
    }
}

/// One entry observed on a feed, or one row of a reconcile or snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The feed's own position of this entry (its cursor), which may differ from `seq` on an
    /// events stream. For a KV bucket or a source's change log it equals `seq`.
    pub position: u64,
    /// The source's sequence number of the mutation. Positive; zero is invalid.
    pub seq: u64,
    /// The entity key, shared: the follower's index, the cache and a feed's own buffer can
    /// hold the one allocation (a clone is a count, not a copy).
    pub key: Arc<str>,
    /// What happened.
    pub op: Op,
    /// The value's bytes; empty unless `op` is [`Op::Put`].
    pub value: Vec<u8>,
    /// How many entries the feed still holds after this one, where the feed knows.
    pub pending: Option<u64>,
    /// How much longer the value lives where the source drops values silently when they
    /// age (a NATS bucket with `max_age` and no limit markers): the follower removes it
    /// itself once this much time has passed on its clock.
    pub expires_in: Option<std::time::Duration>,
    /// The source's stamp of this mutation, where it gives one: a value no other mutation
    /// at the same seq gets, even in a history restored from a backup (see
    /// [`Lineage`](crate::Lineage)). A follower keeps the stamp of the entry at its
    /// watermark to tell its history from another.
    pub stamp: Option<u64>,
}

impl Entry {
    /// An entry whose position is its own seq (a KV bucket, a source's change log).
    #[must_use]
    pub fn new(position: u64, seq: u64, key: impl Into<Arc<str>>, op: Op, value: Vec<u8>) -> Self {
        Entry {
            position,
            seq,
            key: key.into(),
            op,
            value,
            pending: None,
            expires_in: None,
            stamp: None,
        }
    }

    /// A put of `value` at `seq` (position = seq).
    #[must_use]
    pub fn put(seq: u64, key: impl Into<Arc<str>>, value: impl Into<Vec<u8>>) -> Self {
        Entry::new(seq, seq, key, Op::Put, value.into())
    }

    /// A removal at `seq` (position = seq).
    #[must_use]
    pub fn delete(seq: u64, key: impl Into<Arc<str>>) -> Self {
        Entry::new(seq, seq, key, Op::Delete, Vec::new())
    }

    /// A mutation marker at `seq` (position = seq): "`key` changed; fetch it".
    #[must_use]
    pub fn mutation(seq: u64, key: impl Into<Arc<str>>) -> Self {
        Entry::new(seq, seq, key, Op::Mutation, Vec::new())
    }

    /// Builds an entry from borrowed feed bytes. Only a put copies its bytes: a delete,
    /// purge or marker carries none, whatever payload the feed attached.
    #[must_use]
    pub fn from_borrowed(
        position: u64,
        seq: u64,
        key: impl Into<Arc<str>>,
        op: Op,
        payload: &[u8],
    ) -> Self {
        let value = if op == Op::Put {
            payload.to_vec()
        } else {
            Vec::new()
        };
        Entry::new(position, seq, key, op, value)
    }

    /// The same entry, noting how many entries the feed still holds after it.
    #[must_use]
    pub fn with_pending(mut self, pending: u64) -> Self {
        self.pending = Some(pending);
        self
    }

    /// The same entry, with the source's stamp of its mutation (see [`Entry::stamp`]).
    #[must_use]
    pub fn stamped(mut self, stamp: Option<u64>) -> Self {
        self.stamp = stamp;
        self
    }

    /// The same entry, whose value the source drops silently after `ttl` more.
    #[must_use]
    pub fn expiring_in(mut self, ttl: std::time::Duration) -> Self {
        self.expires_in = Some(ttl);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_map_to_cache_changes() {
        assert_eq!(Op::Put.cache_change(), CacheChange::Upsert);
        assert_eq!(Op::Delete.cache_change(), CacheChange::Remove);
        assert_eq!(
            Op::Purge.cache_change(),
            CacheChange::Remove,
            "purge and delete must look the same to a cache"
        );
        assert_eq!(Op::Mutation.cache_change(), CacheChange::Fetch);
        assert_eq!(
            Op::Unknown("ROLLUP".into()).cache_change(),
            CacheChange::Skip,
            "an unknown operation must never become a put"
        );
    }

    #[test]
    fn only_a_put_copies_bytes() {
        let payload = b"tombstone payload";
        assert_eq!(
            Entry::from_borrowed(1, 1, "k", Op::Put, payload).value,
            payload
        );
        for op in [Op::Delete, Op::Purge, Op::Mutation, Op::Unknown("X".into())] {
            let e = Entry::from_borrowed(1, 1, "k", op.clone(), payload);
            assert!(e.value.is_empty(), "{op:?} must not carry bytes");
        }
    }
}
