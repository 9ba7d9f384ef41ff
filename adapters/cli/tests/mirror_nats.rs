//! The `tidemark` binary against a real nats-server: a 10k-key bucket mirrored into a
//! file, the mirror killed with SIGKILL, 100 writes while it is down, a restart that is
//! warm and catches up; `status --json` and the metrics endpoint say so.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::Value;

use common::*;

const KEYS: u32 = 10_000;
const MISSED: u32 = 100;

async fn bucket(client: &async_nats::Client) -> kv::Store {
    kv_bucket(client, "packages").await
}

async fn put_all(store: &kv::Store, keys: impl Iterator<Item = String>) -> u64 {
    let mut acks = futures::stream::iter(keys)
        .map(|key| {
            let store = store.clone();
            async move {
                store
                    .put(key.clone(), Bytes::from(format!("v-{key}")))
                    .await
            }
        })
        .buffer_unordered(256);
    let mut last = 0;
    while let Some(ack) = acks.next().await {
        last = last.max(ack.unwrap());
    }
    last
}

fn mirror(url: &str, file: &std::path::Path, metrics: std::net::SocketAddr) -> Running {
    Running::start(bin().args([
        "mirror",
        &format!("{url}/packages"),
        "--into",
        file.to_str().unwrap(),
        "--metrics",
        &metrics.to_string(),
    ]))
}

fn watermark_of(status: &Value) -> Option<u64> {
    follower(status, "mirror-packages").and_then(|f| f["watermark"].as_u64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_mirror_restarts_warm_and_status_and_metrics_say_so() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    let store = bucket(&client).await;
    let head = put_all(&store, (0..KEYS).map(|i| format!("k{i}"))).await;
    assert_eq!(head, u64::from(KEYS));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cache.db");

    let metrics = free_addr();
    let mut first = mirror(&server.url(), &file, metrics);
    first.wait_line("mirror ready", Duration::from_secs(120));
    eventually(
        "the file holds the bucket's last revision",
        Duration::from_secs(60),
        || watermark_of(&status_json(&file)) == Some(head),
    );
    let scrape = http_get(metrics, "/metrics").unwrap();
    let labels = "{follower=\"mirror-packages\",source=\"packages\"}";
    assert_eq!(
        sample(&scrape, &format!("tidemark_follower_watermark{labels}")),
        Some(10_000.0),
        "the endpoint serves the watermark:\n{scrape}"
    );
    assert_eq!(
        sample(&scrape, &format!("tidemark_follower_lag{labels}")),
        Some(0.0),
        "a mirror at the head has no lag:\n{scrape}"
    );
    first.kill9();

    // While it is down: 100 writes, about half of them to new keys.
    let missed = || (0..MISSED).map(|i| i * 199);
    let new_keys = missed().filter(|k| *k >= KEYS).count();
    let head = put_all(&store, missed().map(|k| format!("k{k}"))).await;
    assert_eq!(head, u64::from(KEYS + MISSED));
    let stale = status_json(&file);
    assert_eq!(watermark_of(&stale), Some(u64::from(KEYS)));

    let metrics = free_addr();
    let second = mirror(&server.url(), &file, metrics);
    eventually(
        "the restarted mirror caught up with the writes it missed",
        Duration::from_secs(60),
        || watermark_of(&status_json(&file)) == Some(head),
    );
    let status = status_json(&file);
    let f = follower(&status, "mirror-packages").unwrap();
    assert_eq!(
        f["last_start"], "warm",
        "a restart over the file is warm: {f}"
    );
    assert_eq!(
        f["resumed_from"],
        u64::from(KEYS),
        "it resumed from the revision the killed mirror had committed: {f}"
    );
    assert_eq!(f["starts"], 2);
    assert_eq!(f["keys"], KEYS as usize + new_keys, "{f}");

    let scrape = http_get(metrics, "/metrics").unwrap();
    let applied = sample(&scrape, &format!("tidemark_follower_applied_total{labels}"));
    assert_eq!(
        applied,
        Some(f64::from(MISSED)),
        "the warm mirror applied only the 100 missed writes, not the 10,100 keys:\n{scrape}"
    );
    for series in [
        "tidemark_follower_lag",
        "tidemark_follower_source_head",
        "tidemark_follower_ready",
        "tidemark_follower_resyncs_total",
    ] {
        assert!(
            sample(&scrape, &format!("{series}{labels}")).is_some(),
            "{series} is served:\n{scrape}"
        );
    }
    assert_eq!(
        sample(&scrape, &format!("tidemark_follower_lag{labels}")),
        Some(0.0)
    );

    let (exit, printed) = second.terminate(Duration::from_secs(30));
    assert!(
        exit.success(),
        "SIGTERM is a graceful stop: {exit:?}\n{printed}"
    );
    assert!(printed.contains("terminated: stopping"), "{printed}");
    assert!(!printed.contains("panicked"), "{printed}");
}
