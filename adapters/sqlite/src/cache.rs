//! A follower's cache and watermark persisted in the database file, written in the same
//! transaction as each applied batch, and the follower that restarts warm from them.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use rusqlite::{OptionalExtension, TransactionBehavior, params};
use tidemark::tidemark_core::{
    Backoff, Follower, FollowerConfig, FollowerConfigBuilder, Input, Output, RawBytes, Rng, Sync,
    Time,
};
use tidemark::{Changes, Error, Received, Result, Source, WakeListener};

use crate::db::{SqliteDb, to_i64, to_u64};
use crate::error::unavailable;
use crate::source::SqliteSource;

fn sql(e: rusqlite::Error) -> Error {
    unavailable("cache", &e)
}

/// One change to a persisted cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOp {
    /// Upsert `key` to `value` as of `seq`.
    Put {
        /// The key.
        key: String,
        /// The seq of the value.
        seq: u64,
        /// The value's bytes.
        value: Vec<u8>,
    },
    /// Remove `key`.
    Remove {
        /// The key.
        key: String,
    },
}

/// A named follower's cache (key → seq, value) and watermark, kept in the database file.
/// Every batch and the watermark it reaches commit together, so after a crash the cache
/// and its watermark always agree.
#[derive(Clone, Debug)]
pub struct PersistedCache {
    db: SqliteDb,
    name: String,
}

impl PersistedCache {
    pub(crate) fn new(db: SqliteDb, name: String) -> Self {
        PersistedCache { db, name }
    }

