//! The server's time, read from the server, for the decisions judged on its clock (SPEC
//! §17: a value's expiry is the server's timestamps against the server's time).
//!
//! nats-server stamps every stream info answer with its own time when it gathered the info
//! (`"ts"`, since 2.10: `StreamInfo.TimeStamp`, set to `time.Now().UTC()`). async-nats
//! 0.51's `stream::Info` does not keep it, so the request is made here and both read from
//! one answer: the info a feed reads when it opens carries the clock at no extra cost.
//! What comes back is plain values: the info, and a [`ServerClock`] whose local readings
//! are durations since an `Instant` the caller keeps.

use std::time::Duration;

use async_nats::jetstream::{self, response::Response, stream};
use tidemark::Result;
use tidemark_jetstream::ServerClock;
use tokio::time::Instant;

use crate::error::unavailable;

/// A stream's info, and the server's clock as it stood when it answered.
#[derive(Debug)]
pub(crate) struct StampedInfo {
    /// The info, as `Stream::get_info` gives it.
    pub info: stream::Info,
    /// The server's clock, its local readings durations since the caller's origin; `None`
    /// from a server that does not stamp its answers (before 2.10).
    pub clock: Option<ServerClock>,
}

/// Reads the info of the stream `stream` through `context`, and the server's time from
/// the same answer. Local readings (the clock's anchor) are measured from `origin`, which
/// the caller keeps for as long as it uses the clock: pass `origin.elapsed()` as the
/// `local` of [`ServerClock::server_now`] and
/// [`Expiry::remaining_at`](tidemark_jetstream::Expiry::remaining_at).
///
/// # Errors
/// [`tidemark::Error::Unavailable`] if the request fails, the server answers with an
/// error (no such stream), or the answer is not a stream's info.
pub(crate) async fn stream_info(
    context: &jetstream::Context,
    stream: &str,
    origin: Instant,
    port: &'static str,
) -> Result<StampedInfo> {
    let asked = origin.elapsed();
    let response: Response<serde_json::Value> = context
        .request(format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await
        .map_err(|e| unavailable(port, format!("stream {stream}: {e}")))?;
    let answered = origin.elapsed();
    match response {
        Response::Ok(body) => stamped(body, asked, answered)
            .map_err(|e| unavailable(port, format!("stream {stream}: {e}"))),
        Response::Err { error } => Err(unavailable(port, format!("stream {stream}: {error}"))),
    }
}

/// The info and the server's clock from a stream info answer's `body`, asked at local
/// reading `asked` and answered at `answered`.
fn stamped(
    mut body: serde_json::Value,
    asked: Duration,
    answered: Duration,
) -> serde_json::Result<StampedInfo> {
    let server_ns = body
        .get_mut("ts")
        .map(serde_json::Value::take)
        .as_ref()
        .and_then(serde_json::Value::as_str)
        .and_then(unix_nanos);
    Ok(StampedInfo {
        info: serde_json::from_value(body)?,
        clock: server_ns.map(|ns| ServerClock::from_reading(ns, asked, answered)),
    })
}

/// An RFC 3339 time as nanoseconds since the Unix epoch; `None` if it does not parse or
/// is not after the epoch (Go's zero time: no reading).
fn unix_nanos(time: &str) -> Option<u64> {
    let time = async_nats::datetime::parse_rfc3339(time).ok()?;
    u64::try_from(time.unix_timestamp_nanos())
        .ok()
        .filter(|&ns| ns > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream info answer as nats-server 2.15 gives it, `ts` included or left out.
    fn body(ts: Option<&str>) -> serde_json::Value {
        let mut body = serde_json::json!({
            "type": "io.nats.jetstream.api.v1.stream_info_response",
            "config": {
                "name": "S", "subjects": ["s.>"], "retention": "limits",
                "max_consumers": -1, "max_msgs": -1, "max_bytes": -1, "max_age": 0,
                "max_msgs_per_subject": -1, "max_msg_size": -1, "discard": "old",
                "storage": "file", "num_replicas": 1, "duplicate_window": 120_000_000_000u64,
                "compression": "none", "allow_direct": false, "mirror_direct": false,
                "sealed": false, "deny_delete": false, "deny_purge": false,
                "allow_rollup_hdrs": false, "consumer_limits": {}
            },
            "created": "2026-01-02T03:04:05.123456789Z",
            "state": {
                "messages": 0, "bytes": 0, "first_seq": 0,
                "first_ts": "0001-01-01T00:00:00Z", "last_seq": 0,
                "last_ts": "0001-01-01T00:00:00Z", "consumer_count": 0
            }
        });
        if let Some(ts) = ts {
            body["ts"] = ts.into();
        }
        body
    }

    #[test]
    fn the_answers_timestamp_is_the_servers_clock() {
        let stamped = stamped(
            body(Some("2026-01-02T03:04:06.5Z")),
            Duration::from_millis(10),
            Duration::from_millis(30),
        )
        .unwrap();
        assert_eq!(stamped.info.config.name, "S");
        let clock = stamped.clock.expect("the server's time is read from ts");
        assert_eq!(
            clock.server_now(Duration::from_millis(30)),
            1_767_323_046_500_000_000,
            "the answer's ts, pinned to when the answer arrived"
        );
        assert_eq!(clock.uncertainty(), Duration::from_millis(20));
    }

    #[test]
    fn a_server_that_does_not_stamp_gives_no_clock() {
        let stamped = stamped(body(None), Duration::ZERO, Duration::ZERO).unwrap();
        assert_eq!(stamped.info.config.name, "S");
        assert!(
            stamped.clock.is_none(),
            "no ts: the server's time is unknown"
        );
        let zero = stamped_with("0001-01-01T00:00:00Z");
        assert!(zero.clock.is_none(), "Go's zero time is no reading");
    }

    fn stamped_with(ts: &str) -> StampedInfo {
        stamped(body(Some(ts)), Duration::ZERO, Duration::ZERO).unwrap()
    }

    /// On the server the tests run (≥ 2.10), a stream info answer carries the server's
    /// time; on one machine its clock and ours agree to well under a second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_real_server_stamps_its_stream_info() {
        let server = tidemark_tests::NatsServer::start()
            .await
            .expect("a real nats-server is required for this test");
        let client = server.connect().await.expect("connect");
        tidemark_tests::wait_jetstream_ready(&client)
            .await
            .expect("jetstream ready");
        let context = jetstream::new(client);
        context
            .create_stream(stream::Config {
                name: "CLOCK".into(),
                subjects: vec!["clock.>".into()],
                ..Default::default()
            })
            .await
            .expect("stream");
        let origin = Instant::now();
        let stamped = stream_info(&context, "CLOCK", origin, "test")
            .await
            .unwrap();
        assert_eq!(stamped.info.config.name, "CLOCK");
        let clock = stamped
            .clock
            .expect("nats-server >= 2.10 puts its time (ts) in a stream info answer");
        let server_now = clock.server_now(origin.elapsed());
        let ours = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let ours = u64::try_from(ours.as_nanos()).unwrap();
        assert!(
            server_now.abs_diff(ours) < 1_000_000_000,
            "the server's time read {server_now} ns, this machine's {ours} ns"
        );
        let missing = stream_info(&context, "NONE", origin, "test").await;
        assert!(
            matches!(missing, Err(tidemark::Error::Unavailable { .. })),
            "no such stream: {missing:?}"
        );
    }
}
