//! The followers under test, all through the fault proxy: in this process the runtime's
//! cache over a `KvBucket`, an announcements follower of the round's events stream, and a
//! durable consumer of that stream (its cursor kept on the server); in a process of its
//! own the built `tidemark mirror` binary into a SQLite file. All are stopped by the round
//! that started them, on failure too (the mirror by its PID: `kill_on_drop`).

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
use tidemark_nats::{KvBucket, NatsEvents};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use crate::checker::{ReadyView, Shown};
use crate::ledger::token;

/// The cache's own sink with one addition: at the moment it becomes ready it hands over
/// what it holds, so the first ready view is judged exactly as it was, not a moment later
/// (not for a follower of announcements, which may hold claims above its watermark).
///
/// Its commits also wait on the follower's sink gate, which a sink-pause fault holds.
struct RecordingCache {
    inner: CacheWriter<Vec<u8>>,
    /// The history its last commit was given (the checker's `Watcher::follows`).
    followed: Followed,
    paused: Arc<tokio::sync::RwLock<()>>,
    reader: Cache<Vec<u8>>,
    name: String,
    views: Option<Arc<Mutex<Vec<ReadyView>>>>,
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
        drop(self.paused.read().await);
        // Before the entries show: a sample that sees the new history's drops knows it
        // was taken.
        *lock(&self.followed) = lineage.history;
        self.inner.commit(watermark, lineage).await
    }

    async fn rollback(&mut self) {
        self.inner.rollback().await;
    }

    fn ready(&mut self, watermark: u64) {
        self.inner.ready(watermark);
        if let Some(views) = &self.views {
            let view = ReadyView {
                follower: self.name.clone(),
                watermark,
                entries: shown(&self.reader),
            };
            lock(views).push(view);
        }
    }
}

/// The history an in-process follower's last commit said it follows, for the sampler.
pub type Followed = Arc<Mutex<Option<u64>>>;

/// The running start of an in-process follower as the sampler reads it: its name, its
/// cache and the history its last commit named.
pub type Current = Arc<Mutex<(String, Cache<Vec<u8>>, Followed)>>;

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

/// What an in-process follower follows.
#[derive(Clone)]
pub enum Follows {
    /// The bucket's own history (a KV watch): a replayed feed.
    Bucket,
    /// The events stream as announcements, the bucket as its source; with a cursor name,
    /// a durable consumer whose position is kept on the server.
    Events {
        events: NatsEvents,
        cursor: Option<&'static str>,
    },
}

/// One of the runtime's followers in this process, over a `KvBucket` (and an events
/// stream) whose client goes through the proxy, into an in-memory cache; a restart is a
/// cold start with an empty cache (a durable consumer keeps its cursor).
pub struct CacheFollower {
    /// What it is called in reports: `cache`, `events cache`, `consumer`.
    pub label: &'static str,
    /// The running start's name and cache, for the sampler: read without waiting on a
    /// restart or a reconcile that holds the follower.
    pub current: Current,
    follows: Follows,
    bucket: KvBucket,
    seed: u64,
    handle: Option<FollowerHandle>,
    pub cache: Cache<Vec<u8>>,
    pub starts: u32,
    pub views: Arc<Mutex<Vec<ReadyView>>>,
    /// The counters of every start, summed as each stops.
    pub counters: Counters,
    /// Held (written) while a fault pauses its sink: every start's commits wait on it.
    pub paused: Arc<tokio::sync::RwLock<()>>,
}

impl CacheFollower {
    pub fn start(
        label: &'static str,
        follows: Follows,
        bucket: KvBucket,
        seed: u64,
        views: Arc<Mutex<Vec<ReadyView>>>,
    ) -> Self {
        let mut follower = CacheFollower {
            label,
            current: Arc::new(Mutex::new((String::new(), cache().1, Followed::default()))),
            follows,
            bucket,
            seed,
            handle: None,
            cache: cache().1,
            starts: 0,
            views,
            counters: Counters::default(),
            paused: Arc::default(),
        };
        follower.spawn();
        follower
    }

    /// The name of the current start, as its watcher and ready view are named.
    pub fn name(&self) -> String {
        format!("{} (start {})", self.label, self.starts)
    }

