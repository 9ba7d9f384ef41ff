//! The clients that call the wire, behind the runtime's ports: [`remote`] for the source,
//! its feeds, wakes, outbox, cursors ([`queue`] and [`sweeps`] add the job queue and
//! retention to it), [`kv`] for the JetStream bucket read as the NATS adapter reads one,
//! [`listener`] for wakes that survive reconnects, and [`naive`] for the strategies the
//! oracle must catch.

pub mod kv;
pub mod listener;
pub mod naive;
pub mod queue;
pub mod remote;
pub mod sweeps;
