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
