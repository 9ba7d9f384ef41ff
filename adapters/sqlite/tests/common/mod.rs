#![allow(dead_code)]

use std::path::PathBuf;

use tidemark_sqlite::SqliteDb;

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
