//! Named locks with an owner, a time to live and a fencing token, shared by every process
//! that opens the file.

use std::time::Duration;

use rusqlite::{OptionalExtension, params};
use tidemark::{Error, Lock, LockLease, Result};

use crate::db::{SqliteDb, begin_write, ms, now_ms, to_i64, to_u64};
use crate::error::unavailable;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("lock", &e)
}

/// Named, expiring locks. A released or expired lock keeps its row, so its fencing token
/// keeps growing across holders.
#[derive(Clone, Debug)]
pub struct SqliteLock {
    db: SqliteDb,
}

impl SqliteLock {
    pub(crate) fn new(db: SqliteDb) -> Self {
        SqliteLock { db }
    }
}

impl Lock for SqliteLock {
    async fn try_lock(&self, name: &str, owner: &str, ttl: Duration) -> Result<Option<LockLease>> {
        let (name, owner) = (name.to_owned(), owner.to_owned());
        self.db
            .write("lock", move |conn| {
                let tx = begin_write(conn, sql)?;
                let now = now_ms();
                let held = tx
                    .query_row(
                        "SELECT owner, expires, fencing FROM locks WHERE name = ?1",
                        [&name],
                        |r| {
                            Ok((
                                r.get::<_, Option<String>>(0)?,
                                r.get::<_, i64>(1)?,
                                r.get::<_, i64>(2)?,
                            ))
                        },
                    )
                    .optional()
                    .map_err(sql)?;
                let fencing = match held {
                    Some((Some(holder), expires, _)) if expires > now && holder != owner => {
                        return Ok(None);
                    }
                    Some((_, _, fencing)) => fencing + 1,
                    None => 1,
                };
                tx.execute(
                    "INSERT INTO locks (name, owner, expires, fencing) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,
                     expires = excluded.expires, fencing = excluded.fencing",
                    params![name, owner, now.saturating_add(ms(ttl)), fencing],
                )
                .map_err(sql)?;
                tx.commit().map_err(sql)?;
                Ok(Some(LockLease {
                    name,
                    owner,
                    fencing: to_u64(fencing),
                }))
            })
            .await
    }

    async fn renew(&self, lease: &LockLease, ttl: Duration) -> Result<()> {
        let lease = lease.clone();
        self.db
            .write("lock", move |conn| {
                let n = conn
                    .execute(
                        "UPDATE locks SET expires = ?4
                         WHERE name = ?1 AND owner = ?2 AND fencing = ?3",
                        params![
                            lease.name,
                            lease.owner,
                            to_i64(lease.fencing),
                            now_ms().saturating_add(ms(ttl))
                        ],
                    )
                    .map_err(sql)?;
                if n == 0 {
                    return Err(Error::LeaseLost(format!(
                        "lock {} (fencing {})",
                        lease.name, lease.fencing
                    )));
                }
                Ok(())
            })
            .await
    }

    async fn release(&self, lease: &LockLease) -> Result<()> {
        let lease = lease.clone();
        self.db
            .write("lock", move |conn| {
                conn.execute(
                    "UPDATE locks SET owner = NULL, expires = 0
                     WHERE name = ?1 AND owner = ?2 AND fencing = ?3",
                    params![lease.name, lease.owner, to_i64(lease.fencing)],
                )
                .map_err(sql)?;
                Ok(())
            })
            .await
    }
}
