//! A source that stalls and goes on without a reconnect (a server paused and continued
//! keeps its connections) reaches a follower that backs off through its probes: the
//! follower retries once the source answers again, not after a backoff grown meanwhile
//! (SPEC §15), and while the source stalls its probes stay bounded. Tokio's paused clock
//! runs it, as every driver test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::until;
use tidemark::tidemark_core::{BackoffPolicy, Follow, FollowerConfig, Phase, ProbePolicy, Utf8};
use tidemark::{Feed, Opened, Source, spawn_cache};
use tidemark_memory::{Memory, MemorySource, Port};
use tokio::sync::watch;

/// The memory source and feed behind a server the test can pause: while paused, every
/// call and every probe waits (nothing fails, nothing reconnects); continued, they go on.
/// `probes`: whether it answers probes at all (the control has none).
#[derive(Clone)]
struct Pausable {
    inner: MemorySource,
    paused: watch::Receiver<bool>,
    probes: bool,
    /// Probes sent.
    sent: Arc<AtomicU64>,
}

impl Pausable {
    fn new(inner: MemorySource, probes: bool) -> (Self, watch::Sender<bool>) {
        let (tx, paused) = watch::channel(false);
        let pausable = Pausable {
            inner,
            paused,
            probes,
            sent: Arc::default(),
        };
        (pausable, tx)
    }

    /// Waits while the server is paused.
    async fn running(paused: &mut watch::Receiver<bool>) {
        let _ = paused.wait_for(|p| !p).await;
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

impl Source for Pausable {
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
        Self::running(&mut self.paused.clone()).await;
        self.inner.watermark().await
    }
    async fn changes_since(&self, since: u64) -> tidemark::Result<tidemark::Changes> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.changes_since(since).await
    }
    async fn changes_and_lineage(
        &self,
        since: u64,
    ) -> tidemark::Result<(tidemark::Changes, tidemark::Lineage)> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.changes_and_lineage(since).await
    }
    async fn lineage_at(&self, seq: u64) -> tidemark::Result<tidemark::Lineage> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.lineage_at(seq).await
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.snapshot().await
    }
    async fn get(&self, key: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.get(key).await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.first_available().await
    }
    fn probe(
        &self,
    ) -> Option<impl std::future::Future<Output = tidemark::Result<()>> + Send + 'static> {
        let mut paused = self.paused.clone();
        let sent = Arc::clone(&self.sent);
        self.probes.then_some(async move {
            sent.fetch_add(1, Ordering::SeqCst);
            Self::running(&mut paused).await;
            Ok(())
        })
    }
}

impl Feed for Pausable {
    const FOLLOW: Follow = <MemorySource as Feed>::FOLLOW;
    type Stream = <MemorySource as Feed>::Stream;

    async fn open(&self, from: u64, after: Option<u64>) -> tidemark::Result<Opened<Self::Stream>> {
        Self::running(&mut self.paused.clone()).await;
        self.inner.open(from, after).await
    }
}

/// The backoff a failed feed waits out: a minute, every time, so that a retry within it
/// has one explanation.
const BACKOFF: Duration = Duration::from_secs(60);

fn config(name: &str) -> FollowerConfig {
    let minute = BackoffPolicy::new(BACKOFF, 1.0, BACKOFF, Duration::from_secs(600), 0.0).unwrap();
    FollowerConfig::builder(name)
        .seed(1)
        .failure_backoff(minute)
        .build()
        .unwrap()
}

