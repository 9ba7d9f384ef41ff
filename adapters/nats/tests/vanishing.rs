//! What a NATS bucket drops without a message a follower could see, against a real server:
//! values aged out by `max_age` on a bucket without limit markers, and a key whose delete
//! marker was purged while older messages keep the stream's first sequence low.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use tidemark::{FollowerConfig, FollowerTask, RawBytes, Source, Status, spawn_cache};
use tidemark_nats::KvBucket;

use common::*;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_aged_out_silently_leave_the_cache_on_the_followers_own_clock() {
    let server = server().await;
    let client = client(&server).await;
    let js = jetstream::new(client.clone());
    let store = retry(WAIT, || {
        js.create_key_value(kv::Config {
            bucket: "aging".into(),
            history: 1,
            max_age: Duration::from_secs(2),
            ..Default::default()
        })
    })
    .await;
    store.put("a", Bytes::from_static(b"1")).await.unwrap();
    store.put("b", Bytes::from_static(b"2")).await.unwrap();
    let bucket = KvBucket::new(client.clone(), "aging").unwrap();
    let (cache, handle) = spawn_cache(config("aging"), RawBytes, bucket.clone(), bucket);
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cache.len(), 2);
    // The server drops them silently (no limit markers): only the follower's own expiry
    // can take them out of the cache.
    wait_until(WAIT, "both values aged out of the cache", || {
        cache.is_empty()
    })
    .await;
    assert_eq!(handle.status().counters.expired, 2);
    // The server's own sweep runs on its schedule; it drops them too.
    retry(WAIT, || {
        let store = store.clone();
        async move {
            match contents(&store).await.len() {
                0 => Ok(()),
                n => Err(format!("{n} values still in the bucket")),
            }
        }
    })
    .await;
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
}

/// Sets the bucket's `max_age` as an operator would, on its stream.
async fn set_max_age(js: &jetstream::Context, bucket: &str, max_age: Duration) {
    let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_age = max_age;
    // The server refuses a duplicates window longer than the age limit.
    if !max_age.is_zero() {
        config.duplicate_window = config.duplicate_window.min(max_age);
    }
    js.update_stream(config).await.unwrap();
}

/// The handle looks the bucket up (at a write) before an operator lifts its age limit:
/// a feed opened after the edit must read the limit as it is now, or the follower expires
/// on its own clock values the bucket keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifted_max_age_stops_the_followers_own_expiry() {
    let server = server().await;
    let client = client(&server).await;
    let js = jetstream::new(client.clone());
    retry(WAIT, || {
        js.create_key_value(kv::Config {
            bucket: "lifted".into(),
            history: 1,
            max_age: Duration::from_secs(2),
            ..Default::default()
        })
    })
    .await;
    let bucket = KvBucket::new(client.clone(), "lifted").unwrap();
    bucket.put("a", b"1".to_vec()).await.unwrap();
    set_max_age(&js, "lifted", Duration::ZERO).await;
    bucket.put("b", b"2".to_vec()).await.unwrap();
    let (cache, handle) = spawn_cache(config("lifted"), RawBytes, bucket.clone(), bucket.clone());
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cache.len(), 2);
    // Past the old limit, with room: both values would have aged out under it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let kept = (
        bucket.get("a").await.unwrap().is_some(),
        bucket.get("b").await.unwrap().is_some(),
    );
    let (len, expired) = (cache.len(), handle.status().counters.expired);
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(kept, (true, true), "the bucket keeps its values");
    assert_eq!(
        (len, expired),
        (2, 0),
        "the cache must keep what the bucket keeps (cached, expired by the follower)"
    );
}

