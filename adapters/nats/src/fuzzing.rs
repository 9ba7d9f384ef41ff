//! The body of the NATS adapter's fuzz target, as a library function: `fuzz/` calls it
//! from libFuzzer, and a plain test replays it over the checked-in corpus. It panics on a
//! violated invariant, which is what a fuzzer looks for.

use std::str::FromStr;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::HeaderName;

use crate::consumer::{ack_timestamp, parse_ack_subject};
use crate::kv::operation;

/// Arbitrary message metadata as a server might send it: the first line is a reply
/// (ack) subject, the others `name: value` headers. Reading it never panics: every header
/// set maps to an operation, and any timestamp gives a remaining life no longer than the
/// bucket's `max_age`.
pub fn message_metadata(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let reply = lines.next().unwrap_or_default();
    // Each part of an ack subject is read on its own: a timestamp that does not parse
    // leaves the value without an expiry, nothing else.
    let _ = parse_ack_subject(reply);
    let published = ack_timestamp(reply);
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        // Only names and values a server could send: the header map itself refuses
        // (panics on) others, and that is not this adapter's code.
        let value = value.trim();
        if value.contains(['\r', '\n']) {
            continue;
        }
        if let Ok(name) = HeaderName::from_str(name.trim()) {
            headers.insert(name, value);
        }
    }
    let _ = operation(Some(&headers)).cache_change();
    let _ = operation(None);
    let max_age = Duration::from_millis(u64::from(data.first().copied().unwrap_or(0)) * 100);
    // The server's time, as any value: the judgement is on its clock.
    let server_now = data
        .iter()
        .rev()
        .take(8)
        .fold(0u64, |n, b| n << 8 | u64::from(*b));
    if let Some(expiry) = tidemark_jetstream::Expiry::new(max_age)
        && let Some(left) = expiry.remaining(published.unwrap_or(u64::MAX), server_now)
    {
        assert!(left <= max_age, "a value never lives longer than max_age");
    }
}
