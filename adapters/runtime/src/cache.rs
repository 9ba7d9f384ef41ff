//! The ready-made cache: a follower's writer and cheap, cloneable reader handles.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use tokio::sync::{broadcast, watch};

use crate::error::{Error, Result};
use crate::sink::Sink;

/// How many changes a slow subscriber can fall behind before it lags.
const CHANGES_CAPACITY: usize = 1024;

/// A change to the cache, as a subscriber sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    /// `key` now holds the value written at `seq`.
    Put {
        /// The key.
        key: String,
        /// The value's seq.
        seq: u64,
    },
    /// `key` was removed at `seq`.
    Removed {
        /// The key.
        key: String,
        /// The removal's seq.
        seq: u64,
    },
    /// The initial sync completed.
    Ready {
        /// The watermark then.
        watermark: u64,
    },
}

/// The cache's map. Hashed, not ordered: nothing reads it in order but the rare
/// [`Cache::keys`] and [`Cache::snapshot`], which sort; a `BTreeMap` made every insert of
/// an initial sync pay for an order nobody used (0.36 s vs 0.12 s for 1M puts, the
/// `follower_task` bench). foldhash, randomly seeded per process (no clock or seed of the
/// core's reaches it, and no iteration order reaches an output unsorted). Keys are the
/// follower's own `Arc<str>`, shared with its index: one allocation per key, not two.
type Map<V> = HashMap<Arc<str>, (u64, Arc<V>), foldhash::fast::RandomState>;

#[derive(Debug)]
struct Shared<V> {
    map: RwLock<Map<V>>,
    watermark: AtomicU64,
    changes: broadcast::Sender<Change>,
}

/// A reader handle on a follower's cache: cheap to clone, safe to share across tasks.
///
/// Values are shared, not copied: [`get`](Self::get) hands out an `Arc` of the stored
/// value. A follower applies each batch under one write lock, together with its
/// watermark, so a reader sees whole batches. [`keys`](Self::keys) and
/// [`snapshot`](Self::snapshot) are in key order. [`wait_ready`](Self::wait_ready)
/// resolves once the initial sync loaded every current entry of the source.
#[derive(Debug)]
pub struct Cache<V> {
    shared: Arc<Shared<V>>,
    ready: watch::Receiver<bool>,
}

impl<V> Clone for Cache<V> {
    fn clone(&self) -> Self {
        Cache {
            shared: Arc::clone(&self.shared),
            ready: self.ready.clone(),
        }
    }
}

/// Keys that keep their values, each as of its new seq ([`Sink::restamp`]).
type Restamps = Vec<(Arc<str>, u64)>;

/// One change waiting for the batch's commit: a value to put, or `None` to remove.
#[derive(Debug)]
struct Pending<V> {
    key: Arc<str>,
    seq: u64,
    value: Option<Arc<V>>,
}

/// The follower's side of a [`Cache`]: the only writer. It gathers a batch's changes and
/// applies them at the batch's commit, under one write lock.
#[derive(Debug)]
pub struct CacheWriter<V> {
    shared: Arc<Shared<V>>,
    ready: watch::Sender<bool>,
    pending: Vec<Pending<V>>,
    /// Keys restamped in the batch (a new history's entries equal to what the cache
    /// holds), each list with the number of pending changes before it.
    restamps: Vec<(usize, Restamps)>,
}

/// A new, empty cache: its writer (give it to a follower) and a reader.
#[must_use]
pub fn cache<V>() -> (CacheWriter<V>, Cache<V>) {
    let shared = Arc::new(Shared {
        map: RwLock::new(Map::default()),
        watermark: AtomicU64::new(0),
        changes: broadcast::channel(CHANGES_CAPACITY).0,
    });
    let (tx, rx) = watch::channel(false);
    (
        CacheWriter {
            shared: Arc::clone(&shared),
            ready: tx,
            pending: Vec::new(),
            restamps: Vec::new(),
        },
        Cache { shared, ready: rx },
    )
}

