//! Conformance bodies for a source view over a key prefix. The keys are NATS-shaped
//! (`orders.1`, `users.1`), so a bucket view over `orders` passes them as well as a
//! memory or SQLite view over `orders.`.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use tidemark_core::{Follower, FollowerConfig, Op, Status, Utf8};

use crate::cache::{Cache, CacheWriter, cache};
use crate::follower::FollowerTask;
use crate::ports::{Changes, Feed, FeedItem, FeedStream, Source};
use crate::sink::Sink;

/// Every key of `view` (the prefix `orders`), by key, from its own snapshot.
pub(super) async fn snapshot_of<S: Source>(view: &S) -> BTreeMap<String, String> {
    view.snapshot()
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| (e.key.to_string(), String::from_utf8(e.value).unwrap()))
        .collect()
}

pub(super) fn cached(cache: &Cache<String>) -> BTreeMap<String, String> {
    cache
        .snapshot()
        .into_iter()
        .map(|(k, _, v)| (k, v.as_ref().clone()))
        .collect()
}

/// Waits (up to 10 s of tokio time) until `cache` holds exactly `want`.
pub(super) async fn converges(cache: &Cache<String>, want: &BTreeMap<String, String>, why: &str) {
    for _ in 0..1000 {
        if cached(cache) == *want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cached(cache), *want, "{why}");
}

/// A persisted cache's warm restart, as a durable sink gives it back: what `reader` held
/// put into a fresh cache and committed at `before`'s watermark with its lineage, and a
/// core resumed from them.
pub(super) async fn restart_warm(
    config: FollowerConfig,
    reader: &Cache<String>,
    before: &Status,
) -> (CacheWriter<String>, Cache<String>, Follower<Utf8>) {
    let held = reader.snapshot();
    let (mut writer, reader) = cache::<String>();
    for (key, seq, value) in &held {
        writer
            .put(key.as_str().into(), *seq, value.as_ref().clone())
            .await
            .unwrap();
    }
    writer
        .commit(before.watermark, before.lineage)
        .await
        .unwrap();
    let mut core = Follower::resume(
        config,
        Utf8,
        before.watermark,
        held.iter().map(|(k, seq, _)| (k.clone(), *seq)),
    );
    core.remember_lineage(before.lineage);
    (writer, reader, core)
}

/// A view over the prefix `orders` of `whole` reads, lists, reconciles and snapshots only
/// that prefix's keys (removals included), reports the source's own watermark (so a
/// follower's watermark means the same over a view), refuses writes outside the prefix
/// with a typed error, and its writes are the source's. Its feed delivers only the
/// prefix's entries, and its head is the last of them, so an initial sync can end.
pub async fn prefix_view_carries_only_its_keys<S: Source + Feed>(whole: &S, view: &S) {
    assert!(view.key_prefix().is_some(), "a view names its prefix");
    assert!(whole.key_prefix().is_none());
    whole.put("orders.1", b"a".to_vec()).await.unwrap();
    whole.put("users.1", b"x".to_vec()).await.unwrap();
    let second = whole.put("orders.2", b"b".to_vec()).await.unwrap();
    whole.put("users.2", b"y".to_vec()).await.unwrap();
    let removed = whole.remove("orders.2").await.unwrap().unwrap();
    let last = whole.put("users.3", b"z".to_vec()).await.unwrap();

    let keys = |m: BTreeMap<String, String>| m.into_keys().collect::<Vec<_>>();
    assert_eq!(keys(snapshot_of(view).await), ["orders.1"]);
    let snap = view.snapshot().await.unwrap();
    assert!(
        snap.watermark >= last,
        "a view's snapshot is at the source's watermark, not its own last key's: {snap:?}"
    );
    assert_eq!(
        view.watermark().await.unwrap(),
        whole.watermark().await.unwrap()
    );
    match view.changes_since(second - 1).await.unwrap() {
        Changes::Since { entries, watermark } => {
            let seen: Vec<(&str, &Op)> = entries.iter().map(|e| (&*e.key, &e.op)).collect();
            assert_eq!(
                seen,
                [("orders.2", &Op::Delete)],
                "a reconcile of a view covers its removals and nothing else"
            );
            assert_eq!(entries[0].seq, removed);
            assert!(watermark >= last);
        }
        other => panic!("nothing was compacted: {other:?}"),
    }
    if let Some(present) = view.present_keys().await.unwrap() {
        assert!(present.keys.contains(&"orders.1".to_owned()));
        assert!(
            present.keys.iter().all(|k| k.starts_with("orders.")),
            "a view lists only its keys: {present:?}"
        );
    }
    assert_eq!(view.get("users.1").await.unwrap(), None, "not in the view");
    assert_eq!(
        view.get("orders.1").await.unwrap().map(|v| v.value),
        Some(b"a".to_vec())
    );
    for write in [
        view.put("users.9", b"v".to_vec()).await.map(Some),
        view.update("users.9", b"v".to_vec(), 0).await.map(Some),
        view.remove("users.1").await,
    ] {
        assert!(
            matches!(write, Err(crate::Error::InvalidKey { .. })),
            "a write outside the view is refused: {write:?}"
        );
    }
    assert_eq!(
        whole.get("users.1").await.unwrap().map(|v| v.value),
        Some(b"x".to_vec()),
        "a refused removal removed nothing"
    );
    let through_view = view.put("orders.3", b"c".to_vec()).await.unwrap();
    assert_eq!(
        whole.get("orders.3").await.unwrap().map(|v| v.seq),
        Some(through_view),
        "a view writes the source itself"
    );

    let opened = view.open(1, None).await.unwrap();
    assert_eq!(
        opened.info.head, through_view,
        "a view's feed ends its initial sync at the prefix's last entry"
    );
    let mut stream = opened.stream;
    let mut seen = Vec::new();
    while seen.last().copied() != Some(through_view) {
        let item = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("the view's feed delivers up to its head");
        match item {
            Some(Ok(FeedItem::Head(_))) => {}
            Some(Ok(FeedItem::Entry(e))) => {
                assert!(
                    e.key.starts_with("orders."),
                    "a view's feed carries only its keys: {e:?}"
                );
                seen.push(e.seq);
            }
            other => panic!("an entry was expected: {other:?}"),
        }
    }
    whole.put("users.4", b"w".to_vec()).await.unwrap();
    let live = whole.put("orders.4", b"d".to_vec()).await.unwrap();
    let item = loop {
        let item = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("the view's feed follows live writes");
        if !matches!(item, Some(Ok(FeedItem::Head(_)))) {
            break item;
        }
    };
    match item {
        Some(Ok(FeedItem::Entry(e))) => assert_eq!(
            (&*e.key, e.seq),
            ("orders.4", live),
            "the other key's write in between is not delivered"
        ),
        other => panic!("an entry was expected: {other:?}"),
    }
}

