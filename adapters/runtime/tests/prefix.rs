//! A follower task over a source view keeps only the view's keys whatever path brings
//! the others: announcements on an events stream, wakes, the announcing registry.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{config, registry, until};
use tidemark::tidemark_core::{Event, Utf8};
use tidemark::{FollowerTask, Source, Wake, cache, spawn_wake_cache};
use tidemark_memory::Memory;

/// The events stream carries every key's announcements; the follower over the view
/// takes the prefix from its source and passes the others, counted, without waiting for
/// the source to confirm them (it never would: the view's reads do not name them).
#[tokio::test(start_paused = true)]
async fn announcements_of_other_keys_never_reach_a_view_follower() {
    let m = Memory::new();
    let r = registry(&m);
    let view = m.source.with_prefix("orders.").unwrap();
    let (writer, reader) = cache::<String>();
    let handle = FollowerTask::new(config("orders"), Utf8, view, m.events.clone(), writer)
        .with_cursor(m.events.clone(), "orders")
        .spawn();
    reader.wait_ready().await.unwrap();
    r.put("users.1", b"x".to_vec()).await.unwrap();
    r.put("orders.1", b"a".to_vec()).await.unwrap();
    r.put("users.2", b"y".to_vec()).await.unwrap();
    r.remove("users.1").await.unwrap();
    let last = r.put("orders.2", b"b".to_vec()).await.unwrap();
    until("the prefix's announcements are applied", || {
        reader.get_versioned("orders.2").map(|(s, _)| s) == Some(last.seq)
    })
    .await;
    assert_eq!(reader.keys(), ["orders.1", "orders.2"]);
    let status = handle.status();
    assert_eq!(
        status.counters.outside, 3,
        "three announcements of other keys were passed: {status:?}"
    );
    assert_eq!(
        status.counters.resyncs, 0,
        "announcements of other keys are not awaited for confirmation"
    );
    handle.reconcile().await.unwrap();
    assert_eq!(reader.keys(), ["orders.1", "orders.2"]);
    assert_eq!(handle.status().counters.resyncs, 0);
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
}

/// A wake carrying an event about another key is no reason to read the source: each
/// change is announced on its own. A wake about the prefix's keys, or one with no event
/// (a backstop wake), is.
#[tokio::test(start_paused = true)]
async fn wakes_about_other_keys_do_not_make_a_view_follower_read_the_source() {
    let m = Memory::new();
    let r = registry(&m);
    let view = m.source.with_prefix("orders.").unwrap();
    let listener = m.wake.listen("changes").await.unwrap();
    let (reader, handle) = spawn_wake_cache(config("orders"), Utf8, view, listener);
    reader.wait_ready().await.unwrap();
    let reads = || handle.status().counters.reconciles;
    let before = reads();
    for i in 0..5 {
        r.put(&format!("users.{i}"), b"x".to_vec()).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        reads(),
        before,
        "five wakes about other keys read nothing from the source"
    );
    r.put("orders.1", b"a".to_vec()).await.unwrap();
    until("the prefix's write is caught up", || {
        reader.get("orders.1").is_some()
    })
    .await;
    assert_eq!(reads(), before + 1);
    m.wake.notify("changes", Vec::new()).await.unwrap();
    until("an empty wake catches up", || reads() == before + 2).await;
    let foreign = Event::Put {
        seq: 99,
        key: "users.9".into(),
        value: b"z".to_vec(),
    };
    m.wake
        .notify("changes", foreign.encode().unwrap())
        .await
        .unwrap();
    m.wake
        .notify("changes", b"not an event".to_vec())
        .await
        .unwrap();
    until("a payload that is not an event still catches up", || {
        reads() == before + 3
    })
    .await;
    assert_eq!(reader.keys(), ["orders.1"]);
    handle.stop_within(Duration::from_secs(5)).await.unwrap();
}

/// The announcing registry writes typed values as JSON, announced like any write.
#[tokio::test(start_paused = true)]
async fn the_announcing_registry_puts_typed_values_as_json() {
    #[derive(serde::Serialize)]
    struct Package<'a> {
        version: &'a str,
    }
    let m = Memory::new();
    let r = registry(&m);
    let w = r
        .put_json("pkg.a", &Package { version: "1.0.0" })
        .await
        .unwrap();
    assert!(w.report.published && w.report.notified, "{w:?}");
    assert_eq!(
        m.source.get("pkg.a").await.unwrap().unwrap().value,
        br#"{"version":"1.0.0"}"#
    );
    let w2 = r
        .update_json("pkg.a", &Package { version: "1.0.1" }, w.seq)
        .await
        .unwrap();
    assert!(w2.seq > w.seq);
    let refused = r
        .put_json(
            "pkg.b",
            &std::collections::BTreeMap::from([((1u8, 2u8), 3u8)]),
        )
        .await;
    assert!(
        matches!(refused, Err(tidemark::Error::Encode { .. })),
        "{refused:?}"
    );
    assert_eq!(
        m.events.records().len(),
        2,
        "a refused write is not announced"
    );
}
