//! A follower that keeps its cache and watermark in the file (the `PersistedCache` sink,
//! under the runtime's one follower task) restarts warm and reads only the delta; a batch
//! the file could not take is decided again.
#![allow(clippy::unwrap_used)]

mod common;

use common::{config, mirror, source_contents, until};
use std::time::Duration;

use tidemark::{FollowerTask, NoFeed, RawBytes, Sink, Source, Wake};
use tidemark_sqlite::{PersistedCache, SqliteDb, Write};

/// Waits until the persisted cache equals the source.
async fn converged(cache: &PersistedCache, db: &SqliteDb, what: &str) {
    let want = source_contents(db).await;
    common::eventually(what, || async { cache.entries().await.unwrap() == want }).await;
    assert_eq!(
        cache.watermark().await.unwrap(),
        db.source().watermark().await.unwrap(),
        "{what}: the persisted watermark is the source's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_restart_reads_only_the_delta() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    src.write_batch(
        (0..1000)
            .map(|i| Write::Put(format!("k{i:04}"), format!("v{i}").into_bytes()))
            .collect(),
    )
    .await
    .unwrap();
    let h = mirror("warm", src.clone(), db.follower_cache("warm"));
    let cold = until(&h, "the cold start is ready", |s| s.ready).await;
    assert_eq!(cold.counters.applied, 1000, "a cold start reads everything");
    h.stop_within(Duration::from_secs(10)).await.unwrap();

    // While the follower is down: 8 puts (one key new, written twice) and 3 removals.
    for i in 0..6 {
        src.put(&format!("k{:04}", i * 100), b"changed".to_vec())
            .await
            .unwrap();
    }
    src.put("new", b"1".to_vec()).await.unwrap();
    src.put("new", b"2".to_vec()).await.unwrap();
    for key in ["k0001", "k0002", "new"] {
        src.remove(key).await.unwrap();
    }
    let head = src.watermark().await.unwrap();
    let cache = db.follower_cache("warm");
    let h = mirror("warm", src.clone(), cache.clone());
    let warm = until(&h, "the warm start caught up", |s| {
        s.ready && s.watermark == head
    })
    .await;
    assert_eq!(
        (
            warm.counters.applied,
            warm.counters.removed,
            warm.counters.stale
        ),
        (8, 3, 0),
        "a warm restart applies only the delta, not the 1000 rows: {warm:?}"
    );
    assert_eq!(warm.counters.resyncs, 0);
    assert_eq!(warm.keys, 1000 - 2, "the status counts every persisted key");
    converged(
        &cache,
        &db,
        "the persisted cache equals the source after the delta",
    )
    .await;
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_below_the_compaction_horizon_resyncs_and_drops_removed_keys() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    for key in ["a", "b", "c"] {
        src.put(key, b"1".to_vec()).await.unwrap();
    }
    let h = mirror("r", src.clone(), db.follower_cache("r"));
    until(&h, "ready", |s| s.ready).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
    src.remove("b").await.unwrap();
    src.put("d", b"4".to_vec()).await.unwrap();
    src.compact_below(src.watermark().await.unwrap() + 1)
        .await
        .unwrap();
    let cache = db.follower_cache("r");
    let h = mirror("r", src.clone(), cache.clone());
    let s = until(&h, "resynced", |s| s.counters.resyncs > 0 && s.ready).await;
    assert_eq!(s.counters.resyncs, 1, "history past the watermark is gone");
    converged(
        &cache,
        &db,
        "the removed key must leave the persisted cache",
    )
    .await;
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_only_persisted_follower_catches_up_on_wakes() {
    let (_dir, _path, db) = common::fresh().await;
    let cache = db.follower_cache("w");
    let listener = db.wake().listen("any").await.unwrap();
    let h = FollowerTask::new(config("w"), RawBytes, db.source(), NoFeed, cache.clone())
        .with_wake(listener)
        .spawn();
    until(&h, "ready", |s| s.ready).await;
    db.source().put("x", b"1".to_vec()).await.unwrap();
    common::eventually("the wake brings the write in", || async {
        cache.watermark().await.unwrap() == 1
    })
    .await;
    assert_eq!(cache.get("x").await.unwrap(), Some((1, b"1".to_vec())));
    h.stop();
}

/// The registry restored from an older backup: its history is behind the watermark a
/// follower persisted elsewhere. The follower must take the restored state (keys the
/// backup lacks removed, keys it has put back) and its watermark, not keep the newer cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_restored_from_an_older_backup_replaces_the_persisted_cache() {
    let (_dir, path, registry) = common::fresh().await;
    let src = registry.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("b", b"2".to_vec()).await.unwrap();
    let backup = path.with_file_name("backup.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    src.put("c", b"3".to_vec()).await.unwrap();
    src.remove("a").await.unwrap();

    // The follower keeps its cache in a file of its own.
    let caches = SqliteDb::open(path.with_file_name("caches.db"))
        .await
        .unwrap();
    let cache = caches.follower_cache("r");
    let h = mirror("r", registry.source(), cache.clone());
    until(&h, "ready at 4", |s| s.ready && s.watermark == 4).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();

    let restored = SqliteDb::open(&backup).await.unwrap();
    assert_eq!(restored.source().watermark().await.unwrap(), 2);
    let h = mirror("r", restored.source(), cache.clone());
    let s = until(&h, "reset", |s| s.counters.resets > 0 && s.ready).await;
    assert_eq!(s.watermark, 2, "the restored history's watermark is taken");
    converged(
        &cache,
        &restored,
        "the persisted cache holds what the restored registry holds: a is back, c is gone",
    )
    .await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();

    // New writes on the restored registry reuse seqs 3 and 4: a restart must not skip
    // them as already applied.
    let rsrc = restored.source();
    rsrc.put("d", b"4".to_vec()).await.unwrap();
    rsrc.put("e", b"5".to_vec()).await.unwrap();
    let h = mirror("r", restored.source(), cache.clone());
    until(&h, "ready", |s| s.ready).await;
    converged(
        &cache,
        &restored,
        "writes after the restore reach the cache",
    )
    .await;
    h.stop();
}

/// Writes `n` mutations to `db`'s registry over keys `k0`..`k39` (every third a removal of
/// a key it holds), each value tagged with `tag`.
async fn churn(db: &SqliteDb, n: u64, tag: &str) {
    let src = db.source();
    for i in 0..n {
        let key = format!("k{}", i % 40);
        if i % 3 == 2 && src.get(&key).await.unwrap().is_some() {
            src.remove(&key).await.unwrap();
        } else {
            src.put(&key, format!("{tag}{i}").into_bytes())
                .await
                .unwrap();
        }
    }
}

/// Issue 25: a registry file restored from a copy taken earlier, then written past the
/// watermark a follower persisted while it was down. Its head is no longer behind the
/// watermark, so only the stamp the follower kept at its watermark tells the restored
/// history from the one it followed; without it the follower resumes from its watermark
/// into the new history's seqs and keeps the old one's keys for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_restored_and_written_past_the_watermark_replaces_the_persisted_cache() {
    let (_dir, path, registry) = common::fresh().await;
    churn(&registry, 60, "first-").await;
    let backup = path.with_file_name("backup.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    churn(&registry, 90, "second-").await;

    let caches = SqliteDb::open(path.with_file_name("caches.db"))
        .await
        .unwrap();
    let cache = caches.follower_cache("r");
    let h = mirror("r", registry.source(), cache.clone());
    until(&h, "ready at 150", |s| s.ready && s.watermark == 150).await;
    converged(&cache, &registry, "the first history is followed").await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();

    // The copy taken at 60 is put back and written past 150 while the follower is down.
    let restored = SqliteDb::open(&backup).await.unwrap();
    churn(&restored, 120, "restored-").await;
    assert_eq!(restored.source().watermark().await.unwrap(), 180);

    let h = mirror("r", restored.source(), cache.clone());
    let s = until(&h, "reset and ready", |s| s.counters.resets > 0 && s.ready).await;
    assert!(
        s.counters.resyncs > 0,
        "the new history is read whole: {s:?}"
    );
    converged(
        &cache,
        &restored,
        "the persisted cache holds the restored registry, not the history it followed",
    )
    .await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
}

/// Issue 25: a registry deleted and made again (a new file, so a new history) and written
/// past the watermark a follower persisted while it was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_made_again_and_written_past_the_watermark_replaces_the_persisted_cache() {
    let (dir, path, registry) = common::fresh().await;
    churn(&registry, 100, "old-").await;
    let caches = SqliteDb::open(dir.path().join("caches.db")).await.unwrap();
    let cache = caches.follower_cache("r");
    let h = mirror("r", registry.source(), cache.clone());
    until(&h, "ready at 100", |s| s.ready && s.watermark == 100).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
    drop(registry);

    let remade = SqliteDb::open(path.with_file_name("remade.db"))
        .await
        .unwrap();
    churn(&remade, 130, "new-").await;
    let h = mirror("r", remade.source(), cache.clone());
    until(&h, "reset and ready", |s| s.counters.resets > 0 && s.ready).await;
    converged(
        &cache,
        &remade,
        "the persisted cache holds the new registry, not the old one's keys",
    )
    .await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_after_a_warm_restart_leaves_the_cache() {
    // The restart's delta is empty, so the follower resumes knowing no key; the removal
    // comes later and must still reach the persisted cache.
    let (_dir, _path, db) = common::fresh().await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let cache = db.follower_cache("w");
    let h = mirror("w", db.source(), cache.clone());
    until(&h, "ready", |s| s.ready).await;
    h.stop_within(Duration::from_secs(10)).await.unwrap();
    let h = mirror("w", db.source(), cache.clone());
    until(&h, "ready", |s| s.ready).await;
    db.source().remove("a").await.unwrap();
    let s = until(&h, "the removal applied", |s| s.counters.removed == 1).await;
    assert_eq!(s.keys, 0);
    converged(&cache, &db, "the removed key left the persisted cache").await;
    h.stop();
}

/// A database whose write lock another connection can hold longer than the busy timeout.
async fn impatient(path: &std::path::Path) -> SqliteDb {
    let options = tidemark_sqlite::Options {
        busy_timeout: Duration::from_millis(50),
        ..tidemark_sqlite::Options::default()
    };
    SqliteDb::open_with(path, options).await.unwrap()
}

/// The cache's file is locked by another process while writes arrive: its commits fail,
/// the follower goes back to its last commit, retries after its backoff (no wake needed),
/// and once the lock is gone the cache holds everything, nothing skipped as "already
/// applied".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_cache_file_could_not_take_is_decided_again() {
    for wake_only in [false, true] {
        let (_dir, path, db) = common::fresh().await;
        let cache_path = path.with_file_name("cache.db");
        let caches = impatient(&cache_path).await;
        let cache = caches.follower_cache("p");
        let h = if wake_only {
            // No wake ever comes: only the follower's own retry can bring the writes in.
            let quiet = db.wake().listen("nobody").await.unwrap();
            FollowerTask::new(config("p"), RawBytes, db.source(), NoFeed, cache.clone())
                .with_wake(quiet)
                .spawn()
        } else {
            mirror("p", db.source(), cache.clone())
        };
        until(&h, "ready", |s| s.ready).await;
        let other = rusqlite::Connection::open(&cache_path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        db.source().put("a", b"1".to_vec()).await.unwrap();
        if wake_only {
            // Ask for a catch-up without waiting for it: it cannot finish while the lock
            // is held.
            let _ = tokio::time::timeout(Duration::from_millis(100), h.reconcile()).await;
        }
        let s = until(&h, "a commit failed", |s| s.counters.rewinds > 0).await;
        assert!(s.counters.rewinds >= 1);
        other.execute_batch("ROLLBACK").unwrap();
        drop(other);
        db.source().put("b", b"2".to_vec()).await.unwrap();
        converged(
            &cache,
            &db,
            "the failed batch's change (a) is not lost, wake-only or not",
        )
        .await;
        h.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_source_read_does_not_wedge_the_follower() {
    let (_dir, path, db) = common::fresh().await;
    let cache = db.follower_cache("r");
    let h = mirror("r", db.source(), cache.clone());
    until(&h, "ready", |s| s.ready).await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .execute_batch("ALTER TABLE registry RENAME TO hidden")
        .unwrap();
    // Ask for a catch-up without waiting for it: it cannot succeed while the table hides.
    let _ = tokio::time::timeout(Duration::from_millis(300), h.reconcile()).await;
    other
        .execute_batch("ALTER TABLE hidden RENAME TO registry")
        .unwrap();
    drop(other);
    db.source().put("b", b"2".to_vec()).await.unwrap();
    converged(
        &cache,
        &db,
        "the follower recovers once the registry reads again",
    )
    .await;
    h.stop();
}

/// The sink itself: a batch lands with its watermark in one transaction, and a batch
/// rolled back leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_and_its_watermark_commit_together_or_not_at_all() {
    let (_dir, _path, db) = common::fresh().await;
    let mut cache = db.follower_cache("f");
    assert_eq!(Sink::<Vec<u8>>::resume(&mut cache).await.unwrap(), None);
    Sink::<Vec<u8>>::put(&mut cache, "k".into(), 5, b"five".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::put(&mut cache, "j".into(), 6, b"six".to_vec())
        .await
        .unwrap();
    assert_eq!(cache.get("k").await.unwrap(), None, "not before the commit");
    Sink::<Vec<u8>>::commit(&mut cache, 6, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(cache.get("k").await.unwrap(), Some((5, b"five".to_vec())));
    Sink::<Vec<u8>>::remove(&mut cache, "k".into(), 7)
        .await
        .unwrap();
    Sink::<Vec<u8>>::rollback(&mut cache).await;
    Sink::<Vec<u8>>::commit(&mut cache, 6, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(
        cache.get("k").await.unwrap(),
        Some((5, b"five".to_vec())),
        "a rolled-back removal never lands"
    );
    let held = Sink::<Vec<u8>>::resume(&mut cache).await.unwrap().unwrap();
    assert_eq!((held.watermark, held.keys), (6, 2));
    let seqs = Sink::<Vec<u8>>::seqs_of(&mut cache, vec!["j".into(), "absent".into()])
        .await
        .unwrap();
    assert_eq!(seqs, [("j".to_owned(), 6)]);
}

/// The key count is kept with the watermark, so a warm restart does not count the rows;
/// a file from before the count was kept is counted once, and kept from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_count_is_kept_with_the_watermark_and_counted_once_for_older_files() {
    let (_dir, path, db) = common::fresh().await;
    let mut cache = db.follower_cache("n");
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        Sink::<Vec<u8>>::put(&mut cache, key.into(), i as u64 + 1, b"v".to_vec())
            .await
            .unwrap();
    }
    Sink::<Vec<u8>>::commit(&mut cache, 3, tidemark::Lineage::default())
        .await
        .unwrap();
    Sink::<Vec<u8>>::put(&mut cache, "a".into(), 4, b"w".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::remove(&mut cache, "b".into(), 5)
        .await
        .unwrap();
    Sink::<Vec<u8>>::remove(&mut cache, "never".into(), 5)
        .await
        .unwrap();
    Sink::<Vec<u8>>::commit(&mut cache, 5, tidemark::Lineage::default())
        .await
        .unwrap();
    let held = cache.held().await.unwrap().unwrap();
    assert_eq!(
        (held.watermark, held.keys),
        (5, 2),
        "an overwrite adds no key"
    );
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("UPDATE follower_state SET keys = NULL", [])
        .unwrap();
    assert_eq!(cache.held().await.unwrap().unwrap().keys, 2, "counted once");
    Sink::<Vec<u8>>::put(&mut cache, "d".into(), 6, b"v".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::commit(&mut cache, 6, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(cache.held().await.unwrap().unwrap().keys, 3);
}

// ---- Issue 10: what a persisted follower committed ahead of its watermark ----

/// A follower of `db`'s events stream (announcements) persisted into `cache`.
fn announced(name: &str, db: &SqliteDb, cache: PersistedCache) -> tidemark::FollowerHandle {
    FollowerTask::new(config(name), RawBytes, db.source(), db.events(), cache).spawn()
}

/// What an events follower committed before its process died: `rows` at or below
/// `watermark` in one batch, then `ahead` — changes past the watermark, announcements no
/// read of the source had confirmed — in a second batch at the same watermark. The file
/// is closed, as a dead process leaves it; the returned cache is on the file reopened.
async fn died_holding(
    path: &std::path::Path,
    rows: &[(&str, u64, &str)],
    watermark: u64,
    ahead: &[(&str, u64, Option<&str>)],
) -> PersistedCache {
    {
        let db = SqliteDb::open(path).await.unwrap();
        let mut cache = db.follower_cache("e");
        for (key, seq, value) in rows {
            Sink::<Vec<u8>>::put(&mut cache, (*key).into(), *seq, value.as_bytes().to_vec())
                .await
                .unwrap();
        }
        Sink::<Vec<u8>>::commit(&mut cache, watermark, tidemark::Lineage::default())
            .await
            .unwrap();
        for (key, seq, value) in ahead {
            match value {
                Some(v) => {
                    Sink::<Vec<u8>>::put(&mut cache, (*key).into(), *seq, v.as_bytes().to_vec())
                        .await
                        .unwrap();
                }
                None => Sink::<Vec<u8>>::remove(&mut cache, (*key).into(), *seq)
                    .await
                    .unwrap(),
            }
        }
        Sink::<Vec<u8>>::commit(&mut cache, watermark, tidemark::Lineage::default())
            .await
            .unwrap();
    }
    SqliteDb::open(path).await.unwrap().follower_cache("e")
}

/// Seeds 1797 and 2977: a removal applied ahead of the watermark (here a foreign event;
/// in the simulator a replaced history's) was committed, and the process died before the
/// read that would have refuted it. Nothing in the file said it was only a claim, so the
/// key was lost for good. The file keeps it, and the restarted follower checks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_committed_ahead_of_the_watermark_is_checked_after_a_crash() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("b", b"2".to_vec()).await.unwrap();
    src.put("c", b"3".to_vec()).await.unwrap();
    // A foreign event said "a removed at 3"; the source's seq 3 is c's put.
    let cache = died_holding(
        &path.with_file_name("cache.db"),
        &[("a", 1, "1"), ("b", 2, "2")],
        2,
        &[("a", 3, None)],
    )
    .await;
    assert_eq!(
        cache.get("a").await.unwrap(),
        None,
        "the claim was committed"
    );
    let h = announced("e", &db, cache.clone());
    until(&h, "ready", |s| s.ready && s.watermark == 3).await;
    converged(
        &cache,
        &db,
        "the key the unconfirmed removal took is back after the restart",
    )
    .await;
    h.stop();
}

/// Seed 373: a value held past the watermark was confirmed after a restart by its seq
/// alone, so a source whose history reused the seq (a restore) kept the replaced value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_committed_ahead_of_the_watermark_is_compared_by_its_bytes_after_a_crash() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("a", b"new history".to_vec()).await.unwrap();
    let cache = died_holding(
        &path.with_file_name("cache.db"),
        &[("a", 1, "1")],
        1,
        &[("a", 2, Some("replaced history"))],
    )
    .await;
    let h = announced("e", &db, cache.clone());
    let s = until(&h, "ready", |s| s.ready && s.watermark == 2).await;
    converged(
        &cache,
        &db,
        "the source's value at seq 2 replaces the claim",
    )
    .await;
    assert_eq!(
        s.counters.invalid, 1,
        "the replaced claim is counted: {s:?}"
    );
    h.stop();
}

/// Found by reading: a warm start learned a key's seq only when a change named it, so a
/// forged key the file held past its watermark that no later change names was checked
/// only thanks to a listing of every key at start. What the file holds ahead is read
/// instead, in its own size, and the forged key still goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_key_committed_ahead_that_no_change_names_is_removed_after_a_crash() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.put("a", b"1".to_vec()).await.unwrap();
    src.put("b", b"2".to_vec()).await.unwrap();
    src.put("c", b"3".to_vec()).await.unwrap();
    let cache = died_holding(
        &path.with_file_name("cache.db"),
        &[("a", 1, "1"), ("b", 2, "2")],
        2,
        &[("x", 3, Some("forged"))],
    )
    .await;
    let h = announced("e", &db, cache.clone());
    until(&h, "ready", |s| s.ready && s.watermark == 3).await;
    converged(&cache, &db, "the forged key is gone").await;
    h.stop();
}

/// What the file keeps ahead of a follower's watermark: a commit whose watermark passes
/// a change, or that changes its key again at or below it, drops it; a watermark that
/// goes back (a restored source) drops what was ahead of the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_keeps_only_what_is_still_ahead_of_the_watermark() {
    let (_dir, _path, db) = common::fresh().await;
    let mut cache = db.follower_cache("k");
    let ahead = |cache: PersistedCache| async move {
        let mut cache = cache;
        let held = Sink::<Vec<u8>>::resume(&mut cache).await.unwrap().unwrap();
        held.ahead
            .unwrap()
            .iter()
            .map(|a| (a.key().to_owned(), a.seq()))
            .collect::<Vec<_>>()
    };
    Sink::<Vec<u8>>::put(&mut cache, "a".into(), 1, b"1".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::put(&mut cache, "b".into(), 5, b"5".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::remove(&mut cache, "c".into(), 6)
        .await
        .unwrap();
    Sink::<Vec<u8>>::put(&mut cache, "d".into(), 7, b"7".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::commit(&mut cache, 1, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(
        ahead(cache.clone()).await,
        [("b".into(), 5), ("c".into(), 6), ("d".into(), 7)]
    );
    // The watermark passes b; d is replaced at a seq the watermark covers.
    Sink::<Vec<u8>>::put(&mut cache, "d".into(), 3, b"3".to_vec())
        .await
        .unwrap();
    Sink::<Vec<u8>>::commit(&mut cache, 5, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(ahead(cache.clone()).await, [("c".into(), 6)]);
    // A restored source: the watermark goes back, and c's removal was the old history's.
    Sink::<Vec<u8>>::commit(&mut cache, 2, tidemark::Lineage::default())
        .await
        .unwrap();
    assert_eq!(ahead(cache.clone()).await, []);
}

/// Issue 30: `stop_within` aborts a follower whose commit waits for the file (another
/// connection holds its write lock), and the commit, on tokio's blocking pool, lands after
/// the abort. A warm start in the same process read what the cache held before it landed:
/// a watermark and rows the orphaned commit then moved on under it. It now reads after
/// every write this process has in flight on the file, through any handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_reads_after_the_commit_an_aborted_follower_left_in_flight() {
    let (_dir, path, db) = common::fresh().await;
    // The restart's handle: another open of the same file in this process.
    let again = SqliteDb::open(&path).await.unwrap();
    let memory = tidemark_memory::Memory::new();
    memory.source.put("a", b"1".to_vec()).await.unwrap();
    let h = FollowerTask::new(
        config("orphan"),
        RawBytes,
        memory.source.clone(),
        memory.source.clone(),
        db.follower_cache("orphan"),
    )
    .spawn();
    until(&h, "ready at 1", |s| s.ready && s.watermark == 1).await;
    let blocker = rusqlite::Connection::open(&path).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    memory.source.put("b", b"2".to_vec()).await.unwrap();
    // The follower applies b and its commit waits for the lock (busy timeout 5 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped = h.stop_within(Duration::from_millis(100)).await;
    assert!(
        matches!(stopped, Err(tidemark::Error::Timeout { .. })),
        "the stop must have aborted the task mid-commit: {stopped:?}"
    );
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        blocker.execute_batch("COMMIT").unwrap();
    });
    let held = again
        .follower_cache("orphan")
        .held()
        .await
        .unwrap()
        .expect("persisted");
    release.join().unwrap();
    assert_eq!(
        held.watermark, 2,
        "a warm start must not read before the aborted follower's commit lands"
    );
    let cache = again.follower_cache("orphan");
    assert_eq!(cache.watermark().await.unwrap(), 2, "the commit landed");
    assert_eq!(cache.len().await.unwrap(), 2);
}

/// A batch that names keys out of order and some more than once (a feed's, not a
/// snapshot's) lands as the last change to each key and counts each key once; so does
/// one in key order that names a key twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lands_as_the_last_change_to_each_key_in_any_order() {
    let (_dir, _path, db) = common::fresh().await;
    let mut cache = db.follower_cache("o");
    let mut apply = async |changes: &[(&str, u64, Option<&str>)], watermark: u64| {
        for &(key, seq, value) in changes {
            match value {
                Some(v) => Sink::<Vec<u8>>::put(&mut cache, key.into(), seq, v.into()).await,
                None => Sink::<Vec<u8>>::remove(&mut cache, key.into(), seq).await,
            }
            .unwrap();
        }
        Sink::<Vec<u8>>::commit(&mut cache, watermark, tidemark::Lineage::default())
            .await
            .unwrap();
    };
    apply(
        &[
            ("m", 1, Some("m1")),
            ("b", 2, Some("b1")),
            ("m", 3, None),
            ("a", 4, Some("a1")),
            ("m", 5, Some("m2")),
            ("z", 6, Some("z1")),
            ("b", 7, Some("b2")),
            ("z", 8, None),
        ],
        8,
    )
    .await;
    apply(
        &[("c", 9, Some("c1")), ("c", 10, Some("c2")), ("d", 11, None)],
        11,
    )
    .await;
    let cache = db.follower_cache("o");
    let entries: Vec<(String, u64, Vec<u8>)> = [
        ("a", 4, "a1"),
        ("b", 7, "b2"),
        ("c", 10, "c2"),
        ("m", 5, "m2"),
    ]
    .into_iter()
    .map(|(k, s, v)| (k.to_owned(), s, v.into()))
    .collect();
    assert_eq!(
        cache.entries().await.unwrap(),
        entries,
        "each key holds its batch's last change, whatever order the batch named them in"
    );
    let held = cache.held().await.unwrap().unwrap();
    assert_eq!(
        (held.watermark, held.keys),
        (11, 4),
        "each key counted once"
    );
}
