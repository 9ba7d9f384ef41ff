//! What `SqliteDb::report` shows an operator: the registry, each persisted follower with
//! how it last started, the outbox, the queue, locks.
#![allow(clippy::unwrap_used)]

mod common;
use std::time::Duration;

use tidemark::tidemark_core::{Job, Legs};
use tidemark::{FollowerConfig, FollowerTask, Lock, Queue, RawBytes, Source};
use tidemark_sqlite::{Start, Write};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_shows_each_follower_and_whether_it_started_warm() {
    let (_dir, _path, db) = common::fresh().await;
    let source = db.announced_source(Legs::default());
    source
        .write_batch(vec![
            Write::Put("a".into(), b"1".to_vec()),
            Write::Put("b".into(), b"2".to_vec()),
        ])
        .await
        .unwrap();
    source.remove("a").await.unwrap();
    let config = || FollowerConfig::builder("mirror").seed(1).build().unwrap();
    let run = || async {
        let src = db.source();
        let follower = FollowerTask::new(
            config(),
            RawBytes,
            src.clone(),
            src,
            db.follower_cache("mirror"),
        )
        .spawn();
        follower.watch_status().wait_for(|s| s.ready).await.unwrap();
        follower.stop_within(Duration::from_secs(10)).await.unwrap();
    };
    run().await;
    let report = db.report().await.unwrap();
    assert_eq!(report.registry.watermark, 3);
    assert_eq!((report.registry.keys, report.registry.tombstones), (1, 1));
    assert_eq!(report.followers.len(), 1);
    let f = &report.followers[0];
    assert_eq!((f.name.as_str(), f.watermark, f.keys), ("mirror", 3, 1));
    assert_eq!(f.last_start, Some(Start::Cold), "a first start is cold");
    assert_eq!(report.outbox_pending, 3, "no relay ran: every write waits");

    db.source().put("c", b"3".to_vec()).await.unwrap();
    run().await;
    let report = db.report().await.unwrap();
    let f = &report.followers[0];
    assert_eq!(
        f.last_start,
        Some(Start::Warm { resumed: 3 }),
        "a restart over its persisted cache is warm, from its watermark"
    );
    assert_eq!((f.starts, f.warm_starts, f.watermark, f.keys), (2, 1, 4, 2));

    let queue = db.queue();
    queue.enqueue(Job::Sweep).await.unwrap();
    queue.enqueue(Job::Sweep).await.unwrap();
    queue.lease(Duration::from_secs(30)).await.unwrap().unwrap();
    db.lock()
        .try_lock("sweeper", "host-1", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let report = db.report().await.unwrap();
    assert_eq!((report.queue.ready, report.queue.leased), (1, 1));
    assert_eq!(report.locks.len(), 1);
    assert_eq!(report.locks[0].owner.as_deref(), Some("host-1"));
}
