//! Secrets the secrets tests plant, and how they look for them. Included by path (not
//! through `common`), so a log-capturing test binary holds nothing else.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

pub const PASSWORD: &str = "pa55-w0rd-secret";
pub const TOKEN: &str = "t0ken-secret";
/// A password holding what a URL parser takes for the end of the authority or userinfo.
pub const AWKWARD_PASSWORD: &str = "aw#k/w?a@r:d%-secret";

pub fn assert_no_secret(what: &str, text: &str) {
    for secret in [PASSWORD, TOKEN, AWKWARD_PASSWORD, "aw#k"] {
        assert!(
            !text.contains(secret),
            "{what} must not show the secret {secret:?}: {text}"
        );
    }
}

/// A loopback port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// Server URLs carrying a password, a token, and a password with URL delimiters in it.
pub fn urls(port: u16) -> [String; 3] {
    [
        format!("nats://mirror:{PASSWORD}@127.0.0.1:{port}"),
        format!("nats://{TOKEN}@127.0.0.1:{port}"),
        format!("nats://mirror:{AWKWARD_PASSWORD}@127.0.0.1:{port}"),
    ]
}

/// Collects everything logged, at every level, by any crate (async-nats included).
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
