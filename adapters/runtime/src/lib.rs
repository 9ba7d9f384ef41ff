//! tidemark: the async ports and the tokio drivers that run [`tidemark_core`] against them.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
pub mod ports;

pub use error::{Error, Result};
pub use ports::*;
pub use tidemark_core;
