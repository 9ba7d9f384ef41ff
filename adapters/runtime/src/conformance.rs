//! The port conformance suite: async test bodies generic over the ports, so every adapter
//! proves the same semantics with the same code. An adapter's tests instantiate each body
//! with a fresh port:
//!
//! ```
//! # use tidemark_memory::MemorySource;
//! #[tokio::test(start_paused = true)]
//! async fn source_changes_cover_removals() {
//!     tidemark::conformance::source_changes_cover_removals(&MemorySource::default()).await;
//! }
//! # fn main() {}
//! ```
//!
//! Bodies panic (with a message saying why the behaviour matters) on a violation. Bodies
//! that wait use tokio time and short durations, so they run under paused time and stay
//! quick against a real clock. Enabled by the `conformance` feature.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;
mod feed;
mod history;
mod lease_end;
mod lock;
mod outbox;
mod prefix;
mod queue;
mod runner;
mod schedule;
mod source;

pub use feed::*;
pub use history::*;
pub use lease_end::*;
pub use lock::*;
pub use outbox::*;
pub use prefix::{prefix_follower_holds_exactly_its_keys, prefix_view_carries_only_its_keys};
pub use queue::*;
pub use runner::*;
pub use schedule::*;
pub use source::*;
