//! One database file: its connection, the blocking-call bridge, and the commit watcher that
//! sees every commit by any process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::schema;

/// How hard SQLite syncs to disk at each commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synchronous {
    /// Every commit is on disk when it returns, even across a power loss (`FULL`).
    Full,
    /// A commit survives a process crash; the last commits may be lost on a power loss
    /// (`NORMAL` in WAL mode). Much faster for single-write transactions.
    Normal,
}

/// How to open a database file.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a call waits for another process's write lock (default 5 s).
    pub busy_timeout: Duration,
    /// How often the commit watcher checks `PRAGMA data_version` (default 2 ms): the
    /// cross-process wake latency is about half this on average.
    pub watch_interval: Duration,
    /// Durability of each commit (default [`Synchronous::Full`]).
    pub synchronous: Synchronous,
    /// Leases per job before it is dead-lettered (default 5).
    pub max_attempts: u32,
    /// Run `PRAGMA quick_check` when opening (default off: it reads the whole file).
    pub verify: bool,
    /// How long a [`sweep`](crate::SqliteSweep) keeps change-log history, tombstones and
    /// events (default: at least a minute, and past what every durable cursor and
    /// persisted follower on the file still needs until they are 7 days old).
    pub retention: tidemark::RetentionPolicy,
    /// Rows a sweep deletes per transaction (default 5000), so writers never wait long
    /// for it.
    pub sweep_batch: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            busy_timeout: Duration::from_secs(5),
            watch_interval: Duration::from_millis(2),
            synchronous: Synchronous::Full,
            max_attempts: 5,
            verify: false,
            retention: tidemark::RetentionPolicy::default(),
            sweep_batch: 5000,
        }
    }
}

pub(crate) struct Shared {
    pub(crate) conn: Mutex<Connection>,
    pub(crate) path: PathBuf,
    pub(crate) options: Options,
    /// Bumped after every commit this handle makes and every commit the watcher sees:
    /// what feeds wait on.
    pub(crate) commits: watch::Sender<u64>,
    /// Bumped only by the watcher, once per change of `data_version` it sees (commits by
    /// any connection, this process's included): what wake listeners wait on, so one
    /// commit makes one wake.
    pub(crate) seen: watch::Sender<u64>,
    /// Every handle on this file in this process shares it ([`file_gate`]): each write
    /// holds it shared until its blocking call returns, whether or not anyone still awaits
    /// it, and [`SqliteDb::settled`] takes it whole.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// `PRAGMA data_version` of `conn` when the schema was last found to be this build's:
    /// it moves only when another connection commits, so an unmoved one spares every call
    /// the schema check (read and changed only under `conn`'s lock).
    schema_seen_at: AtomicI64,
}

/// The write gate of the file at `path` in this process: the one every handle on the
/// same file (by its canonical path) shares, made on the first open.
fn file_gate(path: &Path) -> Arc<tokio::sync::RwLock<()>> {
    type Gates = Mutex<Vec<(PathBuf, Weak<tokio::sync::RwLock<()>>)>>;
    static GATES: std::sync::OnceLock<Gates> = std::sync::OnceLock::new();
    let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut gates = GATES
        .get_or_init(Gates::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    gates.retain(|(_, gate)| gate.strong_count() > 0);
    if let Some(gate) = gates
        .iter()
        .find(|(p, _)| *p == key)
        .and_then(|(_, gate)| gate.upgrade())
    {
        return gate;
    }
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    gates.push((key, Arc::downgrade(&gate)));
    gate
}

/// One tidemark database file. Cheap to clone; every port is a view of it:
/// [`source`](Self::source), [`events`](Self::events), [`wake`](Self::wake),
/// [`queue`](Self::queue), [`lock`](Self::lock), [`schedules`](Self::schedules),
/// [`outbox`](Self::outbox), [`follower_cache`](Self::follower_cache).
///
/// Several handles, in one process or many, may open the same file: WAL mode lets readers
/// run beside one writer, writes take the lock up front (`BEGIN IMMEDIATE`) and wait up to
/// the busy timeout. Every call runs on tokio's blocking pool, never on the async runtime.
#[derive(Clone)]
pub struct SqliteDb {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for SqliteDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteDb")
            .field("path", &self.shared.path)
            .finish_non_exhaustive()
    }
}

