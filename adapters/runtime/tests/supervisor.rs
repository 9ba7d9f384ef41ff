//! Typed workers under a supervisor: dispatch, decode failures, restart policy, drain.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::until;
use tidemark::tidemark_core::{BackoffPolicy, RestartPolicy, Utf8};
use tidemark::{Source, Supervisor, ValueOf, Worker, WorkerPhase};
use tidemark_memory::Memory;

#[derive(Default, Clone)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

struct Mirror {
    log: Log,
    fail_on: Option<&'static str>,
}

impl Worker for Mirror {
    type Decoder = Utf8;
    type Error = String;

    fn name(&self) -> &str {
        "mirror"
    }
    fn description(&self) -> &str {
        "mirrors packages into a log"
    }
    fn source(&self) -> &str {
        "packages"
    }
    fn decoder(&self) -> Utf8 {
        Utf8
    }
    async fn on_put(&mut self, key: &str, seq: u64, value: ValueOf<Self>) -> Result<(), String> {
        if self.fail_on == Some(key) {
            return Err(format!("cannot handle {key}"));
        }
        self.log
            .0
            .lock()
            .unwrap()
            .push(format!("put {key}@{seq}={value}"));
        Ok(())
    }
    async fn on_delete(&mut self, key: &str, seq: u64) -> Result<(), String> {
        self.log.0.lock().unwrap().push(format!("del {key}@{seq}"));
        Ok(())
    }
    async fn drain(&mut self) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.log.0.lock().unwrap().push("drained".into());
    }
}

/// A supervisor running one `Mirror` of `m`'s source under `policy`.
fn supervise(
    m: &Memory,
    log: &Log,
    fail_on: Option<&'static str>,
    policy: RestartPolicy,
) -> Supervisor {
    let sup = Supervisor::new(1);
    let mirror = Mirror {
        log: log.clone(),
        fail_on,
    };
    sup.spawn(mirror, m.source.clone(), m.source.clone(), policy)
        .unwrap();
    sup
}

#[tokio::test(start_paused = true)]
async fn a_worker_gets_puts_and_deletes_and_skips_undecodable_values() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    m.source.put("bad", vec![0xff]).await.unwrap();
    let log = Log::default();
    let sup = supervise(&m, &log, None, RestartPolicy::Never);
    m.source.remove("a").await.unwrap();
    until("the removal is dispatched", || log.lines().len() == 2).await;
    assert_eq!(
        log.lines(),
        ["put a@1=1", "del a@3"],
        "no handler fires for an undecodable value"
    );
    let info = sup.get("mirror").unwrap();
    assert_eq!(info.counters.poison, 1, "the decode failure is counted");
    assert_eq!(info.watermark, 3, "and the watermark moved past it");
    let listed = sup.list();
    assert_eq!(
        (
            listed[0].name.as_str(),
            listed[0].description.as_str(),
            listed[0].source.as_str()
        ),
        ("mirror", "mirrors packages into a log", "packages"),
        "an operator sees what runs and where it reads"
    );
}

