//! Shared helpers for the driver tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

/// Waits (in tokio time) until `cond` holds; panics after 120 simulated seconds with `what`.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A follower config with the given name.
pub fn config(name: &str) -> tidemark::tidemark_core::FollowerConfig {
    tidemark::tidemark_core::FollowerConfig::builder(name)
        .seed(1)
        .build()
        .unwrap()
}

/// The announcing registry over `m`'s memory ports, announcing on channel `"changes"`.
pub type Registry = tidemark::AnnouncingRegistry<
    tidemark_memory::MemorySource,
    tidemark_memory::MemoryEvents,
    tidemark_memory::MemoryWake,
    tidemark_memory::MemoryQueue,
>;

/// An announcing registry over `m`'s memory ports, on wake channel `"changes"`.
pub fn registry(m: &tidemark_memory::Memory) -> Registry {
    tidemark::AnnouncingRegistry::new(
        m.source.clone(),
        m.events.clone(),
        m.wake.clone(),
        m.queue.clone(),
        "changes",
    )
}

/// A supervised worker that does nothing with what it applies: named `"quiet"`, on source
/// `"packages"`.
pub struct Quiet;

impl tidemark::Worker for Quiet {
    type Decoder = tidemark::Utf8;
    type Error = String;
    fn name(&self) -> &str {
        "quiet"
    }
    fn source(&self) -> &str {
        "packages"
    }
    fn decoder(&self) -> tidemark::Utf8 {
        tidemark::Utf8
    }
    async fn on_put(&mut self, _: &str, _: u64, _: String) -> Result<(), String> {
        Ok(())
    }
    async fn on_delete(&mut self, _: &str, _: u64) -> Result<(), String> {
        Ok(())
    }
}

/// A job runner `"r1"` on `m`'s queue: sweeps succeed, pack housekeeping always fails.
pub fn runner(m: &tidemark_memory::Memory) -> tidemark::JobRunner<tidemark_memory::MemoryQueue> {
    use tidemark::tidemark_core::Job;
    let handlers = tidemark::JobHandlers::new()
        .on(["sweep"], |_: Job, _| async { Ok::<(), String>(()) })
        .on(["pack_housekeeping"], |_: Job, _| async {
            Err::<(), String>("always fails".into())
        });
    tidemark::JobRunner::new("r1", m.queue.clone(), handlers).idle_poll(Duration::from_millis(100))
}