/// A follower over a view holds exactly the prefix's keys through an initial sync (a key
/// removed before it started included), live writes and removals made through the whole
/// source and the view, and a resync forced by `compact(seq)` (drop the history below
/// `seq`) while it was stopped: after it, keys the source no longer has are gone and keys
/// outside the prefix never reached it. Nothing outside the prefix even reaches the
/// follower (its `outside` counter stays 0): the view filters at the source.
pub async fn prefix_follower_holds_exactly_its_keys<S, C, Fut>(whole: S, view: S, compact: C)
where
    S: Source + Feed + Clone + 'static,
    C: FnOnce(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    whole.put("orders.1", b"a".to_vec()).await.unwrap();
    whole.put("users.1", b"x".to_vec()).await.unwrap();
    whole.put("orders.2", b"b".to_vec()).await.unwrap();
    whole.remove("orders.2").await.unwrap();
    whole.put("users.2", b"y".to_vec()).await.unwrap();

    let config = FollowerConfig::builder("orders").seed(7).build().unwrap();
    let (writer, reader) = cache::<String>();
    let first = FollowerTask::new(config.clone(), Utf8, view.clone(), view.clone(), writer);
    let handle = first.spawn();
    tokio::time::timeout(Duration::from_secs(10), reader.wait_ready())
        .await
        .expect("a follower over a view becomes ready")
        .unwrap();
    let mut want = BTreeMap::from([("orders.1".to_owned(), "a".to_owned())]);
    assert_eq!(
        cached(&reader),
        want,
        "the initial sync holds the prefix only"
    );

    whole.put("orders.3", b"c".to_vec()).await.unwrap();
    whole.put("users.3", b"z".to_vec()).await.unwrap();
    whole.remove("orders.1").await.unwrap();
    whole.remove("users.1").await.unwrap();
    view.put("orders.4", b"d".to_vec()).await.unwrap();
    whole.put("users.4", b"w".to_vec()).await.unwrap();
    want = BTreeMap::from([
        ("orders.3".to_owned(), "c".to_owned()),
        ("orders.4".to_owned(), "d".to_owned()),
    ]);
    converges(
        &reader,
        &want,
        "live writes and removals of the prefix, and only those",
    )
    .await;
    let before = handle.stop_within(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        before.counters.outside, 0,
        "the view filters at the source: no other key reaches the follower"
    );

    // While it is down: a removal, a write, and the history below them compacted.
    whole.remove("orders.3").await.unwrap();
    let last = whole.put("orders.5", b"e".to_vec()).await.unwrap();
    whole.put("users.5", b"v".to_vec()).await.unwrap();
    compact(last).await;

    // It restarts warm from what it held (a persisted cache's restart), below the
    // compacted history: only a resync can bring it up to date.
    let (writer, reader, core) = restart_warm(config, &reader, &before).await;
    let second = FollowerTask::from_core(core, view.clone(), view.clone(), writer);
    let handle = second.spawn();
    let want = snapshot_of(&view).await;
    assert!(
        want.contains_key("orders.5") && !want.contains_key("orders.3"),
        "the source holds orders.5 and no longer orders.3: {want:?}"
    );
    converges(
        &reader,
        &want,
        "a resync brings the view's keys and removes the rest",
    )
    .await;
    let after = handle.stop_within(Duration::from_secs(10)).await.unwrap();
    assert!(
        after.counters.resyncs > 0 || after.counters.vanished > 0,
        "the history below the watermark was compacted: a resync was due (or, over a \
         source that keeps a history per key, a listing of its keys): {after:?}"
    );
    assert_eq!(
        after.counters.outside, 0,
        "nothing outside the view reached it"
    );
    assert!(
        whole.get("users.5").await.unwrap().is_some(),
        "the source still holds other keys"
    );
}
