#![allow(dead_code)]

use std::path::PathBuf;

use tidemark::{FollowerConfig, FollowerHandle, FollowerTask, RawBytes, Source, Status};
use tidemark_sqlite::{PersistedCache, SqliteDb, SqliteSource};

/// A fresh database in its own temporary directory (kept alive by the returned guard).
pub async fn fresh() -> (tempfile::TempDir, PathBuf, SqliteDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tidemark.db");
    let db = SqliteDb::open(&path).await.expect("open a fresh database");
    (dir, path, db)
}

/// The persisted follower called `name` of `db`'s registry, resumed from its cache.
/// Waits until `cond` holds, polling every 5 ms; panics with `what` after 30 s (commits
/// are synced: a loaded machine can take much longer than an idle one).
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = std::time::Instant::now();
    while !cond().await {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "timed out after 30 s waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Every entry of `db`'s registry: key, seq, value.
pub async fn source_contents(db: &SqliteDb) -> Vec<(String, u64, Vec<u8>)> {
    db.source()
        .snapshot()
        .await
        .expect("snapshot of the registry")
        .entries
        .into_iter()
        .map(|e| (e.key.to_string(), e.seq, e.value))
        .collect()
}

/// A follower's configuration with a fixed seed.
pub fn config(name: &str) -> FollowerConfig {
    FollowerConfig::builder(name)
        .seed(1)
        .build()
        .expect("a valid follower config")
}

/// Follows `source`'s change log into `cache`.
pub fn mirror(name: &str, source: SqliteSource, cache: PersistedCache) -> FollowerHandle {
    FollowerTask::new(config(name), RawBytes, source.clone(), source, cache).spawn()
}

/// Waits until the follower's status satisfies `cond`; panics with `what` after 30 s.
pub async fn until(h: &FollowerHandle, what: &str, cond: impl Fn(&Status) -> bool) -> Status {
    let mut rx = h.watch_status();
    let waited =
        tokio::time::timeout(std::time::Duration::from_secs(30), rx.wait_for(|s| cond(s))).await;
    let status = h.status();
    assert!(waited.is_ok(), "timed out waiting until {what}: {status:?}");
    status
}
