//! A durable store for a follower's cache and watermark, in memory: its state lives behind
//! an `Arc`, so it outlives the sink that writes it (and a simulated host that crashes),
//! like a file on disk. [`MemoryCacheSink`] is the [`Sink`] over it, committing each batch
//! with its watermark in one write, so the store holds the whole batch or none of it.
//!
//! Fault hooks make a commit fail (a retryable [`Error::Unavailable`]), make every durable
//! write slow, or make the process "crash" in the middle of a commit: the commit stops at
//! a chosen write boundary and never returns, and [`MemoryCacheStore::take_stalled`] tells
//! a simulator to crash the host now.
//!
//! A commit is a sequence of steps a sink calls in order —
//! [`begin_commit`](MemoryCacheStore::begin_commit), one or more
//! [`write`](MemoryCacheStore::write)s, [`end_commit`](MemoryCacheStore::end_commit) — so a
//! sink that splits its commit into several writes (a deliberately wrong one, in a
//! simulator) exposes the boundaries between them to the same crash.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidemark::{Ahead, CacheOp, Error, Held, Lineage, Result, Sink};

#[derive(Debug, Default)]
struct StoreFaults {
    /// Commits still to fail at their start.
    fail_next: u32,
    /// How long each durable write takes.
    latency: Duration,
    /// Crash the next commit after this many of its writes landed (0: before any).
    crash_after: Option<u32>,
    /// A commit stopped where the process crashed; not yet taken by the simulator.
    stalled: bool,
}

#[derive(Debug, Default)]
struct State {
    rows: BTreeMap<String, (u64, Vec<u8>)>,
    /// What was committed ahead of the watermark and not yet passed by it: key → (seq,
    /// whether it was a removal). A put's bytes are its row's.
    ahead: BTreeMap<String, (u64, bool)>,
    /// `None` until the first commit.
    watermark: Option<u64>,
    /// What the follower knew of its source's history at the watermark.
    lineage: Lineage,
    /// Writes of the commit in progress that have landed.
    writes_in_commit: u32,
    /// Commits that returned.
    commits: u64,
    faults: StoreFaults,
}

/// A follower's durable cache (key → seq, value) and watermark, shared by its clones.
///
/// Read it with [`held`](Self::held), [`entries`](Self::entries), [`get`](Self::get);
/// write it through a [`MemoryCacheSink`] ([`sink`](Self::sink)). One store is one
/// follower's: do not run two followers on it at once.
#[derive(Clone, Debug, Default)]
pub struct MemoryCacheStore {
    state: Arc<Mutex<State>>,
}

impl MemoryCacheStore {
    /// An empty store (no watermark: a follower on it starts cold).
    #[must_use]
    pub fn new() -> Self {
        MemoryCacheStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change is made whole under the lock, so a panic cannot leave it halfway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sink that writes this store.
    #[must_use]
    pub fn sink(&self) -> MemoryCacheSink {
        MemoryCacheSink {
            store: self.clone(),
            batch: Vec::new(),
        }
    }

    /// What the store holds: its watermark, key count and what it committed ahead of the
    /// watermark (in key order), or `None` before the first commit.
    #[must_use]
    pub fn held(&self) -> Option<Held> {
        let s = self.lock();
        let watermark = s.watermark?;
        let ahead = s
            .ahead
            .iter()
            .filter_map(|(key, &(seq, removed))| {
                if removed {
                    return Some(Ahead::Removed {
                        key: key.clone(),
                        seq,
                    });
                }
                let (held, value) = s.rows.get(key)?;
                (*held == seq).then(|| Ahead::Put {
                    key: key.clone(),
                    seq,
                    value: value.clone(),
                })
            })
            .collect();
        Some(
            Held::new(watermark, s.rows.len())
                .with_ahead(ahead)
                .with_lineage(s.lineage),
        )
    }

    /// The committed watermark, `None` before the first commit.
    #[must_use]
    pub fn watermark(&self) -> Option<u64> {
        self.lock().watermark
    }

    /// `key`'s stored seq and value.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<(u64, Vec<u8>)> {
        self.lock().rows.get(key).cloned()
    }

