//! A tidemark file opened read-only: an operator's look at the entries it holds (a
//! persisted follower's cache or the registry) and its report, beside a process that is
//! writing it.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use crate::db::to_u64;
use crate::report::{Report, read};
use crate::schema::{self, SCHEMA_VERSION};
use crate::{Error, Result};

/// Which entries of a file to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder<'a> {
    /// The registry (the file's own source): its keys that hold a value.
    Registry,
    /// The cache of the persisted follower of this name.
    Follower(&'a str),
}

/// A tidemark file opened read-only: it is neither created, migrated nor switched to WAL,
/// and a process writing it is not disturbed (a read sees the last commit before it
/// began). What `tidemark status`, `get`, `ls`, `dump` and `verify` read through.
///
/// Every call blocks: call it from a blocking context, or use
/// `tokio::task::spawn_blocking`.
#[derive(Debug)]
pub struct ReadOnlyDb {
    conn: Connection,
    path: PathBuf,
}

impl ReadOnlyDb {
    /// Opens the tidemark file at `path` for reading.
    ///
    /// # Errors
    /// A missing file is [`Error::Io`]; a file that is not a tidemark database, is
    /// damaged or newer is refused as [`SqliteDb::open`](crate::SqliteDb::open) refuses
    /// it; a file with an older schema is [`Error::OlderSchema`], since its tables are
    /// not yet in the shape this build reads.
    pub fn open(path: impl AsRef<Path>) -> Result<ReadOnlyDb> {
        let path = path.as_ref();
        let err = |e| Error::from_sqlite(path, e);
        if let Err(e) = std::fs::metadata(path) {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: e,
            });
        }
        schema::check_header(path)?;
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        schema::refuse_foreign(&conn, path)?;
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(err)?;
        if version == 0 {
            return Err(Error::Foreign {
                path: path.to_path_buf(),
                reason: "no tidemark schema (an empty database)".into(),
            });
        }
        if version < SCHEMA_VERSION {
            return Err(Error::OlderSchema {
                path: path.to_path_buf(),
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        Ok(ReadOnlyDb {
            conn,
            path: path.to_path_buf(),
        })
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn sql(&self, e: rusqlite::Error) -> Error {
        Error::from_sqlite(&self.path, e)
    }

    /// What the file holds (see [`SqliteDb::report`](crate::SqliteDb::report)), in one
    /// read transaction.
    ///
    /// # Errors
    /// An SQLite failure ([`Error::Sqlite`], [`Error::Corrupt`]).
    pub fn report(&mut self) -> Result<Report> {
        read(&mut self.conn).map_err(|e| Error::from_sqlite(&self.path, e))
    }

    /// The names of the persisted followers the file holds, in name order.
    ///
    /// # Errors
    /// An SQLite failure.
    pub fn follower_names(&self) -> Result<Vec<String>> {
        let mut stmt = self
            .conn
            .prepare("SELECT name FROM follower_state ORDER BY name")
            .map_err(|e| self.sql(e))?;
        let rows = stmt.query_map([], |r| r.get(0)).map_err(|e| self.sql(e))?;
        rows.collect::<rusqlite::Result<_>>()
            .map_err(|e| self.sql(e))
    }

    /// `key`'s value and seq in `held`; `None` when absent (or when there is no such
    /// follower).
    ///
    /// # Errors
    /// An SQLite failure.
    pub fn get(&self, held: Holder<'_>, key: &str) -> Result<Option<(u64, Vec<u8>)>> {
        let row = match held {
            Holder::Registry => self
                .conn
                .query_row(
                    "SELECT seq, value FROM registry WHERE key = ?1 AND deleted = 0",
                    [key],
                    |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Option<Vec<u8>>>(1)?)),
                )
                .optional(),
            Holder::Follower(name) => self
                .conn
                .query_row(
                    "SELECT seq, value FROM follower_cache WHERE name = ?1 AND key = ?2",
                    params![name, key],
                    |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Option<Vec<u8>>>(1)?)),
                )
                .optional(),
        }
        .map_err(|e| self.sql(e))?;
        Ok(row.map(|(seq, value)| (to_u64(seq), value.unwrap_or_default())))
    }

    /// Reads the entries of `held` whose keys start with `prefix` (`""`: all), in key
    /// order, handing each (key, seq, value) to `each` until it breaks; returns the
    /// watermark they are complete up to — the registry's, or the follower's committed
    /// one — or `None` for a follower the file does not hold (and then calls `each` for
    /// nothing). One read transaction: the entries and the watermark are one commit's,
    /// however long `each` takes, and a process writing the file goes on meanwhile.
    ///
    /// # Errors
    /// An SQLite failure.
    pub fn scan(
        &mut self,
        held: Holder<'_>,
        prefix: &str,
        mut each: impl FnMut(&str, u64, &[u8]) -> ControlFlow<()>,
    ) -> Result<Option<u64>> {
        let path = self.path.clone();
        let sql = |e| Error::from_sqlite(&path, e);
        let tx = self.conn.transaction().map_err(sql)?;
        let watermark = match held {
            Holder::Registry => tx
                .query_row(
                    "SELECT value FROM tidemark_meta WHERE name = 'watermark'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .map_err(sql)?
                .or(Some(0)),
            Holder::Follower(name) => tx
                .query_row(
                    "SELECT watermark FROM follower_state WHERE name = ?1",
                    [name],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .map_err(sql)?,
        };
        let Some(watermark) = watermark.map(to_u64) else {
            return Ok(None);
        };
        {
            // A range on the primary key: the rows under the prefix, not the table.
            let mut stmt;
            let mut rows = match held {
                Holder::Registry => {
                    stmt = tx
                        .prepare(
                            "SELECT key, seq, value FROM registry
                             WHERE deleted = 0 AND key >= ?1 ORDER BY key",
                        )
                        .map_err(sql)?;
                    stmt.query([prefix]).map_err(sql)?
                }
                Holder::Follower(name) => {
                    stmt = tx
                        .prepare(
                            "SELECT key, seq, value FROM follower_cache
                             WHERE name = ?1 AND key >= ?2 ORDER BY key",
                        )
                        .map_err(sql)?;
                    stmt.query(params![name, prefix]).map_err(sql)?
                }
            };
            while let Some(row) = rows.next().map_err(sql)? {
                let key: String = row.get(0).map_err(sql)?;
                if !key.starts_with(prefix) {
                    break;
                }
                let seq = to_u64(row.get(1).map_err(sql)?);
                let value: Option<Vec<u8>> = row.get(2).map_err(sql)?;
                if each(&key, seq, value.as_deref().unwrap_or_default()).is_break() {
                    break;
                }
            }
        }
        tx.finish().map_err(sql)?;
        Ok(Some(watermark))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::ops::ControlFlow;

    use tidemark::{CacheOp, Source};

    use super::*;
    use crate::SqliteDb;

    fn scan(db: &mut ReadOnlyDb, held: Holder<'_>, prefix: &str) -> (Option<u64>, Vec<String>) {
        let mut keys = Vec::new();
        let w = db
            .scan(held, prefix, |k, seq, v| {
                keys.push(format!("{k}@{seq}={}", String::from_utf8_lossy(v)));
                ControlFlow::Continue(())
            })
            .unwrap();
        (w, keys)
    }

    #[tokio::test]
    async fn reads_a_registry_and_a_follower_by_prefix_without_writing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let db = SqliteDb::open(&path).await.unwrap();
        let source = db.source();
        for k in ["a", "b/1", "b/2", "c"] {
            source.put(k, k.as_bytes().to_vec()).await.unwrap();
        }
        source.remove("b/2").await.unwrap();
        let cache = db.follower_cache("m");
        let put = |key: &str, seq| CacheOp::Put {
            key: key.into(),
            seq,
            value: b"v".to_vec(),
        };
        cache
            .apply(
                vec![put("b/1", 2), put("ba", 3)],
                3,
                tidemark::Lineage::default(),
            )
            .await
            .unwrap();

        let mut ro = ReadOnlyDb::open(&path).unwrap();
        assert_eq!(ro.follower_names().unwrap(), ["m"]);
        assert_eq!(
            scan(&mut ro, Holder::Registry, "b/"),
            (Some(5), vec!["b/1@2=b/1".to_owned()]),
            "a removed key is not read; the prefix is a prefix of whole bytes"
        );
        assert_eq!(
            scan(&mut ro, Holder::Follower("m"), "b"),
            (Some(3), vec!["b/1@2=v".to_owned(), "ba@3=v".to_owned()])
        );
        assert_eq!(scan(&mut ro, Holder::Follower("none"), ""), (None, vec![]));
        assert_eq!(
            ro.get(Holder::Registry, "c").unwrap(),
            Some((4, b"c".to_vec()))
        );
        assert_eq!(ro.get(Holder::Registry, "b/2").unwrap(), None);
        assert_eq!(
            ro.get(Holder::Follower("m"), "ba").unwrap(),
            Some((3, b"v".to_vec()))
        );
        assert!(
            ReadOnlyDb::open(dir.path().join("absent.db")).is_err()
                && !dir.path().join("absent.db").exists(),
            "a missing file is an error, never created"
        );
    }
}
