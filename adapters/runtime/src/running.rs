//! A spawned driver task and its stop trigger: what the follower's and the relay's handles
//! wrap, so stopping and joining mean the same everywhere.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::shutdown::{Shutdown, StopSignal};

/// A task spawned with its own [`Shutdown`], named for its errors (`"follower mirror"`).
#[derive(Debug)]
pub(crate) struct Running<T> {
    kind: &'static str,
    name: String,
    shutdown: Shutdown,
    task: JoinHandle<Result<T>>,
}

impl<T: Send + 'static> Running<T> {
    /// Spawns `run(stop)` inside `span` on the current tokio runtime.
    pub(crate) fn spawn<F>(
        kind: &'static str,
        name: String,
        span: tracing::Span,
        run: impl FnOnce(StopSignal) -> F,
    ) -> Self
    where
        F: Future<Output = Result<T>> + Send + 'static,
    {
        let shutdown = Shutdown::new();
        let task = tokio::spawn(run(shutdown.signal()).instrument(span));
        Running {
            kind,
            name,
            shutdown,
            task,
        }
    }
}

impl<T> Running<T> {
    /// The task's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn stop(&self) {
        self.shutdown.trigger();
    }

    pub(crate) fn shutdown(&self) -> Shutdown {
        self.shutdown.clone()
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Ends the task now, as a crash would.
    pub(crate) fn abort(self) {
        self.task.abort();
    }

    /// Waits for the task to end: its result, or [`Error::Worker`] if it panicked.
    pub(crate) async fn join(self) -> Result<T> {
        match self.task.await {
            Ok(result) => result,
            Err(e) => Err(Error::Worker {
                worker: self.name,
                reason: e.to_string(),
            }),
        }
    }

    /// Stops the task and waits at most `budget` for it; aborts it after that
    /// ([`Error::Timeout`]).
    pub(crate) async fn stop_within(mut self, budget: Duration) -> Result<T> {
        self.stop();
        match tokio::time::timeout(budget, &mut self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(Error::Worker {
                worker: self.name,
                reason: e.to_string(),
            }),
            Err(_) => {
                self.task.abort();
                Err(Error::Timeout {
                    what: format!("{} {}", self.kind, self.name),
                    budget,
                })
            }
        }
    }
}
