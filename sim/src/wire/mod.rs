//! The wire: the small protocol between the source host and its clients, knowing nothing
//! of the world that uses it. async-nats cannot run on turmoil's network, so the simulated
//! source speaks this instead, behind the same ports.
//!
//! [`frame`] reads and writes one message a frame; [`source`] holds the source's requests
//! and answers, which carry the other services' calls ([`queue`], [`sweeps`],
//! [`jetstream`]) as variants; [`job`] writes a job inside any of them. Every name is
//! re-exported here.

pub mod frame;
pub mod jetstream;
pub mod job;
pub mod queue;
pub mod source;
pub mod sweeps;

pub use frame::{FrameReader, HEARTBEAT, PORT, READ_TIMEOUT, encode, read_untimed, write};
pub use jetstream::{JsAnswer, JsCall, JsDelivery, JsStart};
pub use queue::{QueueAnswer, QueueCall, WireLease};
pub use source::{
    Request, Response, WireClaimed, WireEntry, WireFeedInfo, WireLineage, WirePlan, WireReport,
    WireRow, WireUpdate,
};
pub use sweeps::{SweepAnswer, SweepCall, WireDue, WireLockLease};