impl<V> Cache<V> {
    fn map(&self) -> RwLockReadGuard<'_, Map<V>> {
        self.shared.map.read().unwrap_or_else(|e| e.into_inner())
    }

    /// `key`'s value, shared (no copy of the value is made).
    #[must_use]
    pub fn get(&self, key: &str) -> Option<Arc<V>> {
        self.map().get(key).map(|(_, v)| Arc::clone(v))
    }

    /// `key`'s value, shared, and its seq.
    #[must_use]
    pub fn get_versioned(&self, key: &str) -> Option<(u64, Arc<V>)> {
        self.map().get(key).map(|(s, v)| (*s, Arc::clone(v)))
    }

    /// Reads `key`'s value in place, under the read lock (keep `f` short).
    pub fn with<R>(&self, key: &str, f: impl FnOnce(&V) -> R) -> Option<R> {
        self.map().get(key).map(|(_, v)| f(v))
    }

    /// How many keys it holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Every key, in order.
    #[must_use]
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.map().keys().map(|k| k.to_string()).collect();
        keys.sort_unstable();
        keys
    }

    /// Every entry (key, seq, shared value), in key order, at one point in time.
    #[must_use]
    pub fn snapshot(&self) -> Vec<(String, u64, Arc<V>)> {
        let mut entries: Vec<(String, u64, Arc<V>)> = self
            .map()
            .iter()
            .map(|(k, (s, v))| (k.to_string(), *s, Arc::clone(v)))
            .collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    /// Calls `f` on every entry, in no particular order, holding the read lock (keep it
    /// short; [`snapshot`](Self::snapshot) gives key order without holding it).
    pub fn for_each(&self, mut f: impl FnMut(&str, u64, &V)) {
        for (k, (s, v)) in self.map().iter() {
            f(k, *s, v);
        }
    }

    /// The applied watermark: the highest seq whose effect is in the cache.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.shared.watermark.load(Ordering::Acquire)
    }

    /// Whether the initial sync completed.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the initial sync completed; returns the watermark. Fails with
    /// [`Error::Closed`] if the follower went away before that.
    pub async fn wait_ready(&self) -> Result<u64> {
        let mut rx = self.ready.clone();
        rx.wait_for(|ready| *ready)
            .await
            .map_err(|_| Error::Closed("cache writer"))?;
        Ok(self.watermark())
    }

    /// Subscribes to changes from now on. A subscriber that falls more than 1024 changes
    /// behind gets `Lagged`: it should re-read [`snapshot`](Self::snapshot).
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.shared.changes.subscribe()
    }
}

impl<V> CacheWriter<V> {
    /// Another reader of this cache.
    #[must_use]
    pub fn reader(&self) -> Cache<V> {
        Cache {
            shared: Arc::clone(&self.shared),
            ready: self.ready.subscribe(),
        }
    }

    fn announce(&self, change: impl FnOnce() -> Change) {
        // Building and sending a change costs; nobody listening costs nothing.
        if self.shared.changes.receiver_count() > 0 {
            let _ = self.shared.changes.send(change());
        }
    }