    /// Every stored entry: key → (seq, value).
    #[must_use]
    pub fn entries(&self) -> BTreeMap<String, (u64, Vec<u8>)> {
        self.lock().rows.clone()
    }

    /// Keys stored.
    #[must_use]
    pub fn len(&self) -> usize {
        self.lock().rows.len()
    }

    /// Whether no key is stored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.lock().rows.is_empty()
    }

    /// The stored seq of each of `keys` that is stored.
    #[must_use]
    pub fn seqs_of(&self, keys: &[String]) -> Vec<(String, u64)> {
        let s = self.lock();
        keys.iter()
            .filter_map(|k| s.rows.get(k).map(|(seq, _)| (k.clone(), *seq)))
            .collect()
    }

    /// The stored seq of every key, in key order.
    #[must_use]
    pub fn all_seqs(&self) -> Vec<(String, u64)> {
        self.lock()
            .rows
            .iter()
            .map(|(k, (seq, _))| (k.clone(), *seq))
            .collect()
    }

    /// Commits that completed (returned to their sink).
    #[must_use]
    pub fn commits(&self) -> u64 {
        self.lock().commits
    }

    /// Throws away everything stored, as deleting a cache file does: a follower on it
    /// starts cold. Its fault hooks stay armed. Call it with no follower running on it.
    pub fn wipe(&self) {
        let mut s = self.lock();
        let faults = std::mem::take(&mut s.faults);
        *s = State {
            faults,
            ..State::default()
        };
    }

    // ---- fault hooks ----

    /// The next `n` commits fail at their start with a retryable [`Error::Unavailable`],
    /// writing nothing.
    pub fn fail_next_commits(&self, n: u32) {
        self.lock().faults.fail_next = n;
    }

    /// Every durable write takes `latency` (tokio's clock: simulated under a simulator).
    pub fn set_write_latency(&self, latency: Duration) {
        self.lock().faults.latency = latency;
    }

    /// The process crashes during the next commit, once `after_writes` of its writes
    /// landed (0: before any; more than the commit makes: after all of them, before it
    /// returns). The commit never returns; [`take_stalled`](Self::take_stalled) reports it.
    pub fn crash_next_commit(&self, after_writes: u32) {
        self.lock().faults.crash_after = Some(after_writes);
    }

    /// Disarms a crash armed by [`crash_next_commit`](Self::crash_next_commit) that has
    /// not happened yet; whether one was armed.
    pub fn disarm_crash(&self) -> bool {
        self.lock().faults.crash_after.take().is_some()
    }

    /// Whether a commit stopped where its process crashed since the last call (the
    /// caller crashes the host now).
    pub fn take_stalled(&self) -> bool {
        std::mem::take(&mut self.lock().faults.stalled)
    }

    /// Disarms every fault (failing, slow and crashing commits).
    pub fn heal(&self) {
        self.lock().faults = StoreFaults::default();
    }

    // ---- the steps of a commit ----

    /// Starts a commit: fails if a failure is armed (nothing is written), and stops for
    /// good if a crash is armed before the first write.
    pub async fn begin_commit(&self) -> Result<()> {
        let crash = {
            let mut s = self.lock();
            s.writes_in_commit = 0;
            if s.faults.fail_next > 0 {
                s.faults.fail_next -= 1;
                return Err(Error::unavailable("cache store", "injected commit failure"));
            }
            s.faults.crash_after == Some(0)
        };
        if crash {
            self.crash().await;
        }
        Ok(())
    }

    /// One durable write: after the write latency, applies `ops` in order and, if given,
    /// sets the watermark and the lineage kept with it — all at once. Stops for good if a
    /// crash is armed after it.
    pub async fn write(&self, ops: Vec<CacheOp>, at: Option<(u64, Lineage)>) {
        let watermark = at.map(|(w, _)| w);
        let latency = self.lock().faults.latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let crash = {
            let mut s = self.lock();
            // A watermark that goes back is a new history (a restored source): what was
            // held ahead of the old one is the old one's.
            if let (Some(w), Some(before)) = (watermark, s.watermark)
                && w < before
            {
                s.ahead.clear();
            }
            let mark = watermark.or(s.watermark).unwrap_or(0);
            for op in ops {
                // What is held ahead is marked first: a change at or below the watermark
                // (every one of a sync) costs no copy of its key, and nothing when nothing
                // is held ahead.
                let seq = op.seq();
                if seq > mark {
                    let removed = matches!(op, CacheOp::Remove { .. });
                    s.ahead.insert(op.key().to_owned(), (seq, removed));
                } else if !s.ahead.is_empty() {
                    s.ahead.remove(op.key());
                }
                match op {
                    CacheOp::Put { key, seq, value } => {
                        s.rows.insert(key, (seq, value));
                    }
                    CacheOp::Remove { key, .. } => {
                        s.rows.remove(&key);
                    }
                }
            }
            if let Some((w, lineage)) = at {
                s.watermark = Some(w);
                s.lineage = lineage;
                s.ahead.retain(|_, (seq, _)| *seq > w);
            }
            s.writes_in_commit += 1;
            s.faults.crash_after == Some(s.writes_in_commit)
        };
        if crash {
            self.crash().await;
        }
    }

    /// Ends a commit; stops for good if a crash is still armed (after all the writes,
    /// before the commit returns).
    pub async fn end_commit(&self) {
        let crash = {
            let mut s = self.lock();
            if s.faults.crash_after.is_some() {
                true
            } else {
                s.commits += 1;
                false
            }
        };
        if crash {
            self.crash().await;
        }
    }

    /// The process dies here: the commit never returns.
    async fn crash(&self) {
        {
            let mut s = self.lock();
            s.faults.crash_after = None;
            s.faults.stalled = true;
        }
        std::future::pending::<()>().await;
    }
}