    /// Whether its views are at a watermark (a replayed feed's) rather than holding
    /// announcements above it.
    pub fn replays(&self) -> bool {
        matches!(self.follows, Follows::Bucket)
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let config = FollowerConfig::builder(format!("campaign-{}", self.label.replace(' ', "-")))
            .seed(self.seed.wrapping_add(u64::from(self.starts)))
            .build()
            .unwrap_or_else(|e| panic!("the {} config: {e}", self.label));
        let (inner, reader) = cache();
        let followed = Followed::default();
        let sink = RecordingCache {
            inner,
            followed: Arc::clone(&followed),
            paused: Arc::clone(&self.paused),
            reader: reader.clone(),
            name: self.name(),
            views: self.replays().then(|| Arc::clone(&self.views)),
        };
        let source = self.bucket.clone();
        self.handle = Some(match &self.follows {
            Follows::Bucket => {
                FollowerTask::new(config, RawBytes, source, self.bucket.clone(), sink).spawn()
            }
            Follows::Events {
                events,
                cursor: None,
            } => FollowerTask::new(config, RawBytes, source, events.clone(), sink).spawn(),
            Follows::Events {
                events,
                cursor: Some(name),
            } => FollowerTask::new(config, RawBytes, source, events.clone(), sink)
                .with_cursor(events.clone(), *name)
                .spawn(),
        });
        *lock(&self.current) = (self.name(), reader.clone(), followed);
        self.cache = reader;
    }

    /// Asks the running start for one reconcile pass (what closes the window of an
    /// announcement lost after its write, SPEC §5), waiting at most `within`.
    pub async fn reconcile(&self, within: Duration) -> Result<(), String> {
        let Some(handle) = &self.handle else {
            return Err(format!("{} is not running", self.label));
        };
        match tokio::time::timeout(within, handle.reconcile()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("{}: reconcile failed: {e}", self.label)),
            Err(_) => Err(format!(
                "{}: a reconcile after healing took over {within:?}",
                self.label
            )),
        }
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

    /// A cold start whose sink is paused from the start: its first commit waits until
    /// the returned guard is dropped.
    pub async fn restart_paused(&mut self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.stop().await;
        self.paused = Arc::default();
        let held = Arc::clone(&self.paused).write_owned().await;
        self.spawn();
        held
    }
}

pub fn add_counters(sum: &mut Counters, c: &Counters) {
    sum.resets += c.resets;
    sum.resyncs += c.resyncs;
    sum.reopens += c.reopens;
    sum.gaps += c.gaps;
    sum.stale += c.stale;
    sum.invalid += c.invalid;
    sum.poison += c.poison;
}

/// What the campaign adds to the mirror's file before the mirror first opens it: every
/// commit of the follower's state (the mirror's sink upserts `follower_state` last in each
/// batch's transaction) copies the cache as it stands into `camp_commits` / `camp_rows`,
/// inside that transaction; `camp_starts` marks the last commit before each start. So the
/// view a start became ready with is read exactly, not a moment later.
const COMMIT_LOG: &str = "
    CREATE TABLE camp_commits (id INTEGER PRIMARY KEY, watermark INTEGER NOT NULL);
    CREATE TABLE camp_rows (commit_id INTEGER NOT NULL, key TEXT NOT NULL,
        seq INTEGER NOT NULL, head BLOB);
    CREATE TABLE camp_starts (start INTEGER PRIMARY KEY, after_commit INTEGER NOT NULL);
    CREATE TRIGGER camp_commit_insert AFTER INSERT ON follower_state BEGIN
        INSERT INTO camp_commits (watermark) VALUES (NEW.watermark);
        INSERT INTO camp_rows SELECT (SELECT MAX(id) FROM camp_commits), key, seq,
            substr(value, 1, 64) FROM follower_cache WHERE name = NEW.name;
    END;
    CREATE TRIGGER camp_commit_update AFTER UPDATE ON follower_state BEGIN
        INSERT INTO camp_commits (watermark) VALUES (NEW.watermark);
        INSERT INTO camp_rows SELECT (SELECT MAX(id) FROM camp_commits), key, seq,
            substr(value, 1, 64) FROM follower_cache WHERE name = NEW.name;
    END;
";

/// Makes the mirror's file (tidemark's schema, so the mirror takes it as its own) with the
/// campaign's commit log.
pub async fn prepare_mirror_file(file: &Path) -> Result<(), String> {
    let db = tidemark_sqlite::SqliteDb::open(file)
        .await
        .map_err(|e| format!("making the mirror's file: {e}"))?;
    drop(db);
    let conn = Connection::open(file).map_err(|e| format!("opening the mirror's file: {e}"))?;
    conn.execute_batch(COMMIT_LOG)
        .map_err(|e| format!("adding the commit log to the mirror's file: {e}"))
}