fn connect(path: &Path, options: &Options) -> Result<Connection> {
    let sql = |e| Error::from_sqlite(path, e);
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sql)?;
    conn.busy_timeout(options.busy_timeout).map_err(sql)?;
    // Reading the header page first turns "not a database" into a typed error early.
    let _: i32 = conn
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .map_err(sql)?;
    Ok(conn)
}

impl SqliteDb {
    /// Opens (creating if absent) the tidemark database at `path` with default options.
    ///
    /// A file that is not a database, is truncated or corrupt, belongs to another
    /// application, or carries a newer schema is refused with its [`Error`] variant.
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteDb> {
        SqliteDb::open_with(path, Options::default()).await
    }

    /// Opens the database at `path` with `options`.
    pub async fn open_with(path: impl AsRef<Path>, options: Options) -> Result<SqliteDb> {
        let path = path.as_ref().to_path_buf();
        let p = path.clone();
        tokio::task::spawn_blocking(move || SqliteDb::open_blocking(&p, options))
            .await
            .map_err(|e| Error::Io {
                path,
                source: std::io::Error::other(e.to_string()),
            })?
    }

    /// [`open_with`](Self::open_with) for a caller outside any async runtime (it blocks).
    /// The ports themselves need a tokio runtime.
    pub fn open_blocking(path: &Path, options: Options) -> Result<SqliteDb> {
        let sql = |e| Error::from_sqlite(path, e);
        schema::check_header(path)?;
        let mut conn = connect(path, &options)?;
        // Before the journal mode: switching a foreign file to WAL would change it.
        schema::refuse_foreign(&conn, path)?;
        let mode: String = conn
            .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
            .map_err(sql)?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(path = %path.display(), mode, "WAL mode unavailable");
        }
        let sync = match options.synchronous {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        };
        conn.pragma_update(None, "synchronous", sync).map_err(sql)?;
        schema::migrate(&mut conn, path)?;
        if options.verify {
            let verdict: String = conn
                .query_row("PRAGMA quick_check", [], |r| r.get(0))
                .map_err(sql)?;
            if verdict != "ok" {
                return Err(Error::Corrupt {
                    path: path.to_path_buf(),
                    detail: verdict,
                });
            }
        }
        let schema_seen_at = data_version(&conn).map_err(sql)?;
        let watcher = connect(path, &options)?;
        let (commits, _) = watch::channel(0);
        let (seen, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
            options,
            commits,
            seen,
            gate: file_gate(path),
            schema_seen_at: AtomicI64::new(schema_seen_at),
        });
        spawn_watcher(Arc::downgrade(&shared), watcher)?;
        Ok(SqliteDb { shared })
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The options it was opened with.
    #[must_use]
    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// Runs `f` on the connection on tokio's blocking pool; SQLite failures become
    /// [`tidemark::Error::Unavailable`] for `port`.
    pub(crate) async fn call<T, F>(&self, port: &'static str, f: F) -> tidemark::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> tidemark::Result<T> + Send + 'static,
    {
        self.run(port, None, f).await
    }

    /// Like [`call`](Self::call) for a call that may write without waking anyone (see
    /// [`write`](Self::write)): it holds the file's write gate until the blocking call
    /// returns, also when the caller was dropped meanwhile (a follower task aborted
    /// mid-commit), so [`settled`](Self::settled) waits for it.
    pub(crate) async fn call_write<T, F>(&self, port: &'static str, f: F) -> tidemark::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> tidemark::Result<T> + Send + 'static,
    {
        let gate = Arc::clone(&self.shared.gate).read_owned().await;
        self.run(port, Some(gate), f).await
    }

    /// Like [`call_write`](Self::call_write), and wakes this process's waiters once it
    /// committed (other processes see it through their watcher).
    pub(crate) async fn write<T, F>(&self, port: &'static str, f: F) -> tidemark::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> tidemark::Result<T> + Send + 'static,
    {
        let out = self.call_write(port, f).await?;
        self.shared.commits.send_modify(|n| *n = n.wrapping_add(1));
        Ok(out)
    }

    /// Waits until every write this process started on the file (through any handle) has
    /// returned, those whose callers are gone included: a call on tokio's blocking pool
    /// runs to its end once started, so a task aborted mid-commit (`stop_within` past its
    /// budget) leaves its commit to land later. A warm start reads after it.
    pub(crate) async fn settled(&self) {
        drop(self.shared.gate.write().await);
    }

    /// Runs `f` on the connection on the blocking pool, holding `gate` (if any) until it
    /// returns.
    async fn run<T, F>(
        &self,
        port: &'static str,
        gate: Option<tokio::sync::OwnedRwLockReadGuard<()>>,
        f: F,
    ) -> tidemark::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> tidemark::Result<T> + Send + 'static,
    {
        let shared = Arc::clone(&self.shared);
        tokio::task::spawn_blocking(move || {
            let _gate = gate;
            let mut conn = shared.conn.lock().unwrap_or_else(|e| e.into_inner());
            shared.schema_unchanged(&conn, port)?;
            f(&mut conn)
        })
        .await
        .map_err(|e| tidemark::Error::unavailable(port, format!("blocking task failed: {e}")))?
    }

    /// Tells this process's waiters about a commit made through [`call`](Self::call).
    pub(crate) fn committed(&self) {
        self.shared.commits.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A connection of its own for a read held open across awaits (a snapshot read part by
    /// part), so the handle's shared connection stays free for every other call. It can
    /// neither create the file nor write to it.
    pub(crate) fn reader(&self) -> Result<Connection> {
        let path = &self.shared.path;
        let sql = |e| Error::from_sqlite(path, e);
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sql)?;
        conn.busy_timeout(self.shared.options.busy_timeout)
            .map_err(sql)?;
        conn.pragma_update(None, "query_only", true).map_err(sql)?;
        Ok(conn)
    }

    /// A receiver that changes after every commit to the file by anyone.
    pub(crate) fn commits(&self) -> watch::Receiver<u64> {
        self.shared.commits.subscribe()
    }

    /// A receiver that changes once per batch of commits the watcher saw.
    pub(crate) fn seen(&self) -> watch::Receiver<u64> {
        self.shared.seen.subscribe()
    }
}

impl Shared {
    /// Refuses a call once the file's schema is not this build's: another process, on a
    /// newer build, migrated it since this handle opened it ([`SchemaChanged`]). The
    /// version is read only when another connection committed since it was last found
    /// good. A write transaction checks again under the write lock ([`begin_write`]).
    ///
    /// [`SchemaChanged`]: tidemark::Error::SchemaChanged
    fn schema_unchanged(&self, conn: &Connection, port: &'static str) -> tidemark::Result<()> {
        let sql = |e: rusqlite::Error| crate::error::unavailable(port, &e);
        let now = data_version(conn).map_err(sql)?;
        if now == self.schema_seen_at.load(Ordering::Relaxed) {
            return Ok(());
        }
        check_schema(conn, sql)?;
        self.schema_seen_at.store(now, Ordering::Relaxed);
        Ok(())
    }
}

/// `PRAGMA data_version` of `conn`: changes when another connection commits to the file.
fn data_version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.prepare_cached("PRAGMA data_version")?
        .query_row([], |r| r.get(0))
}

/// [`tidemark::Error::SchemaChanged`] unless the file is at the schema this build reads
/// and writes ([`SCHEMA_VERSION`](schema::SCHEMA_VERSION)), which it was brought to when
/// this handle opened it.
fn check_schema(
    conn: &Connection,
    sql: impl Fn(rusqlite::Error) -> tidemark::Error,
) -> tidemark::Result<()> {
    let found: i64 = conn
        .prepare_cached("PRAGMA user_version")
        .and_then(|mut s| s.query_row([], |r| r.get(0)))
        .map_err(sql)?;
    if found == schema::SCHEMA_VERSION {
        return Ok(());
    }
    Err(tidemark::Error::SchemaChanged {
        store: conn.path().unwrap_or("(in memory)").to_owned(),
        opened: schema::SCHEMA_VERSION,
        found,
    })
}

/// Begins a write transaction: `BEGIN IMMEDIATE` (the write lock is held from here on, so
/// no migration can land before it commits), then checks that the file is still at the
/// schema this build writes. Every write transaction of every port starts here, so none
/// runs this build's statements on a file a newer build migrated while it was open
/// ([`tidemark::Error::SchemaChanged`]). `sql` maps an SQLite failure to the port's error.
pub(crate) fn begin_write(
    conn: &mut Connection,
    sql: impl Fn(rusqlite::Error) -> tidemark::Error,
) -> tidemark::Result<rusqlite::Transaction<'_>> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(&sql)?;
    check_schema(&tx, sql)?;
    Ok(tx)
}

/// The commit watcher: a dedicated thread and connection asking `PRAGMA data_version`,
/// which changes whenever another connection (in any process) commits to the file. It
/// reads no table: it is not polling the source's rows. It ends with the last handle.
fn spawn_watcher(shared: Weak<Shared>, conn: Connection) -> Result<()> {
    let (interval, path) = match shared.upgrade() {
        Some(s) => (s.options.watch_interval, s.path.clone()),
        None => return Ok(()),
    };
    // The baseline is read before `open` returns: read by the thread once it runs, a
    // commit made in between (the thread can start late on a loaded machine) would become
    // the baseline and wake no listener (found by a flaky test: about 1 in 10 runs).
    let mut last: Option<i64> = conn
        .pragma_query_value(None, "data_version", |r| r.get::<_, i64>(0))
        .ok();
    std::thread::Builder::new()
        .name("tidemark-sqlite-watch".into())
        .spawn(move || {
            loop {
                let Some(s) = shared.upgrade() else { return };
                match conn.pragma_query_value(None, "data_version", |r| r.get::<_, i64>(0)) {
                    Ok(v) => {
                        if last.is_some_and(|l| l != v) {
                            s.commits.send_modify(|n| *n = n.wrapping_add(1));
                            s.seen.send_modify(|n| *n = n.wrapping_add(1));
                        }
                        last = Some(v);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "commit watcher could not read data_version")
                    }
                }
                drop(s);
                std::thread::sleep(interval);
            }
        })
        .map_err(|source| Error::Io { path, source })?;
    Ok(())
}