#[tokio::test(start_paused = true)]
async fn by_default_a_worker_exit_is_terminal_and_reported() {
    let m = Memory::new();
    m.source.put("boom", b"x".to_vec()).await.unwrap();
    let sup = supervise(&m, &Log::default(), Some("boom"), RestartPolicy::default());
    until("the worker fails", || {
        matches!(sup.get("mirror").unwrap().phase, WorkerPhase::Failed(_))
    })
    .await;
    let info = sup.get("mirror").unwrap();
    assert_eq!(info.restarts, 0, "the default policy never restarts");
    assert!(
        matches!(&info.phase, WorkerPhase::Failed(r) if r.contains("cannot handle boom")),
        "the reason is reported: {info:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_opted_in_worker_is_restarted_with_backoff_up_to_its_limit() {
    let m = Memory::new();
    m.source.put("boom", b"x".to_vec()).await.unwrap();
    let policy = RestartPolicy::OnExit {
        backoff: BackoffPolicy::default(),
        max_restarts: Some(3),
    };
    let sup = supervise(&m, &Log::default(), Some("boom"), policy);
    until("the restarts are used up", || {
        matches!(sup.get("mirror").unwrap().phase, WorkerPhase::Failed(_))
    })
    .await;
    assert_eq!(
        sup.get("mirror").unwrap().restarts,
        3,
        "restarted exactly up to its limit"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_drains_every_worker_within_its_budget() {
    let m = Memory::new();
    let log = Log::default();
    let sup = supervise(&m, &log, None, RestartPolicy::Never);
    until("the worker is live", || {
        sup.get("mirror").unwrap().phase
            != WorkerPhase::Running(tidemark::tidemark_core::Phase::Starting)
    })
    .await;
    let infos = sup
        .shutdown(Duration::from_secs(1))
        .await
        .expect("drains within the budget");
    assert_eq!(infos[0].phase, WorkerPhase::Stopped);
    assert_eq!(
        log.lines(),
        ["drained"],
        "in-flight work is drained on shutdown"
    );
}

#[tokio::test(start_paused = true)]
async fn a_worker_slower_than_the_budget_is_aborted_and_named() {
    struct Slow;
    impl Worker for Slow {
        type Decoder = Utf8;
        type Error = String;
        fn name(&self) -> &str {
            "slow"
        }
        fn source(&self) -> &str {
            "packages"
        }
        fn decoder(&self) -> Utf8 {
            Utf8
        }
        async fn on_put(&mut self, _: &str, _: u64, _: String) -> Result<(), String> {
            Ok(())
        }
        async fn on_delete(&mut self, _: &str, _: u64) -> Result<(), String> {
            Ok(())
        }
        async fn drain(&mut self) {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    }
    let m = Memory::new();
    let sup = Supervisor::new(1);
    sup.spawn(
        Slow,
        m.source.clone(),
        m.source.clone(),
        RestartPolicy::Never,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    match sup.shutdown(Duration::from_secs(1)).await {
        Err(tidemark::Error::Timeout { what, .. }) => {
            assert!(what.contains("slow"), "the late worker is named")
        }
        other => panic!("a drain over budget must be reported, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn the_listing_shows_a_live_workers_current_watermark_and_counters() {
    let m = Memory::new();
    let log = Log::default();
    let sup = supervise(&m, &log, None, RestartPolicy::Never);
    until("the worker is live", || {
        matches!(
            sup.get("mirror").unwrap().phase,
            tidemark::WorkerPhase::Running(tidemark::tidemark_core::Phase::Live)
        )
    })
    .await;
    for i in 0..5u8 {
        m.source
            .put(&format!("k{i}"), vec![b'0' + i])
            .await
            .unwrap();
    }
    until("every put is dispatched", || log.lines().len() == 5).await;
    let info = sup.get("mirror").unwrap();
    assert_eq!(
        (info.watermark, info.counters.applied),
        (5, 5),
        "an operator must see how far a live worker is, not where it was when its phase last changed"
    );
}

/// A worker that fails on `key` while `armed` holds it, once per arming.
struct Flaky {
    log: Log,
    armed: Arc<Mutex<Option<String>>>,
}

impl Worker for Flaky {
    type Decoder = Utf8;
    type Error = String;

    fn name(&self) -> &str {
        "flaky"
    }
    fn source(&self) -> &str {
        "packages"
    }
    fn decoder(&self) -> Utf8 {
        Utf8
    }
    async fn on_put(&mut self, key: &str, seq: u64, value: ValueOf<Self>) -> Result<(), String> {
        let mut armed = self.armed.lock().unwrap();
        if armed.as_deref() == Some(key) {
            *armed = None;
            return Err(format!("cannot handle {key} yet"));
        }
        self.log
            .0
            .lock()
            .unwrap()
            .push(format!("put {key}@{seq}={value}"));
        Ok(())
    }
    async fn on_delete(&mut self, key: &str, seq: u64) -> Result<(), String> {
        self.log.0.lock().unwrap().push(format!("del {key}@{seq}"));
        Ok(())
    }
}

fn restart_quickly(max_restarts: Option<u32>) -> RestartPolicy {
    RestartPolicy::OnExit {
        backoff: BackoffPolicy::new(
            Duration::from_secs(1),
            2.0,
            Duration::from_secs(10),
            Duration::from_secs(30),
            0.0,
        )
        .unwrap(),
        max_restarts,
    }
}

/// SPEC §13: a supervised worker that restarts keeps what it applied, so a key deleted
/// while it was down reaches `on_delete` even though the source compacted its history
/// meanwhile (a fresh core would resync without knowing the key was ever there).
#[tokio::test(start_paused = true)]
async fn a_restart_after_a_delete_and_a_compaction_delivers_on_delete() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    m.source.put("b", b"2".to_vec()).await.unwrap();
    let log = Log::default();
    let armed = Arc::new(Mutex::new(Some("boom".to_owned())));
    let sup = Supervisor::new(1);
    let worker = Flaky {
        log: log.clone(),
        armed: armed.clone(),
    };
    sup.spawn(
        worker,
        m.source.clone(),
        m.source.clone(),
        restart_quickly(None),
    )
    .unwrap();
    until("a and b are handled", || log.lines().len() == 2).await;
    m.source.put("boom", b"x".to_vec()).await.unwrap();
    until("the worker fails and waits to restart", || {
        sup.get("flaky").unwrap().phase == WorkerPhase::Restarting
    })
    .await;
    // While it is down: a is deleted and the history that says so is compacted away.
    m.source.remove("a").await.unwrap();
    m.source.compact_below(m.source.current_watermark() + 1);
    until("the restarted worker catches up", || {
        log.lines().iter().any(|l| l.starts_with("del a"))
            && log.lines().iter().any(|l| l.starts_with("put boom"))
    })
    .await;
    let info = sup.get("flaky").unwrap();
    assert_eq!(info.restarts, 1);
    assert!(
        info.counters.resyncs >= 1,
        "the compaction forced a resync: {info:?}"
    );
    assert_eq!(
        log.lines()[..2],
        ["put a@1=1", "put b@2=2"],
        "what was applied before the failure is not delivered again"
    );
}

/// Restarts count "in a row": a worker that stayed healthy for its backoff's reset period
/// starts counting again, so a limit of one restart allows one per incident.
#[tokio::test(start_paused = true)]
async fn restarts_in_a_row_reset_after_a_healthy_period() {
    let m = Memory::new();
    let log = Log::default();
    let armed = Arc::new(Mutex::new(Some("k1".to_owned())));
    let sup = Supervisor::new(1);
    sup.spawn(
        Flaky {
            log: log.clone(),
            armed: armed.clone(),
        },
        m.source.clone(),
        m.source.clone(),
        restart_quickly(Some(1)),
    )
    .unwrap();
    m.source.put("k1", b"1".to_vec()).await.unwrap();
    until("k1 handled after one restart", || log.lines().len() == 1).await;
    // Healthy for longer than the reset period (30 s), then a second incident.
    tokio::time::sleep(Duration::from_secs(60)).await;
    *armed.lock().unwrap() = Some("k2".to_owned());
    m.source.put("k2", b"2".to_vec()).await.unwrap();
    until("k2 handled after another restart", || {
        log.lines().len() == 2
    })
    .await;
    let info = sup.get("flaky").unwrap();
    assert_eq!(info.restarts, 2);
    assert!(
        matches!(info.phase, WorkerPhase::Running(_)),
        "a second incident after a healthy stretch is not the second restart in a row: {info:?}"
    );
    // A failure right after that restart is the second in a row: a limit of one is used up.
    *armed.lock().unwrap() = Some("k3".to_owned());
    m.source.put("k3", b"3".to_vec()).await.unwrap();
    let failure = tokio::time::timeout(Duration::from_secs(120), sup.terminal_failure())
        .await
        .expect("a second failure in a row is terminal, and reported");
    assert_eq!(failure.worker, "flaky");
    assert!(failure.reason.contains("cannot handle k3"), "{failure:?}");
    assert_eq!(sup.get("flaky").unwrap().restarts, 2);
}

#[tokio::test(start_paused = true)]
async fn a_wake_only_worker_can_be_supervised_and_shut_down_through_a_shared_reference() {
    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let log = Log::default();
    let sup = Arc::new(Supervisor::new(1));
    let listener = tidemark::Wake::listen(&m.wake, "changes").await.unwrap();
    sup.spawn_wake(
        Mirror {
            log: log.clone(),
            fail_on: None,
        },
        m.source.clone(),
        listener,
        RestartPolicy::Never,
    )
    .unwrap();
    until("the first reconcile", || log.lines().len() == 1).await;
    m.source.put("b", b"2".to_vec()).await.unwrap();
    tidemark::Wake::notify(&m.wake, "changes", Vec::new())
        .await
        .unwrap();
    until("a wake brings b in", || log.lines().len() == 2).await;
    let shared = Arc::clone(&sup);
    let infos = tokio::spawn(async move { shared.shutdown(Duration::from_secs(1)).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(infos[0].phase, WorkerPhase::Stopped);
}

/// A shutdown budget of `Duration::MAX` ("wait as long as it takes") is not an overflow
/// panic on the deadline it would end at.
#[tokio::test(start_paused = true)]
async fn a_shutdown_budget_for_ever_is_not_a_panic() {
    let sup = Supervisor::new(1);
    assert!(sup.shutdown(Duration::MAX).await.unwrap().is_empty());
}
