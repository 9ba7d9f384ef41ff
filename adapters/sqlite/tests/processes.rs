//! Several processes on one file. The test binary re-invokes itself as the child (the
//! `child_process` entry point, which does nothing unless `TIDEMARK_SQLITE_CHILD` is set).
//! The parent only ever kills the child it spawned, by its handle.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write as _};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tidemark::tidemark_core::{FollowerConfig, Legs, RawBytes};
use tidemark::{Cache, Source, Wake, spawn_cache, spawn_wake_cache};
use tidemark_sqlite::{SqliteDb, Write};

const CHILD_ENV: &str = "TIDEMARK_SQLITE_CHILD";

fn spawn_child(mode: &str, path: &Path) -> Child {
    Command::new(std::env::current_exe().expect("own test binary"))
        .args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, mode)
        .env("TIDEMARK_SQLITE_CHILD_DB", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child writer")
}

/// The child's work: `plain N` writes N mutations without announcing them; `announce`
/// writes announced mutations forever, printing `SEQ n` after each commit.
#[test]
fn child_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let path = std::env::var("TIDEMARK_SQLITE_CHILD_DB").expect("db path");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let db = SqliteDb::open(&path).await.unwrap();
        let mut out = std::io::stdout();
        if let Some(n) = mode.strip_prefix("plain ") {
            let n: u64 = n.parse().unwrap();
            let src = db.source();
            for i in 0..n {
                let key = format!("p{}", i % 37);
                let seq = if i % 5 == 4 {
                    src.remove(&key).await.unwrap()
                } else {
                    Some(src.put(&key, i.to_le_bytes().to_vec()).await.unwrap())
                };
                if let Some(seq) = seq {
                    writeln!(out, "SEQ {seq}").unwrap();
                }
            }
        } else {
            let src = db.announced_source(Legs::default());
            let mut i: u64 = 0;
            loop {
                i += 1;
                let key = format!("k{}", i % 53);
                let seqs = match i % 7 {
                    0 => vec![src.remove(&key).await.unwrap()],
                    3 => src
                        .write_batch(vec![
                            Write::Put(key.clone(), vec![1; 64]),
                            Write::Put(format!("b{}", i % 11), vec![2; 32]),
                            Write::Remove(format!("k{}", (i + 5) % 53)),
                        ])
                        .await
                        .unwrap(),
                    _ => vec![Some(src.put(&key, i.to_le_bytes().to_vec()).await.unwrap())],
                };
                for seq in seqs.into_iter().flatten() {
                    writeln!(out, "SEQ {seq}").unwrap();
                }
                out.flush().unwrap();
            }
        }
        out.flush().unwrap();
    });
}

