//! Reconnect counters of the clients [`NatsOptions::connect`](crate::NatsOptions::connect)
//! made, so that every bucket and stream over one client reports that client's reconnects
//! to its followers ([`Source::reconnects`](tidemark::Source::reconnects)).
//!
//! async-nats reports reconnects only to an event callback given before the client
//! exists, so the counter is made with the callback and found again from the client by
//! the identity of its statistics, which every clone of a client shares.
//!
//! A server that stalls and goes on (paused and continued) keeps the connection, so no
//! reconnect is reported; [`probe`] is what a follower that backs off asks instead
//! ([`Source::probe`](tidemark::Source::probe)).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_nats::jetstream::context::AccountErrorKind;
use async_nats::{Client, ConnectOptions, Event, Statistics, jetstream};
use tidemark::{Error, Result};
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
    live_match(&counted, Arc::as_ptr(&stats)).cloned()
}

/// A probe of the JetStream API behind `context`: an account-info request, which changes
/// nothing on the server and costs it little. `Ok` when JetStream answered, even with an
/// error; a failure when it did not (no answer, no responders, a client that cannot send).
/// It takes no timeout of its own: the follower gives it up at its probe deadline.
pub(crate) fn probe(
    context: &jetstream::Context,
) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
    let context = context.clone();
    async move {
        match context.query_account().await {
            Ok(_) => Ok(()),
            Err(e) if answered(&e.kind()) => Ok(()),
            Err(e) => Err(Error::unavailable("source", e.to_string())),
        }
    }
}

/// Whether an account-info request that failed with `kind` was answered by JetStream: an
/// API error is an answer (the path works); no responders (JetStream not up yet after a
/// restart), a timeout or a client that could not send is none.
fn answered(kind: &AccountErrorKind) -> bool {
    matches!(kind, AccountErrorKind::JetStream(_))
}

/// The value of the entry whose referent is alive and is `target`.
///
/// An entry whose client is gone never matches, whatever its address: only a live
/// referent is compared. (A `Weak` keeps its allocation, so a new client cannot be given
/// a dropped one's address while its entry is held; this does not lean on that.)
fn live_match<T, V>(entries: &[(Weak<T>, V)], target: *const T) -> Option<&V> {
    entries
        .iter()
        .find(|(referent, _)| {
            referent
                .upgrade()
                .is_some_and(|live| std::ptr::eq(Arc::as_ptr(&live), target))
        })
        .map(|(_, value)| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stands for a client's statistics: any value behind an `Arc`.
    #[derive(Debug, Default)]
    struct Stats {
        _n: u64,
    }

    #[test]
    fn only_an_api_answer_counts_as_answered() {
        let api_error: async_nats::jetstream::Error = serde_json::from_str(
            r#"{"code":503,"err_code":10039,"description":"jetstream not enabled for account"}"#,
        )
        .expect("an API error");
        assert!(
            answered(&AccountErrorKind::JetStream(api_error)),
            "an API error is an answer: the path to the server works"
        );
        for none in [
            AccountErrorKind::TimedOut,
            AccountErrorKind::JetStreamUnavailable,
            AccountErrorKind::Other,
        ] {
            assert!(
                !answered(&none),
                "{none:?} is no answer: a follower must not take it for a path that is back"
            );
        }
    }

    #[test]
    fn a_live_client_finds_its_own_counter() {
        let (a, b) = (Arc::new(Stats { _n: 1 }), Arc::new(Stats { _n: 2 }));
        let entries = vec![(Arc::downgrade(&a), "a"), (Arc::downgrade(&b), "b")];
        assert_eq!(live_match(&entries, Arc::as_ptr(&b)), Some(&"b"));
        assert_eq!(live_match(&entries, Arc::as_ptr(&a)), Some(&"a"));
        let other = Arc::new(Stats { _n: 3 });
        assert_eq!(
            live_match(&entries, Arc::as_ptr(&other)),
            None,
            "a client nobody registered has no counter"
        );
    }

    #[test]
    fn a_dropped_clients_entry_never_matches_its_address() {
        let dead = Arc::new(Stats { _n: 1 });
        let address = Arc::as_ptr(&dead);
        let entries = vec![(Arc::downgrade(&dead), "dead")];
        drop(dead);
        // A client at the dropped one's address must not be handed the dead client's
        // counter: it would hear another connection's reconnects, or none of its own.
        assert_eq!(
            live_match(&entries, address),
            None,
            "the dead client's counter was found by address"
        );
    }
}
