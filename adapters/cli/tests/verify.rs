//! `tidemark verify SOURCE FILE`: an untouched mirror passes while a writer writes (no
//! false alarm, on a NATS bucket, a prefix view and a SQLite registry); an entry changed,
//! removed or added behind the mirror's back is named and exit 1; what cannot be
//! compared is one line and exit 2.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tidemark::Source;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn verify(args: &[&str]) -> (Output, Value) {
    let mut all = vec!["verify"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = run(&all);
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out, report)
}

fn assert_equal(args: &[&str]) -> Value {
    let (out, report) = verify(args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: no false alarm while a writer writes: {report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(report["equal"], true, "{report}");
    report
}

/// The head of a NATS bucket.
async fn head(client: &async_nats::Client, bucket: &str) -> u64 {
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
    stream.info().await.unwrap().state.last_sequence
}

fn watermark(file: &std::path::Path, name: &str) -> Option<u64> {
    follower(&status_json(file), name).and_then(|f| f["watermark"].as_u64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_mirror_passes_while_written_and_fails_when_touched_behind_its_back() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    let store = kv_bucket(&client, "pkgs").await;
    for i in 0..400 {
        let key = if i % 2 == 0 { "pkg" } else { "doc" };
        store
            .put(format!("{key}.{i}"), Bytes::from(format!("v{i}")))
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let (full, part) = (dir.path().join("full.db"), dir.path().join("part.db"));
    let (full_arg, part_arg) = (full.to_str().unwrap(), part.to_str().unwrap());
    let source = format!("{}/pkgs", server.url());
    let mut mirrors = [
        Running::start(bin().args(["mirror", &source, "--into", full_arg])),
        Running::start(bin().args(["mirror", &source, "--into", part_arg, "--prefix", "pkg"])),
    ];
    for m in &mut mirrors {
        m.wait_line("mirror ready", LIMIT);
    }

    // A writer over both halves of the bucket: puts, overwrites, removals, new keys.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("{}.{}", if n % 2 == 0 { "pkg" } else { "doc" }, n % 600);
                if n % 5 == 0 {
                    store.purge(&key).await.unwrap();
                } else {
                    store.put(&key, Bytes::from(n.to_string())).await.unwrap();
                }
                if n % 50 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            n
        })
    };
    let checks = {
        let (source, full_arg, part_arg) =
            (source.clone(), full_arg.to_owned(), part_arg.to_owned());
        tokio::task::spawn_blocking(move || {
            let mut left_out = 0;
            for _ in 0..4 {
                let r = assert_equal(&[&source, &full_arg]);
                assert!(r["compared"].as_u64() > Some(100), "{r}");
                left_out += r["left_out"].as_u64().unwrap();
                let r = assert_equal(&[&source, &part_arg, "--prefix", "pkg"]);
                assert!(r["compared"].as_u64() > Some(50), "{r}");
            }
            left_out
        })
    };
    let left_out = checks.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let writes = writer.await.unwrap();
    assert!(
        writes > 100,
        "the writer wrote during the checks ({writes})"
    );
    eprintln!("{writes} writes; {left_out} keys left out as newer than the mirror");

    // Quiet now: the mirror at the head, stopped, and its file touched by hand.
    let head = head(&client, "pkgs").await;
    eventually("the mirror reached the head", LIMIT, || {
        watermark(&full, "mirror-pkgs") == Some(head)
    });
    let [first, second] = mirrors;
    first.terminate(LIMIT);
    second.terminate(LIMIT);
    assert_equal(&[&source, full_arg]);
    let c = rusqlite::Connection::open(&full).unwrap();
    let (changed, removed): (String, String) = {
        let mut keys = c
            .prepare(
                "SELECT key FROM follower_cache WHERE name = 'mirror-pkgs' ORDER BY key LIMIT 2",
            )
            .unwrap();
        let keys: Vec<String> = keys
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        (keys[0].clone(), keys[1].clone())
    };
    c.execute(
        "UPDATE follower_cache SET value = x'00' WHERE name = 'mirror-pkgs' AND key = ?1",
        [&changed],
    )
    .unwrap();
    c.execute(
        "DELETE FROM follower_cache WHERE name = 'mirror-pkgs' AND key = ?1",
        [&removed],
    )
    .unwrap();
    c.execute(
        "INSERT INTO follower_cache (name, key, seq, value) VALUES ('mirror-pkgs', 'doc.ghost', 3, x'01')",
        [],
    )
    .unwrap();
    drop(c);

    let (out, report) = verify(&[&source, full_arg]);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_eq!(
        report["wrong"]["first"][0]["key"],
        changed.as_str(),
        "{report}"
    );
    assert_eq!(
        report["missing"]["first"],
        serde_json::json!([removed]),
        "{report}"
    );
    assert_eq!(
        report["extra"]["first"],
        serde_json::json!(["doc.ghost"]),
        "{report}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with("tidemark: "))
            .count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("1 missing, 1 extra, 1 wrong"), "{stderr}");
    // The text report names them too.
    let text = run(&["verify", &source, full_arg]);
    let text = String::from_utf8_lossy(&text.stdout);
    for key in [changed.as_str(), removed.as_str(), "doc.ghost", "not equal"] {
        assert!(text.contains(key), "{key} in:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_mirror_passes_while_written_and_fails_when_the_registry_is_edited() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("reg.db");
    let cache = dir.path().join("cache.db");
    let db = tidemark_sqlite::SqliteDb::open(&reg).await.unwrap();
    let source = db.source();
    for i in 0..200 {
        source.put(&format!("k{i}"), b"0".to_vec()).await.unwrap();
    }
    let (reg_arg, cache_arg) = (reg.to_str().unwrap(), cache.to_str().unwrap());
    let mut mirror = Running::start(bin().args(["mirror", reg_arg, "--into", cache_arg]));
    mirror.wait_line("mirror ready", LIMIT);

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (source, stop) = (source.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("k{}", n % 300);
                if n % 4 == 0 {
                    source.remove(&key).await.unwrap();
                } else {
                    source.put(&key, n.to_string().into_bytes()).await.unwrap();
                }
            }
            n
        })
    };
    let checks = {
        let (reg_arg, cache_arg) = (reg_arg.to_owned(), cache_arg.to_owned());
        tokio::task::spawn_blocking(move || {
            for _ in 0..5 {
                assert_equal(&[&reg_arg, &cache_arg]);
            }
        })
    };
    checks.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    assert!(writer.await.unwrap() > 50);
    let head = source.watermark().await.unwrap();
    eventually("the mirror reached the head", LIMIT, || {
        watermark(&cache, "mirror-reg") == Some(head)
    });

    // Edits straight into the registry's table, which no change log records: the mirror,
    // still running, never hears of them.
    let c = rusqlite::Connection::open(&reg).unwrap();
    let live: Vec<(String, i64)> = c
        .prepare("SELECT key, seq FROM registry WHERE deleted = 0 ORDER BY key LIMIT 2")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let ((changed, _), (removed, removed_seq)) = (live[0].clone(), live[1].clone());
    c.execute(
        "UPDATE registry SET value = x'00' WHERE key = ?1",
        [&changed],
    )
    .unwrap();
    c.execute("DELETE FROM registry WHERE key = ?1", [&removed])
        .unwrap();
    c.execute(
        "INSERT INTO registry (key, value, seq, deleted) VALUES ('added', x'01', ?1, 0)",
        [removed_seq],
    )
    .unwrap();
    drop(c);
    let (out, report) = verify(&[reg_arg, cache_arg]);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_eq!(
        report["wrong"]["first"][0]["key"],
        changed.as_str(),
        "{report}"
    );
    assert_eq!(
        report["extra"]["first"],
        serde_json::json!([removed]),
        "{report}"
    );
    assert_eq!(
        report["missing"]["first"],
        serde_json::json!(["added"]),
        "{report}"
    );
    let (exit, printed) = mirror.terminate(LIMIT);
    assert!(exit.success(), "{printed}");
}

