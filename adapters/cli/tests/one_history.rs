//! Issue 25's steps with the built `tidemark` binary against a real nats-server: a
//! 1,000-key bucket mirrored into a file, the mirror killed with SIGKILL, the bucket
//! deleted and made again and written past the mirror's watermark (1,500 keys, a third
//! deleted again), the mirror started again over the same file: the file ends equal to
//! the new bucket, never keeping the old history's values.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::Value;

use common::*;

const KEYS: u32 = 1_000;
const NEW_KEYS: u32 = 1_500;
const LIMIT: Duration = Duration::from_secs(120);

fn mirror(url: &str, file: &Path, metrics: std::net::SocketAddr) -> Running {
    Running::start(bin().args([
        "mirror",
        &format!("{url}/reg"),
        "--into",
        file.to_str().unwrap(),
        "--metrics",
        &metrics.to_string(),
    ]))
}

fn watermark_of(file: &Path) -> Option<u64> {
    follower(&status_json(file), "mirror-reg").and_then(|f| f["watermark"].as_u64())
}

/// `dump --json` as key → (seq, value).
fn dump(file: &Path) -> BTreeMap<String, (u64, Value)> {
    let out = run(&["dump", file.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            let value = v.get("value").or(v.get("value_base64")).unwrap().clone();
            (
                v["key"].as_str().unwrap().to_owned(),
                (v["seq"].as_u64().unwrap(), value),
            )
        })
        .collect()
}

/// The bucket's keys, revisions and values, read with async-nats.
async fn bucket_contents(store: &jetstream::kv::Store) -> BTreeMap<String, (u64, Value)> {
    let mut out = BTreeMap::new();
    let mut keys = store.keys().await.unwrap();
    while let Some(key) = keys.next().await {
        let key = key.unwrap();
        let entry = store.entry(&key).await.unwrap().unwrap();
        let value = Value::from(std::str::from_utf8(&entry.value).unwrap());
        out.insert(key, (entry.revision, value));
    }
    out
}

async fn head(js: &jetstream::Context) -> u64 {
    js.get_stream("KV_reg")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .last_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_killed_while_its_bucket_is_remade_and_written_past_its_watermark_ends_equal_to_the_new_bucket()
 {
    let server = server().await;
    let client = server.connect().await.unwrap();
    let js = jetstream::new(client.clone());
    let store = kv_bucket(&client, "reg").await;
    for i in 0..KEYS {
        store
            .put(format!("k{i}"), Bytes::from(format!("v{i}")))
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.db");

    let mut first = mirror(&server.url(), &file, free_addr());
    first.wait_line("mirror ready", LIMIT);
    eventually("the file holds the first bucket", LIMIT, || {
        watermark_of(&file) == Some(u64::from(KEYS))
    });
    first.kill9();

    js.delete_key_value("reg").await.unwrap();
    let store = kv_bucket(&client, "reg").await;
    for i in 0..NEW_KEYS {
        store
            .put(format!("k{i}"), Bytes::from(format!("new{i}")))
            .await
            .unwrap();
    }
    for i in (0..NEW_KEYS).filter(|i| i % 3 == 0) {
        store.delete(format!("k{i}")).await.unwrap();
    }
    let head = head(&js).await;
    assert!(
        head > u64::from(KEYS),
        "the new history passed the watermark"
    );
    let want = bucket_contents(&store).await;
    assert_eq!(want.len(), 1_000);

    let metrics = free_addr();
    let second = mirror(&server.url(), &file, metrics);
    eventually(
        "the restarted mirror reached the new bucket's head",
        LIMIT,
        || watermark_of(&file) == Some(head),
    );
    let held = dump(&file);
    let old = held
        .iter()
        .filter(|(k, v)| want.get(*k) != Some(*v))
        .count();
    assert!(
        held == want,
        "the file must equal the new bucket: {old} of its {} keys are not the new bucket's \
         (the old history's values), {} of the bucket's {} keys missing",
        held.len(),
        want.keys().filter(|k| !held.contains_key(*k)).count(),
        want.len()
    );
    let scrape = http_get(metrics, "/metrics").unwrap();
    let resyncs = sample(
        &scrape,
        "tidemark_follower_resyncs_total{follower=\"mirror-reg\",source=\"reg\"}",
    );
    assert!(
        resyncs.is_some_and(|n| n >= 1.0),
        "taking the new history is a resync the metrics show: {resyncs:?}\n{scrape}"
    );
    let (exit, printed) = second.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{exit:?}\n{printed}");
    assert!(!printed.contains("panicked"), "{printed}");
}
