//! Retention on one file: relayed outbox rows go and pending ones stay; history a
//! persisted follower or a durable cursor still needs stays until the maximum age forces
//! it out, and then that follower resyncs and converges; two sweepers under the lock never
//! run at once.
#![allow(clippy::unwrap_used)]

mod common;

use common::{mirror, source_contents, until};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{Legs, RetentionPolicy};
use tidemark::{Cursors, Publish, Source, Sweep, Swept, sweep_under_lock};
use tidemark_sqlite::{SqliteDb, SqliteSource, Write};

/// The fence of a sweep run by hand, outside the sweeper lock (never taken here).
fn fence() -> tidemark::LockLease {
    tidemark::LockLease {
        name: tidemark::SWEEP_LOCK.into(),
        owner: "test".into(),
        fencing: 0,
    }
}

/// Keeps nothing for unknown readers; never forces out what a known one needs.
fn needed_only() -> RetentionPolicy {
    RetentionPolicy::new(Duration::ZERO, None).unwrap()
}

async fn count(db: &SqliteDb, table: &str) -> i64 {
    let c = rusqlite::Connection::open(db.path()).unwrap();
    c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
        .unwrap()
}

async fn puts(src: &SqliteSource, range: std::ops::Range<u32>) {
    src.write_batch(
        range
            .map(|i| Write::Put(format!("k{:02}", i % 20), format!("v{i}").into_bytes()))
            .collect(),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_rows_are_removed_only_after_they_were_relayed() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.announced_source(Legs::default());
    for i in 0..5 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let sweep = db.sweeper().with_policy(needed_only());
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(swept.outbox_rows, 0, "pending rows are never swept");
    assert_eq!(count(&db, "outbox").await, 5);

    let relay = db.relay(db.events(), db.wake(), db.queue(), "reg");
    assert_eq!(relay.drain().await.unwrap().done, 5);
    src.put("late", b"v".to_vec()).await.unwrap();
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        swept.outbox_rows, 5,
        "relayed rows go, with their copies of the values"
    );
    assert_eq!(
        count(&db, "outbox").await,
        1,
        "the row written after the relay ran is still pending and stays"
    );
    assert_eq!(relay.pending().await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_a_persisted_follower_needs_is_kept_and_it_restarts_warm() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    puts(&src, 0..100).await;
    let h = mirror("warm", src.clone(), db.follower_cache("warm"));
    until(&h, "ready", |s| s.ready).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
    let stopped_at = db.follower_cache("warm").watermark().await.unwrap();
    puts(&src, 100..150).await;
    src.remove("k03").await.unwrap();

    let swept = db
        .sweeper()
        .with_policy(needed_only())
        .sweep(&fence())
        .await
        .unwrap();
    assert_eq!(
        swept.first_available,
        stopped_at + 1,
        "history goes up to what the stopped follower needs, and no further"
    );
    assert_eq!(swept.log_rows, stopped_at, "everything it has applied goes");
    assert_eq!(src.first_available().await.unwrap(), stopped_at + 1);

    let cache = db.follower_cache("warm");
    let head = src.watermark().await.unwrap();
    let h = mirror("warm", src.clone(), cache.clone());
    let warm = until(&h, "caught up", |s| s.ready && s.watermark == head).await;
    assert_eq!(
        warm.counters.resyncs, 0,
        "the kept history serves its restart: no resync"
    );
    assert_eq!((warm.counters.applied, warm.counters.removed), (50, 1));
    assert_eq!(
        cache.entries().await.unwrap(),
        source_contents(&db).await,
        "converged"
    );
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_age_forces_history_out_and_the_lagging_follower_resyncs_and_converges() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    puts(&src, 0..40).await;
    let h = mirror("lag", src.clone(), db.follower_cache("lag"));
    until(&h, "ready", |s| s.ready).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
    let stopped_at = db.follower_cache("lag").watermark().await.unwrap();

    // Written while the follower is down: puts, and removals of keys it holds.
    puts(&src, 40..80).await;
    for key in ["k15", "k16", "k17"] {
        src.remove(key).await.unwrap();
    }
    let max_age = Duration::from_millis(300);
    let sweep = db
        .sweeper()
        .with_policy(RetentionPolicy::new(Duration::ZERO, Some(max_age)).unwrap());
    let first = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        first.first_available,
        stopped_at + 1,
        "younger than the maximum age: still kept for the follower"
    );
    let marked = src.watermark().await.unwrap();
    tokio::time::sleep(max_age + Duration::from_millis(50)).await;
    puts(&src, 80..90).await;
    let forced = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        forced.first_available,
        marked + 1,
        "older than the maximum age: gone though the follower needs it"
    );
    assert!(
        forced.tombstones >= 3,
        "the removals' tombstones went too: {forced:?}"
    );

    let cache = db.follower_cache("lag");
    let head = src.watermark().await.unwrap();
    let h = mirror("lag", src.clone(), cache.clone());
    let back = until(&h, "caught up", |s| s.ready && s.watermark == head).await;
    assert_eq!(
        back.counters.resyncs, 1,
        "a follower below the horizon resyncs: {back:?}"
    );
    assert_eq!(
        cache.entries().await.unwrap(),
        source_contents(&db).await,
        "after the resync the cache is the source: removed keys gone, new values in"
    );
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_a_durable_cursor_still_needs_are_kept() {
    let (_dir, _path, db) = common::fresh().await;
    let events = db.events();
    for i in 0..10 {
        events
            .publish(&format!("k{i}"), b"x".to_vec())
            .await
            .unwrap();
    }
    events.save("consumer", 4).await.unwrap();
    let sweep = db.sweeper().with_policy(needed_only());
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        (swept.events, swept.first_event),
        (4, 5),
        "records up to the cursor go"
    );
    let left: Vec<u64> = events
        .records(0, 100)
        .await
        .unwrap()
        .iter()
        .map(|r| r.position)
        .collect();
    assert_eq!(
        left,
        (5..=10).collect::<Vec<_>>(),
        "what the cursor has yet to read stays"
    );

    // A default policy keeps even unneeded records for a minute.
    events.save("consumer", 10).await.unwrap();
    let swept = db.sweeper().sweep(&fence()).await.unwrap();
    assert_eq!(
        swept.events, 0,
        "young records stay for readers the file cannot see"
    );
}

