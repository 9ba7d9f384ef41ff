//! tidemark: the async ports and the tokio drivers that run [`tidemark_core`] against them.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod announce;
mod cache;
mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
mod follower;
mod noop;
pub mod ports;
mod scheduler;
mod shutdown;
mod sink;
mod supervisor;
mod worker;

pub use announce::{AnnouncingRegistry, Written};
pub use cache::{Cache, CacheWriter, Change, cache};
pub use clock::Clock;
pub use error::{Error, Result};
pub use follower::{FollowerHandle, FollowerTask, Reconciled, spawn_cache, spawn_wake_cache};
pub use noop::{NoCursors, NoFeed, NoStream, NoWake};
pub use ports::*;
pub use scheduler::{Fired, fire_due, run_scheduler};
pub use shutdown::{Shutdown, StopSignal};
pub use sink::Sink;
pub use supervisor::{Supervisor, WorkerInfo, WorkerPhase};
pub use tidemark_core;
pub use worker::{ValueOf, Worker, WorkerSink};
