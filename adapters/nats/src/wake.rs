//! Wake channels over core NATS subjects: fire and forget, never stored.

use async_nats::{Client, Subscriber};
use futures::StreamExt as _;
use tidemark::{Received, Result, Wake, WakeListener};

use crate::error::{check_key, unavailable};

/// Wake channels as core NATS subjects `<prefix>.<channel>`: a notify reaches every
/// process listening at that moment, anywhere on the NATS system. Cheap to clone.
#[derive(Clone, Debug)]
pub struct NatsWake {
    client: Client,
    prefix: String,
}

impl NatsWake {
    /// Wake channels under subject `prefix`.
    ///
    /// # Errors
    /// [`tidemark::Error::InvalidKey`] if `prefix` is not a valid subject.
    pub fn new(client: Client, prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        check_key(&prefix)?;
        Ok(NatsWake { client, prefix })
    }

    fn subject(&self, channel: &str) -> Result<String> {
        check_key(channel)?;
        Ok(format!("{}.{channel}", self.prefix))
    }
}

/// A subscription to one wake channel.
#[derive(Debug)]
pub struct NatsWakeListener {
    subscriber: Subscriber,
}

impl WakeListener for NatsWakeListener {
    async fn recv(&mut self) -> Result<Received> {
        Ok(match self.subscriber.next().await {
            Some(message) => Received::Wake(message.payload.to_vec()),
            None => Received::Closed,
        })
    }
}

impl Wake for NatsWake {
    type Listener = NatsWakeListener;

    async fn notify(&self, channel: &str, payload: Vec<u8>) -> Result<()> {
        let subject = self.subject(channel)?;
        self.client
            .publish(subject, payload.into())
            .await
            .map_err(|e| unavailable("wake", e))?;
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("wake", e))
    }

    /// Publishes every payload, then flushes once.
    async fn notify_batch(&self, channel: &str, payloads: Vec<Vec<u8>>) -> Vec<Result<()>> {
        let n = payloads.len();
        let subject = match self.subject(channel) {
            Ok(subject) => subject,
            Err(e) => return e.for_each_of(n),
        };
        let mut out = Vec::with_capacity(n);
        for payload in payloads {
            out.push(
                self.client
                    .publish(subject.clone(), payload.into())
                    .await
                    .map_err(|e| unavailable("wake", e)),
            );
        }
        if let Err(e) = self.client.flush().await {
            let reason = e.to_string();
            for r in &mut out {
                if r.is_ok() {
                    *r = Err(unavailable("wake", reason.clone()));
                }
            }
        }
        out
    }

    async fn listen(&self, channel: &str) -> Result<NatsWakeListener> {
        let subject = self.subject(channel)?;
        let subscriber = self
            .client
            .subscribe(subject)
            .await
            .map_err(|e| unavailable("wake", e))?;
        // The subscription is registered with the server before a notify can race it.
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("wake", e))?;
        Ok(NatsWakeListener { subscriber })
    }
}