    /// The follower's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The persisted watermark (0 for a follower never persisted).
    pub async fn watermark(&self) -> Result<u64> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                conn.query_row(
                    "SELECT watermark FROM follower_state WHERE name = ?1",
                    [name],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .map(|w| w.map_or(0, to_u64))
                .map_err(sql)
            })
            .await
    }

    /// `key`'s cached value and seq.
    pub async fn get(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>> {
        let (name, key) = (self.name.clone(), key.to_owned());
        self.db
            .call("cache", move |conn| {
                conn.prepare_cached(
                    "SELECT seq, value FROM follower_cache WHERE name = ?1 AND key = ?2",
                )
                .and_then(|mut s| {
                    s.query_row(params![name, key], |r| {
                        Ok((to_u64(r.get(0)?), r.get::<_, Vec<u8>>(1)?))
                    })
                    .optional()
                })
                .map_err(sql)
            })
            .await
    }

    /// Keys cached.
    pub async fn len(&self) -> Result<u64> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                conn.query_row(
                    "SELECT count(*) FROM follower_cache WHERE name = ?1",
                    [name],
                    |r| r.get::<_, i64>(0),
                )
                .map(to_u64)
                .map_err(sql)
            })
            .await
    }

    /// Whether nothing is cached.
    pub async fn is_empty(&self) -> Result<bool> {
        Ok(self.len().await? == 0)
    }

    /// Every cached entry, in key order.
    pub async fn entries(&self) -> Result<Vec<(String, u64, Vec<u8>)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT key, seq, value FROM follower_cache WHERE name = ?1 ORDER BY key",
                    )
                    .map_err(sql)?;
                let rows = stmt
                    .query_map([name], |r| Ok((r.get(0)?, to_u64(r.get(1)?), r.get(2)?)))
                    .map_err(sql)?;
                rows.collect::<rusqlite::Result<_>>().map_err(sql)
            })
            .await
    }

    /// The seq of each of `keys` that is cached.
    pub async fn seqs_of(&self, keys: Vec<String>) -> Result<Vec<(String, u64)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let mut stmt = conn
                    .prepare_cached("SELECT seq FROM follower_cache WHERE name = ?1 AND key = ?2")
                    .map_err(sql)?;
                let mut out = Vec::new();
                for key in keys {
                    let seq = stmt
                        .query_row(params![name, key], |r| r.get::<_, i64>(0))
                        .optional()
                        .map_err(sql)?;
                    if let Some(seq) = seq {
                        out.push((key, to_u64(seq)));
                    }
                }
                Ok(out)
            })
            .await
    }

    /// The seq of every cached key.
    pub async fn all_seqs(&self) -> Result<Vec<(String, u64)>> {
        let name = self.name.clone();
        self.db
            .call("cache", move |conn| {
                let mut stmt = conn
                    .prepare_cached("SELECT key, seq FROM follower_cache WHERE name = ?1")
                    .map_err(sql)?;
                let rows = stmt
                    .query_map([name], |r| Ok((r.get(0)?, to_u64(r.get(1)?))))
                    .map_err(sql)?;
                rows.collect::<rusqlite::Result<_>>().map_err(sql)
            })
            .await
    }

    /// Applies `ops` and records `watermark`, in one transaction. With `keep_only`, every
    /// cached key not in it is removed too (a resync from a snapshot), and the watermark
    /// is set to `watermark` even if that is lower: a snapshot of a source whose history
    /// restarted (restored from a backup, recreated) replaces the old one. Otherwise the
    /// recorded watermark only grows.
    pub async fn apply(
        &self,
        ops: Vec<CacheOp>,
        watermark: u64,
        keep_only: Option<BTreeSet<String>>,
    ) -> Result<()> {
        let name = self.name.clone();
        self.db
            .write("cache", move |conn| {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(sql)?;
                let replaced = keep_only.is_some();
                if let Some(keep) = keep_only {
                    let stale: Vec<String> = {
                        let mut stmt = tx
                            .prepare_cached("SELECT key FROM follower_cache WHERE name = ?1")
                            .map_err(sql)?;
                        let rows = stmt
                            .query_map([&name], |r| r.get::<_, String>(0))
                            .map_err(sql)?;
                        rows.filter_map(|k| k.ok().filter(|k| !keep.contains(k)))
                            .collect()
                    };
                    let mut del = tx
                        .prepare_cached("DELETE FROM follower_cache WHERE name = ?1 AND key = ?2")
                        .map_err(sql)?;
                    for key in stale {
                        del.execute(params![name, key]).map_err(sql)?;
                    }
                }
                {
                    // Never an older value over a newer one, except when a resync replaces
                    // the cache with a new history (?5).
                    let mut put = tx
                        .prepare_cached(
                            "INSERT INTO follower_cache (name, key, seq, value) VALUES (?1, ?2, ?3, ?4)
                             ON CONFLICT (name, key) DO UPDATE SET seq = excluded.seq,
                             value = excluded.value WHERE ?5 OR excluded.seq > follower_cache.seq",
                        )
                        .map_err(sql)?;
                    let mut del = tx
                        .prepare_cached("DELETE FROM follower_cache WHERE name = ?1 AND key = ?2")
                        .map_err(sql)?;
                    for op in &ops {
                        match op {
                            CacheOp::Put { key, seq, value } => {
                                put.execute(params![name, key, to_i64(*seq), value, replaced])
                            }
                            CacheOp::Remove { key } => del.execute(params![name, key]),
                        }
                        .map_err(sql)?;
                    }
                }
                tx.execute(
                    "INSERT INTO follower_state (name, watermark) VALUES (?1, ?2)
                     ON CONFLICT (name) DO UPDATE SET watermark =
                     CASE WHEN ?3 THEN excluded.watermark
                          ELSE max(watermark, excluded.watermark) END",
                    params![name, to_i64(watermark), replaced],
                )
                .map_err(sql)?;
                tx.commit().map_err(sql)
            })
            .await
    }
}

/// What one catch-up read and applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Rows read from the source (changes and snapshot entries).
    pub read: u64,
    /// Puts applied to the cache.
    pub applied: u64,
    /// Keys removed from the cache.
    pub removed: u64,
    /// Whether history was compacted past the watermark, forcing a full resync.
    pub resynced: bool,
    /// The watermark afterwards.
    pub watermark: u64,
}

/// A follower whose cache lives in the database file: the core [`Follower`] driven by
/// reconciles ([`Sync::WakeOnly`]) against a [`SqliteSource`], each batch of decisions
/// written to a [`PersistedCache`] with its watermark in one transaction.
///
/// Restarting is warm: [`start`](Self::start) reads the persisted watermark, the source's
/// changes since it, and the cached seqs of only the keys those changes touch, then
/// resumes the core from there ([`Follower::resume`]) — the cost is the delta, not the
/// cache's size. If history was compacted past the watermark it loads every cached key and
/// resyncs from a snapshot instead, removing cached keys the source no longer has.
///
/// A catch-up that fails (a source read, a busy database) leaves the persisted cache as it
/// was; the next one starts again from it, so nothing the core decided in the failed
/// attempt is lost. [`run`](Self::run) retries after the configured failure backoff.
/// One name is one follower: do not run two `PersistentFollower`s of the same cache at
/// once.
#[derive(Debug)]
pub struct PersistentFollower {
    config: FollowerConfig,
    core: Follower<RawBytes>,
    source: SqliteSource,
    cache: PersistedCache,
    prefetched: Option<(u64, Changes)>,
    /// A catch-up failed after the core had moved on: restart it from the persisted state.
    stale: bool,
    epoch: Instant,
}

