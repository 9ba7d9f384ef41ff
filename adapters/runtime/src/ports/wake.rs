//! Wake channels: a cheap "something changed" signal, never the data itself.

use std::future::Future;
use std::time::Duration;

use crate::error::Result;

/// What a listener received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Received {
    /// A wake, with its payload (an event's wire bytes, or empty).
    Wake(Vec<u8>),
    /// Nothing arrived within the timeout.
    TimedOut,
    /// The wake source closed: the listener will receive nothing more.
    Closed,
}

/// A subscription to one wake channel.
pub trait WakeListener: Send {
    /// The next wake, waiting as long as it takes; [`Received::Closed`] when the wake
    /// source closes. Never [`Received::TimedOut`].
    ///
    /// Must be cancel-safe: the follower task drops it whenever a feed item, a timer or
    /// stop comes first.
    fn recv(&mut self) -> impl Future<Output = Result<Received>> + Send;

    /// The next wake, or [`Received::TimedOut`] after `timeout` (tokio time, so paused
    /// time and simulators apply).
    fn recv_timeout(&mut self, timeout: Duration) -> impl Future<Output = Result<Received>> + Send {
        async move {
            match tokio::time::timeout(timeout, self.recv()).await {
                Ok(received) => received,
                Err(_) => Ok(Received::TimedOut),
            }
        }
    }
}

/// Notify and listen on named wake channels.
pub trait Wake: Send + Sync {
    /// A listener on one channel.
    type Listener: WakeListener + 'static;

    /// Wakes every current listener of `channel`. Wakes are not stored: a listener that
    /// subscribes later does not see them (readers catch up from the source, not from wakes).
    fn notify(&self, channel: &str, payload: Vec<u8>) -> impl Future<Output = Result<()>> + Send;

    /// Notifies `channel` once per payload, in order; one result per payload. The
    /// default notifies one at a time; a backend overrides it to pay once for the batch.
    fn notify_batch(
        &self,
        channel: &str,
        payloads: Vec<Vec<u8>>,
    ) -> impl Future<Output = Vec<Result<()>>> + Send {
        async move {
            let mut out = Vec::with_capacity(payloads.len());
            for payload in payloads {
                out.push(self.notify(channel, payload).await);
            }
            out
        }
    }

    /// Subscribes to `channel`.
    fn listen(&self, channel: &str) -> impl Future<Output = Result<Self::Listener>> + Send;
}
