//! The ports: small async traits an adapter implements (memory, SQLite, NATS, the
//! simulator) and the drivers are written against, once.
//!
//! Every method returns `impl Future + Send`, so a driver generic over a port can be
//! spawned on a multi-threaded runtime. Implementations are cheap handles (an `Arc`
//! inside) shared by reference.

mod cursor;
mod feed;
mod lock;
mod outbox;
mod publish;
mod queue;
mod schedule;
mod source;
mod sweep;
mod wake;

pub use cursor::Cursors;
pub use feed::{Feed, FeedItem, FeedStream, Opened, take_ready};
pub use lock::{Lock, LockLease};
pub use outbox::{Claimed, Outbox, OutboxRow, OutboxUpdate, OutboxWatch};
pub use publish::Publish;
pub use queue::{
    JobCounts, JobRecord, JobRetention, JobState, Leased, Queue, ReadySignal, TickKey,
};
pub use schedule::{DueSchedule, ScheduleStore};
pub use source::{Changes, PresentKeys, Snapshot, SnapshotParts, Source, ValueAt, Versioned};
pub use sweep::{Sweep, Swept};
pub use wake::{Received, Wake, WakeListener};
