//! `tidemark get`, `ls` and `dump` read a mirror's file while `tidemark mirror` writes it
//! (a writer keeps writing the bucket meanwhile): every read succeeds, is one commit's
//! view, and disturbs the mirror in nothing; once the writer stops, `dump` is the
//! bucket. Over a registry file they read the registry.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);
const KEYS: usize = 300;

fn stdout(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `dump --json` as key → (seq, value).
fn dump(file: &str) -> BTreeMap<String, (u64, Value)> {
    let text = stdout(&["dump", file, "--json"]);
    let mut entries = BTreeMap::new();
    let mut last = String::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let key = v["key"].as_str().unwrap().to_owned();
        assert!(key > last, "dump is in key order: {last} then {key}");
        last.clone_from(&key);
        let value = v.get("value").or(v.get("value_base64")).unwrap().clone();
        entries.insert(key, (v["seq"].as_u64().unwrap(), value));
    }
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_beside_a_running_mirror_see_whole_commits_and_end_equal_to_the_bucket() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    let store = kv_bucket(&client, "reads").await;
    for i in 0..KEYS {
        store
            .put(format!("k{i:03}"), Bytes::from("0"))
            .await
            .unwrap();
    }
    store
        .put("bin", Bytes::from_static(&[0xff, 0x00, 0x01]))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cache.db");
    let file_arg = file.to_str().unwrap().to_owned();
    let mut mirror = Running::start(bin().args([
        "mirror",
        &format!("{}/reads", server.url()),
        "--into",
        &file_arg,
    ]));
    mirror.wait_line("mirror ready", LIMIT);

    // A writer: puts over every key, and removes some, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("k{:03}", n as usize % KEYS);
                if n % 7 == 0 {
                    store.delete(&key).await.unwrap();
                } else {
                    store.put(&key, Bytes::from(n.to_string())).await.unwrap();
                }
            }
            n
        })
    };

    let reads = {
        let file = file_arg.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut rounds = 0;
            let mut watermarks = Vec::new();
            while started.elapsed() < Duration::from_secs(5) || rounds < 5 {
                rounds += 1;
                let entries = dump(&file);
                let keys: Vec<String> = stdout(&["ls", &file]).lines().map(str::to_owned).collect();
                assert!(
                    keys.windows(2).all(|w| w[0] < w[1]),
                    "ls is in key order, each key once"
                );
                assert!(!entries.is_empty() && !keys.is_empty());
                let bin = stdout(&["get", &file, "bin", "--json"]);
                let bin: Value = serde_json::from_str(&bin).unwrap();
                assert_eq!(
                    bin["value_base64"], "/wAB",
                    "bytes that are not text survive"
                );
                let status = status_json(std::path::Path::new(&file));
                watermarks.push(follower(&status, "mirror-reads").unwrap()["watermark"].as_u64());
            }
            (rounds, watermarks)
        })
    };
    let (rounds, watermarks) = reads.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let writes = writer.await.unwrap();
    assert!(
        writes > 100,
        "the writer wrote while the reads ran ({writes})"
    );
    assert!(
        watermarks.first() < watermarks.last(),
        "the mirror kept committing while {rounds} rounds of reads ran: {watermarks:?}"
    );

    // The writer is done: once the mirror is at the bucket's head, dump is the bucket.
    let js = async_nats::jetstream::new(client.clone());
    let head = js
        .get_stream("KV_reads")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .last_sequence;
    eventually("the mirror reached the bucket's head", LIMIT, || {
        follower(&status_json(&file), "mirror-reads").unwrap()["watermark"] == head
    });
    let entries = dump(&file_arg);
    let mut expected = BTreeMap::new();
    let mut keys = store.keys().await.unwrap();
    while let Some(key) = futures::StreamExt::next(&mut keys).await {
        let key = key.unwrap();
        let entry = store.entry(&key).await.unwrap().unwrap();
        let value = match std::str::from_utf8(&entry.value) {
            Ok(text) => Value::from(text),
            Err(_) => Value::from("/wAB"),
        };
        expected.insert(key, (entry.revision, value));
    }
    assert_eq!(entries, expected, "dump holds the bucket, key for key");
    // A key the bucket still holds (the writer's last word on any one key may have been
    // a delete).
    let (key, (_, value)) = expected
        .iter()
        .find(|(k, _)| k.starts_with('k'))
        .expect("the writer removes only some keys");
    let one = stdout(&["get", &file_arg, key]);
    assert_eq!(
        one.trim_end(),
        value.as_str().unwrap_or_default(),
        "get prints the value"
    );
    let ls_k00: Vec<String> = stdout(&["ls", &file_arg, "--prefix", "k00"])
        .lines()
        .map(str::to_owned)
        .collect();
    let want: Vec<&String> = expected.keys().filter(|k| k.starts_with("k00")).collect();
    assert_eq!(ls_k00.iter().collect::<Vec<_>>(), want);

    let (exit, printed) = mirror.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{printed}");
    assert!(
        !printed.contains("locked") && !printed.contains("WARN") && !printed.contains("ERROR"),
        "the reads disturbed the mirror in nothing:\n{printed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_name_what_is_not_there_and_read_a_registry_file() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("reg.db");
    let db = tidemark_sqlite::SqliteDb::open(&reg).await.unwrap();
    for (k, v) in [("a/1", "x"), ("a/2", "y"), ("b/1", "z")] {
        tidemark::Source::put(&db.source(), k, v.as_bytes().to_vec())
            .await
            .unwrap();
    }
    tidemark::Source::remove(&db.source(), "a/2").await.unwrap();
    let reg = reg.to_str().unwrap();
    assert_eq!(
        stdout(&["ls", reg]),
        "a/1\nb/1\n",
        "a file with no follower is read as a registry; a removed key is gone"
    );
    assert_eq!(stdout(&["dump", reg, "--prefix", "a/"]), "a/1 @1 = x\n");
    assert_eq!(stdout(&["get", reg, "b/1"]), "z\n");

    let out = run(&["get", reg, "a/2"]);
    assert_eq!(out.status.code(), Some(1), "a missing key is exit 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no key \"a/2\" in the registry") && stderr.lines().count() == 1,
        "{stderr}"
    );
    let out = run(&["ls", reg, "--follower", "nope"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a follower the file lacks is a usage error"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("holds no follower \"nope\""),
        "{out:?}"
    );
    let missing = dir.path().join("missing.db");
    let out = run(&["dump", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!missing.exists(), "a read never creates a file");
}
