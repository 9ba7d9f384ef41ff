//! Stop signals: one trigger, many listeners.

use tokio::sync::watch;

/// Triggers a stop. Clones trigger the same stop.
#[derive(Clone, Debug)]
pub struct Shutdown {
    tx: watch::Sender<bool>,
}

/// Resolves once its [`Shutdown`] was triggered.
#[derive(Clone, Debug)]
pub struct StopSignal {
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::new()
    }
}

impl Shutdown {
    /// A trigger not yet pulled.
    #[must_use]
    pub fn new() -> Self {
        Shutdown {
            tx: watch::channel(false).0,
        }
    }

    /// A signal that resolves when this is triggered.
    #[must_use]
    pub fn signal(&self) -> StopSignal {
        StopSignal {
            rx: self.tx.subscribe(),
        }
    }

    /// Asks every signal's holder to stop.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    /// Whether it was triggered.
    #[must_use]
    pub fn is_triggered(&self) -> bool {
        *self.tx.borrow()
    }
}

impl StopSignal {
    /// A signal that never fires.
    #[must_use]
    pub fn never() -> Self {
        // A dropped, untriggered trigger never fires.
        let (_tx, rx) = watch::channel(false);
        StopSignal { rx }
    }

    /// Waits until a stop is asked (or the trigger was dropped untriggered: then never).
    pub async fn stopped(&mut self) {
        if self.rx.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether a stop was asked.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        *self.rx.borrow()
    }
}