/// The view the mirror's start `start` became ready with at `watermark`, from the commit
/// log: the first commit at `watermark` after the start began, or (a warm start at the
/// head commits nothing before it is ready) the file as the start found it. `Err` when
/// no such commit exists, which the log makes impossible unless the mirror said ready at a
/// watermark its file never held.
pub fn ready_view(file: &Path, start: u32, watermark: u64) -> Result<Vec<Shown>, String> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let db = Connection::open_with_flags(file, flags).map_err(|e| e.to_string())?;
    db.busy_timeout(Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let w = i64::try_from(watermark).map_err(|e| e.to_string())?;
    let after: i64 = db
        .query_row(
            "SELECT after_commit FROM camp_starts WHERE start = ?1",
            [start],
            |r| r.get(0),
        )
        .map_err(|e| format!("start {start} was not marked: {e}"))?;
    let first_at: Option<i64> = db
        .query_row(
            "SELECT MIN(id) FROM camp_commits WHERE id > ?1 AND watermark = ?2",
            [after, w],
            |r| r.get(0),
        )
        .map_err(|e| e.to_string())?;
    let found: Option<(i64, i64)> = db
        .query_row(
            "SELECT id, watermark FROM camp_commits WHERE id = ?1",
            [first_at.unwrap_or(after)],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(|e| e.to_string())?;
    let id = match found {
        Some((id, at)) if at == w => id,
        other => {
            return Err(format!(
                "the mirror's start {start} said ready at {watermark}, but its file holds no \
                 commit at {watermark} of that start (the last before it: {other:?})"
            ));
        }
    };
    let mut rows = db
        .prepare("SELECT key, seq, head FROM camp_rows WHERE commit_id = ?1 ORDER BY key")
        .map_err(|e| e.to_string())?;
    let view = rows
        .query_map([id], |r| {
            let seq: i64 = r.get(1)?;
            let head: Vec<u8> = r.get(2)?;
            Ok((r.get(0)?, seq as u64, token(&head)))
        })
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<Shown>, _>>()
        .map_err(|e| e.to_string());
    drop(rows);
    view
}

/// Where `key` stood in each commit of the mirror's file that moved it, with the starts
/// between them, from the commit log: how a failure that names the mirror's key came to
/// be (which commit dropped it, at what watermark, after which start).
pub fn key_trail(file: &Path, key: &str) -> Result<String, String> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let db = Connection::open_with_flags(file, flags).map_err(|e| e.to_string())?;
    db.busy_timeout(Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let mut starts: VecDeque<(i64, i64)> = db
        .prepare("SELECT start, after_commit FROM camp_starts ORDER BY after_commit, start")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()
        })
        .map_err(|e| e.to_string())?;
    let mut stmt = db
        .prepare(
            "SELECT c.id, c.watermark, r.seq FROM camp_commits c
             LEFT JOIN camp_rows r ON r.commit_id = c.id AND r.key = ?1 ORDER BY c.id",
        )
        .map_err(|e| e.to_string())?;
    let commits = stmt
        .query_map([key], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Option<i64>>(2)?,
            ))
        })
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let mut trail = Vec::new();
    let mut was: Option<Option<i64>> = None;
    for (id, watermark, seq) in commits {
        while starts.front().is_some_and(|&(_, after)| after < id) {
            let (start, _) = starts.pop_front().unwrap_or_default();
            trail.push(format!("start {start}"));
        }
        if was != Some(seq) {
            trail.push(match seq {
                Some(seq) => format!("commit {id} (w {watermark}): at {seq}"),
                None => format!("commit {id} (w {watermark}): absent"),
            });
            was = Some(seq);
        }
    }
    trail.extend(
        starts
            .into_iter()
            .map(|(start, _)| format!("start {start}")),
    );
    Ok(trail.join("; "))
}

/// How many of the mirror's last lines a failure report can show.
const KEPT_LINES: usize = 300;

/// The `tidemark mirror` process: started, killed with SIGKILL by its PID, started again;
/// the last lines it printed kept for a failure report, and the watermark each start said
/// it was ready at.
pub struct Mirror {
    bin: PathBuf,
    source: String,
    pub file: PathBuf,
    child: Option<Child>,
    pub lines: Arc<Mutex<VecDeque<String>>>,
    /// Each start that said it was ready, with the watermark it said.
    pub ready: Arc<Mutex<Vec<(u32, u64)>>>,
    pub starts: u32,
    /// Exits it made on its own (a start while the server was down, say), each a line.
    pub exits: Vec<String>,
    /// While a fault holds it down, nothing starts it again.
    pub held_down: bool,
    /// Lines saying a feed gave up on a consumer as stalled (no campaign fault keeps a
    /// server stalled long enough for that), and how many heartbeats queued behind a
    /// flow-control request it read on through.
    pub gave_up_stalled: Arc<Mutex<Vec<String>>>,
    pub stale_heartbeats: Arc<std::sync::atomic::AtomicU64>,
    /// Lines saying it took a new history of its source.
    pub new_histories: Arc<std::sync::atomic::AtomicU64>,
}

impl Mirror {
    pub fn new(bin: PathBuf, source: String, file: PathBuf) -> Mirror {
        Mirror {
            bin,
            source,
            file,
            child: None,
            lines: Arc::default(),
            ready: Arc::default(),
            starts: 0,
            exits: Vec::new(),
            held_down: false,
            gave_up_stalled: Arc::default(),
            stale_heartbeats: Arc::default(),
            new_histories: Arc::default(),
        }
    }