/// Asserts exit 2 and one line on stderr containing `what`.
fn cannot_compare(args: &[&str], what: &str) {
    let (out, _) = verify(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("tidemark: "))
        .collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].contains(what), "{what:?} in {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_compared_is_one_line_and_exit_2() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    kv_bucket(&client, "real").await;
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("reg.db");
    let cache = dir.path().join("cache.db");
    let db = tidemark_sqlite::SqliteDb::open(&reg).await.unwrap();
    db.source().put("a", b"1".to_vec()).await.unwrap();
    let cache_db = tidemark_sqlite::SqliteDb::open(&cache).await.unwrap();
    cache_db
        .follower_cache("mirror-real")
        .apply(Vec::new(), 0, tidemark::Lineage::default())
        .await
        .unwrap();
    let (reg, cache) = (reg.to_str().unwrap(), cache.to_str().unwrap());
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "not a database, only words, long enough to be read").unwrap();

    let bucket = format!("{}/real", server.url());
    cannot_compare(
        &[&format!("{}/typo", server.url()), cache],
        "bucket typo does not exist",
    );
    cannot_compare(
        &[&bucket, dir.path().join("none.db").to_str().unwrap()],
        "none.db",
    );
    cannot_compare(&[&bucket, text.to_str().unwrap()], "not an SQLite database");
    cannot_compare(
        &[&bucket, cache, "--follower", "nope"],
        "holds no follower \"nope\"",
    );
    cannot_compare(&[&bucket, reg], "holds no mirror");
    cannot_compare(&["http://h/b", cache], "scheme");
    cannot_compare(
        &[&format!("nats://{}/real", free_addr()), cache],
        "cannot connect",
    );
    cannot_compare(
        &[dir.path().join("gone.db").to_str().unwrap(), cache],
        "does not exist",
    );
    assert!(
        !dir.path().join("gone.db").exists(),
        "a missing registry is not made up"
    );
    let (out, _) = verify(&[&bucket, cache]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "an empty mirror of an empty bucket is equal: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
