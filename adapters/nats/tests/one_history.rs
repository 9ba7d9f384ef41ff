//! One history across restarts (SPEC §4), against a real nats-server: a bucket deleted
//! and made again, then written past a follower's watermark, is taken as the new history
//! it is — by a follower that was down meanwhile and resumes from a persisted watermark
//! with a new handle (as a new process does), and by one that kept running. And what the
//! adapter reads to tell: the stream's creation time, and the stored time of the message
//! at a seq, gone with the message.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use tidemark::{
    Feed, FeedItem, FeedStream, FollowerHandle, FollowerTask, RawBytes, Source, Status,
};
use tidemark_memory::MemoryCacheStore;
use tidemark_nats::KvBucket;

use common::*;

/// The old history's keys.
const KEYS: u32 = 1_000;
/// The new history's keys, a third of them deleted again: 2,000 mutations, past the
/// follower's watermark of 1,000.
const NEW_KEYS: u32 = 1_500;

fn follow(bucket: &KvBucket, store: &MemoryCacheStore) -> FollowerHandle {
    FollowerTask::new(
        config("one-history"),
        RawBytes,
        bucket.clone(),
        bucket.clone(),
        store.sink(),
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

/// Deletes bucket `name` and makes it again (one revision per key), then writes
/// `k0`..`k{NEW_KEYS-1}` with new values and deletes every third again. Returns the new
/// stream's head and its store.
async fn remake(client: &async_nats::Client, name: &str) -> (u64, kv::Store) {
    let js = jetstream::new(client.clone());
    js.delete_key_value(name).await.unwrap();
    let store = create_bucket(client, name, 1, 1).await;
    put_keys_with(&store, NEW_KEYS, 256, |i| {
        bytes::Bytes::from(format!("new{i}"))
    })
    .await;
    for i in (0..NEW_KEYS).filter(|i| i % 3 == 0) {
        store.delete(format!("k{i}")).await.unwrap();
    }
    let mut stream = js.get_stream(format!("KV_{name}")).await.unwrap();
    let head = stream.info().await.unwrap().state.last_sequence;
    assert_eq!(
        head,
        u64::from(NEW_KEYS + NEW_KEYS / 3),
        "every write acknowledged"
    );
    (head, store)
}

/// The cache's keys and values.
fn held(cache: &MemoryCacheStore) -> BTreeMap<String, Vec<u8>> {
    cache
        .entries()
        .into_iter()
        .map(|(k, (_, v))| (k, v))
        .collect()
}

/// Panics unless `cache` holds exactly `want`, naming what differs.
fn assert_same(cache: &BTreeMap<String, Vec<u8>>, want: &BTreeMap<String, Vec<u8>>) {
    let old: Vec<&String> = cache
        .iter()
        .filter(|(k, v)| want.get(*k) != Some(*v))
        .map(|(k, _)| k)
        .collect();
    let missing = want.keys().filter(|k| !cache.contains_key(*k)).count();
    assert!(
        old.is_empty() && missing == 0,
        "the cache must equal the new bucket, never serve the old history: {} keys held \
         with a value the bucket does not have (first: {:?}), {missing} of the bucket's \
         {} keys missing",
        old.len(),
        old.iter().take(3).collect::<Vec<_>>(),
        want.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_down_while_its_bucket_was_remade_and_written_past_its_watermark_takes_the_new_history()
 {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "reg", 1, 1).await;
    put_keys(&store, KEYS, 256).await;
    let cache = MemoryCacheStore::new();

    let h = follow(&KvBucket::new(client.clone(), "reg").unwrap(), &cache);
    until(&h, "the first run is ready at the old head", |s| {
        s.ready && s.watermark == u64::from(KEYS)
    })
    .await;
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    assert_eq!(cache.watermark(), Some(u64::from(KEYS)));
    let kept = cache.held().unwrap().lineage;

    let (head, store) = remake(&client, "reg").await;
    assert!(
        head > u64::from(KEYS),
        "the new history passed the watermark"
    );
    let want = contents(&store).await;
    assert_eq!(want.len(), 1_000, "1,500 keys, a third deleted");

    // A new handle, as a restarted process has: it remembers no stream of its own.
    let h = follow(&KvBucket::new(client.clone(), "reg").unwrap(), &cache);
    let status = until(&h, "the restarted follower reached the new head", |s| {
        s.ready && s.watermark == head
    })
    .await;
    let stopped = h.stop_within(Duration::from_secs(30)).await.unwrap();
    assert_same(&held(&cache), &want);
    assert!(
        status.counters.resets >= 1 && stopped.counters.resets >= 1,
        "the new history is taken as a reset, counted: {stopped:?}"
    );
    let now = cache.held().unwrap().lineage;
    assert!(
        kept.history.is_some() && now.history.is_some() && now.history != kept.history,
        "the sink keeps the history with its watermark, the new one now: {kept:?} → {now:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_follower_whose_bucket_is_remade_and_written_past_its_watermark_takes_the_new_history()
 {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "live", 1, 1).await;
    put_keys(&store, KEYS, 256).await;
    let cache = MemoryCacheStore::new();
    let h = follow(&KvBucket::new(client.clone(), "live").unwrap(), &cache);
    until(&h, "ready at the old head", |s| {
        s.ready && s.watermark == u64::from(KEYS)
    })
    .await;

    let (head, store) = remake(&client, "live").await;
    let want = contents(&store).await;
    let status = until(&h, "the follower reached the new head", |s| {
        s.ready && s.watermark == head
    })
    .await;
    // Nothing is written after `head`: whatever the follower does next, its cache must be
    // the new bucket's now.
    assert_same(&held(&cache), &want);
    assert!(
        status.counters.resets >= 1,
        "the new history is taken as a reset, counted: {status:?}"
    );
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    assert_same(&held(&cache), &want);
}

/// The first entry the feed opened at `from` delivers.
async fn first_entry(bucket: &KvBucket, from: u64) -> tidemark::tidemark_core::Entry {
    let mut opened = bucket.open(from, None).await.unwrap();
    loop {
        match opened.stream.next().await {
            Some(Ok(FeedItem::Entry(e))) => return e,
            Some(Ok(_)) => {}
            other => panic!("the feed ended before its first entry: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stamp_at_a_seq_is_its_messages_stored_time_and_none_once_the_message_is_gone() {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "stamps", 1, 1).await;
    let bucket = KvBucket::new(client.clone(), "stamps").unwrap();
    let a1 = bucket.put("a", b"1".to_vec()).await.unwrap();
    let b1 = bucket.put("b", b"1".to_vec()).await.unwrap();
    let a2 = bucket.put("a", b"2".to_vec()).await.unwrap();

    let js = jetstream::new(client.clone());
    let mut stream = js.get_stream("KV_stamps").await.unwrap();
    let created = stream.info().await.unwrap().created.unix_timestamp_nanos();
    let created = Some(u64::try_from(created).unwrap());
    // The message's stored time as async-nats reads it (a key's entry).
    let b_entry = store.entry("b").await.unwrap().unwrap();
    let b_time = Some(u64::try_from(b_entry.created.unix_timestamp_nanos()).unwrap());

    let at = bucket.lineage_at(b1).await.unwrap();
    assert_eq!(
        at.history, created,
        "the history is the stream's creation time"
    );
    assert_eq!(at.stamp, b_time, "a present message: its stored time");
    assert_eq!(
        bucket.lineage_at(a1).await.unwrap().stamp,
        None,
        "a revision overwritten in a history-1 bucket has no stamp"
    );
    assert_eq!(bucket.lineage_at(0).await.unwrap().stamp, None);
    assert_eq!(bucket.lineage_at(a2 + 5).await.unwrap().stamp, None);
    assert_eq!(
        bucket.lineage_at(u64::MAX).await.unwrap().stamp,
        None,
        "any seq is an answer, never an error"
    );

    // What the feed delivers and what it opens with agree with it, so a follower that
    // kept the stamp of the entry at its watermark finds the same one on its next read.
    let delivered = first_entry(&bucket, b1).await;
    assert_eq!((delivered.seq, delivered.stamp), (b1, b_time));
    let opened = bucket.open(b1 + 1, None).await.unwrap();
    assert_eq!(
        opened.info.lineage, at,
        "a feed opened after b says b's lineage"
    );
    drop(opened);
    let snapshot = bucket.snapshot().await.unwrap();
    assert_eq!(snapshot.watermark, a2);
    assert_eq!(
        snapshot.lineage,
        bucket.lineage_at(a2).await.unwrap(),
        "a snapshot says the lineage at its watermark"
    );
    // Since 1: a's first revision (seq 1) was overwritten, and the stream starts at 2.
    let changes = bucket.changes_since(a1).await.unwrap();
    let tidemark::Changes::Since { entries, .. } = changes else {
        panic!("changes since the stream's first seq - 1: {changes:?}");
    };
    assert_eq!(entries.len(), 2, "b and a's second revision: {entries:?}");
    assert!(
        entries.iter().all(|e| e.stamp.is_some()),
        "every change carries its stamp: {entries:?}"
    );

    // Deleted, then purged: the message at the seq is gone.
    let del = bucket.remove("b").await.unwrap().unwrap();
    assert!(
        bucket.lineage_at(del).await.unwrap().stamp.is_some(),
        "a delete marker is a mutation"
    );
    stream.purge().filter("$KV.stamps.b").await.unwrap();
    assert_eq!(bucket.lineage_at(del).await.unwrap().stamp, None, "purged");
    assert_eq!(bucket.lineage_at(b1).await.unwrap().stamp, None);

    // Made again: another history, at every seq.
    js.delete_key_value("stamps").await.unwrap();
    create_bucket(&client, "stamps", 1, 1).await;
    assert_eq!(bucket.put("a", b"3".to_vec()).await.unwrap(), 1);
    let read = bucket.lineage_at(1).await.unwrap();
    assert!(
        read.history.is_some() && read.history != created,
        "{read:?} after {created:?}"
    );
}

/// A backup of stream `name` as `nats stream backup` takes it (`$JS.API.STREAM.SNAPSHOT`,
/// no consumers): its config, its state and the snapshot's bytes.
async fn backup(client: &async_nats::Client, name: &str) -> (serde_json::Value, Vec<u8>) {
    use futures::StreamExt as _;
    let inbox = client.new_inbox();
    let mut chunks = client.subscribe(inbox.clone()).await.unwrap();
    let request = serde_json::json!({ "deliver_subject": inbox, "no_consumers": true });
    let answer = client
        .request(
            format!("$JS.API.STREAM.SNAPSHOT.{name}"),
            request.to_string().into(),
        )
        .await
        .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
    assert!(answer.get("error").is_none(), "snapshot refused: {answer}");
    let mut data = Vec::new();
    loop {
        let chunk = tokio::time::timeout(Duration::from_secs(30), chunks.next())
            .await
            .expect("the snapshot's next chunk")
            .expect("the chunk subscription");
        if chunk.payload.is_empty() {
            // The end: a status of 204, or an error.
            let status = chunk.status.map(|s| s.as_u16());
            assert!(
                status.is_none_or(|s| s == 204),
                "snapshot failed: {chunk:?}"
            );
            break;
        }
        data.extend_from_slice(&chunk.payload);
        if let Some(reply) = chunk.reply {
            client.publish(reply, bytes::Bytes::new()).await.unwrap();
        }
    }
    let meta = serde_json::json!({ "config": answer["config"], "state": answer["state"] });
    (meta, data)
}

/// Restores a [`backup`] in place of its stream (deleted first, as a restore needs), as
/// `nats stream restore` does (`$JS.API.STREAM.RESTORE`, chunks sent as requests).
async fn restore(client: &async_nats::Client, name: &str, meta: &serde_json::Value, data: &[u8]) {
    let js = jetstream::new(client.clone());
    js.delete_stream(name).await.unwrap();
    let answer = client
        .request(
            format!("$JS.API.STREAM.RESTORE.{name}"),
            meta.to_string().into(),
        )
        .await
        .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
    let deliver = answer["deliver_subject"]
        .as_str()
        .unwrap_or_else(|| panic!("restore refused: {answer}"))
        .to_owned();
    for chunk in data.chunks(64 * 1024) {
        client
            .request(deliver.clone(), bytes::Bytes::copy_from_slice(chunk))
            .await
            .unwrap();
    }
    let done = client.request(deliver, bytes::Bytes::new()).await.unwrap();
    let done: serde_json::Value = serde_json::from_slice(&done.payload).unwrap();
    assert!(done.get("error").is_none(), "restore failed: {done}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_down_while_its_bucket_was_restored_from_a_backup_and_written_past_its_watermark_takes_the_new_history()
 {
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "kept", 1, 1).await;
    put_keys(&store, 600, 256).await;
    let (meta, data) = backup(&client, "KV_kept").await;
    let backed_up = KvBucket::new(client.clone(), "kept")
        .unwrap()
        .lineage_at(600)
        .await
        .unwrap();
    put_keys_with(&store, KEYS, 256, |i| {
        bytes::Bytes::from(format!("after{i}"))
    })
    .await;
    let js = jetstream::new(client.clone());
    let mut stream = js.get_stream("KV_kept").await.unwrap();
    let watermark = stream.info().await.unwrap().state.last_sequence;
    let cache = MemoryCacheStore::new();
    let bucket = KvBucket::new(client.clone(), "kept").unwrap();
    let h = follow(&bucket, &cache);
    until(&h, "ready at the head", |s| {
        s.ready && s.watermark == watermark
    })
    .await;
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    let kept = cache.held().unwrap().lineage;

    restore(&client, "KV_kept", &meta, &data).await;
    let restored = KvBucket::new(client.clone(), "kept").unwrap();
    assert_eq!(
        restored.watermark().await.unwrap(),
        600,
        "the backup's head"
    );
    let read = restored.lineage_at(600).await.unwrap();
    // Written past the watermark: the seqs after 600 are the restored history's.
    let store = create_bucket(&client, "kept", 1, 1).await;
    put_keys_with(&store, NEW_KEYS, 256, |i| {
        bytes::Bytes::from(format!("new{i}"))
    })
    .await;
    let head = restored.watermark().await.unwrap();
    assert!(head > watermark, "{head} past {watermark}");
    let want = contents(&store).await;

    let h = follow(&KvBucket::new(client.clone(), "kept").unwrap(), &cache);
    let status = until(
        &h,
        "the restarted follower reached the restored history's head",
        |s| s.ready && s.watermark == head,
    )
    .await;
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    assert_same(&held(&cache), &want);
    assert!(status.counters.resets >= 1, "a reset, counted: {status:?}");
    // What nats-server 2.15 gives a restored stream (see tidemark-jetstream's lineage
    // module): a stream restored from a backup of its own format is added again with a
    // new creation time, so the history alone tells it.
    assert_ne!(
        read.history, kept.history,
        "a restored stream's creation time: {read:?}"
    );
    assert_eq!(
        read.stamp, backed_up.stamp,
        "a restored message keeps its stored time: {backed_up:?} backed up, {read:?} restored"
    );
}

/// The runtime's conformance body over a bucket deleted and made again while a persisted
/// follower was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_a_restarted_follower_takes_a_recreated_bucket() {
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "conf", 1, 1).await;
    let again = client.clone();
    tidemark::conformance::a_restarted_follower_takes_a_new_history(
        KvBucket::new(client.clone(), "conf").unwrap(),
        || async move {
            jetstream::new(again.clone())
                .delete_key_value("conf")
                .await
                .unwrap();
            create_bucket(&again, "conf", 1, 1).await;
            KvBucket::new(again, "conf").unwrap()
        },
    )
    .await;
}

/// The runtime's conformance body over a bucket deleted and made again under a running
/// follower.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_a_running_follower_takes_a_recreated_bucket() {
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "conf", 1, 1).await;
    let again = client.clone();
    tidemark::conformance::a_running_follower_takes_a_new_history(
        KvBucket::new(client.clone(), "conf").unwrap(),
        || async move {
            jetstream::new(again.clone())
                .delete_key_value("conf")
                .await
                .unwrap();
            create_bucket(&again, "conf", 1, 1).await;
        },
    )
    .await;
}

/// Issue 25's steps at the library level: the bucket mirrored into a SQLite file, which
/// keeps the lineage with the watermark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_mirrored_into_a_sqlite_file_remade_while_the_mirror_was_down_ends_equal_to_the_new_bucket()
 {
    use tidemark_sqlite::SqliteDb;
    let server = server().await;
    let client = client(&server).await;
    let store = create_bucket(&client, "filed", 1, 1).await;
    put_keys(&store, KEYS, 256).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.db");
    let mirror = |cache| {
        FollowerTask::new(
            config("mirror"),
            RawBytes,
            KvBucket::new(client.clone(), "filed").unwrap(),
            KvBucket::new(client.clone(), "filed").unwrap(),
            cache,
        )
        .spawn()
    };

    let db = SqliteDb::open(&path).await.unwrap();
    let h = mirror(db.follower_cache("mirror"));
    until(&h, "the mirror is ready at the old head", |s| {
        s.ready && s.watermark == u64::from(KEYS)
    })
    .await;
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    drop(db);

    let (head, store) = remake(&client, "filed").await;
    let want = contents(&store).await;

    let db = SqliteDb::open(&path).await.unwrap();
    let cache = db.follower_cache("mirror");
    let h = mirror(cache.clone());
    let status = until(&h, "the restarted mirror reached the new head", |s| {
        s.ready && s.watermark == head
    })
    .await;
    h.stop_within(Duration::from_secs(30)).await.unwrap();
    let held: BTreeMap<String, Vec<u8>> = cache
        .entries()
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _, v)| (k, v))
        .collect();
    assert_same(&held, &want);
    assert!(status.counters.resets >= 1, "a reset, counted: {status:?}");
}