impl PersistentFollower {
    /// Resumes (or starts) the follower called `cache.name()`; `config` is used with
    /// [`Sync::WakeOnly`]. Call [`catch_up`](Self::catch_up) to bring it up to date.
    pub async fn start(
        config: FollowerConfigBuilder,
        source: SqliteSource,
        cache: PersistedCache,
    ) -> Result<Self> {
        let config = config.sync(Sync::WakeOnly).build()?;
        let (core, prefetched) = Self::resume(&config, &source, &cache).await?;
        Ok(PersistentFollower {
            config,
            core,
            source,
            cache,
            prefetched,
            stale: false,
            epoch: Instant::now(),
        })
    }

    /// A core resumed from the persisted watermark, knowing the cached seqs of the keys
    /// the delta since then touches (or of every key, when history was compacted past
    /// it), and that delta, read once.
    async fn resume(
        config: &FollowerConfig,
        source: &SqliteSource,
        cache: &PersistedCache,
    ) -> Result<(Follower<RawBytes>, Option<(u64, Changes)>)> {
        let watermark = cache.watermark().await?;
        let changes = source.changes_since(watermark).await?;
        let keys = match &changes {
            Changes::Since { entries, .. } => {
                cache
                    .seqs_of(entries.iter().map(|e| e.key.clone()).collect())
                    .await?
            }
            Changes::Compacted { .. } => cache.all_seqs().await?,
        };
        let core = Follower::resume(config.clone(), RawBytes, watermark, keys);
        Ok((core, Some((watermark, changes))))
    }

