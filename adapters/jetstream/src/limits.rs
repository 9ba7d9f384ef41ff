//! The largest value a write to a bucket may carry, and when the adapter reads the
//! bucket's limit again.
//!
//! The bucket's `max_value_size` is its stream's `max_msg_size`, which an operator can
//! raise or lower at any time. A limit read once when the handle looked the bucket up
//! refuses values the bucket now takes, or lets through values the server then refuses
//! with a generic error. So the limit is read again when it is older than a refresh
//! interval, before a value above it is refused, and after the server refused a value
//! as too large.

use std::time::Duration;

/// Room kept in the server's `max_payload` for what a KV write adds to the value: the
/// subject and headers (an update's expected revision, a message id).
pub const HEADER_ROOM: usize = 1024;

/// The JetStream API error code for "message size exceeds maximum allowed": the stream's
/// `max_msg_size` (a bucket's `max_value_size`) refused a write.
pub const MESSAGE_EXCEEDS_MAXIMUM: u64 = 10054;

/// The largest value a write may carry: `follower_max` (what every follower takes), the
/// bucket's own limit `bucket_max` (its stream's `max_msg_size`; zero or negative: none),
/// and the server's `max_payload` less [`HEADER_ROOM`] (zero: unknown), whichever is
/// least.
#[must_use]
pub fn value_limit(bucket_max: i64, server_max_payload: usize, follower_max: usize) -> usize {
    let bucket = usize::try_from(bucket_max).ok().filter(|&m| m > 0);
    let server = (server_max_payload > 0).then(|| server_max_payload.saturating_sub(HEADER_ROOM));
    [bucket, server]
        .into_iter()
        .flatten()
        .fold(follower_max, usize::min)
}

/// Whether a write the server refused with the JetStream API error `error_code` was
/// refused for its size: the limit the handle holds is out of date.
#[must_use]
pub fn refused_for_size(error_code: u64) -> bool {
    error_code == MESSAGE_EXCEEDS_MAXIMUM
}

/// What to do with a value about to be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write it.
    Send,
    /// Refuse it: it is larger than `max`, read recently enough to refuse on.
    TooLarge {
        /// The limit.
        max: usize,
    },
    /// Read the limit from the server ([`ValueLimit::observe`]) and judge again.
    ReadFirst,
}

/// A bucket's value limit as a handle last read it, and when it must read it again.
///
/// Time is the caller's monotonic clock, as a duration since an origin it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValueLimit {
    refresh: Duration,
    confirm: Duration,
    /// The limit and when it was read; `None` before the first read or after a refusal
    /// by the server.
    read: Option<(usize, Duration)>,
}

impl ValueLimit {
    /// A limit not read yet, read again once it is `refresh` old, and before a value above
    /// it is refused unless it is at most `confirm` old (so an operator's raise shows
    /// within `confirm`, and a caller writing oversized values in a loop costs the server
    /// at most one read per `confirm`).
    #[must_use]
    pub fn new(refresh: Duration, confirm: Duration) -> ValueLimit {
        ValueLimit {
            refresh,
            confirm: confirm.min(refresh),
            read: None,
        }
    }

    /// The limit last read, if it stands.
    #[must_use]
    pub fn max(&self) -> Option<usize> {
        self.read.map(|(max, _)| max)
    }

    /// What to do with a value of `len` bytes at `now`.
    #[must_use]
    pub fn judge(&self, len: usize, now: Duration) -> Verdict {
        let Some((max, at)) = self.read else {
            return Verdict::ReadFirst;
        };
        let age = now.saturating_sub(at);
        if len <= max {
            if age < self.refresh {
                Verdict::Send
            } else {
                Verdict::ReadFirst
            }
        } else if age <= self.confirm {
            Verdict::TooLarge { max }
        } else {
            Verdict::ReadFirst
        }
    }

    /// The limit read from the server at `now` (see [`value_limit`]).
    pub fn observe(&mut self, max: usize, now: Duration) {
        self.read = Some((max, now));
    }

    /// The server refused a write for its size ([`refused_for_size`]): the limit held is
    /// out of date, and the next judgement reads it first.
    pub fn refused(&mut self) {
        self.read = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn the_least_of_follower_bucket_and_server_payload_wins() {
        assert_eq!(value_limit(-1, 0, 8 * MIB), 8 * MIB, "no limits known");
        assert_eq!(
            value_limit(0, 0, 8 * MIB),
            8 * MIB,
            "zero is no bucket limit"
        );
        assert_eq!(value_limit(4096, MIB, 8 * MIB), 4096, "the bucket's");
        assert_eq!(
            value_limit(-1, MIB, 8 * MIB),
            MIB - HEADER_ROOM,
            "the server's payload less the room for subject and headers"
        );
        assert_eq!(value_limit(i64::MAX, 64 * MIB, 8 * MIB), 8 * MIB);
    }

    #[test]
    fn only_a_size_refusal_reads_the_limit_again() {
        assert!(refused_for_size(10054));
        assert!(
            !refused_for_size(10071),
            "a wrong last sequence is not about size"
        );
    }

    #[test]
    fn the_limit_is_read_first_then_refreshed() {
        let s = Duration::from_secs;
        let mut limit = ValueLimit::new(s(30), s(1));
        assert_eq!(
            limit.judge(10, s(0)),
            Verdict::ReadFirst,
            "nothing read yet"
        );
        limit.observe(100, s(0));
        assert_eq!(limit.judge(100, s(29)), Verdict::Send);
        assert_eq!(
            limit.judge(100, s(30)),
            Verdict::ReadFirst,
            "an operator may have lowered it since"
        );
    }

    #[test]
    fn a_value_above_the_limit_is_refused_only_on_a_fresh_read() {
        let s = Duration::from_secs;
        let mut limit = ValueLimit::new(s(30), s(1));
        limit.observe(100, s(0));
        assert_eq!(limit.judge(101, s(1)), Verdict::TooLarge { max: 100 });
        assert_eq!(
            limit.judge(101, s(2)),
            Verdict::ReadFirst,
            "an operator may have raised it since"
        );
        limit.observe(200, s(2));
        assert_eq!(limit.judge(101, s(2)), Verdict::Send, "raised: taken");
    }

    #[test]
    fn a_refusal_by_the_server_reads_the_limit_again() {
        let s = Duration::from_secs;
        let mut limit = ValueLimit::new(s(30), s(1));
        limit.observe(100, s(0));
        assert_eq!(limit.judge(80, s(0)), Verdict::Send);
        limit.refused();
        assert_eq!(limit.judge(80, s(0)), Verdict::ReadFirst);
        limit.observe(64, s(0));
        assert_eq!(limit.judge(80, s(0)), Verdict::TooLarge { max: 64 });
    }
}
