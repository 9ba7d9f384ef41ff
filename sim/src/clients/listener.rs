//! A wake listener that survives its link: it reconnects after a failure and reports one
//! wake on every (re)connection, because wakes sent while it was away are lost and the
//! follower must catch up from the source. It never polls the source.

use std::time::Duration;

use tidemark::{Received, Result, Wake, WakeListener};

use crate::clients::remote::{Remote, RemoteListener};

/// How long to wait before reconnecting a failed listener.
const RECONNECT: Duration = Duration::from_millis(500);

/// A self-healing wake subscription.
#[derive(Debug)]
pub struct ReconnectingListener {
    remote: Remote,
    channel: String,
    inner: Option<RemoteListener>,
}

impl ReconnectingListener {
    /// Listens on `channel` of the source host behind `remote`.
    #[must_use]
    pub fn new(remote: Remote, channel: impl Into<String>) -> Self {
        ReconnectingListener {
            remote,
            channel: channel.into(),
            inner: None,
        }
    }
}

impl WakeListener for ReconnectingListener {
    async fn recv(&mut self) -> Result<Received> {
        loop {
            match &mut self.inner {
                None => match self.remote.listen(&self.channel).await {
                    Ok(listener) => {
                        self.inner = Some(listener);
                        return Ok(Received::Wake(Vec::new()));
                    }
                    Err(_) => tokio::time::sleep(RECONNECT).await,
                },
                Some(listener) => match listener.recv().await {
                    Ok(Received::Wake(payload)) => return Ok(Received::Wake(payload)),
                    Ok(Received::TimedOut) => {}
                    Ok(Received::Closed) | Err(_) => {
                        self.inner = None;
                        tokio::time::sleep(RECONNECT).await;
                    }
                },
            }
        }
    }
}