/// Milliseconds since the unix epoch: the clock every process on the machine shares.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A stored 64-bit random value (a history id, a stamp: SQLite's integers are signed) as
/// the `u64` it stands for, bit for bit (unlike [`to_u64`], which clamps a count).
pub(crate) fn bits(v: i64) -> u64 {
    u64::from_ne_bytes(v.to_ne_bytes())
}

/// A `u64` as SQLite stores it, bit for bit: the inverse of [`bits`].
pub(crate) fn stored(v: u64) -> i64 {
    i64::from_ne_bytes(v.to_ne_bytes())
}

/// A `u64` seq or position as SQLite's integer.
pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// SQLite's integer as a `u64` seq or position (negative values, written by no one but a
/// foreign writer, read as 0).
pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A duration as whole milliseconds for SQLite.
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The check under the write lock, without the per-call one in front of it: a
    /// migration that lands between a call's check and its transaction is still caught.
    #[test]
    fn a_write_transaction_checks_the_schema_under_the_write_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let db = SqliteDb::open_blocking(&path, Options::default()).unwrap();
        let sql = |e: rusqlite::Error| crate::error::unavailable("test", &e);
        let mut conn = db.shared.conn.lock().unwrap();
        begin_write(&mut conn, sql).unwrap().commit().unwrap();
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", schema::SCHEMA_VERSION + 1)
            .unwrap();
        let err = begin_write(&mut conn, sql).map(drop).unwrap_err();
        assert!(
            matches!(
                err,
                tidemark::Error::SchemaChanged { opened, found, .. }
                    if opened == schema::SCHEMA_VERSION && found == schema::SCHEMA_VERSION + 1
            ),
            "{err}"
        );
        assert!(
            conn.is_autocommit(),
            "the refused transaction is rolled back"
        );
    }
}
