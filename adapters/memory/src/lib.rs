//! tidemark-memory: the in-process reference implementation of every tidemark port.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