async fn converge(cache: &Cache<Vec<u8>>, db: &SqliteDb, why: &str) {
    let src = db.source();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let snap = src.snapshot().await.unwrap();
        if cache.watermark() == snap.watermark {
            let mine: Vec<(String, u64, Vec<u8>)> = cache
                .snapshot()
                .into_iter()
                .map(|(k, s, v)| (k, s, Vec::clone(&v)))
                .collect();
            let theirs: Vec<(String, u64, Vec<u8>)> = snap
                .entries
                .into_iter()
                .map(|e| (e.key.to_string(), e.seq, e.value))
                .collect();
            assert_eq!(mine, theirs, "{why}: converged cache must equal the source");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{why}: follower stuck at {} while the source is at {}",
            cache.watermark(),
            snap.watermark
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unannounced_write_in_another_process_wakes_this_one() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("seed", b"0".to_vec()).await.unwrap();
    let config = FollowerConfig::new("wake-only").unwrap();
    let listener = db.wake().listen("registry").await.unwrap();
    let (cache, handle) = spawn_wake_cache(config, RawBytes, db.source(), listener);
    cache.wait_ready().await.unwrap();
    assert_eq!(cache.watermark(), 1);

    let mut raw = db.wake().listen("registry").await.unwrap();
    let started = Instant::now();
    let mut child = spawn_child("plain 200", &path);
    let first = tidemark::WakeListener::recv_timeout(&mut raw, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        first,
        tidemark::Received::Wake(Vec::new()),
        "a commit nobody announced must still wake a listener in another process"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "child writer failed: {status}");
    converge(&cache, &db, "a wake-only follower (which never polls)").await;
    assert!(
        cache.watermark() > 150,
        "the child's writes arrived: {}",
        cache.watermark()
    );
    eprintln!(
        "child start to first wake and convergence: {:?}",
        started.elapsed()
    );
    handle.stop();
}

fn seqs_from(child: &mut Child, want: usize) -> Vec<u64> {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut seqs = Vec::new();
    while seqs.len() < want {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(s) = line.strip_prefix("SEQ ") {
                    seqs.push(s.trim().parse().expect("a seq"));
                }
            }
            _ => break,
        }
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing_twenty_times() {
    let (_dir, path, db) = common::fresh().await;
    drop(db);
    let mut printed: Vec<u64> = Vec::new();
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    for round in 0..20 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let want = 5 + (rng % 60) as usize;
        let mut child = spawn_child("announce", &path);
        let seqs = seqs_from(&mut child, want);
        child.kill().expect("kill -9 our own child");
        child.wait().unwrap();
        assert!(
            !seqs.is_empty(),
            "round {round}: the child committed nothing"
        );
        printed.extend(seqs);

        let db = SqliteDb::open(&path)
            .await
            .unwrap_or_else(|e| panic!("round {round}: reopen after kill -9 failed: {e}"));
        let conn = rusqlite::Connection::open(&path).unwrap();
        let q = |sql: &str| -> (i64, i64) {
            conn.query_row(sql, [], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
        };
        let watermark = db.source().watermark().await.unwrap();
        let w = i64::try_from(watermark).unwrap();
        assert_eq!(
            q("SELECT count(*), COALESCE(max(seq), 0) FROM changelog"),
            (w, w),
            "round {round}: the change log holds exactly seqs 1..=watermark"
        );
        assert_eq!(
            q("SELECT COALESCE(max(seq), 0), count(DISTINCT seq) - count(*) FROM registry"),
            (w, 0),
            "round {round}: the last commit's seq is the watermark"
        );
        assert_eq!(
            q("SELECT count(*), COALESCE(max(seq), 0) FROM outbox"),
            (w, w),
            "round {round}: every committed write has its outbox row"
        );
        let last = *printed.last().unwrap();
        assert!(
            last <= watermark,
            "round {round}: a write reported committed ({last}) is missing (watermark {watermark})"
        );
        assert!(
            printed.windows(2).all(|p| p[0] < p[1]),
            "seqs across restarts must strictly increase"
        );

        let relay = db.relay(db.events(), db.wake(), db.queue(), "registry");
        relay.drain().await.unwrap();
        assert_eq!(
            relay.pending().await.unwrap(),
            0,
            "round {round}: outbox drained"
        );
        assert_eq!(
            q("SELECT count(DISTINCT seq), COALESCE(max(seq), 0) FROM events"),
            (w, w),
            "round {round}: every committed write was published after restart"
        );

        // A persisted follower restarts warm each round and converges on the delta.
        let survivor = db.follower_cache("survivor");
        let source = db.source();
        let f = tidemark::FollowerTask::new(
            FollowerConfig::builder("survivor").seed(1).build().unwrap(),
            RawBytes,
            source.clone(),
            source,
            survivor.clone(),
        )
        .spawn();
        let mut status = f.watch_status();
        tokio::time::timeout(
            Duration::from_secs(30),
            status.wait_for(|s| s.ready && s.watermark == watermark),
        )
        .await
        .unwrap_or_else(|_| panic!("round {round}: the survivor catches up"))
        .unwrap();
        f.stop_within(Duration::from_secs(10)).await.unwrap();
        let snap: Vec<(String, u64, Vec<u8>)> = db
            .source()
            .snapshot()
            .await
            .unwrap()
            .entries
            .into_iter()
            .map(|e| (e.key.to_string(), e.seq, e.value))
            .collect();
        assert_eq!(
            survivor.entries().await.unwrap(),
            snap,
            "round {round}: the persisted follower lost nothing"
        );
    }
    let db = SqliteDb::open(&path).await.unwrap();
    let config = FollowerConfig::builder("after-crashes").build().unwrap();
    let (cache, handle) = spawn_cache(config, RawBytes, db.source(), db.source());
    cache.wait_ready().await.unwrap();
    converge(&cache, &db, "a follower after 20 crashes").await;
    handle.stop();
}
