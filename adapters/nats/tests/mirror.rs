//! A NATS bucket mirrored into a SQLite file (the persisted sink under the one follower
//! task), against a real nats-server: a warm restart reads only the delta.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use tidemark::{FollowerHandle, FollowerTask, RawBytes, Source, Status};
use tidemark_nats::KvBucket;
use tidemark_sqlite::{PersistedCache, SqliteDb};

use common::*;

const KEYS: u32 = 100_000;
const MISSED: u32 = 1_000;

fn mirror(bucket: &KvBucket, cache: PersistedCache) -> FollowerHandle {
    FollowerTask::new(
        config("mirror"),
        RawBytes,
        bucket.clone(),
        bucket.clone(),
        cache,
    )
    .spawn()
}

async fn until(h: &FollowerHandle, what: &str, cond: impl Fn(&Status) -> bool) -> Status {
    let mut rx = h.watch_status();
    let waited = tokio::time::timeout(Duration::from_secs(120), rx.wait_for(|s| cond(s))).await;
    let status = h.status();
    assert!(waited.is_ok(), "timed out waiting until {what}: {status:?}");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_mirrored_into_a_sqlite_file_restarts_warm_and_reads_only_the_delta() {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "packages", 1, 1).await;
    let mut want: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    put_keys(&store, KEYS, 512).await;
    for i in 0..KEYS {
        want.insert(format!("k{i}"), format!("v{i}").into_bytes());
    }
    let bucket = KvBucket::new(client.clone(), "packages").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = SqliteDb::open(dir.path().join("mirror.db")).await.unwrap();

    let h = mirror(&bucket, db.follower_cache("mirror"));
    let cold = until(&h, "the cold mirror is ready", |s| s.ready).await;
    assert_eq!(cold.counters.applied, u64::from(KEYS), "{cold:?}");
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    drop(db);

    // While the mirror is down: 1,000 changes to distinct keys, a tenth of them removals,
    // some of them new keys.
    for i in 0..MISSED {
        let key = format!("k{}", i * 97 % (KEYS + 200));
        if i % 10 == 0 {
            bucket.remove(&key).await.unwrap();
            want.remove(&key);
        } else {
            bucket.put(&key, b"changed".to_vec()).await.unwrap();
            want.insert(key, b"changed".to_vec());
        }
    }
    let head = bucket.watermark().await.unwrap();

    let db = SqliteDb::open(dir.path().join("mirror.db")).await.unwrap();
    let cache = db.follower_cache("mirror");
    let h = mirror(&bucket, cache.clone());
    let warm = until(&h, "the warm mirror caught up", |s| {
        s.ready && s.watermark == head
    })
    .await;
    assert_eq!(
        warm.counters.applied + warm.counters.removed + warm.counters.stale,
        u64::from(MISSED),
        "a warm restart reads the 1,000 changes, not the 100,000 keys: {warm:?}"
    );
    assert_eq!(warm.counters.resyncs, 0, "{warm:?}");
    assert_eq!(
        warm.keys,
        want.len(),
        "the status counts every persisted key"
    );
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    assert_eq!(cache.watermark().await.unwrap(), head);
    let held: BTreeMap<String, Vec<u8>> = cache
        .entries()
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _, v)| (k, v))
        .collect();
    assert!(held == want, "the file holds exactly the bucket's contents");
}