/// The [`Sink`] over a [`MemoryCacheStore`]: buffers a batch and writes it with its
/// watermark in one durable write at the batch boundary; on start says what the store
/// holds, and the seqs of the keys a delta names, for a lazy warm start.
#[derive(Debug)]
pub struct MemoryCacheSink {
    store: MemoryCacheStore,
    batch: Vec<CacheOp>,
}

impl MemoryCacheSink {
    /// The store it writes.
    #[must_use]
    pub fn store(&self) -> &MemoryCacheStore {
        &self.store
    }

    /// Takes the uncommitted batch (for a sink that wraps this one and writes it its own
    /// way).
    pub fn take_batch(&mut self) -> Vec<CacheOp> {
        std::mem::take(&mut self.batch)
    }
}

impl<V: AsRef<[u8]> + Send> Sink<V> for MemoryCacheSink {
    const HOLDS_VALUES: bool = true;

    /// Compares the bytes stored: no decoded value is kept to compare with.
    fn holds(&self, key: &str, new: &V, _: &dyn Fn(&V, &V) -> bool) -> bool {
        self.store
            .lock()
            .rows
            .get(key)
            .is_some_and(|(_, bytes)| bytes.as_slice() == new.as_ref())
    }

    /// Writes each key again with the bytes it holds, at its new seq: a store of bytes
    /// has no value to share, and the batch stays one write.
    async fn restamp(&mut self, keys: Vec<(Arc<str>, u64)>) -> Result<()> {
        let s = self.store.lock();
        for (key, seq) in keys {
            let Some((_, value)) = s.rows.get(&*key) else {
                return Err(Error::NotFound(format!("{key} restamped but not stored")));
            };
            let key = key.to_string();
            let value = value.clone();
            self.batch.push(CacheOp::Put { key, seq, value });
        }
        Ok(())
    }

    async fn put(&mut self, key: Arc<str>, seq: u64, value: V) -> Result<()> {
        self.batch.push(CacheOp::Put {
            key: key.to_string(),
            seq,
            value: value.as_ref().to_vec(),
        });
        Ok(())
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        self.batch.push(CacheOp::Remove {
            key: key.to_string(),
            seq,
        });
        Ok(())
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> Result<()> {
        self.store.begin_commit().await?;
        let ops = std::mem::take(&mut self.batch);
        self.store.write(ops, Some((watermark, lineage))).await;
        self.store.end_commit().await;
        Ok(())
    }

    async fn rollback(&mut self) {
        self.batch.clear();
    }

    async fn resume(&mut self) -> Result<Option<Held>> {
        Ok(self.store.held())
    }

    async fn seqs_of(&mut self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        Ok(self.store.seqs_of(&keys))
    }

    async fn all_seqs(&mut self) -> Result<Vec<(String, u64)>> {
        Ok(self.store.all_seqs())
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// Polls once: these futures finish at once unless a crash or latency stops them.
    fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
        let mut fut = std::pin::pin!(fut);
        match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        }
    }

