//! What the follower task logs (SPEC §2: a decode failure is logged with key and error).
//!
//! In a test binary of its own: `tracing` caches, per call site, whether anyone listens,
//! so a test without a subscriber running first on another thread would silence these.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use tidemark::{FollowerConfig, Source, decode_fn, spawn_cache};
use tidemark_memory::Memory;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The operator sees which follower skipped which key and the user's decoder's own error,
/// at warn level, and the follower goes on.
#[test]
fn a_decode_failure_is_logged_with_the_follower_the_key_and_the_error() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let m = Memory::new();
            m.source.put("pkg/poison", b"oops".to_vec()).await.unwrap();
            m.source.put("pkg/fine", b"7".to_vec()).await.unwrap();
            let decoder = decode_fn(|_key: &str, bytes: Vec<u8>| {
                String::from_utf8(bytes)
                    .unwrap()
                    .parse::<u32>()
                    .map_err(|e| format!("not a version number: {e}"))
            });
            let config = FollowerConfig::builder("versions").seed(1).build().unwrap();
            let (cache, h) = spawn_cache(config, decoder, m.source.clone(), m.source.clone());
            cache.wait_ready().await.unwrap();
            assert_eq!(cache.get("pkg/fine"), Some(7), "the follower goes on");
            h.stop();
        });
    });
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = logs
        .lines()
        .find(|l| l.contains("failed to decode"))
        .unwrap_or_else(|| panic!("no decode failure was logged: {logs}"));
    for want in [
        "WARN",
        "versions",
        "pkg/poison",
        "not a version number",
        "seq=1",
    ] {
        assert!(line.contains(want), "the log line names {want:?}: {line}");
    }
}