    /// The applied watermark.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.core.watermark()
    }

    /// Whether the initial catch-up completed.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.core.is_ready()
    }

    /// The persisted cache this follower writes.
    #[must_use]
    pub fn cache(&self) -> &PersistedCache {
        &self.cache
    }

    fn now(&self) -> Time {
        Time::from_nanos(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Carries out the core's decisions until it has none left, then persists what it
    /// applied with the new watermark in one transaction. On an error nothing of this
    /// attempt is persisted, and the next call starts again from the persisted state.
    pub async fn catch_up(&mut self) -> Result<CatchUp> {
        if self.stale {
            let (core, prefetched) = Self::resume(&self.config, &self.source, &self.cache).await?;
            self.core = core;
            self.prefetched = prefetched;
            self.stale = false;
        }
        let result = self.attempt().await;
        self.stale = result.is_err();
        result
    }

    /// The changes since `since`: the delta read at start if nothing was committed since
    /// (a write between start and the first catch-up must not be missed), else a fresh
    /// read, whose keys' cached seqs the core is told first (a removal of a key it never
    /// heard of would decide nothing).
    async fn changes_since(&mut self, since: u64) -> Result<Changes> {
        match self.prefetched.take() {
            Some((at, Changes::Since { entries, watermark }))
                if at == since && self.source.watermark().await? == watermark =>
            {
                return Ok(Changes::Since { entries, watermark });
            }
            Some((at, compacted @ Changes::Compacted { .. })) if at == since => {
                return Ok(compacted);
            }
            _ => {}
        }
        let changes = self.source.changes_since(since).await?;
        if let Changes::Since { entries, .. } = &changes {
            let keys = entries.iter().map(|e| e.key.clone()).collect();
            self.core.remember(self.cache.seqs_of(keys).await?);
        }
        Ok(changes)
    }

    async fn attempt(&mut self) -> Result<CatchUp> {
        let mut report = CatchUp::default();
        let mut ops = Vec::new();
        let mut keep_only: Option<BTreeSet<String>> = None;
        let start_watermark = self.core.watermark();
        while let Some(output) = self.core.poll_output() {
            let now = self.now();
            match output {
                Output::LookupSource { token } => {
                    self.core.handle_input(Input::SourceFound { token }, now);
                }
                Output::Reconcile { token, since } => {
                    let changes = self.changes_since(since).await?;
                    let input = match changes {
                        Changes::Since { entries, watermark } => {
                            report.read += entries.len() as u64;
                            Input::Changes {
                                token,
                                changes: entries,
                                source_watermark: watermark,
                            }
                        }
                        Changes::Compacted { first_available } => Input::ChangesUnavailable {
                            token,
                            first_available,
                        },
                    };
                    self.core.handle_input(input, now);
                }
                Output::Snapshot { token } => {
                    let snap = self.source.snapshot().await?;
                    report.read += snap.entries.len() as u64;
                    report.resynced = true;
                    keep_only = Some(snap.entries.iter().map(|e| e.key.clone()).collect());
                    self.core.handle_input(
                        Input::Snapshot {
                            token,
                            entries: snap.entries,
                            source_watermark: snap.watermark,
                        },
                        now,
                    );
                }
                Output::Fetch { token, key, .. } => {
                    let value = self.source.get(&key).await?.map(|v| (v.seq, v.value));
                    self.core.handle_input(Input::Fetched { token, value }, now);
                }
                Output::Put { key, seq, value } => {
                    report.applied += 1;
                    ops.push(CacheOp::Put { key, seq, value });
                }
                Output::Remove { key, .. } => {
                    report.removed += 1;
                    ops.push(CacheOp::Remove { key });
                }
                Output::Diagnostic(d) => tracing::debug!(follower = self.cache.name(), ?d),
                Output::Stopped => break,
                // No feed in this mode; readiness is the core's own flag.
                _ => {}
            }
        }
        report.watermark = self.core.watermark();
        if !ops.is_empty() || keep_only.is_some() || report.watermark != start_watermark {
            self.cache
                .apply(coalesce(ops), report.watermark, keep_only)
                .await?;
        }
        Ok(report)
    }

    /// Reports a wake and catches up.
    pub async fn wake(&mut self) -> Result<CatchUp> {
        let now = self.now();
        self.core.handle_input(Input::Wake, now);
        self.catch_up().await
    }

    /// Catches up on every wake from `listener` until it closes. A failed catch-up is
    /// logged and retried after the configured failure backoff (sooner if a wake comes);
    /// only the listener failing ends it with an error.
    pub async fn run<L: WakeListener>(&mut self, listener: &mut L) -> Result<()> {
        let mut backoff = Backoff::new(*self.config.failure_backoff());
        let mut rng = Rng::new(self.config.seed());
        let result = self.catch_up().await;
        let mut failing = self.failed(result, &mut backoff);
        loop {
            let received = if failing {
                let delay = backoff.next_delay(self.now(), &mut rng);
                listener.recv_timeout(delay).await?
            } else {
                listener.recv().await?
            };
            let result = match received {
                Received::Wake(_) => self.wake().await,
                Received::TimedOut if failing => self.catch_up().await,
                Received::TimedOut => continue,
                Received::Closed => return Ok(()),
            };
            failing = self.failed(result, &mut backoff);
        }
    }

    /// Whether a catch-up failed; logs the failure, and a success resets the backoff.
    fn failed(&self, result: Result<CatchUp>, backoff: &mut Backoff) -> bool {
        match result {
            Ok(_) => {
                backoff.reset();
                false
            }
            Err(e) => {
                tracing::warn!(follower = self.cache.name(), error = %e, "catch-up failed; retrying");
                true
            }
        }
    }
}

/// Keeps only the last op per key, in order (a batch may touch a key twice).
fn coalesce(ops: Vec<CacheOp>) -> Vec<CacheOp> {
    let mut last: HashMap<String, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let key = match op {
            CacheOp::Put { key, .. } | CacheOp::Remove { key } => key.clone(),
        };
        last.insert(key, i);
    }
    ops.into_iter()
        .enumerate()
        .filter(|(i, op)| {
            let key = match op {
                CacheOp::Put { key, .. } | CacheOp::Remove { key } => key,
            };
            last.get(key) == Some(i)
        })
        .map(|(_, op)| op)
        .collect()
}
