//! A reconnect of the client beneath a feed reaches the follower: it retries at once rather
//! than waiting out a backoff grown while the source was away, and a flapping connection
//! cannot make it retry in a tight loop.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{config, until};
use tidemark::tidemark_core::{Follow, Phase, Utf8};
use tidemark::{Feed, Opened, RECONNECT_GAP, RECONNECT_SETTLE, Source, spawn_cache};
use tidemark_memory::{Memory, MemorySource, Port};
use tokio::sync::watch;

/// The memory feed, as if a client beneath it reconnected whenever the test says so.
struct Reconnecting {
    feed: MemorySource,
    reconnects: watch::Receiver<u64>,
}

impl Feed for Reconnecting {
    const FOLLOW: Follow = <MemorySource as Feed>::FOLLOW;
    type Stream = <MemorySource as Feed>::Stream;

    async fn open(&self, from: u64, after: Option<u64>) -> tidemark::Result<Opened<Self::Stream>> {
        self.feed.open(from, after).await
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.reconnects.clone())
    }
}

/// A ready follower over `m` whose feed then fails for ten minutes (simulated) while
/// writes go on, so its feed backoff has grown to its cap; the feed is healed at the end.
async fn after_a_long_outage(
    m: &Memory,
    name: &str,
) -> (
    tidemark::Cache<String>,
    tidemark::FollowerHandle,
    watch::Sender<u64>,
) {
    let (tx, rx) = watch::channel(0);
    let feed = Reconnecting {
        feed: m.source.clone(),
        reconnects: rx,
    };
    let (cache, h) = spawn_cache(config(name), Utf8, m.source.clone(), feed);
    cache.wait_ready().await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(600)).await;
    m.faults.set_failing(Port::Feed, false);
    assert_eq!(
        h.status().phase,
        Phase::BackingOff,
        "the follower waits out its feed backoff"
    );
    (cache, h, tx)
}

#[tokio::test(start_paused = true)]
async fn a_reconnect_ends_a_grown_backoff_at_once() {
    let m = Memory::new();
    let (cache, h, tx) = after_a_long_outage(&m, "reconnect").await;
    let reopens = h.status().counters.reopens;
    tx.send_modify(|n| *n += 1);
    // Far less than the grown backoff (up to 30 s): only the reconnect can explain it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        cache.watermark(),
        m.source.current_watermark(),
        "the follower must reopen its feed and catch up as soon as the client reconnects"
    );
    assert!(cache.get("during").is_some());
    assert_eq!(
        h.status().counters.reopens,
        reopens + 1,
        "one reopen, at once"
    );
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn without_a_reconnect_the_grown_backoff_is_waited_out() {
    // The control of the test above: the same outage, no reconnect.
    let m = Memory::new();
    let (cache, h, _tx) = after_a_long_outage(&m, "no-reconnect").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_ne!(
        cache.watermark(),
        m.source.current_watermark(),
        "without a reconnect the follower still waits out its backoff"
    );
    until("the backoff ends", || {
        cache.watermark() == m.source.current_watermark()
    })
    .await;
    drop(h);
}

#[tokio::test(start_paused = true)]
async fn a_flapping_connection_cannot_make_the_follower_retry_in_a_tight_loop() {
    let m = Memory::new();
    let (_cache, h, tx) = after_a_long_outage(&m, "flapping").await;
    m.faults.set_failing(Port::Feed, true);
    let reopens = h.status().counters.reopens;
    // A reconnect every millisecond for five seconds, while the source stays away.
    let flapping = Duration::from_secs(5);
    let started = tokio::time::Instant::now();
    while started.elapsed() < flapping {
        tx.send_modify(|n| *n += 1);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let tries = h.status().counters.reopens - reopens;
    let most = u64::try_from(flapping.as_millis() / RECONNECT_GAP.as_millis()).unwrap() + 1;
    assert!(
        tries >= 2,
        "reconnects must still be acted on while flapping ({tries} reopens)"
    );
    assert!(
        tries <= most,
        "{tries} reopens in {flapping:?} of flapping: at most one per {RECONNECT_GAP:?} \
         ({most}), or a flapping connection hammers a source that is away"
    );
    // Once the flapping stops, the settle window ends and the backoff paces again.
    let reopens = h.status().counters.reopens;
    tokio::time::sleep(RECONNECT_SETTLE + Duration::from_secs(10)).await;
    let later = h.status().counters.reopens - reopens;
    assert!(
        later
            <= u64::try_from(RECONNECT_SETTLE.as_millis() / RECONNECT_GAP.as_millis()).unwrap() + 1,
        "{later} reopens in the 12 s after the flapping: only the backoff and the settle \
         window may retry"
    );
}
