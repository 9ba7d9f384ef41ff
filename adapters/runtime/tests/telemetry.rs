//! What the drivers report beyond their state: `metrics` series named and labelled as
//! SPEC §16 lists them and the health a readiness probe asks for. The `tracing` span each
//! driver's log lines carry is tested in `spans.rs`, a binary of its own.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Quiet, config, runner, until};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tidemark::tidemark_core::{Job, Legs};
use tidemark::{
    Announcer, Health, Queue, Relay, RestartPolicy, Source, Supervisor, Utf8, spawn_cache,
};
use tidemark_memory::{Memory, Port};

/// A recorder that keeps every series' latest value (counters as totals, gauges as set),
/// keyed by `name{label=value,...}`, so a test reads what an exporter would serve.
#[derive(Clone, Default)]
struct Recorded(Arc<Mutex<BTreeMap<String, Arc<AtomicU64>>>>);

fn series(key: &Key) -> String {
    let labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorded {
    fn cell(&self, key: &Key) -> Arc<AtomicU64> {
        Arc::clone(self.0.lock().unwrap().entry(series(key)).or_default())
    }

    fn counter(&self, name: &str) -> Option<u64> {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map(|c| c.load(Ordering::SeqCst))
    }

    fn gauge(&self, name: &str) -> Option<f64> {
        self.counter(name).map(f64::from_bits)
    }

    fn names(&self) -> Vec<String> {
        self.0.lock().unwrap().keys().cloned().collect()
    }
}

impl Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

const M: &str = "{follower=m,source=m}";

#[tokio::test(start_paused = true)]
async fn a_followers_series_are_named_labelled_and_move_with_it() {
    let rec = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    m.source.put("b", b"2".to_vec()).await.unwrap();
    m.source.put("bad", vec![0xff]).await.unwrap();
    let (cache, follower) = spawn_cache(config("m"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    let c = |n: &str| rec.counter(&format!("tidemark_follower_{n}{M}"));
    let g = |n: &str| rec.gauge(&format!("tidemark_follower_{n}{M}"));
    until("the ready series are published", || g("ready") == Some(1.0)).await;
    assert_eq!(c("applied_total"), Some(2), "{:?}", rec.names());
    assert_eq!(c("poison_total"), Some(1), "a value Utf8 rejects is poison");
    assert_eq!(g("watermark"), Some(3.0));
    assert_eq!(g("source_head"), Some(3.0));
    assert_eq!(g("lag"), Some(0.0), "a follower at the head has no lag");
    assert_eq!(g("keys"), Some(2.0));
    for n in [
        "removed_total",
        "invalid_total",
        "reopens_total",
        "resyncs_total",
    ] {
        assert_eq!(c(n), Some(0), "{n} is exported from the start");
    }

    m.source.remove("a").await.unwrap();
    m.source.put("c", b"3".to_vec()).await.unwrap();
    until("the removal and the put are counted", || {
        c("removed_total") == Some(1) && c("applied_total") == Some(3)
    })
    .await;
    assert_eq!(g("watermark"), Some(5.0));
    assert_eq!(g("keys"), Some(2.0));
    follower.stop();
}

#[tokio::test(start_paused = true)]
async fn lag_is_the_source_head_minus_the_watermark_and_a_stuck_follower_is_stalled() {
    let rec = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    let m = Memory::new();
    for i in 0..5 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    m.faults.set_failing(Port::Feed, true);
    let (_cache, follower) = spawn_cache(config("m"), Utf8, m.source.clone(), m.source.clone());
    let lag = || rec.gauge(&format!("tidemark_follower_lag{M}"));
    until("the source's head is known", || lag() == Some(5.0)).await;
    assert_eq!(follower.lag(), 5, "the handle says the same as the gauge");
    let stall = Duration::from_secs(30);
    let h = follower.health(stall);
    assert!(!h.healthy() && !h.ready, "not ready is not healthy: {h}");
    assert_eq!(
        h.stalled_for, None,
        "not stalled yet: it has only just started"
    );

    tokio::time::sleep(Duration::from_secs(31)).await;
    let h = follower.health(stall);
    assert!(
        h.stalled_for.is_some_and(|d| d >= stall),
        "a follower whose feed keeps failing is stalled after the threshold: {h}"
    );
    let all = Health::of([&follower], stall);
    assert!(!all.healthy());
    assert!(all.to_string().contains("stalled"), "{all}");

    m.faults.set_failing(Port::Feed, false);
    until("the follower catches up after the feed heals", || {
        follower.health(stall).healthy()
    })
    .await;
    assert_eq!(lag(), Some(0.0));
    assert_eq!(follower.lag(), 0);
    assert!(Health::of([&follower], stall).healthy());

    follower.stop();
    until("a stopped follower is not healthy", || {
        follower.health(stall).down.is_some()
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_follower_of_a_prefix_is_not_behind_when_other_keys_change() {
    let m = Memory::new();
    m.source.put("pkg/a", b"1".to_vec()).await.unwrap();
    m.source.put("doc/x", b"1".to_vec()).await.unwrap();
    let view = m.source.with_prefix("pkg/").unwrap();
    let (cache, follower) = spawn_cache(config("pkgs"), Utf8, view.clone(), view);
    cache.wait_ready().await.unwrap();
    assert_eq!(
        follower.lag(),
        0,
        "the source's last seq (doc/x) is not one this follower can reach"
    );
    for i in 0..5 {
        m.source
            .put(&format!("doc/{i}"), b"2".to_vec())
            .await
            .unwrap();
    }
    m.source.put("pkg/b", b"2".to_vec()).await.unwrap();
    until("the prefix's new key arrives", || cache.len() == 2).await;
    m.source.put("doc/last", b"3".to_vec()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(120)).await;
    let h = follower.health(Duration::from_secs(60));
    assert_eq!(
        h.lag(),
        0,
        "writes to other prefixes are nothing this follower could apply: {h}"
    );
    assert!(h.healthy(), "{h}");
    follower.stop();
}

#[tokio::test(start_paused = true)]
async fn the_supervisors_health_is_every_worker_ready_and_not_stalled() {
    let rec = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    m.faults.set_failing(Port::Feed, true);
    let sup = Supervisor::new(1);
    sup.spawn(
        Quiet,
        m.source.clone(),
        m.source.clone(),
        RestartPolicy::Never,
    )
    .unwrap();
    let stall = Duration::from_secs(10);
    tokio::time::sleep(Duration::from_secs(11)).await;
    let health = sup.health(stall);
    assert!(!health.healthy(), "a worker that cannot sync: {health}");
    assert_eq!(health.followers.len(), 1);
    assert_eq!(health.followers[0].name, "quiet");
    assert!(health.followers[0].stalled_for.is_some(), "{health}");

    m.faults.set_failing(Port::Feed, false);
    until("the worker is ready", || sup.health(stall).healthy()).await;
    let labels = "{follower=quiet,source=packages}";
    assert_eq!(
        rec.counter(&format!("tidemark_follower_applied_total{labels}")),
        Some(1),
        "a worker's series carry its name and source: {:?}",
        rec.names()
    );
    sup.shutdown(Duration::from_secs(5)).await.unwrap();
    let health = sup.health(stall);
    assert!(health.followers.is_empty() || !health.healthy());
}

#[tokio::test(start_paused = true)]
async fn a_relay_reports_outbox_pending_and_what_it_relayed() {
    let rec = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    let m = Memory::new();
    let source = m.announced_source(Legs::default());
    for i in 0..3 {
        source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    m.faults.set_failing(Port::Publish, true);
    let relay = Relay::new(
        m.outbox.clone(),
        Announcer::new(m.events.clone(), m.wake.clone(), m.queue.clone(), "changes"),
        "r1",
    )
    .spawn();
    let pending = || rec.gauge("tidemark_outbox_pending{relay=r1}");
    until("three rows are pending while publish fails", || {
        pending() == Some(3.0)
    })
    .await;
    assert!(rec.counter("tidemark_relay_failures_total{relay=r1}") >= Some(3));
    m.faults.set_failing(Port::Publish, false);
    until("the outbox drains", || pending() == Some(0.0)).await;
    assert_eq!(rec.counter("tidemark_relay_done_total{relay=r1}"), Some(3));
    relay.stop_within(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_job_runner_reports_queue_depth_dead_letters_and_what_it_ran() {
    let rec = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    let m = Memory::new();
    m.queue.enqueue(Job::Sweep).await.unwrap();
    m.queue.enqueue(Job::Sweep).await.unwrap();
    let key = "k".to_owned();
    m.queue
        .enqueue(Job::PackHousekeeping { key })
        .await
        .unwrap();
    let runner = runner(&m).spawn();
    until("the failing job is dead-lettered", || {
        rec.gauge("tidemark_dead_letters{runner=r1}") == Some(1.0)
            && rec.counter("tidemark_jobs_acked_total{runner=r1}") == Some(2)
    })
    .await;
    assert_eq!(rec.gauge("tidemark_queue_depth{runner=r1}"), Some(0.0));
    assert_eq!(
        rec.counter("tidemark_jobs_dead_lettered_total{runner=r1}"),
        Some(1)
    );
    assert!(rec.counter("tidemark_jobs_failed_total{runner=r1}") >= Some(1));
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
}
