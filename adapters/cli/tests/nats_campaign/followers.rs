//! The followers under test, both through the fault proxy: the runtime's cache over a
//! `KvBucket` in this process, and the built `tidemark mirror` binary into a SQLite file.
//! Both are stopped by the round that started them, on failure too (the mirror by its
//! PID: `kill_on_drop`).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension as _};
use tidemark::{
    Cache, CacheWriter, Counters, FollowerConfig, FollowerHandle, FollowerTask, Lineage, RawBytes,
    Result as TmResult, Sink, cache,
};
use tidemark_nats::KvBucket;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use crate::checker::{ReadyView, Shown};
use crate::ledger::token;

/// The cache's own sink with one addition: at the moment it becomes ready it hands over
/// what it holds, so the first ready view is judged exactly as it was, not a moment later.
struct RecordingCache {
    inner: CacheWriter<Vec<u8>>,
    reader: Cache<Vec<u8>>,
    name: String,
    views: Arc<Mutex<Vec<ReadyView>>>,
}

impl Sink<Vec<u8>> for RecordingCache {
    const FALLIBLE: bool = false;

    async fn put(&mut self, key: Arc<str>, seq: u64, value: Vec<u8>) -> TmResult<()> {
        self.inner.put(key, seq, value).await
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> TmResult<()> {
        self.inner.remove(key, seq).await
    }

    fn reserve(&mut self, keys: usize) {
        self.inner.reserve(keys);
    }

    async fn commit(&mut self, watermark: u64, lineage: Lineage) -> TmResult<()> {
        self.inner.commit(watermark, lineage).await
    }

    async fn rollback(&mut self) {
        self.inner.rollback().await;
    }

    fn ready(&mut self, watermark: u64) {
        self.inner.ready(watermark);
        let view = ReadyView {
            follower: self.name.clone(),
            watermark,
            entries: shown(&self.reader),
        };
        lock(&self.views).push(view);
    }
}

/// What a cache holds, as the checker reads it.
pub fn shown(cache: &Cache<Vec<u8>>) -> Vec<Shown> {
    cache
        .snapshot()
        .into_iter()
        .map(|(k, s, v)| (k, s, token(&v)))
        .collect()
}

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The runtime's cache follower over a `KvBucket` whose client goes through the proxy.
pub struct CacheFollower {
    bucket: KvBucket,
    seed: u64,
    handle: Option<FollowerHandle>,
    pub cache: Cache<Vec<u8>>,
    pub starts: u32,
    pub views: Arc<Mutex<Vec<ReadyView>>>,
    /// The counters of every start, summed as each stops.
    pub counters: Counters,
}

impl CacheFollower {
    pub fn start(bucket: KvBucket, seed: u64, views: Arc<Mutex<Vec<ReadyView>>>) -> Self {
        let mut follower = CacheFollower {
            bucket,
            seed,
            handle: None,
            cache: cache().1,
            starts: 0,
            views,
            counters: Counters::default(),
        };
        follower.spawn();
        follower
    }

    /// The name of the current start, as its watcher and ready view are named.
    pub fn name(&self) -> String {
        format!("cache (start {})", self.starts)
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let config = FollowerConfig::builder("campaign-cache")
            .seed(self.seed.wrapping_add(u64::from(self.starts)))
            .build()
            .unwrap_or_else(|e| panic!("the cache's config: {e}"));
        let (inner, reader) = cache();
        let sink = RecordingCache {
            inner,
            reader: reader.clone(),
            name: self.name(),
            views: Arc::clone(&self.views),
        };
        let task = FollowerTask::new(
            config,
            RawBytes,
            self.bucket.clone(),
            self.bucket.clone(),
            sink,
        );
        self.handle = Some(task.spawn());
        self.cache = reader;
    }

    /// Stops the running start (waiting at most 5 s); keeps its counters.
    pub async fn stop(&mut self) {
        if let Some(handle) = self.handle.take() {
            let status = handle.status();
            let counters = match handle.stop_within(Duration::from_secs(5)).await {
                Ok(end) => end.counters,
                Err(_) => status.counters,
            };
            add_counters(&mut self.counters, &counters);
        }
    }

