//! A follower that keeps its cache and watermark in the file restarts warm and reads only
//! the delta.
#![allow(clippy::unwrap_used)]

mod common;
use tidemark::{Source, Wake};
use tidemark_sqlite::{SqliteDb, Write};

async fn source_contents(db: &SqliteDb) -> Vec<(String, u64, Vec<u8>)> {
    db.source()
        .snapshot()
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| (e.key, e.seq, e.value))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_restart_reads_only_the_delta() {
    let (_dir, path, db) = common::fresh().await;
    let src = db.source();
    src.write_batch(
        (0..1000)
            .map(|i| Write::Put(format!("k{i:04}"), format!("v{i}").into_bytes()))
            .collect(),
    )
    .await
    .unwrap();
    let mut f = common::persistent_follower(&db, "warm").await;
    let cold = f.catch_up().await.unwrap();
    assert_eq!(cold.read, 1000, "a cold start reads everything");
    assert!(f.is_ready());
    drop(f);
    drop(db);

    // While the follower is down: 7 puts (one overwrite of a new key) and 3 removals.
    let db = SqliteDb::open(&path).await.unwrap();
    let src = db.source();
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
    let mut f = common::persistent_follower(&db, "warm").await;
    assert_eq!(f.watermark(), 1000, "resumes from the persisted watermark");
    let warm = f.catch_up().await.unwrap();
    assert_eq!(
        warm.read, 9,
        "a warm restart must read only the delta (latest change per key), not the 1000 rows"
    );
    assert!(!warm.resynced);
    assert_eq!(warm.watermark, src.watermark().await.unwrap());
    assert_eq!(
        f.cache().entries().await.unwrap(),
        source_contents(&db).await,
        "the persisted cache equals the source after the delta"
    );
    assert_eq!(f.cache().watermark().await.unwrap(), warm.watermark);
    let again = f.wake().await.unwrap();
    assert_eq!(again.read, 0, "a second catch-up finds nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_below_the_compaction_horizon_resyncs_and_drops_removed_keys() {
    let (_dir, _path, db) = common::fresh().await;
    let src = db.source();
    for key in ["a", "b", "c"] {
        src.put(key, b"1".to_vec()).await.unwrap();
    }
    let mut f = common::persistent_follower(&db, "r").await;
    f.catch_up().await.unwrap();
    drop(f);
    src.remove("b").await.unwrap();
    src.put("d", b"4".to_vec()).await.unwrap();
    src.compact_below(src.watermark().await.unwrap() + 1)
        .await
        .unwrap();
    let mut f = common::persistent_follower(&db, "r").await;
    let r = f.catch_up().await.unwrap();
    assert!(
        r.resynced,
        "history past the watermark is gone: only a snapshot helps"
    );
    assert_eq!(
        f.cache().entries().await.unwrap(),
        source_contents(&db).await,
        "the removed key must leave the persisted cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_follower_catches_up_on_wakes() {
    let (_dir, _path, db) = common::fresh().await;
    let mut f = common::persistent_follower(&db, "w").await;
    let mut listener = db.wake().listen("any").await.unwrap();
    let cache = f.cache().clone();
    let task = tokio::spawn(async move { f.run(&mut listener).await });
    db.source().put("x", b"1".to_vec()).await.unwrap();
    common::eventually("the wake brings the write in", || async {
        cache.watermark().await.unwrap() == 1
    })
    .await;
    assert_eq!(cache.get("x").await.unwrap(), Some((1, b"1".to_vec())));
    task.abort();
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
    let start = |source| {
        tidemark_sqlite::PersistentFollower::start(
            tidemark::tidemark_core::FollowerConfig::builder("r"),
            source,
            caches.follower_cache("r"),
        )
    };
    let mut f = start(registry.source()).await.unwrap();
    assert_eq!(f.catch_up().await.unwrap().watermark, 4);
    drop(f);

    let restored = SqliteDb::open(&backup).await.unwrap();
    assert_eq!(restored.source().watermark().await.unwrap(), 2);
    let mut f = start(restored.source()).await.unwrap();
    let r = f.catch_up().await.unwrap();
    assert!(r.resynced, "a source behind the watermark needs a snapshot");
    assert_eq!(r.watermark, 2, "the restored history's watermark is taken");
    assert_eq!(
        f.cache().entries().await.unwrap(),
        source_contents(&restored).await,
        "the persisted cache holds what the restored registry holds: a is back, c is gone"
    );
    assert_eq!(
        f.cache().watermark().await.unwrap(),
        2,
        "the persisted watermark follows the restored history down"
    );
    let again = f.wake().await.unwrap();
    assert_eq!(
        (again.read, again.resynced),
        (0, false),
        "and it is settled"
    );
    drop(f);

    // New writes on the restored registry reuse seqs 3 and 4: a restart must not skip
    // them as already applied.
    let rsrc = restored.source();
    rsrc.put("d", b"4".to_vec()).await.unwrap();
    rsrc.put("e", b"5".to_vec()).await.unwrap();
    let mut f = start(restored.source()).await.unwrap();
    f.catch_up().await.unwrap();
    assert_eq!(
        f.cache().entries().await.unwrap(),
        source_contents(&restored).await,
        "writes after the restore reach the cache"
    );
}

/// A database whose write lock another connection can hold longer than the busy timeout.
async fn impatient(path: &std::path::Path) -> SqliteDb {
    let options = tidemark_sqlite::Options {
        busy_timeout: std::time::Duration::from_millis(50),
        ..tidemark_sqlite::Options::default()
    };
    SqliteDb::open_with(path, options).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_after_a_warm_restart_leaves_the_cache() {
    // The restart's delta is empty, so the follower resumes knowing no key; the removal
    // comes later and must still reach the persisted cache.
    let (_dir, _path, db) = common::fresh().await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let mut f = common::persistent_follower(&db, "w").await;
    f.catch_up().await.unwrap();
    drop(f);
    let mut f = common::persistent_follower(&db, "w").await;
    f.catch_up().await.unwrap();
    db.source().remove("a").await.unwrap();
    let r = f.wake().await.unwrap();
    assert_eq!(r.removed, 1, "{r:?}");
    assert_eq!(f.cache().get("a").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_between_start_and_the_first_catch_up_is_not_missed() {
    let (_dir, _path, db) = common::fresh().await;
    let mut f = common::persistent_follower(&db, "s").await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    f.catch_up().await.unwrap();
    assert_eq!(
        f.cache().get("a").await.unwrap(),
        Some((1, b"1".to_vec())),
        "the delta read at start is stale once something was committed"
    );
}

/// A persisted follower caught up, then `a` written; another connection runs `fault`, the
/// catch-up fails (`failing` says why), the connection runs `heal`; after `b` is written
/// one catch-up must leave the cache equal to the source, `a` included.
async fn a_failed_catch_up_is_made_good(name: &str, fault: &str, failing: &str, heal: &str) {
    let (_dir, path, _) = common::fresh().await;
    let db = impatient(&path).await;
    let mut f = common::persistent_follower(&db, name).await;
    f.catch_up().await.unwrap();
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch(fault).unwrap();
    assert!(f.wake().await.is_err(), "{failing}");
    other.execute_batch(heal).unwrap();
    drop(other);
    db.source().put("b", b"2".to_vec()).await.unwrap();
    f.wake().await.unwrap();
    assert_eq!(
        f.cache().entries().await.unwrap(),
        source_contents(&db).await,
        "the failed attempt's change (a) is not lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_could_not_be_persisted_is_applied_by_the_next_catch_up() {
    // Another process holds the write lock: reads work (WAL), the cache write cannot.
    a_failed_catch_up_is_made_good(
        "p",
        "BEGIN IMMEDIATE",
        "the cache write times out",
        "COMMIT",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_source_read_does_not_wedge_the_follower() {
    a_failed_catch_up_is_made_good(
        "r",
        "ALTER TABLE registry RENAME TO hidden",
        "the registry cannot be read",
        "ALTER TABLE hidden RENAME TO registry",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_persisted_cache_never_takes_an_older_value_over_a_newer_one() {
    let (_dir, _path, db) = common::fresh().await;
    let cache = db.follower_cache("f");
    let put = |seq: u64, value: &str| tidemark_sqlite::CacheOp::Put {
        key: "k".into(),
        seq,
        value: value.as_bytes().to_vec(),
    };
    cache.apply(vec![put(7, "new")], 7, None).await.unwrap();
    // A second writer of the same name, a step behind (a rolling deploy).
    cache.apply(vec![put(6, "old")], 6, None).await.unwrap();
    assert_eq!(cache.get("k").await.unwrap(), Some((7, b"new".to_vec())));
    assert_eq!(cache.watermark().await.unwrap(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_retries_a_failed_catch_up_without_waiting_for_a_wake() {
    let (_dir, path, _) = common::fresh().await;
    let db = impatient(&path).await;
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let mut f = common::persistent_follower(&db, "run").await;
    let cache = f.cache().clone();
    // Another process holds the write lock, so run's first catch-up cannot persist; it
    // then lets go without committing, so no commit wakes the listener: only a retry
    // brings a in.
    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let mut listener = db.wake().listen("none").await.unwrap();
    let task = tokio::spawn(async move { f.run(&mut listener).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        cache.get("a").await.unwrap(),
        None,
        "the lock is still held"
    );
    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    common::eventually("a retry brings a in", || async {
        cache.get("a").await.unwrap().is_some()
    })
    .await;
    assert!(!task.is_finished(), "a failed catch-up does not end run");
    task.abort();
}
