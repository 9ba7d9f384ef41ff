//! In-process wake channels.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tidemark::{Error, Received, Result, Wake, WakeListener};
use tokio::sync::broadcast;

use crate::faults::{Faults, Port};

/// Wakes a listener can fall behind by before they collapse into one (a wake only says
/// "catch up", so collapsing loses nothing).
const CAPACITY: usize = 64;

#[derive(Debug, Default)]
struct State {
    channels: BTreeMap<String, broadcast::Sender<Vec<u8>>>,
    closed: bool,
}

/// In-process wake channels. [`close`](Self::close) ends every listener cleanly.
#[derive(Clone, Debug, Default)]
pub struct MemoryWake {
    state: Arc<Mutex<State>>,
    faults: Faults,
}

impl MemoryWake {
    /// Open channels whose calls consult `faults`.
    #[must_use]
    pub fn new(faults: Faults) -> Self {
        MemoryWake {
            state: Arc::default(),
            faults,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the wake source: every listener receives [`Received::Closed`]; later calls
    /// fail with [`Error::Closed`].
    pub fn close(&self) {
        let mut s = self.state();
        s.closed = true;
        s.channels.clear();
    }

    /// How many listeners `channel` has.
    #[must_use]
    pub fn listeners(&self, channel: &str) -> usize {
        self.state()
            .channels
            .get(channel)
            .map_or(0, broadcast::Sender::receiver_count)
    }
}

/// A subscription to one in-process wake channel.
#[derive(Debug)]
pub struct MemoryListener {
    rx: broadcast::Receiver<Vec<u8>>,
}

impl WakeListener for MemoryListener {
    async fn recv(&mut self) -> Result<Received> {
        match self.rx.recv().await {
            Ok(payload) => Ok(Received::Wake(payload)),
            // Missed wakes collapse into one: the reader catches up from the source anyway.
            Err(broadcast::error::RecvError::Lagged(_)) => Ok(Received::Wake(Vec::new())),
            Err(broadcast::error::RecvError::Closed) => Ok(Received::Closed),
        }
    }
}

impl Wake for MemoryWake {
    type Listener = MemoryListener;

    async fn notify(&self, channel: &str, payload: Vec<u8>) -> Result<()> {
        self.faults.check(Port::Notify)?;
        let s = self.state();
        if s.closed {
            return Err(Error::Closed("wake"));
        }
        if let Some(tx) = s.channels.get(channel) {
            // No listener is not an error: nobody needed waking.
            let _ = tx.send(payload);
        }
        Ok(())
    }

    async fn listen(&self, channel: &str) -> Result<MemoryListener> {
        self.faults.check(Port::Listen)?;
        let mut s = self.state();
        if s.closed {
            return Err(Error::Closed("wake"));
        }
        let tx = s
            .channels
            .entry(channel.to_owned())
            .or_insert_with(|| broadcast::channel(CAPACITY).0);
        Ok(MemoryListener { rx: tx.subscribe() })
    }
}