    /// Applies the batch's changes under one write lock and moves the watermark, then
    /// tells subscribers (who thus never see a change above the watermark they read).
    fn apply_pending(&mut self, watermark: u64) {
        if self.pending.is_empty() && self.restamps.is_empty() {
            self.shared.watermark.store(watermark, Ordering::Release);
            return;
        }
        // receiver_count takes the channel's lock: ask once per batch.
        let announced = self.shared.changes.receiver_count() > 0;
        let mut changes = Vec::new();
        {
            let mut map = self.shared.map.write().unwrap_or_else(|e| e.into_inner());
            let mut restamps = std::mem::take(&mut self.restamps).into_iter().peekable();
            for (i, Pending { key, seq, value }) in self.pending.drain(..).enumerate() {
                while let Some((_, keys)) = restamps.next_if(|(before, _)| *before <= i) {
                    restamp(&mut map, keys, announced.then_some(&mut changes));
                }
                match value {
                    Some(value) => {
                        if announced {
                            changes.push(Change::Put {
                                key: key.to_string(),
                                seq,
                            });
                        }
                        map.insert(key, (seq, value));
                    }
                    None => {
                        map.remove(&key);
                        if announced {
                            let key = key.to_string();
                            changes.push(Change::Removed { key, seq });
                        }
                    }
                }
            }
            for (_, keys) in restamps {
                restamp(&mut map, keys, announced.then_some(&mut changes));
            }
            self.shared.watermark.store(watermark, Ordering::Release);
        }
        // A batch of a whole new history needs room for a change per key: not kept once
        // it is applied (32 MiB at 1M keys), beyond what a sync's batch needs.
        if self.pending.capacity() > crate::sink::SYNC_FEED_BATCH {
            self.pending.shrink_to(crate::sink::SYNC_FEED_BATCH);
        }
        for change in changes {
            let _ = self.shared.changes.send(change);
        }
    }
}

/// Keeps each key's value, now as of its new seq (noted in `changes`, when someone
/// listens). The follower restamps only keys the cache said it holds.
fn restamp<V>(map: &mut Map<V>, keys: Restamps, mut changes: Option<&mut Vec<Change>>) {
    for (key, seq) in keys {
        let Some(held) = map.get_mut(&key) else {
            debug_assert!(false, "{key} restamped but not held");
            continue;
        };
        held.0 = seq;
        if let Some(changes) = changes.as_deref_mut() {
            let key = key.to_string();
            changes.push(Change::Put { key, seq });
        }
    }
}

impl<V: Send + Sync> Sink<V> for CacheWriter<V> {
    const FALLIBLE: bool = false;
    const HOLDS_VALUES: bool = true;

    fn holds(&self, key: &str, new: &V, same: &dyn Fn(&V, &V) -> bool) -> bool {
        // Only what is committed: a change pending would not be what it compares with.
        debug_assert!(self.pending.is_empty() && self.restamps.is_empty());
        self.shared
            .map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .is_some_and(|(_, held)| same(held, new))
    }

    async fn restamp(&mut self, keys: Vec<(Arc<str>, u64)>) -> Result<()> {
        self.restamps.push((self.pending.len(), keys));
        Ok(())
    }

    async fn put(&mut self, key: Arc<str>, seq: u64, value: V) -> Result<()> {
        self.pending.push(Pending {
            key,
            seq,
            value: Some(Arc::new(value)),
        });
        Ok(())
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        self.pending.push(Pending {
            key,
            seq,
            value: None,
        });
        Ok(())
    }

    fn reserve(&mut self, keys: usize) {
        let mut map = self.shared.map.write().unwrap_or_else(|e| e.into_inner());
        if map.capacity() - map.len() < keys {
            map.reserve(keys);
        }
        self.pending.reserve(keys.min(crate::sink::SYNC_FEED_BATCH));
    }

    fn ready(&mut self, watermark: u64) {
        self.apply_pending(watermark);
        self.ready.send_replace(true);
        self.announce(|| Change::Ready { watermark });
    }

    async fn commit(&mut self, watermark: u64, _: tidemark_core::Lineage) -> Result<()> {
        self.apply_pending(watermark);
        Ok(())
    }

    async fn rollback(&mut self) {
        self.pending.clear();
        self.restamps.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_huge_batch_leaves_no_room_for_another_behind() {
        let (mut writer, reader) = cache::<u64>();
        let n = 2 * crate::sink::SYNC_FEED_BATCH as u64;
        for i in 0..n {
            writer.put(format!("k{i}").into(), i + 1, i).await.unwrap();
        }
        writer
            .commit(n, tidemark_core::Lineage::default())
            .await
            .unwrap();
        assert_eq!(reader.len() as u64, n);
        assert!(
            writer.pending.capacity() <= crate::sink::SYNC_FEED_BATCH,
            "{} changes of room kept, empty",
            writer.pending.capacity()
        );
    }
}
