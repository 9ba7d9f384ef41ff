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

/// What the NATS client does with a request whose reply went with a connection that
/// dropped: it waits out its request timeout, then fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A call of [`LosingReplies`] whose next reply can be lost.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Call {
    Lookup,
    Open,
    Reconcile,
}

/// The memory source and feed behind a client that reconnects when the test says so, and
/// loses the reply to a call the test names (once): that call waits out
/// [`REQUEST_TIMEOUT`] and fails, as a request in flight across a reconnect does.
#[derive(Clone)]
struct LosingReplies {
    inner: MemorySource,
    reconnects: watch::Receiver<u64>,
    /// The call whose next reply is lost.
    lose: std::sync::Arc<std::sync::Mutex<Option<Call>>>,
    /// How many calls wait on a lost reply now.
    waiting: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LosingReplies {
    fn new(inner: MemorySource) -> (Self, watch::Sender<u64>) {
        let (tx, reconnects) = watch::channel(0);
        let lossy = LosingReplies {
            inner,
            reconnects,
            lose: std::sync::Arc::default(),
            waiting: std::sync::Arc::default(),
        };
        (lossy, tx)
    }

    fn lose_next(&self, call: Call) {
        *self.lose.lock().unwrap() = Some(call);
    }

    fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits out the request timeout if `call`'s reply is to be lost.
    async fn maybe_lost(&self, call: Call) -> tidemark::Result<()> {
        if self.lose.lock().unwrap().take_if(|c| *c == call).is_none() {
            return Ok(());
        }
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        /// Counts the call out however it ends (waited out, or dropped by the follower).
        struct Out<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _out = Out(&self.waiting);
        tokio::time::sleep(REQUEST_TIMEOUT).await;
        Err(tidemark::Error::unavailable(
            "source",
            format!("{call:?}: request timed out"),
        ))
    }
}

impl Source for LosingReplies {
    async fn put(&self, key: &str, value: Vec<u8>) -> tidemark::Result<u64> {
        self.inner.put(key, value).await
    }
    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> tidemark::Result<u64> {
        self.inner.update(key, value, expected).await
    }
    async fn remove(&self, key: &str) -> tidemark::Result<Option<u64>> {
        self.inner.remove(key).await
    }
    async fn watermark(&self) -> tidemark::Result<u64> {
        self.maybe_lost(Call::Lookup).await?;
        self.inner.watermark().await
    }
    async fn changes_since(&self, since: u64) -> tidemark::Result<tidemark::Changes> {
        self.inner.changes_since(since).await
    }
    async fn changes_and_lineage(
        &self,
        since: u64,
    ) -> tidemark::Result<(tidemark::Changes, tidemark::Lineage)> {
        self.maybe_lost(Call::Reconcile).await?;
        self.inner.changes_and_lineage(since).await
    }
    async fn lineage_at(&self, seq: u64) -> tidemark::Result<tidemark::Lineage> {
        self.inner.lineage_at(seq).await
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        self.inner.snapshot().await
    }
    async fn get(&self, key: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        self.inner.get(key).await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        self.inner.first_available().await
    }
    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.reconnects.clone())
    }
}

impl Feed for LosingReplies {
    const FOLLOW: Follow = <MemorySource as Feed>::FOLLOW;
    type Stream = <MemorySource as Feed>::Stream;

    async fn open(&self, from: u64, after: Option<u64>) -> tidemark::Result<Opened<Self::Stream>> {
        self.maybe_lost(Call::Open).await?;
        self.inner.open(from, after).await
    }

    fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        Some(self.reconnects.clone())
    }
}

/// Far below [`REQUEST_TIMEOUT`]: only abandoning the request at the reconnect explains a
/// follower done within it (the retry itself is immediate in simulated time).
const AT_ONCE: Duration = Duration::from_millis(500);

