//! Test harness for tidemark: real `nats-server` processes for integration tests.
//!
//! [`NatsServer`] runs one JetStream server on a free loopback port with its own temporary
//! storage; [`NatsCluster`] runs a JetStream cluster of several such nodes. Both can kill a
//! server with SIGKILL and restart it on the same port with the same storage, and both stop
//! every process they started when dropped, so a failing test leaves nothing running.
//!
//! The binary is found by [`NatsServerBin::find`]: `$NATS_SERVER_BIN`, then the
//! project-local `.tools/nats/bin/nats-server` that `bash scripts/provision-nats.sh`
//! installs, then `PATH`. A missing server or one older than [`MIN_VERSION`] is an error
//! that says how to get a good one; tests must fail on it, never skip.

mod nats_server;

pub use nats_server::{
    HarnessError, MIN_VERSION, NatsCluster, NatsServer, NatsServerBin, NatsServerOptions,
    NatsVersion, PROVISION_HINT, wait_jetstream_ready,
};

/// The README's Rust examples, compiled (and, where they need no server, run) as doc tests
/// of this crate, which can reach every adapter, so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
