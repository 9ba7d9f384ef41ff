//! `tidemark mirror --metrics ADDR` against a real nats-server: `/healthz` says the
//! follower runs, `/readyz` says 503 (and why) until the initial sync and 200 after, a
//! stall shows; a bucket that disappears while the mirror runs is waited for, and the
//! mirror follows it again when it is back.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_follow_the_mirror_through_a_bucket_that_comes_goes_and_comes_back() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cache.db");
    let addr = free_addr();
    let mut mirror = Running::start(bin().args([
        "mirror",
        &format!("{}/later", server.url()),
        "--into",
        file.to_str().unwrap(),
        "--metrics",
        &addr.to_string(),
        "--wait-for-source",
        "--stall-after",
        "1",
    ]));
    mirror.wait_line("waiting for it", LIMIT);

    // Before the initial sync: alive, not ready, and the reason says whose and why.
    eventually("the endpoint answers", LIMIT, || {
        http_status(addr, "/healthz").0.contains("200")
    });
    let (status, body) = http_status(addr, "/readyz");
    assert!(
        status.contains("503"),
        "not ready before the bucket exists: {status}"
    );
    assert!(
        body.contains("mirror-later") && (body.contains("not ready") || body.contains("stalled")),
        "the reason names the follower: {body}"
    );
    let (status, _) = http_status(addr, "/nothing-here");
    assert!(status.contains("404"), "{status}");

    let store = kv_bucket(&client, "later").await;
    for i in 0..50 {
        store.put(format!("k{i}"), Bytes::from("v")).await.unwrap();
    }
    eventually("ready once the initial sync is done", LIMIT, || {
        http_status(addr, "/readyz").0.contains("200")
    });
    let (_, scrape) = http_status(addr, "/metrics");
    assert!(
        scrape.contains("tidemark_follower_watermark{follower=\"mirror-later\""),
        "/metrics is still served: {scrape}"
    );

    // The bucket goes away while the mirror runs: it waits (no exit), stays alive, and
    // once it has made no progress for --stall-after, readiness says it stalled.
    let js = jetstream::new(client.clone());
    js.delete_key_value("later").await.unwrap();
    eventually("readiness notices the stall", LIMIT, || {
        let (status, body) = http_status(addr, "/readyz");
        status.contains("503") && body.contains("stalled")
    });
    assert!(
        http_status(addr, "/healthz").0.contains("200"),
        "the process and its follower still run"
    );

    // Back, with a write: the mirror follows it again.
    let store = kv_bucket(&client, "later").await;
    store.put("back", Bytes::from("again")).await.unwrap();
    eventually("the mirror holds the recreated bucket's key", LIMIT, || {
        follower(&status_json(&file), "mirror-later").is_some_and(|f| f["keys"] == 1)
    });
    eventually("ready again", LIMIT, || {
        http_status(addr, "/readyz").0.contains("200")
    });

    let (exit, printed) = mirror.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{exit:?}\n{printed}");
    assert!(!printed.contains("panicked"), "{printed}");
}
