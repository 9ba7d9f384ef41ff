//! Test harness for tidemark: real `nats-server` processes for integration tests.
//!
//! [`NatsServer`] runs one JetStream server on 127.0.0.1, on a port the server picks, with
//! its own temporary storage; [`NatsCluster`] runs a JetStream cluster of several such
//! nodes, whose routes can go through fault proxies ([`RouteLink`]). A server can be killed with SIGKILL and restarted on the same port with the same
//! storage, and every process the harness started is killed when its owner is dropped, so
//! a failing test leaves nothing running. [`FaultProxy`] sits between a client and a
//! server on 127.0.0.1 and adds latency, stalls a direction, resets connections or leaves
//! them half-open, on command.
//!
//! The binary is found by [`NatsServerBin::find`]: `$NATS_SERVER_BIN`, then the
//! project-local `.tools/nats/bin/nats-server` that `bash scripts/provision-nats.sh`
//! installs, then `PATH`. A missing server or one older than [`MIN_VERSION`] is an error
//! that says how to get a good one; tests must fail on it, never skip.
//!
//! [`fuzz_corpus`] hands the checked-in fuzz corpus to the tests that replay it, and
//! [`CountingAlloc`] counts the heap for the benches that measure memory; [`mod@bench`] has
//! what they print beside their figures (CPU seconds, the load) and their `perf` switch.

pub mod alloc;
pub mod bench;
mod corpus;
mod fault_proxy;
mod nats_bin;
mod nats_server;

pub use alloc::CountingAlloc;
pub use corpus::fuzz_corpus;
pub use fault_proxy::{Direction, FaultProxy};
pub use nats_bin::{MIN_VERSION, NatsServerBin, NatsVersion, PROVISION_HINT};
pub use nats_server::{
    HarnessError, NatsCluster, NatsServer, NatsServerOptions, RouteLink, wait_jetstream_ready,
};

/// The README's Rust examples, compiled (and, where they need no server, run) as doc tests
/// of this crate, which can reach every adapter, so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
