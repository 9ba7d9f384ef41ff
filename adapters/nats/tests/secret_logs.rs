//! Secrets in server URLs never reach logs (SPEC §15), async-nats' own included.
//!
//! In a test binary of its own: `tracing` caches, per call site, whether anyone listens.
//! A test on another thread that connects first, with no subscriber, would have async-nats'
//! call sites cached as silent, and this test would then capture nothing.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tidemark_nats::NatsOptions;

#[path = "common/secrets.rs"]
mod secrets;

use secrets::{Captured, assert_no_secret, closed_port, urls};

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
