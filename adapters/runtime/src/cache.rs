//! The ready-made cache: a follower's writer and cheap, cloneable reader handles.

use std::collections::BTreeMap;
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

#[derive(Debug)]
struct Shared<V> {
    map: RwLock<BTreeMap<String, (u64, V)>>,
    watermark: AtomicU64,
    changes: broadcast::Sender<Change>,
}

/// A reader handle on a follower's cache: cheap to clone, safe to share across tasks.
///
/// Iteration is in key order. [`wait_ready`](Self::wait_ready) resolves once the initial
/// sync loaded every current entry of the source.
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

/// The follower's side of a [`Cache`]: the only writer.
#[derive(Debug)]
pub struct CacheWriter<V> {
    shared: Arc<Shared<V>>,
    ready: watch::Sender<bool>,
}

/// A new, empty cache: its writer (give it to a follower) and a reader.
#[must_use]
pub fn cache<V>() -> (CacheWriter<V>, Cache<V>) {
    let shared = Arc::new(Shared {
        map: RwLock::new(BTreeMap::new()),
        watermark: AtomicU64::new(0),
        changes: broadcast::channel(CHANGES_CAPACITY).0,
    });
    let (tx, rx) = watch::channel(false);
    (
        CacheWriter {
            shared: Arc::clone(&shared),
            ready: tx,
        },
        Cache { shared, ready: rx },
    )
}

impl<V> Cache<V> {
    fn map(&self) -> RwLockReadGuard<'_, BTreeMap<String, (u64, V)>> {
        self.shared.map.read().unwrap_or_else(|e| e.into_inner())
    }

    /// `key`'s value, cloned.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<V>
    where
        V: Clone,
    {
        self.map().get(key).map(|(_, v)| v.clone())
    }

    /// `key`'s value and seq, cloned.
    #[must_use]
    pub fn get_versioned(&self, key: &str) -> Option<(u64, V)>
    where
        V: Clone,
    {
        self.map().get(key).cloned()
    }

    /// Reads `key`'s value in place, without cloning it.
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
        self.map().keys().cloned().collect()
    }

    /// Every entry (key, seq, value), in key order, at one point in time.
    #[must_use]
    pub fn snapshot(&self) -> Vec<(String, u64, V)>
    where
        V: Clone,
    {
        self.map()
            .iter()
            .map(|(k, (s, v))| (k.clone(), *s, v.clone()))
            .collect()
    }

    /// Calls `f` on every entry in key order, holding the read lock (keep it short).
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
}

impl<V: Send + Sync> Sink<V> for CacheWriter<V> {
    const FALLIBLE: bool = false;

    async fn put(&mut self, key: String, seq: u64, value: V) -> Result<()> {
        // receiver_count takes the channel's lock: ask once per put, not twice.
        let announced = (self.shared.changes.receiver_count() > 0).then(|| key.clone());
        self.shared
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, (seq, value));
        if let Some(key) = announced {
            let _ = self.shared.changes.send(Change::Put { key, seq });
        }
        Ok(())
    }

    async fn remove(&mut self, key: String, seq: u64) -> Result<()> {
        self.shared
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        self.announce(|| Change::Removed { key, seq });
        Ok(())
    }

    fn ready(&mut self, watermark: u64) {
        self.shared.watermark.store(watermark, Ordering::Release);
        self.ready.send_replace(true);
        self.announce(|| Change::Ready { watermark });
    }

    async fn commit(&mut self, watermark: u64) -> Result<()> {
        self.shared.watermark.store(watermark, Ordering::Release);
        Ok(())
    }
}