/// The other way: an age limit set (without limit markers) after the handle looked the
/// bucket up. The server drops the values silently; only the follower's own expiry, from
/// the limit as it is now, takes them out of the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_age_limit_set_later_is_applied_by_the_followers_own_expiry() {
    let server = server().await;
    let client = client(&server).await;
    let js = jetstream::new(client.clone());
    create_bucket(&client, "limited", 1, 1).await;
    let bucket = KvBucket::new(client.clone(), "limited").unwrap();
    bucket.put("a", b"1".to_vec()).await.unwrap();
    bucket.put("b", b"2".to_vec()).await.unwrap();
    set_max_age(&js, "limited", Duration::from_secs(2)).await;
    let (cache, handle) = spawn_cache(config("limited"), RawBytes, bucket.clone(), bucket.clone());
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cache.len(), 2, "synced before the values aged out");
    let emptied = tokio::time::timeout(Duration::from_secs(10), async {
        while !cache.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let (len, expired) = (cache.len(), handle.status().counters.expired);
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
    assert!(
        emptied.is_ok() && expired == 2,
        "the follower must expire values aged out under the new limit (cached {len}, \
         expired {expired})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_purged_marker_no_replay_reaches_is_found_by_the_presence_check() {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "purged", 1, 1).await;
    store.put("a", Bytes::from_static(b"1")).await.unwrap();
    store.put("k", Bytes::from_static(b"2")).await.unwrap();
    let bucket = KvBucket::new(client.clone(), "purged").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = tidemark_sqlite::SqliteDb::open(dir.path().join("c.db"))
        .await
        .unwrap();
    let cache = db.follower_cache("purged");
    let start = |check: bool| {
        let mut config = FollowerConfig::builder("purged").seed(3);
        if check {
            config = config.presence_check(Duration::from_millis(200));
        }
        FollowerTask::new(
            config.build().unwrap(),
            RawBytes,
            bucket.clone(),
            bucket.clone(),
            cache.clone(),
        )
        .spawn()
    };
    let h = start(false);
    let mut status = h.watch_status();
    status.wait_for(|s: &Status| s.ready).await.unwrap();
    h.stop_within(Duration::from_secs(5)).await.unwrap();
    // While the follower is away: k is deleted and its marker purged from the stream; a
    // (seq 1) keeps the first sequence low, so nothing looks compacted.
    store.delete("k").await.unwrap();
    let mut stream = jetstream::new(client.clone())
        .get_stream("KV_purged")
        .await
        .unwrap();
    stream.purge().filter("$KV.purged.k").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.first_sequence, 1);

    let h = start(true);
    let mut status = h.watch_status();
    tokio::time::timeout(WAIT, status.wait_for(|s: &Status| s.counters.vanished == 1))
        .await
        .unwrap_or_else(|_| panic!("the presence check finds k gone: {:?}", h.status()))
        .unwrap();
    h.stop_within(Duration::from_secs(5)).await.unwrap();
    let held: Vec<String> = cache
        .entries()
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _, _)| k)
        .collect();
    assert_eq!(held, ["a"], "k left the persisted cache, a stays");
}

/// The presence listing holds every live key of a bucket of any size while other keys are
/// purged during it. It used to list the stream's subjects, which the server pages by
/// offset (100,000 a page): a subject purged between two pages shifted later ones past the
/// page boundary, and the check then dropped live keys (a reviewer saw 57–112 of 100,200
/// missing). It is now a headers-only replay of the last message per key, confirmed at its
/// end by a read of the last message present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_over_100k_keys_holds_every_live_key_while_others_are_purged() {
    const KEYS: u32 = 100_200;
    const PURGED: u32 = 2_000;
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "many", 1, 1).await;
    let js = jetstream::new(client.clone());
    // The keys to purge first, so each purge shifts every later subject of the listing.
    let name = |i: u32| format!("k{i:06}");
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(2_000) {
        let mut acks = Vec::with_capacity(chunk.len());
        for &i in chunk {
            acks.push(
                js.publish(format!("$KV.many.{}", name(i)), Bytes::from_static(b"v"))
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let bucket = KvBucket::new(client.clone(), "many").unwrap();
    let stream = js.get_stream("KV_many").await.unwrap();
    let purging = tokio::spawn(async move {
        for i in 0..PURGED {
            stream
                .purge()
                .filter(format!("$KV.many.{}", name(i)))
                .await
                .unwrap();
        }
    });
    let mut short = Vec::new();
    while !purging.is_finished() {
        let listed = bucket
            .present_keys()
            .await
            .unwrap()
            .expect("NATS lists keys");
        let listed: std::collections::HashSet<String> = listed.keys.into_iter().collect();
        let missing = (PURGED..KEYS)
            .map(name)
            .filter(|k| !listed.contains(k))
            .count();
        if missing > 0 {
            short.push(missing);
        }
    }
    purging.await.unwrap();
    let _ = store;
    assert!(
        short.is_empty(),
        "every listing holds every key never purged; listings short by {short:?}"
    );
}
