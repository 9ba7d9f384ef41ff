//! The `tracing` span each driver's log lines carry (SPEC §16).
//!
//! In a test binary of its own, one test: `tracing` caches, per call site, whether anyone
//! listens, and a test without a subscriber registering the same call site (a worker's
//! span) on another thread while this one sets its subscriber can leave it cached as
//! silent for good.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Quiet, config, runner, until};
use tidemark::tidemark_core::Legs;
use tidemark::{Announcer, Relay, RestartPolicy, Source, Supervisor, Utf8, spawn_cache};
use tidemark_memory::{Memory, Port};

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn line_with(&self, what: &str) -> Option<String> {
        self.text()
            .lines()
            .find(|l| l.contains(what))
            .map(str::to_owned)
    }
}

#[tokio::test(start_paused = true)]
async fn each_drivers_log_lines_carry_its_span_and_name() {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let m = Memory::new();
    m.source.put("a", b"1".to_vec()).await.unwrap();
    let (cache, follower) =
        spawn_cache(config("spanned"), Utf8, m.source.clone(), m.source.clone());
    cache.wait_ready().await.unwrap();
    follower.stop_within(Duration::from_secs(5)).await.unwrap();
    let ready = lines
        .line_with(" ready")
        .unwrap_or_else(|| panic!("the follower logs its readiness: {}", lines.text()));
    assert!(
        ready.contains("follower{name=spanned}"),
        "a follower's line names it by its span: {ready}"
    );

    let sup = Supervisor::new(1);
    sup.spawn(
        Quiet,
        m.source.clone(),
        m.source.clone(),
        RestartPolicy::Never,
    )
    .unwrap();
    until("the worker is ready", || {
        sup.get("quiet").is_some_and(|w| w.watermark == 1)
    })
    .await;
    sup.shutdown(Duration::from_secs(5)).await.unwrap();
    let line = lines
        .line_with("feed opened worker=quiet")
        .expect("the worker logs its feed opening");
    assert!(
        line.contains("worker{name=quiet}"),
        "a supervised worker's lines carry its span: {line}"
    );

    m.announced_source(Legs::default())
        .put("b", b"2".to_vec())
        .await
        .unwrap();
    m.faults.set_failing(Port::Publish, true);
    let relay = Relay::new(
        m.outbox.clone(),
        Announcer::new(m.events.clone(), m.wake.clone(), m.queue.clone(), "changes"),
        "r1",
    )
    .spawn();
    until("the relay backs off", || {
        lines.line_with("relay backing off").is_some()
    })
    .await;
    relay.stop_within(Duration::from_secs(5)).await.unwrap();
    let line = lines.line_with("relay backing off").unwrap();
    assert!(
        line.contains("relay{owner=r1}"),
        "a relay's lines carry its span: {line}"
    );

    // The runner's first two queue calls: its count for the gauges, then a lease.
    m.faults.fail_next(Port::Queue, 2);
    let runner = runner(&m).spawn();
    until("the runner logs the failed lease", || {
        lines.line_with("leasing a job failed").is_some()
    })
    .await;
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
    let line = lines.line_with("leasing a job failed").unwrap();
    assert!(
        line.contains("job_runner{name=r1}"),
        "a job runner's lines carry its span: {line}"
    );
}