    /// A cold start: the running one stopped, a new one with an empty cache.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.spawn();
    }
}

fn add_counters(sum: &mut Counters, c: &Counters) {
    sum.resets += c.resets;
    sum.resyncs += c.resyncs;
    sum.reopens += c.reopens;
    sum.gaps += c.gaps;
    sum.stale += c.stale;
    sum.invalid += c.invalid;
    sum.poison += c.poison;
}

/// The `tidemark mirror` process: started, killed with SIGKILL by its PID, started again;
/// the last lines it printed kept for a failure report.
pub struct Mirror {
    bin: PathBuf,
    source: String,
    pub file: PathBuf,
    child: Option<Child>,
    pub lines: Arc<Mutex<VecDeque<String>>>,
    pub starts: u32,
    /// Exits it made on its own (a start while the server was down, say), each a line.
    pub exits: Vec<String>,
    /// While a fault holds it down, nothing starts it again.
    pub held_down: bool,
}

impl Mirror {
    pub fn new(bin: PathBuf, source: String, file: PathBuf) -> Mirror {
        Mirror {
            bin,
            source,
            file,
            child: None,
            lines: Arc::default(),
            starts: 0,
            exits: Vec::new(),
            held_down: false,
        }
    }

    pub fn start(&mut self) -> Result<(), String> {
        let mut command = Command::new(&self.bin);
        command
            .args(["mirror", &self.source, "--into"])
            .arg(&self.file)
            .env("RUST_LOG", "info")
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        self.starts += 1;
        let start = self.starts;
        let out = child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Send + Unpin>);
        let err = child
            .stderr
            .take()
            .map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Send + Unpin>);
        for pipe in [out, err].into_iter().flatten() {
            let lines = Arc::clone(&self.lines);
            tokio::spawn(async move {
                let mut reader = BufReader::new(pipe).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    let mut kept = lock(&lines);
                    if kept.len() == 60 {
                        kept.pop_front();
                    }
                    kept.push_back(format!("[start {start}] {line}"));
                }
            });
        }
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL to its PID, and reaped.
    pub async fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Whether it runs; an exit of its own is recorded (and it is no longer running).
    pub fn running(&mut self) -> bool {
        let Some(child) = self.child.as_mut() else {
            return false;
        };
        match child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                let last = lock(&self.lines).back().cloned().unwrap_or_default();
                self.exits.push(format!("{status}: {last}"));
                self.child = None;
                false
            }
            Err(_) => false,
        }
    }

    /// Whether any line it printed says it panicked.
    pub fn panicked(&self) -> Option<String> {
        lock(&self.lines)
            .iter()
            .find(|l| l.contains("panicked"))
            .cloned()
    }
}

/// Rows of a file's follower cache: key, revision, value (or its first 64 bytes).
pub type Rows = Vec<(String, u64, Vec<u8>)>;

/// The mirror's file, read in one transaction: its committed watermark and entries
/// (tokens only, or whole values with `values`). `None` before the mirror made it.
pub fn read_file(file: &Path, follower: &str, values: bool) -> Option<(u64, Rows)> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let db = Connection::open_with_flags(file, flags).ok()?;
    db.busy_timeout(Duration::from_secs(2)).ok()?;
    db.execute_batch("BEGIN").ok()?;
    let watermark: Option<i64> = db
        .query_row(
            "SELECT watermark FROM follower_state WHERE name = ?1",
            [follower],
            |r| r.get(0),
        )
        .optional()
        .ok()?;
    let sql = match values {
        true => "SELECT key, seq, value FROM follower_cache WHERE name = ?1 ORDER BY key",
        false => {
            "SELECT key, seq, substr(value, 1, 64) FROM follower_cache WHERE name = ?1 ORDER BY key"
        }
    };
    let mut rows = db.prepare(sql).ok()?;
    let entries = rows
        .query_map([follower], |r| {
            let seq: i64 = r.get(1)?;
            Ok((r.get(0)?, seq as u64, r.get(2)?))
        })
        .ok()?
        .collect::<Result<Rows, _>>()
        .ok()?;
    drop(rows);
    let _ = db.execute_batch("COMMIT");
    Some((watermark.unwrap_or(0) as u64, entries))
}