    fn put(sink: &mut MemoryCacheSink, key: &str, seq: u64) {
        poll_once(Sink::<Vec<u8>>::put(sink, key.into(), seq, b"v".to_vec()))
            .expect("put is immediate")
            .expect("put never fails");
    }

    fn commit(sink: &mut MemoryCacheSink, watermark: u64) -> Option<Result<()>> {
        poll_once(Sink::<Vec<u8>>::commit(sink, watermark, Lineage::default()))
    }

    #[test]
    fn a_wiped_store_starts_its_follower_cold_with_its_faults_still_armed() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        put(&mut sink, "a", 1);
        assert!(matches!(commit(&mut sink, 1), Some(Ok(()))));
        store.fail_next_commits(1);
        store.wipe();
        assert_eq!(store.held(), None, "nothing is left to resume from");
        put(&mut sink, "b", 2);
        assert!(
            matches!(commit(&mut sink, 2), Some(Err(_))),
            "a fault armed before the wipe still fires"
        );
    }

    #[test]
    fn a_commit_makes_the_batch_and_its_watermark_durable_together() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        assert_eq!(
            store.held(),
            None,
            "a fresh store must start the follower cold"
        );
        put(&mut sink, "a", 1);
        put(&mut sink, "b", 2);
        assert!(
            store.is_empty(),
            "an uncommitted batch must not be visible in the store"
        );
        assert!(matches!(commit(&mut sink, 2), Some(Ok(()))));
        assert_eq!(store.held(), Some(Held::new(2, 2).with_ahead(Vec::new())));
        assert_eq!(
            store.seqs_of(&["b".into(), "zz".into()]),
            vec![("b".into(), 2)]
        );
    }

    #[test]
    fn a_rolled_back_batch_never_reaches_the_store() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        put(&mut sink, "a", 1);
        poll_once(Sink::<Vec<u8>>::rollback(&mut sink)).expect("rollback is immediate");
        assert!(matches!(commit(&mut sink, 0), Some(Ok(()))));
        assert!(store.is_empty(), "a rollback must discard the batch");
    }

    #[test]
    fn a_failed_commit_writes_nothing_and_is_retryable() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        store.fail_next_commits(1);
        put(&mut sink, "a", 1);
        match commit(&mut sink, 1) {
            Some(Err(e)) => assert!(e.is_retryable(), "the driver must retry it: {e}"),
            other => panic!("the armed failure must fail the commit: {other:?}"),
        }
        assert_eq!(store.held(), None, "a failed commit must write nothing");
        assert!(matches!(commit(&mut sink, 1), Some(Ok(()))));
        assert_eq!(store.watermark(), Some(1), "only the next commit fails");
    }

    #[test]
    fn a_crash_before_the_write_leaves_none_of_the_batch() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        store.crash_next_commit(0);
        put(&mut sink, "a", 1);
        assert!(
            commit(&mut sink, 1).is_none(),
            "a crashed commit never returns"
        );
        assert!(store.take_stalled(), "the crash must be reported once");
        assert!(!store.take_stalled());
        assert_eq!(store.held(), None, "none of the batch may land");
    }

    #[test]
    fn a_crash_after_the_write_leaves_the_whole_batch() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        store.crash_next_commit(1);
        put(&mut sink, "a", 1);
        put(&mut sink, "b", 2);
        assert!(commit(&mut sink, 2).is_none());
        assert!(store.take_stalled());
        assert_eq!(
            store.held(),
            Some(Held::new(2, 2).with_ahead(Vec::new())),
            "the one write is the whole batch with its watermark"
        );
        assert_eq!(store.commits(), 0, "the commit never returned");
    }

    #[test]
    fn a_disarmed_crash_does_not_happen() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        store.crash_next_commit(0);
        assert!(store.disarm_crash());
        put(&mut sink, "a", 1);
        assert!(matches!(commit(&mut sink, 1), Some(Ok(()))));
        assert!(!store.take_stalled());
    }

    /// The real warm-restart path: a follower task commits into the store, stops, and a
    /// new task on the same store resumes from it and still removes a key deleted while
    /// it was down (it learns the key's seq from the store, not from a model).
    #[tokio::test(start_paused = true)]
    async fn a_follower_restarts_warm_from_the_store_and_sees_a_delete_made_while_down() {
        use tidemark::tidemark_core::{FollowerConfig, RawBytes};
        use tidemark::{FollowerTask, Source};

        use crate::Memory;

        let memory = Memory::new();
        let source = memory.source.clone();
        let store = MemoryCacheStore::new();
        let config = || {
            FollowerConfig::builder("warm")
                .seed(7)
                .build()
                .expect("valid")
        };
        source.put("a", b"1".to_vec()).await.expect("put");
        source.put("b", b"2".to_vec()).await.expect("put");

        let first = FollowerTask::new(
            config(),
            RawBytes,
            source.clone(),
            source.clone(),
            store.sink(),
        )
        .spawn();
        let mut status = first.watch_status();
        status
            .wait_for(|s| s.ready && s.watermark == 2)
            .await
            .expect("the first run reaches the head");
        first
            .stop_within(Duration::from_secs(5))
            .await
            .expect("stops");
        assert_eq!(
            store.watermark(),
            Some(2),
            "the store holds what was committed"
        );

        source.remove("a").await.expect("remove");
        let second = FollowerTask::new(
            config(),
            RawBytes,
            source.clone(),
            source.clone(),
            store.sink(),
        )
        .spawn();
        let mut status = second.watch_status();
        status
            .wait_for(|s| s.ready && s.watermark == 3)
            .await
            .expect("the restarted run catches up");
        second
            .stop_within(Duration::from_secs(5))
            .await
            .expect("stops");
        assert_eq!(
            store.get("a"),
            None,
            "a key deleted while the follower was down must leave the warm store"
        );
        assert_eq!(store.get("b"), Some((2, b"2".to_vec())));
        assert_eq!(store.watermark(), Some(3));
    }

    // ---- Issue 10: what a persisted follower committed ahead of its watermark ----

    /// What an events follower committed before its process died: `rows` at or below
    /// `watermark`, then `ahead` — announcements no read of the source had confirmed —
    /// in a second batch at the same watermark; the sink is dropped, as a dead process's.
    fn died_holding(
        store: &MemoryCacheStore,
        rows: &[(&str, u64, &str)],
        watermark: u64,
        ahead: &[(&str, u64, Option<&str>)],
    ) {
        let mut sink = store.sink();
        for (key, seq, value) in rows {
            poll_once(Sink::<Vec<u8>>::put(
                &mut sink,
                (*key).into(),
                *seq,
                value.as_bytes().to_vec(),
            ))
            .expect("immediate")
            .expect("put");
        }
        assert!(matches!(commit(&mut sink, watermark), Some(Ok(()))));
        for (key, seq, value) in ahead {
            let done = match value {
                Some(v) => poll_once(Sink::<Vec<u8>>::put(
                    &mut sink,
                    (*key).into(),
                    *seq,
                    v.as_bytes().to_vec(),
                )),
                None => poll_once(Sink::<Vec<u8>>::remove(&mut sink, (*key).into(), *seq)),
            };
            done.expect("immediate").expect("applied");
        }
        assert!(matches!(commit(&mut sink, watermark), Some(Ok(()))));
    }

    /// A memory source that took `puts` in order (seqs 1, 2, …).
    async fn source_with(puts: &[(&str, &str)]) -> crate::Memory {
        use tidemark::Source;
        let memory = crate::Memory::new();
        for (key, value) in puts {
            memory
                .source
                .put(key, value.as_bytes().to_vec())
                .await
                .expect("put");
        }
        memory
    }

    /// Restarts an events follower on `store` over `memory`'s source and waits until it
    /// is ready at `head`; returns its status.
    async fn restart(
        memory: &crate::Memory,
        store: &MemoryCacheStore,
        head: u64,
    ) -> tidemark::Status {
        use tidemark::FollowerTask;
        use tidemark::tidemark_core::{FollowerConfig, RawBytes};
        let config = FollowerConfig::builder("events")
            .seed(7)
            .build()
            .expect("valid");
        let task = FollowerTask::new(
            config,
            RawBytes,
            memory.source.clone(),
            memory.events.clone(),
            store.sink(),
        )
        .spawn();
        let mut status = task.watch_status();
        status
            .wait_for(|s| s.ready && s.watermark == head)
            .await
            .expect("the restarted follower catches up");
        let status = task.status();
        task.stop_within(Duration::from_secs(5))
            .await
            .expect("stops");
        status
    }

    /// The store's rows: key → (seq, value).
    fn rows(pairs: &[(&str, u64, &str)]) -> BTreeMap<String, (u64, Vec<u8>)> {
        pairs
            .iter()
            .map(|(k, s, v)| ((*k).to_owned(), (*s, v.as_bytes().to_vec())))
            .collect()
    }

    /// Seeds 1797 and 2977: a removal applied ahead of the watermark was committed and
    /// the process died before the read that would refute it; nothing in the store said
    /// it was a claim, so the key was lost for good.
    #[tokio::test(start_paused = true)]
    async fn a_removal_committed_ahead_of_the_watermark_is_checked_after_a_crash() {
        let memory = source_with(&[("a", "1"), ("b", "2"), ("c", "3")]).await;
        let store = MemoryCacheStore::new();
        // A foreign event said "a removed at 3"; the source's seq 3 is c's put.
        died_holding(
            &store,
            &[("a", 1, "1"), ("b", 2, "2")],
            2,
            &[("a", 3, None)],
        );
        restart(&memory, &store, 3).await;
        assert_eq!(
            store.entries(),
            rows(&[("a", 1, "1"), ("b", 2, "2"), ("c", 3, "3")]),
            "the key the unconfirmed removal took is back"
        );
    }

    /// Seed 373: a value held past the watermark was confirmed after a restart by its
    /// seq alone, so a source whose new history reused the seq kept the replaced value.
    #[tokio::test(start_paused = true)]
    async fn a_value_committed_ahead_of_the_watermark_is_compared_by_its_bytes_after_a_crash() {
        let memory = source_with(&[("a", "1"), ("a", "new history")]).await;
        let store = MemoryCacheStore::new();
        died_holding(
            &store,
            &[("a", 1, "1")],
            1,
            &[("a", 2, Some("replaced history"))],
        );
        let status = restart(&memory, &store, 2).await;
        assert_eq!(store.entries(), rows(&[("a", 2, "new history")]));
        assert_eq!(status.counters.invalid, 1, "the replaced claim is counted");
    }

    /// Found by reading: a forged key held past the watermark that no later change names
    /// was checked only thanks to a listing of every key at start; the store's list of
    /// what it holds ahead finds it, and the warm start lists nothing.
    #[tokio::test(start_paused = true)]
    async fn a_forged_key_committed_ahead_that_no_change_names_is_removed_after_a_crash() {
        let memory = source_with(&[("a", "1"), ("b", "2"), ("c", "3")]).await;
        let store = MemoryCacheStore::new();
        died_holding(
            &store,
            &[("a", 1, "1"), ("b", 2, "2")],
            2,
            &[("x", 3, Some("forged"))],
        );
        let status = restart(&memory, &store, 3).await;
        assert_eq!(
            store.entries(),
            rows(&[("a", 1, "1"), ("b", 2, "2"), ("c", 3, "3")]),
            "the forged key is gone"
        );
        assert!(status.counters.invalid > 0, "the forged key is counted");
    }

    /// Issue 30: a key the presence check found gone was removed at the listing's
    /// watermark, above the follower's own on an events stream, so the store kept the
    /// removal ahead like an announcement's; after a crash the follower held it as a claim,
    /// and the first read, naming the key's real removal at another seq, counted it
    /// invalid (one that did not name the key would have sent it to a snapshot).
    #[tokio::test(start_paused = true)]
    async fn a_key_a_presence_check_found_gone_is_no_claim_after_a_crash() {
        use tidemark::tidemark_core::{FollowerConfig, RawBytes};
        use tidemark::{FollowerTask, Source};
        let memory = source_with(&[("a", "1"), ("b", "2"), ("c", "3")]).await;
        let store = MemoryCacheStore::new();
        let config = FollowerConfig::builder("events")
            .seed(7)
            .presence_check(Duration::from_secs(1))
            .build()
            .expect("valid");
        let task = FollowerTask::new(
            config,
            RawBytes,
            memory.source.clone(),
            memory.events.clone(),
            store.sink(),
        )
        .spawn();
        let mut status = task.watch_status();
        status
            .wait_for(|s| s.ready && s.watermark == 3)
            .await
            .expect("ready");
        // Written without an announcement: only the presence check finds `a` gone, at the
        // listing's watermark 5, while the follower's stays at 3.
        memory.source.remove("a").await.expect("removed");
        memory.source.put("d", b"4".to_vec()).await.expect("put");
        status
            .wait_for(|s| s.counters.vanished == 1)
            .await
            .expect("the presence check finds a gone");
        task.stop_within(Duration::from_secs(5))
            .await
            .expect("stops");
        assert_eq!(store.get("a"), None);
        let status = restart(&memory, &store, 5).await;
        assert_eq!(
            status.counters.invalid, 0,
            "a removal a read of the source made is no claim to refute"
        );
        assert_eq!(status.counters.resyncs, 0);
        assert_eq!(
            store.entries(),
            rows(&[("b", 2, "2"), ("c", 3, "3"), ("d", 5, "4")])
        );
    }

    /// What the store keeps ahead of the watermark: a commit whose watermark passes a
    /// change, or that changes its key again at or below it, drops it; a watermark that
    /// goes back (a restored source) drops what was ahead of the old one.
    #[test]
    fn the_store_keeps_only_what_is_still_ahead_of_the_watermark() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        let ahead = || -> Vec<(String, u64)> {
            let held = store.held().expect("committed");
            held.ahead
                .expect("kept")
                .iter()
                .map(|a| (a.key().to_owned(), a.seq()))
                .collect()
        };
        put(&mut sink, "a", 1);
        put(&mut sink, "b", 5);
        poll_once(Sink::<Vec<u8>>::remove(&mut sink, "c".into(), 6))
            .expect("now")
            .expect("ok");
        put(&mut sink, "d", 7);
        assert!(matches!(commit(&mut sink, 1), Some(Ok(()))));
        assert_eq!(ahead(), [("b".into(), 5), ("c".into(), 6), ("d".into(), 7)]);
        put(&mut sink, "d", 3);
        assert!(matches!(commit(&mut sink, 5), Some(Ok(()))));
        assert_eq!(ahead(), [("c".into(), 6)]);
        assert!(matches!(commit(&mut sink, 2), Some(Ok(()))));
        assert_eq!(ahead(), []);
    }

    #[test]
    fn a_restamp_keeps_the_stored_bytes_at_the_new_seq_in_the_same_commit() {
        let store = MemoryCacheStore::new();
        let mut sink = store.sink();
        put(&mut sink, "a", 7);
        assert!(matches!(commit(&mut sink, 7), Some(Ok(()))));
        let never = |_: &Vec<u8>, _: &Vec<u8>| false;
        assert!(
            Sink::<Vec<u8>>::holds(&sink, "a", &b"v".to_vec(), &never),
            "the stored bytes are compared, whatever the decoder says"
        );
        assert!(!Sink::<Vec<u8>>::holds(&sink, "a", &b"w".to_vec(), &never));
        assert!(!Sink::<Vec<u8>>::holds(&sink, "b", &b"v".to_vec(), &never));
        poll_once(Sink::<Vec<u8>>::restamp(&mut sink, vec![("a".into(), 2)]))
            .expect("restamp is immediate")
            .expect("a stored key restamps");
        assert_eq!(
            store.get("a"),
            Some((7, b"v".to_vec())),
            "not before the commit"
        );
        assert!(matches!(commit(&mut sink, 2), Some(Ok(()))));
        assert_eq!(store.get("a"), Some((2, b"v".to_vec())));
    }
}