    pub fn start(&mut self) -> Result<(), String> {
        self.mark_start(self.starts + 1)?;
        let mut command = Command::new(&self.bin);
        command
            .args(["mirror", &self.source, "--into"])
            .arg(&self.file)
            .env("RUST_LOG", "info,tidemark_nats::consumer=debug")
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
            let ready = Arc::clone(&self.ready);
            let gave_up = Arc::clone(&self.gave_up_stalled);
            let stale = Arc::clone(&self.stale_heartbeats);
            let histories = Arc::clone(&self.new_histories);
            tokio::spawn(async move {
                let mut reader = BufReader::new(pipe).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    if let Some(watermark) = ready_at(&line) {
                        lock(&ready).push((start, watermark));
                    }
                    if line.contains(STAYS_STALLED) {
                        lock(&gave_up).push(format!("[start {start}] {line}"));
                    }
                    if line.contains(STALE_HEARTBEAT) {
                        stale.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    if NEW_HISTORY.iter().any(|said| line.contains(said)) {
                        histories.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    let mut kept = lock(&lines);
                    if kept.len() == KEPT_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(format!("[start {start}] {line}"));
                }
            });
        }
        self.child = Some(child);
        Ok(())
    }

    /// Marks in the commit log where start `start` begins (no mirror runs meanwhile).
    fn mark_start(&self, start: u32) -> Result<(), String> {
        let conn = Connection::open(&self.file)
            .map_err(|e| format!("opening the mirror's file to mark start {start}: {e}"))?;
        conn.busy_timeout(Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
        conn.execute(
            "INSERT INTO camp_starts (start, after_commit)
             VALUES (?1, (SELECT IFNULL(MAX(id), 0) FROM camp_commits))",
            [start],
        )
        .map_err(|e| format!("marking the mirror's start {start}: {e}"))?;
        Ok(())
    }

    /// SIGSTOP (`pause`) or SIGCONT to its PID, if it runs.
    pub fn signal(&self, pause: bool) -> Result<(), String> {
        let Some(pid) = self.child.as_ref().and_then(Child::id) else {
            return Ok(());
        };
        let signal = if pause { "-STOP" } else { "-CONT" };
        let sent = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .map_err(|e| format!("kill {signal} {pid}: {e}"))?;
        match sent.success() {
            true => Ok(()),
            false => Err(format!("kill {signal} {pid}: {sent}")),
        }
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

/// What a feed's failure says when it gave up on a consumer as stalled
/// (`tidemark_jetstream::Failure::Stalled`).
pub const STAYS_STALLED: &str = "stays stalled";
/// What a feed logs (at debug) when it reads on past a heartbeat the server sent while it
/// waited on the reader.
pub const STALE_HEARTBEAT: &str = "a heartbeat sent while the server waited on the reader";

/// What the follower task's warnings say when it takes a new history of its source.
const NEW_HISTORY: [&str; 2] = [
    "the source is a new history",
    "the source serves another history",
];

/// The watermark in the follower task's line saying it is ready (`ready worker=… watermark=N`).
fn ready_at(line: &str) -> Option<u64> {
    let (_, rest) = line.split_once(" ready worker=")?;
    let (_, number) = rest.split_once("watermark=")?;
    let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
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

/// What the in-process followers logged that the checker reads: each line saying a feed
/// gave up on a consumer as stalled, and how many heartbeats queued behind a flow-control
/// request they read on through. A tracing layer fills it ([`Capture`]); a round takes
/// it at its end (rounds run one at a time).
#[derive(Debug, Default)]
pub struct Captured {
    pub gave_up_stalled: Vec<String>,
    pub stale_heartbeats: u64,
}

pub static CAPTURED: Mutex<Captured> = Mutex::new(Captured {
    gave_up_stalled: Vec::new(),
    stale_heartbeats: 0,
});

/// The tracing layer that fills [`CAPTURED`] (its filter: [`Capture::wants`]).
pub struct Capture;

impl Capture {
    /// Warnings of tidemark's crates (a feed's failure is in its "backing off" line) and
    /// the NATS feed's own debug lines.
    pub fn wants(meta: &tracing::Metadata<'_>) -> bool {
        let target = meta.target();
        target.starts_with("tidemark")
            && (*meta.level() <= tracing::Level::WARN
                || target.starts_with("tidemark_nats::consumer"))
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut text = String::new();
        event.record(
            &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                use std::fmt::Write as _;
                let _ = write!(text, " {}={value:?}", field.name());
            },
        );
        if text.contains(STAYS_STALLED) {
            lock(&CAPTURED).gave_up_stalled.push(text);
        } else if text.contains(STALE_HEARTBEAT) {
            lock(&CAPTURED).stale_heartbeats += 1;
        }
    }
}
