//! The source host's JetStream on the wire: the calls a KV bucket's reader makes (stream
//! info, the last message present, a key's last message, a consumer and its deliveries)
//! and their answers.

use serde::{Deserialize, Serialize};
use tidemark_jetstream::{Limits, StreamState};

/// Where a consumer starts, on the wire.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum JsStart {
    /// The last message per key, then every later one.
    LastPerKey,
    /// Every message from this seq.
    Seq(u64),
}

/// A call on the source host's JetStream.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JsCall {
    /// The stream's state, as its info reports it.
    Info,
    /// The last message present now (a read that cannot race).
    LastPresent,
    /// A key's last message, and the stream's last seq read with it.
    Last {
        /// The key.
        key: String,
    },
    /// Makes a consumer; the connection then carries [`JsCall::Next`] calls, each
    /// answered with a [`JsAnswer::Batch`].
    Consume {
        /// Where it starts.
        start: JsStart,
        /// Deliver no values (a listing of keys needs only each message's key and
        /// operation): a put then comes with an empty value.
        headers_only: bool,
        /// The follower whose feed it is (`None`: a replay), for the oracle: what an
        /// overwrite removes before a feed delivers it is what the follower may never see.
        feed_of: Option<String>,
    },
    /// The consumer's next deliveries, at most `max`.
    Next {
        /// The most to deliver.
        max: u32,
    },
}

/// A message as a consumer delivers it, on the wire.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsDelivery {
    /// Its seq.
    pub seq: u64,
    /// Its key.
    pub key: String,
    /// The value put; `None` for a delete marker.
    pub value: Option<Vec<u8>>,
    /// The consumer's pending count after it, as the server reports it.
    pub pending: u64,
}

/// The source host's JetStream answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JsAnswer {
    /// The stream's state, and its one limit.
    State {
        /// Messages it holds.
        messages: u64,
        /// The seq of its first message (one past the last when empty).
        first_seq: u64,
        /// The last seq stored.
        last_seq: u64,
        /// Revisions kept per key (the bucket's history); it has no other limit.
        history: u64,
    },
    /// The last message present, if any.
    LastPresent(Option<u64>),
    /// A key's last message (its seq, and its value or `None` for a delete marker), and
    /// the stream's last seq.
    Last {
        /// The key's last message.
        message: Option<(u64, Option<Vec<u8>>)>,
        /// The stream's last seq.
        last_seq: u64,
    },
    /// The consumer exists; ask for its deliveries.
    Consuming,
    /// Deliveries; none is an idle heartbeat (nothing to send for a heartbeat interval).
    Batch(Vec<JsDelivery>),
}

impl JsAnswer {
    /// The stream state an [`JsAnswer::State`] reports, and its limits as stream info
    /// gives them to the decisions.
    #[must_use]
    pub fn state(&self) -> Option<(StreamState, Limits)> {
        match *self {
            JsAnswer::State {
                messages,
                first_seq,
                last_seq,
                history,
            } => Some((
                StreamState {
                    messages,
                    first_seq,
                    last_seq,
                },
                Limits {
                    per_subject: i64::try_from(history).unwrap_or(i64::MAX),
                    max_age_ns: 0,
                    max_messages: -1,
                    max_bytes: -1,
                    message_ttl: false,
                },
            )),
            _ => None,
        }
    }
}
