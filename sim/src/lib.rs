//! tidemark-sim: a turmoil simulation of writers, a source host and followers running the
//! real runtime drivers, with faults drawn from a seed and a convergence oracle.
//!
//! It reads in layers, each importing only those below it:
//! - [`scenario`] (what a run simulates, its settings, and the fault plan drawn from the
//!   seed) and [`trace`] at the bottom, read by every other layer;
//! - [`wire`]: frames and every message type, knowing nothing of the world;
//! - [`checks`]: the oracle and the ledgers, reading only what is recorded into them;
//! - [`clients`] that call the wire behind the runtime's ports, and [`hosts`] that serve
//!   it (and tell the checks what they serve);
//! - [`world`] on top: one run in phases (build, fault phase, heal, liveness, verdict),
//!   the hosts' programs and the faults; the campaign CLI (`main.rs`) last.
//!
//! A fault is injected in [`world`] (its `faults` file) and its effect checked in
//! [`checks`].
//!
//! Persisted followers run the real persisted-sink path: a `MemoryCacheStore` that
//! outlives their host, written by its sink at every batch boundary and read back by
//! `Sink::resume` after a crash; the probe wraps that sink and only watches.
//!
//! Two relay hosts drain the source host's outbox with the runtime's `Relay`; a ledger
//! on the source host checks that no row is published by two relays holding it at once
//! and that none is lost.
//!
//! The worker hosts also run the runtime's job runner and retention over the wire (see
//! [`world::jobs`] and [`world::retention`]): sweeps on their schedule under the sweeper lock, checked by a
//! ledger that no two owners hold the lock at once and that no sweep removes what the
//! retention policy or job retention keeps.
//!
//! A run has two phases. In the safety phase the fault plan drawn from the seed is carried
//! out (partitions, holds, latency, link failures, crashes of followers, the source and
//! writers between commit and announce, lost, duplicated and reordered announcements,
//! poison values, compaction, crashes in the middle of a persisted commit, slow and
//! failing durable writes, relay crashes, foreign and adversarial events, reconnect
//! storms, restores of the source from an older backup) and after every simulation step
//! each follower's probe checks: watermark monotone (it may go back once per restore, as
//! the follower takes the restored history), never-older per key, no seq applied twice,
//! and at ready, at every committed watermark and at every warm restart that the committed
//! cache holds exactly the source's state at that watermark (in the restored history, or
//! in the one it replaced until the follower reads the restored source). In the liveness
//! phase everything heals, writers go quiet, and every follower's cache and watermark must
//! equal the source's within a bound. The same seed gives the same trace hash.
#![forbid(unsafe_code)]

pub mod checks;
pub mod clients;
pub mod hosts;
pub mod scenario;
pub mod trace;
pub mod wire;
pub mod world;
