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
