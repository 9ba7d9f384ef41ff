//! A source that stalls and goes on without a reconnect (a server paused and continued
//! keeps its connections) reaches a follower that backs off through its probes: the
//! follower retries once the source answers again, not after a backoff grown meanwhile
//! (SPEC §15), and while the source stalls its probes stay bounded. So does a source made
//! again after probes answered that it was missing (a bucket deleted), and a request sent
//! while the path was cut, whose reply never comes, is given up once the source answers
//! again. Tokio's paused clock runs it, as every driver test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::until;
use tidemark::tidemark_core::{BackoffPolicy, Follow, FollowerConfig, Phase, ProbePolicy, Utf8};
use tidemark::{Feed, Opened, Source, spawn_cache};
use tidemark_memory::{Memory, MemorySource, Port};
use tokio::sync::watch;

/// The memory source and feed behind a server the test can pause: while paused, every
/// call and every probe waits (nothing fails, nothing reconnects); continued, they go on.
/// Cut off ([`cut_off`](Self::cut_off)), a call or probe sent gets no reply ever (a node
/// cut off from its cluster: the connection stays up); gone
/// ([`gone`](Self::gone)), calls fail and probes answer that the source is missing (a
/// bucket deleted). `probes`: whether it answers probes at all (the control has none).
#[derive(Clone)]
struct Pausable {
    inner: MemorySource,
    paused: watch::Receiver<bool>,
    probes: bool,
    /// Probes sent.
    sent: Arc<AtomicU64>,
    cut_off: Arc<AtomicBool>,
    gone: Arc<AtomicBool>,
}

impl Pausable {
    fn new(inner: MemorySource, probes: bool) -> (Self, watch::Sender<bool>) {
        let (tx, paused) = watch::channel(false);
        let pausable = Pausable {
            inner,
            paused,
            probes,
            sent: Arc::default(),
            cut_off: Arc::default(),
            gone: Arc::default(),
        };
        (pausable, tx)
    }

    /// Waits while the server is paused.
    async fn running(paused: &mut watch::Receiver<bool>) {
        let _ = paused.wait_for(|p| !p).await;
    }

    /// What a call meets before the source: no reply ever while cut off, "not found"
    /// while gone, a wait while paused.
    async fn reach(&self) -> tidemark::Result<()> {
        if self.gone.load(Ordering::SeqCst) {
            return Err(tidemark::Error::unavailable("source", "stream not found"));
        }
        if self.cut_off.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Self::running(&mut self.paused.clone()).await;
        Ok(())
    }

    fn cut_off(&self, cut: bool) {
        self.cut_off.store(cut, Ordering::SeqCst);
    }

    fn gone(&self, gone: bool) {
        self.gone.store(gone, Ordering::SeqCst);
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
        self.reach().await?;
        self.inner.watermark().await
    }
    async fn changes_since(&self, since: u64) -> tidemark::Result<tidemark::Changes> {
        self.reach().await?;
        self.inner.changes_since(since).await
    }
    async fn changes_and_lineage(
        &self,
        since: u64,
    ) -> tidemark::Result<(tidemark::Changes, tidemark::Lineage)> {
        self.reach().await?;
        self.inner.changes_and_lineage(since).await
    }
    async fn lineage_at(&self, seq: u64) -> tidemark::Result<tidemark::Lineage> {
        self.reach().await?;
        self.inner.lineage_at(seq).await
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        self.reach().await?;
        self.inner.snapshot().await
    }
    async fn get(&self, key: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        self.reach().await?;
        self.inner.get(key).await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        self.reach().await?;
        self.inner.first_available().await
    }
    fn probe(
        &self,
    ) -> Option<impl std::future::Future<Output = tidemark::Result<()>> + Send + 'static> {
        let mut paused = self.paused.clone();
        let sent = Arc::clone(&self.sent);
        let (gone, cut_off) = (
            self.gone.load(Ordering::SeqCst),
            self.cut_off.load(Ordering::SeqCst),
        );
        self.probes.then_some(async move {
            sent.fetch_add(1, Ordering::SeqCst);
            if gone {
                return Err(tidemark::Error::unavailable("source", "stream not found"));
            }
            if cut_off {
                std::future::pending::<()>().await;
            }
            Self::running(&mut paused).await;
            Ok(())
        })
    }
}

impl Feed for Pausable {
    const FOLLOW: Follow = <MemorySource as Feed>::FOLLOW;
    type Stream = <MemorySource as Feed>::Stream;

