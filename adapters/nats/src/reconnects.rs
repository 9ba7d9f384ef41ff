//! Reconnect counters of the clients [`NatsOptions::connect`](crate::NatsOptions::connect)
//! made, so that every bucket and stream over one client reports that client's reconnects
//! to its followers ([`Source::reconnects`](tidemark::Source::reconnects)).
//!
//! async-nats reports reconnects only to an event callback given before the client
//! exists, so the counter is made with the callback and found again from the client by
//! the identity of its statistics, which every clone of a client shares.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_nats::{Client, ConnectOptions, Event, Statistics};
use tokio::sync::watch;

/// The clients whose reconnects are counted. Entries of dropped clients are pruned on
/// each registration.
static COUNTED: Mutex<Vec<(Weak<Statistics>, watch::Receiver<u64>)>> = Mutex::new(Vec::new());

/// `options` with an event callback that counts reconnects (every connect after the
/// first), and the counter.
pub(crate) fn counting(options: ConnectOptions) -> (ConnectOptions, watch::Receiver<u64>) {
    let (tx, rx) = watch::channel(0u64);
    let first = AtomicBool::new(true);
    let options = options.event_callback(move |event| {
        if matches!(event, Event::Connected) && !first.swap(false, Ordering::Relaxed) {
            tx.send_modify(|n| *n += 1);
        }
        std::future::ready(())
    });
    (options, rx)
}

/// Remembers that `client`'s reconnects are counted by `counter`.
pub(crate) fn register(client: &Client, counter: watch::Receiver<u64>) {
    let mut counted = COUNTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    counted.retain(|(stats, _)| stats.strong_count() > 0);
    counted.push((Arc::downgrade(&client.statistics()), counter));
}

/// The reconnect counter of `client`, if [`NatsOptions::connect`](crate::NatsOptions::connect)
/// made it.
pub(crate) fn of(client: &Client) -> Option<watch::Receiver<u64>> {
    let stats = client.statistics();
    let counted = COUNTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    counted
        .iter()
        .find(|(s, _)| std::ptr::eq(s.as_ptr(), Arc::as_ptr(&stats)))
        .map(|(_, counter)| counter.clone())
}