#[tokio::test(start_paused = true)]
async fn a_lookup_whose_reply_a_reconnect_lost_is_retried_at_once() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (lossy, tx) = LosingReplies::new(m.source.clone());
    lossy.lose_next(Call::Lookup);
    let (cache, h) = spawn_cache(config("lost-lookup"), Utf8, lossy.clone(), lossy.clone());
    until("the lookup waits on its lost reply", || {
        lossy.waiting() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.send_modify(|n| *n += 1);
    let ready = tokio::time::timeout(AT_ONCE, cache.wait_ready()).await;
    assert!(
        matches!(ready, Ok(Ok(_))),
        "a lookup out across a reconnect must be abandoned and retried at once, not wait \
         out the client's {REQUEST_TIMEOUT:?} request timeout (SPEC §15: converge quickly \
         after the source comes back)"
    );
    assert_eq!(lossy.waiting(), 0, "the lost request was dropped");
    assert_eq!(cache.get("a").as_deref().map(String::as_str), Some("1"));
    drop(h);
}

#[tokio::test(start_paused = true)]
async fn without_a_reconnect_a_lost_reply_is_waited_out() {
    // The control of the test above: the same lost reply, no reconnect.
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (lossy, _tx) = LosingReplies::new(m.source.clone());
    lossy.lose_next(Call::Lookup);
    let (cache, h) = spawn_cache(
        config("lost-no-reconnect"),
        Utf8,
        lossy.clone(),
        lossy.clone(),
    );
    until("the lookup waits on its lost reply", || {
        lossy.waiting() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1) + AT_ONCE).await;
    assert!(
        !cache.is_ready(),
        "without a reconnect nothing tells the follower its reply is lost"
    );
    cache.wait_ready().await.unwrap();
    assert_eq!(lossy.waiting(), 0, "the request timed out");
    drop(h);
}

#[tokio::test(start_paused = true)]
async fn a_feed_open_whose_reply_a_reconnect_lost_is_retried_at_once() {
    let m = Memory::new();
    let (lossy, tx) = LosingReplies::new(m.source.clone());
    let (cache, h) = spawn_cache(config("lost-open"), Utf8, lossy.clone(), lossy.clone());
    cache.wait_ready().await.unwrap();
    // The feed fails at its next entry; its reopen's reply is lost.
    lossy.lose_next(Call::Open);
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    until("the reopen waits on its lost reply", || {
        lossy.waiting() == 1
    })
    .await;
    m.faults.set_failing(Port::Feed, false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.send_modify(|n| *n += 1);
    tokio::time::sleep(AT_ONCE).await;
    assert_eq!(
        cache.get("during").as_deref().map(String::as_str),
        Some("x"),
        "a feed open out across a reconnect must be abandoned and reopened at once, not \
         wait out the client's {REQUEST_TIMEOUT:?} request timeout"
    );
    assert_eq!(h.status().phase, Phase::Live);
    assert_eq!(lossy.waiting(), 0, "the lost request was dropped");
}

#[tokio::test(start_paused = true)]
async fn a_reconcile_whose_reply_a_reconnect_lost_is_retried_at_once() {
    let m = Memory::new();
    let (lossy, tx) = LosingReplies::new(m.source.clone());
    let (cache, h) = spawn_cache(config("lost-reconcile"), Utf8, lossy.clone(), lossy.clone());
    cache.wait_ready().await.unwrap();
    lossy.lose_next(Call::Reconcile);
    let h = std::sync::Arc::new(h);
    let asking = tokio::spawn({
        let h = std::sync::Arc::clone(&h);
        async move { h.reconcile().await }
    });
    until("the reconcile waits on its lost reply", || {
        lossy.waiting() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.send_modify(|n| *n += 1);
    let answered = tokio::time::timeout(AT_ONCE, asking).await;
    assert!(
        matches!(answered, Ok(Ok(Ok(_)))),
        "a reconcile out across a reconnect must be abandoned and read again at once, not \
         wait out the client's {REQUEST_TIMEOUT:?} request timeout"
    );
    assert_eq!(lossy.waiting(), 0, "the lost request was dropped");
}

/// The memory events stream's cursors, losing the replies to the next saves the test arms
/// (`lose` counts them): each waits out [`REQUEST_TIMEOUT`] and fails, as a save out
/// across a reconnect does.
#[derive(Clone)]
struct LosingSaves {
    inner: tidemark_memory::MemoryEvents,
    lose: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    waiting: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LosingSaves {
    /// `m`'s events stream's cursors, losing nothing until armed.
    fn of(m: &Memory) -> Self {
        LosingSaves {
            inner: m.events.clone(),
            lose: std::sync::Arc::default(),
            waiting: std::sync::Arc::default(),
        }
    }
}

impl tidemark::Cursors for LosingSaves {
    async fn load(&self, name: &str) -> tidemark::Result<Option<u64>> {
        self.inner.load(name).await
    }

    async fn save(&self, name: &str, position: u64) -> tidemark::Result<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        if self
            .lose
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.waiting.fetch_add(1, SeqCst);
            tokio::time::sleep(REQUEST_TIMEOUT).await;
            self.waiting.fetch_sub(1, SeqCst);
            return Err(tidemark::Error::unavailable("cursor", "request timed out"));
        }
        self.inner.save(name, position).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_cursor_save_whose_reply_a_reconnect_lost_does_not_hold_the_consumer() {
    use std::sync::atomic::Ordering::SeqCst;
    use tidemark::Cursors as _;
    let m = Memory::new();
    let registry = common::registry(&m);
    let (lossy, tx) = LosingReplies::new(m.source.clone());
    let cursors = LosingSaves::of(&m);
    let (sink, cache) = tidemark::cache();
    let h = tidemark::FollowerTask::new(config("consumer"), Utf8, lossy, m.events.clone(), sink)
        .with_cursor(cursors.clone(), "consumer")
        .spawn();
    cache.wait_ready().await.unwrap();
    cursors.lose.store(1, SeqCst);
    registry.put("a", b"1".to_vec()).await.unwrap();
    until("the cursor save waits on its lost reply", || {
        cursors.waiting.load(SeqCst) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.send_modify(|n| *n += 1);
    registry.put("b", b"2".to_vec()).await.unwrap();
    tokio::time::sleep(AT_ONCE).await;
    assert_eq!(
        cache.get("b").as_deref().map(String::as_str),
        Some("2"),
        "a cursor save out across a reconnect must be abandoned (saved with the next \
         commit), not hold the consumer for the client's {REQUEST_TIMEOUT:?} request timeout"
    );
    until("the cursor is saved up to the last event", || {
        futures::executor::block_on(m.events.load("consumer")).unwrap() == Some(2)
    })
    .await;
    drop(h);
}

#[tokio::test(start_paused = true)]
async fn a_cursor_save_that_failed_is_made_again_though_no_event_follows() {
    use std::sync::atomic::Ordering::SeqCst;
    use tidemark::Cursors as _;
    let m = Memory::new();
    let registry = common::registry(&m);
    let cursors = LosingSaves::of(&m);
    let (sink, cache) = tidemark::cache();
    let h = tidemark::FollowerTask::new(
        config("consumer"),
        Utf8,
        m.source.clone(),
        m.events.clone(),
        sink,
    )
    .with_cursor(cursors.clone(), "consumer")
    .spawn();
    cache.wait_ready().await.unwrap();
    // The save of the event and the one tried again with the commit of the read that
    // confirms it both fail (a server away for both): on a quiet stream nothing later
    // commits or checkpoints.
    cursors.lose.store(2, SeqCst);
    registry.put("a", b"1".to_vec()).await.unwrap();
    until("both saves failed", || {
        cursors.lose.load(SeqCst) == 0 && cursors.waiting.load(SeqCst) == 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        m.events.load("consumer").await.unwrap(),
        Some(1),
        "a failed save of the last event observed must be made again after a backoff \
         (SPEC: every observed entry is checkpointed), not wait for an event that may \
         never come"
    );
    drop(h);
}