/// A sweep that notes how many of its kind run at once, and takes a while.
#[derive(Clone, Default)]
struct Watched {
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    runs: Arc<AtomicUsize>,
}

impl Sweep for Watched {
    async fn sweep(&self, _fence: &tidemark::LockLease) -> tidemark::Result<Swept> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(Swept::default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sweepers_under_the_lock_never_run_at_once() {
    let (_dir, path, db) = common::fresh().await;
    let other = SqliteDb::open(&path).await.unwrap();
    let watched = Watched::default();
    let (lock_a, lock_b) = (db.lock(), other.lock());
    let lease = Duration::from_secs(5);
    let mut ran = 0;
    for _ in 0..5 {
        let (a, b) = tokio::join!(
            sweep_under_lock(&lock_a, &watched, "process-a", lease),
            sweep_under_lock(&lock_b, &watched, "process-b", lease)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(
            a.is_some() || b.is_some(),
            "one of them takes the free lock"
        );
        ran += usize::from(a.is_some()) + usize::from(b.is_some());
    }
    assert_eq!(
        watched.most.load(Ordering::SeqCst),
        1,
        "never two sweeps at once"
    );
    assert_eq!(watched.runs.load(Ordering::SeqCst), ran);
    assert!(
        lock_a.try_lock_free_check().await,
        "the lock is released after each sweep"
    );
}

trait FreeCheck {
    async fn try_lock_free_check(&self) -> bool;
}

impl FreeCheck for tidemark_sqlite::SqliteLock {
    async fn try_lock_free_check(&self) -> bool {
        tidemark::Lock::try_lock(
            self,
            tidemark::SWEEP_LOCK,
            "checker",
            Duration::from_secs(1),
        )
        .await
        .unwrap()
        .is_some()
    }
}
