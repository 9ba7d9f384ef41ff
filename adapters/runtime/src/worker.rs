//! The user-facing worker: a typed handler of one source's changes.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use tidemark_core::{Decode, FollowerConfig};

use crate::error::{Error, Result};
use crate::sink::Sink;

/// The decoded value type of worker `W`.
pub type ValueOf<W> = <<W as Worker>::Decoder as Decode>::Value;

/// A user's worker: what to do with each change of one source. The runtime does the
/// lookup, initial sync, resume, decode, dispatch, backoff and shutdown.
///
/// Handlers should be idempotent: a restarted worker replays from its source's head.
/// A handler error ends the worker; its [`RestartPolicy`](tidemark_core::RestartPolicy)
/// decides what next.
///
/// Wrong wiring does not compile: `on_put` receives exactly the decoder's value type, so a
/// worker whose handler expects something else is refused by the compiler, not at run time.
///
/// ```compile_fail
/// use tidemark::{ValueOf, Worker};
/// use tidemark::tidemark_core::Utf8;
///
/// struct Counter;
///
/// impl Worker for Counter {
///     type Decoder = Utf8; // decodes to String
///     type Error = String;
///     fn name(&self) -> &str { "counter" }
///     fn source(&self) -> &str { "packages" }
///     fn decoder(&self) -> Utf8 { Utf8 }
///     // Expects a number where the decoder gives a String: a compile error.
///     async fn on_put(&mut self, _key: &str, _seq: u64, value: u64) -> Result<(), String> {
///         let _ = value;
///         Ok(())
///     }
///     async fn on_delete(&mut self, _key: &str, _seq: u64) -> Result<(), String> { Ok(()) }
/// }
/// ```
///
/// The same worker wired to its decoder's type compiles:
///
/// ```
/// use tidemark::{ValueOf, Worker};
/// use tidemark::tidemark_core::Utf8;
///
/// struct Counter(usize);
///
/// impl Worker for Counter {
///     type Decoder = Utf8;
///     type Error = String;
///     fn name(&self) -> &str { "counter" }
///     fn source(&self) -> &str { "packages" }
///     fn decoder(&self) -> Utf8 { Utf8 }
///     async fn on_put(&mut self, _key: &str, _seq: u64, value: ValueOf<Self>) -> Result<(), String> {
///         self.0 += value.len();
///         Ok(())
///     }
///     async fn on_delete(&mut self, _key: &str, _seq: u64) -> Result<(), String> { Ok(()) }
/// }
/// ```
pub trait Worker: Send + 'static {
    /// Decodes the source's bytes into the worker's value type; its error type is the
    /// user's. A decode failure is logged, counted and skipped: no handler runs.
    type Decoder: Decode<Value: Send> + Send + 'static;
    /// Why a handler failed.
    type Error: Display + Send;

    /// The worker's name (unique within a supervisor; shown to operators).
    fn name(&self) -> &str;

    /// What it does, for operators.
    fn description(&self) -> &str {
        ""
    }

    /// The bucket or stream it follows, for operators and logs.
    fn source(&self) -> &str;

    /// A fresh decoder (called on every start and restart).
    fn decoder(&self) -> Self::Decoder;

    /// The follower's configuration (default: named after the worker).
    fn config(&self) -> Result<FollowerConfig> {
        Ok(FollowerConfig::builder(self.name()).build()?)
    }

    /// `key` now holds `value`, written at `seq`.
    fn on_put(
        &mut self,
        key: &str,
        seq: u64,
        value: ValueOf<Self>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// `key` was removed at `seq`.
    fn on_delete(
        &mut self,
        key: &str,
        seq: u64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The worker is stopping: finish in-flight work (within the shutdown budget).
    fn drain(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Adapts a [`Worker`] to a follower's [`Sink`].
#[derive(Debug)]
pub struct WorkerSink<W>(pub W);

impl<W: Worker> Sink<ValueOf<W>> for WorkerSink<W> {
    async fn put(&mut self, key: Arc<str>, seq: u64, value: ValueOf<W>) -> Result<()> {
        self.0
            .on_put(&key, seq, value)
            .await
            .map_err(|e| Error::Worker {
                worker: self.0.name().to_owned(),
                reason: e.to_string(),
            })
    }

    async fn remove(&mut self, key: Arc<str>, seq: u64) -> Result<()> {
        self.0
            .on_delete(&key, seq)
            .await
            .map_err(|e| Error::Worker {
                worker: self.0.name().to_owned(),
                reason: e.to_string(),
            })
    }

    async fn drain(&mut self) {
        self.0.drain().await;
    }
}