    async fn open(&self, from: u64, after: Option<u64>) -> tidemark::Result<Opened<Self::Stream>> {
        self.reach().await?;
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

/// A follower whose feed failed while its bucket was deleted, backing off for a minute:
/// its probes answer "not found" and then, the bucket made again, find it.
async fn gone_while_backing_off(
    m: &Memory,
    pausable: &Pausable,
    name: &str,
) -> (tidemark::Cache<String>, tidemark::FollowerHandle) {
    let (cache, h) = spawn_cache(config(name), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    pausable.gone(true);
    m.faults.set_failing(Port::Feed, true);
    m.source.put("during", b"x".to_vec()).await.unwrap();
    until("the feed fails and the follower backs off", || {
        h.status().phase == Phase::BackingOff
    })
    .await;
    m.faults.set_failing(Port::Feed, false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    pausable.gone(false);
    (cache, h)
}

#[tokio::test(start_paused = true)]
async fn a_source_made_again_ends_a_backoff_its_absence_grew() {
    let m = Memory::new();
    let (pausable, _paused) = Pausable::new(m.source.clone(), true);
    let (cache, h) = gone_while_backing_off(&m, &pausable, "made-again").await;
    assert_eq!(
        h.status().counters.resumes,
        0,
        "probes finding it missing resume nothing"
    );
    tokio::time::sleep(SOON).await;
    assert_eq!(
        cache.watermark(),
        m.source.current_watermark(),
        "a follower whose probes find its source again after answers that it was missing \
         (a bucket made again) must retry at once, not wait out its {BACKOFF:?} backoff"
    );
    assert_eq!(h.status().counters.resumes, 1);
}

#[tokio::test(start_paused = true)]
async fn without_probes_a_source_made_again_waits_out_the_backoff() {
    // The control: the same absence, a source that cannot be probed.
    let m = Memory::new();
    let (pausable, _paused) = Pausable::new(m.source.clone(), false);
    let (cache, h) = gone_while_backing_off(&m, &pausable, "made-again-unprobed").await;
    tokio::time::sleep(SOON).await;
    assert_ne!(cache.watermark(), m.source.current_watermark());
    until("the backoff ends", || {
        cache.watermark() == m.source.current_watermark()
    })
    .await;
    assert_eq!(h.status().counters.resumes, 0);
}

/// A ready follower over `pausable` asked to reconcile while its source is cut off for
/// `cut`: the reconcile's read goes out and gets no reply, then the path heals. Returns
/// the reconcile's outcome within [`SOON`] of the healing (`None`: still out).
async fn reconcile_across_a_cut(
    pausable: &Pausable,
    name: &str,
    cut: Duration,
) -> (
    Option<tidemark::Result<tidemark::Reconciled>>,
    tidemark::FollowerHandle,
) {
    let (cache, h) = spawn_cache(config(name), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    pausable.cut_off(true);
    let h = Arc::new(h);
    let asked = tokio::spawn({
        let h = Arc::clone(&h);
        async move { h.reconcile().await }
    });
    tokio::time::sleep(cut).await;
    pausable.cut_off(false);
    tokio::time::sleep(SOON).await;
    let answered = match asked.is_finished() {
        true => Some(asked.await.unwrap()),
        false => {
            asked.abort();
            let _ = asked.await;
            None
        }
    };
    (
        answered,
        Arc::into_inner(h).expect("the reconcile is done or dropped"),
    )
}

#[tokio::test(start_paused = true)]
async fn a_request_sent_while_the_path_was_cut_is_given_up_once_the_source_answers_again() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (pausable, _paused) = Pausable::new(m.source.clone(), true);
    let (answered, h) = reconcile_across_a_cut(&pausable, "cut-off", Duration::from_secs(6)).await;
    let reconciled = answered.expect(
        "a request whose reply never comes must be given up once probes beside it find the \
         source answering again, and retried (SPEC §15), not wait out a request timeout",
    );
    reconciled.expect("the retried reconcile reads the source");
    assert_eq!(
        h.status().counters.resumes,
        1,
        "the path's return retried it"
    );
    assert_eq!(h.status().phase, Phase::Live);
}

#[tokio::test(start_paused = true)]
async fn without_probes_a_request_sent_while_the_path_was_cut_waits_for_its_reply() {
    // The control: the same cut, a source that cannot be probed. The memory source has
    // no request timeout, so the request is out for good.
    let m = Memory::new();
    let (pausable, _paused) = Pausable::new(m.source.clone(), false);
    let (answered, h) =
        reconcile_across_a_cut(&pausable, "cut-off-unprobed", Duration::from_secs(6)).await;
    assert!(answered.is_none(), "nothing gives the request up");
    assert_eq!(h.status().counters.resumes, 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_held_up_by_a_pause_gets_its_answer_and_is_not_cut() {
    // A server paused and continued keeps the request: its reply comes with the probes'
    // answers, inside the grace, and nothing is retried.
    let m = Memory::new();
    let (pausable, paused) = Pausable::new(m.source.clone(), true);
    let (cache, h) = spawn_cache(config("held-up"), Utf8, pausable.clone(), pausable.clone());
    cache.wait_ready().await.unwrap();
    paused.send_replace(true);
    let reconcile = h.reconcile();
    let unpause = async {
        tokio::time::sleep(Duration::from_secs(6)).await;
        paused.send_replace(false);
    };
    let (reconciled, ()) = tokio::join!(reconcile, unpause);
    reconciled.expect("the request held up by the pause is answered");
    let status = h.status();
    assert_eq!(status.counters.resumes, 0, "no request was cut: {status:?}");
    assert_eq!(
        status.counters.reconciles, 1,
        "one reconcile, not a retry: {status:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lookup_lost_while_the_source_answers_probes_is_given_up_and_sent_again() {
    // Sent to a cluster node that lost its lead a moment later: no reply ever, while the
    // new leader answers every probe, so no probe went unanswered to say the path was
    // cut. A request of one round trip outliving several answered probes is lost.
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (pausable, _paused) = Pausable::new(m.source.clone(), true);
    pausable.cut_off(true);
    let (cache, h) = spawn_cache(
        config("lost-lookup"),
        Utf8,
        pausable.clone(),
        pausable.clone(),
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    pausable.cut_off(false);
    tokio::time::timeout(SOON, cache.wait_ready())
        .await
        .expect(
            "a lookup whose reply never comes, with the source answering probes beside it, \
             must be given up and sent again within a few probes, not wait out a request \
             timeout (10 s on NATS; for good on this source)",
        )
        .unwrap();
    assert_eq!(cache.get("a").as_deref().map(String::as_str), Some("1"));
    assert_eq!(h.status().counters.resumes, 1, "one request given up");
}

/// The memory events stream, which the test can leave without a leader (`away`: opening
/// it fails, and its probe, where it has one, finds it missing), as a cluster's events
/// stream electing a leader while the bucket's stream answers all along.
#[derive(Clone)]
struct AwayEvents {
    inner: tidemark_memory::MemoryEvents,
    away: Arc<AtomicBool>,
    /// Whether it can be probed (the control has no probe of its own).
    probes: bool,
}

impl Feed for AwayEvents {
    const FOLLOW: Follow = Follow::Announcements;
    type Stream = tidemark_memory::EventStream;

    async fn open(&self, from: u64, after: Option<u64>) -> tidemark::Result<Opened<Self::Stream>> {
        if self.away.load(Ordering::SeqCst) {
            return Err(tidemark::Error::unavailable(
                "events",
                "stream has no leader",
            ));
        }
        self.inner.open(from, after).await
    }

    fn probe(
        &self,
    ) -> Option<impl std::future::Future<Output = tidemark::Result<()>> + Send + 'static> {
        let away = self.away.load(Ordering::SeqCst);
        self.probes.then_some(async move {
            match away {
                true => Err(tidemark::Error::unavailable(
                    "events",
                    "stream has no leader",
                )),
                false => Ok(()),
            }
        })
    }
}

/// A ready follower of announcements whose bucket answers probes all along, and whose
/// events stream fails and stays away for 5 s while it backs off for [`BACKOFF`]; then
/// the stream is back, with an event it announced meanwhile to read.
async fn events_away_while_backing_off(
    probes: bool,
    name: &str,
) -> (tidemark::Cache<String>, tidemark::FollowerHandle) {
    let m = Memory::new();
    let registry = common::registry(&m);
    let (source, _paused) = Pausable::new(m.source.clone(), true);
    let events = AwayEvents {
        inner: m.events.clone(),
        away: Arc::default(),
        probes,
    };
    let (cache, h) = spawn_cache(config(name), Utf8, source, events.clone());
    cache.wait_ready().await.unwrap();
    events.away.store(true, Ordering::SeqCst);
    m.faults.set_failing(Port::Events, true);
    registry.put("during", b"x".to_vec()).await.unwrap();
    until("the feed fails and the follower backs off", || {
        h.status().phase == Phase::BackingOff
    })
    .await;
    m.faults.set_failing(Port::Events, false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    events.away.store(false, Ordering::SeqCst);
    tokio::time::sleep(SOON).await;
    (cache, h)
}

#[tokio::test(start_paused = true)]
async fn an_events_stream_back_ends_the_backoff_though_the_bucket_answered_all_along() {
    let (cache, h) = events_away_while_backing_off(true, "events-back").await;
    assert_eq!(
        cache.get("during").as_deref().map(String::as_str),
        Some("x"),
        "the feed's own probe finds its stream back: the backoff ends then, though the \
         source's probe was answered throughout ({:?})",
        h.status()
    );
    assert_eq!(h.status().counters.resumes, 1);
}

#[tokio::test(start_paused = true)]
async fn without_the_feeds_probe_the_events_streams_return_waits_out_the_backoff() {
    // The control: the bucket's answers say nothing of the events stream.
    let (cache, h) = events_away_while_backing_off(false, "events-unprobed").await;
    assert_eq!(cache.get("during"), None);
    assert_eq!(h.status().counters.resumes, 0);
    assert_eq!(h.status().phase, Phase::BackingOff);
}
