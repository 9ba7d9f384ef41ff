//! Reconnect counters of the clients [`NatsOptions::connect`](crate::NatsOptions::connect)
//! made, so that every bucket and stream over one client reports that client's reconnects
//! to its followers ([`Source::reconnects`](tidemark::Source::reconnects)).
//!
//! async-nats reports reconnects only to an event callback given before the client
//! exists, so the counter is made with the callback and found again from the client by
//! the identity of its statistics, which every clone of a client shares.
//!
//! A server that stalls and goes on (paused and continued) keeps the connection, and so
//! does a cluster whose stream lost its leader and elected another, so no reconnect is
//! reported; [`probe`] is what a follower that backs off asks instead
//! ([`Source::probe`](tidemark::Source::probe)).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::GetStreamErrorKind;
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

/// A probe of `stream` through the JetStream API behind `context`: a stream-info request
/// (`Context::get_stream`), which changes nothing on the server and costs it little. On a
/// cluster only the stream's leader answers it, so an answer means the stream is served,
/// not only that some server is up. `Ok` when the stream answered; a failure when it was
/// not answered, or answered that there is no such stream (a bucket deleted: the
/// follower's retries fail alike until it is made again, and the first probe that finds
/// it ends the backoff they grew) ([`answered`]). It takes no timeout of its own: the
/// follower gives it up at its probe deadline.
pub(crate) fn probe(
    context: &jetstream::Context,
    stream: String,
) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
    let context = context.clone();
    async move {
        match context.get_stream(&stream).await {
            Ok(_) => Ok(()),
            Err(e) if answered(&e.kind()) => Ok(()),
            Err(e) => Err(Error::unavailable(
                "source",
                format!("stream {stream}: {e}"),
            )),
        }
    }
}

/// Whether a stream-info request that failed with `kind` was answered by the stream: a
/// refusal is (the path to the stream works). "Stream not found" is not: the follower
/// cannot read it any more than when nobody answers. Nor is a timeout, no responders
/// (JetStream not up yet after a restart), a client that could not send, or a 503 (a
/// cluster with no leader to answer, JetStream not enabled): the stream is not served.
fn answered(kind: &GetStreamErrorKind) -> bool {
    match kind {
        GetStreamErrorKind::JetStream(e) => {
            e.error_code() != ErrorCode::STREAM_NOT_FOUND && e.code() != 503
        }
        _ => false,
    }
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

    fn api_error(json: &str) -> GetStreamErrorKind {
        GetStreamErrorKind::JetStream(serde_json::from_str(json).expect("an API error"))
    }

    #[test]
    fn a_refusal_is_an_answer_and_a_missing_stream_is_none() {
        assert!(
            answered(&api_error(
                r#"{"code":400,"err_code":10025,"description":"bad request"}"#
            )),
            "an API error other than a 503 is an answer: the path to the stream works"
        );
        assert!(
            !answered(&api_error(
                r#"{"code":404,"err_code":10059,"description":"stream not found"}"#
            )),
            "a deleted bucket: found missing, no stream a retry could read"
        );
    }

    #[test]
    fn no_reply_and_a_stream_not_served_are_no_answer() {
        for none in [
            api_error(
                r#"{"code":503,"err_code":10008,"description":"JetStream cluster not available"}"#,
            ),
            api_error(
                r#"{"code":503,"err_code":10039,"description":"jetstream not enabled for account"}"#,
            ),
            api_error(r#"{"code":503,"err_code":10118,"description":"stream is offline"}"#),
            GetStreamErrorKind::Request,
        ] {
            assert!(
                !answered(&none),
                "{none:?} is no answer: a follower must not take it for a stream that is back"
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
