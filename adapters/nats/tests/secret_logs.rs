//! Secrets in server URLs never reach logs (SPEC §15), async-nats' own included.
//!
//! In a test binary of its own: `tracing` caches, per call site, whether anyone listens.
//! A test on another thread that connects first, with no subscriber, would have async-nats'
//! call sites cached as silent, and this test would then capture nothing.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_nats::NatsOptions;

const PASSWORD: &str = "pa55-w0rd-secret";
const TOKEN: &str = "t0ken-secret";

fn assert_no_secret(what: &str, text: &str) {
    for secret in [PASSWORD, TOKEN] {
        assert!(
            !text.contains(secret),
            "{what} must not show the secret {secret:?}: {text}"
        );
    }
}

/// A loopback port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    listener.local_addr().unwrap().port()
}

fn urls(port: u16) -> [String; 2] {
    [
        format!("nats://mirror:{PASSWORD}@127.0.0.1:{port}"),
        format!("nats://{TOKEN}@127.0.0.1:{port}"),
    ]
}

/// Collects everything logged, at every level, by any crate (async-nats included).
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

#[test]
fn logs_of_a_failed_connect_never_show_a_password() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let port = closed_port();
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let result = NatsOptions::new(urls(port))
                .connection_timeout(Duration::from_secs(2))
                .connect()
                .await;
            assert!(result.is_err(), "nothing listens on the port");
        });
    });
    let logged = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    assert!(
        logged.contains(&port.to_string()),
        "the connect attempts were logged (else this test proves nothing): {logged}"
    );
    assert_no_secret("the log", &logged);
}
