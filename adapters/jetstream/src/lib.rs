//! tidemark-jetstream: every decision tidemark takes about what a NATS JetStream server
//! says, as deterministic pieces with no I/O, no async and no clock.
//!
//! The NATS adapter (`tidemark-nats`) reads facts off the wire — a delivered message's
//! stream and consumer sequences, its pending count and the server's timestamp; an idle
//! heartbeat; a flow-control request; stream info; a listing page — and hands them to the
//! pieces here, which say what they mean: deliver this, answer that, confirm with a read
//! that cannot race, the replay is done at watermark W, the consumer stalled (reopen), the
//! stream is a new history (reset), the value expires in D, the history a read says it
//! is of ([`StreamLineage`]). The adapter carries the decision out. This is quinn-proto's
//! split applied to an adapter: the pieces decide, the async code does.
//!
//! A replay's end, from the facts a consumer delivers:
//!
//! ```
//! use tidemark_jetstream::{Replay, Step};
//!
//! // A replay from seq 1 whose head, read once its consumer existed, is 5.
//! let mut replay = Replay::new(1, 5);
//! assert_eq!(replay.on_message(5, 0), Step::Confirm, "a pending count of 0 is no proof");
//! // The read of the last message present found 7: a key was overwritten meanwhile.
//! assert_eq!(replay.on_confirmed(7), Step::Read);
//! assert_eq!(replay.on_message(7, 0), Step::Confirm);
//! assert_eq!(replay.on_confirmed(7), Step::Done { through: 7 });
//! ```
//!
//! Time comes in as a value (nanoseconds), never read. The same facts give the same
//! decisions, so property tests and the simulator replay any run.
//!
//! With the `model` feature, the `model` module is a model of a JetStream stream and its consumers
//! that misbehaves as nats-server does (pending counts one low for a moment after an
//! overwrite removes an undelivered revision, idle heartbeats, flow control, purges,
//! `max_age`, a stream deleted and recreated, listings paged by offset, clocks that
//! disagree); the property tests drive every piece against it.
#![forbid(unsafe_code)]

mod lineage;
mod liveness;
mod replay;
mod stream;

pub use lineage::{Delivered, Highest, Remade, StreamLineage, history, snapshot_lineage, stamp};
pub use liveness::{
    CONSUMER_NOT_FOUND, ConsumerInfo, Failure, Heard, Heartbeat, Liveness, MAX_STALLS, Reply,
    STREAM_NOT_FOUND, Sent, Tick, connection,
};
pub use replay::{Confirmed, Gate, ReadyGate, Replay, Step};
pub use stream::{
    Created, Identity, LastPresent, LastRead, Limits, Reader, StreamState, first_available, head,
    last_read, per_key_only, read_unfiltered, whole_stream,
};

#[cfg(feature = "model")]
pub mod model;

mod cursor;
mod expiry;
mod limits;

pub use cursor::{Floor, Opening, Resume, Start};
pub use expiry::{Expiry, ServerClock, kept_for};
pub use limits::{
    HEADER_ROOM, MESSAGE_EXCEEDS_MAXIMUM, ValueLimit, Verdict, refused_for_size, value_limit,
};

pub mod coalesce;
pub mod job_delivery;
pub mod queue_scan;

pub use coalesce::{Coalesce, Found, KeyWrite, Named, coalesce};
pub use queue_scan::{ScanEnd, ScanStep};

mod lease;

pub use lease::{LockRecord, TAKE_ATTEMPTS, Take, holds, names, take};

mod tick_job;

pub use tick_job::{TickJob, TickRecord, tick_job, tick_of_message_id};