/// A ready follower over `m` through `pausable`, whose feed then failed (once) so that it
/// backs off for [`BACKOFF`], during which the server is paused for `pause` and continued.
async fn paused_while_backing_off(
    m: &Memory,
    pausable: &Pausable,
    paused: &watch::Sender<bool>,
    name: &str,
    pause: Duration,
) -> (tidemark::Cache<String>, tidemark::FollowerHandle) {
    let (cache, h) = spawn_cache(config(name), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    until("the feed fails and the follower backs off", || {
        h.status().phase == Phase::BackingOff
    })
    .await;
    m.faults.set_failing(Port::Feed, false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    paused.send_replace(true);
    tokio::time::sleep(pause).await;
    paused.send_replace(false);
    (cache, h)
}

/// Well inside [`BACKOFF`]: a probe's pace and timeout and a retry, with room to spare.
const SOON: Duration = Duration::from_secs(3);

#[tokio::test(start_paused = true)]
async fn a_source_that_answers_again_after_a_pause_ends_the_backoff_at_once() {
    let m = Memory::new();
    let (pausable, paused) = Pausable::new(m.source.clone(), true);
    let (cache, h) =
        paused_while_backing_off(&m, &pausable, &paused, "resumed", Duration::from_secs(4)).await;
    assert_eq!(h.status().counters.resumes, 0, "nothing resumed yet");
    tokio::time::sleep(SOON).await;
    assert_eq!(
        cache.watermark(),
        m.source.current_watermark(),
        "a follower whose source answers again after a pause, with no reconnect, must \
         retry at once, not wait out its {BACKOFF:?} backoff (SPEC §15)"
    );
    assert!(cache.get("during").is_some());
    assert_eq!(
        h.status().counters.resumes,
        1,
        "the backoff was ended by the source answering again"
    );
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn without_probes_the_backoff_is_waited_out_after_a_pause() {
    // The control of the test above: the same pause, a source that cannot be probed.
    let m = Memory::new();
    let (pausable, paused) = Pausable::new(m.source.clone(), false);
    let (cache, h) =
        paused_while_backing_off(&m, &pausable, &paused, "unprobed", Duration::from_secs(4)).await;
    tokio::time::sleep(SOON).await;
    assert_ne!(
        cache.watermark(),
        m.source.current_watermark(),
        "nothing tells a follower without probes that its source is back"
    );
    until("the backoff ends", || {
        cache.watermark() == m.source.current_watermark()
    })
    .await;
    assert_eq!(h.status().counters.resumes, 0);
}

#[tokio::test(start_paused = true)]
async fn a_source_that_answers_all_along_does_not_shorten_the_backoff() {
    // A backoff with another cause than a stall (here a feed that fails) is not cut short
    // by probes the server answers: only an answer after a miss means anything.
    let m = Memory::new();
    let (pausable, _paused) = Pausable::new(m.source.clone(), true);
    let (cache, h) = spawn_cache(config("answered"), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    until("the follower backs off", || {
        h.status().phase == Phase::BackingOff
    })
    .await;
    let reopens = h.status().counters.reopens;
    tokio::time::sleep(BACKOFF - SOON).await;
    assert_eq!(
        h.status().counters.reopens,
        reopens,
        "probes answered all along must not end a backoff"
    );
    assert_eq!(h.status().counters.resumes, 0);
    assert!(
        pausable.sent() > 0,
        "the follower probed while it backed off"
    );
}

#[tokio::test(start_paused = true)]
async fn probes_of_a_paused_source_stay_bounded() {
    let m = Memory::new();
    let (pausable, paused) = Pausable::new(m.source.clone(), true);
    let (cache, h) = spawn_cache(config("bounded"), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    until("the follower backs off", || {
        h.status().phase == Phase::BackingOff
    })
    .await;
    paused.send_replace(true);
    let before = pausable.sent();
    let pause = Duration::from_secs(50);
    tokio::time::sleep(pause).await;
    let sent = pausable.sent() - before;
    let policy = ProbePolicy::default();
    let most = pause.as_millis()
        / policy
            .timeout()
            .as_millis()
            .max(policy.interval().as_millis())
        + 1;
    assert!(
        u128::from(sent) <= most,
        "{sent} probes in {pause:?} of pause: one out at a time, each given up after \
         {:?}, is at most {most}; more is a tight loop against a server that is away",
        policy.timeout()
    );
    assert!(sent >= 2, "the follower kept probing while paused ({sent})");
    drop(h);
}
