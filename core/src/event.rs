//! Events: what a writer announces about a mutation, and their JSON wire form.

use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};

use crate::entry::{Entry, Op};

/// An announcement that the source changed.
///
/// On the wire it is a JSON object tagged by `"kind"`:
/// `{"kind":"put","seq":7,"key":"a","value":"aGk="}` (the value's bytes in standard
/// base64, so any bytes round-trip exactly), `{"kind":"removed","seq":8,"key":"a"}`,
/// `{"kind":"mutation","seq":9,"key":"a"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    /// `key` now holds `value`, as of `seq`.
    Put {
        /// The source's sequence number of this mutation.
        seq: u64,
        /// The entity key.
        key: String,
        /// The new value's bytes.
        #[serde(with = "base64_bytes")]
        value: Vec<u8>,
    },
    /// `key` was removed at `seq`.
    Removed {
        /// The source's sequence number of this mutation.
        seq: u64,
        /// The entity key.
        key: String,
    },
    /// A marker: `key` changed at `seq`; fetch its current value from the source.
    Mutation {
        /// The source's sequence number of this mutation.
        seq: u64,
        /// The entity key.
        key: String,
    },
}

/// Why a payload is not an event. A consumer counts it and skips it; it never stops.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotAnEvent {
    /// The bytes are not JSON, not an object with a known `"kind"`, or have wrong field types.
    #[error("not an event: {0}")]
    Malformed(String),
    /// The JSON is well formed but names a seq of zero.
    #[error("not an event: seq must be positive")]
    ZeroSeq,
    /// The JSON is well formed but names an empty key.
    #[error("not an event: empty key")]
    EmptyKey,
}

/// Why an event could not be turned into bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The event breaks a rule every reader enforces (a zero seq, an empty key): its bytes
    /// would be "not an event" to every consumer, so it is refused at the writer.
    #[error("event could not be serialised: {0}")]
    Invalid(NotAnEvent),
    /// The JSON serialiser failed.
    #[error("event could not be serialised: {0}")]
    Json(#[from] serde_json::Error),
}

impl Event {
    /// The event announcing a write committed at `seq`: a put of `value`, or a removal
    /// when there is none (what a source's outbox row carries).
    #[must_use]
    pub fn of_write(seq: u64, key: &str, value: Option<&[u8]>) -> Event {
        let key = key.to_owned();
        match value {
            Some(v) => Event::Put {
                seq,
                key,
                value: v.to_vec(),
            },
            None => Event::Removed { seq, key },
        }
    }

    /// The entity key this event is about.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            Event::Put { key, .. } | Event::Removed { key, .. } | Event::Mutation { key, .. } => {
                key
            }
        }
    }

    /// The source's sequence number of the mutation.
    #[must_use]
    pub fn seq(&self) -> u64 {
        match self {
            Event::Put { seq, .. } | Event::Removed { seq, .. } | Event::Mutation { seq, .. } => {
                *seq
            }
        }
    }

    /// Decodes a wire payload. Anything that is not a valid event is [`NotAnEvent`]: a value
    /// to count and skip, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Event, NotAnEvent> {
        let event: Event =
            serde_json::from_slice(bytes).map_err(|e| NotAnEvent::Malformed(e.to_string()))?;
        if event.seq() == 0 {
            return Err(NotAnEvent::ZeroSeq);
        }
        if event.key().is_empty() {
            return Err(NotAnEvent::EmptyKey);
        }
        Ok(event)
    }

    /// The JSON wire form. An event that [`decode`](Self::decode) would refuse (a zero
    /// seq, an empty key) is refused here too, with [`EncodeError::Invalid`]: what a
    /// writer announces, every reader can read.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        if self.seq() == 0 {
            return Err(EncodeError::Invalid(NotAnEvent::ZeroSeq));
        }
        if self.key().is_empty() {
            return Err(EncodeError::Invalid(NotAnEvent::EmptyKey));
        }
        Ok(serde_json::to_vec(self)?)
    }

    /// The feed entry this event stands for, observed at feed `position`.
    #[must_use]
    pub fn into_entry(self, position: u64) -> Entry {
        match self {
            Event::Put { seq, key, value } => Entry::new(position, seq, key, Op::Put, value),
            Event::Removed { seq, key } => Entry::new(position, seq, key, Op::Delete, Vec::new()),
            Event::Mutation { seq, key } => {
                Entry::new(position, seq, key, Op::Mutation, Vec::new())
            }
        }
    }
}

mod base64_bytes {
    use super::BASE64;
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&BASE64.encode(bytes))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        BASE64
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(seq: u64, key: &str, value: &[u8]) -> Event {
        Event::Put {
            seq,
            key: key.into(),
            value: value.to_vec(),
        }
    }

    #[test]
    fn a_write_is_announced_as_a_put_or_a_removal() {
        assert_eq!(Event::of_write(3, "k", Some(b"v")), put(3, "k", b"v"));
        assert_eq!(
            Event::of_write(4, "k", None),
            Event::Removed {
                seq: 4,
                key: "k".into()
            }
        );
    }

    #[test]
    fn every_kind_answers_key_and_seq() {
        let events = [
            put(1, "a", b"x"),
            Event::Removed {
                seq: 2,
                key: "b".into(),
            },
            Event::Mutation {
                seq: 3,
                key: "c".into(),
            },
        ];
        let got: Vec<_> = events
            .iter()
            .map(|e| (e.key().to_owned(), e.seq()))
            .collect();
        assert_eq!(got, [("a".into(), 1), ("b".into(), 2), ("c".into(), 3)]);
    }

    #[test]
    fn wire_form_is_tagged_by_kind_in_snake_case() {
        let json: serde_json::Value =
            serde_json::from_slice(&put(7, "a", b"hi").encode().unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"kind": "put", "seq": 7, "key": "a", "value": "aGk="})
        );
        let removed = Event::Removed {
            seq: 8,
            key: "a".into(),
        }
        .encode()
        .unwrap();
        assert_eq!(removed, br#"{"kind":"removed","seq":8,"key":"a"}"#);
        let marker = Event::Mutation {
            seq: 9,
            key: "a".into(),
        }
        .encode()
        .unwrap();
        assert_eq!(marker, br#"{"kind":"mutation","seq":9,"key":"a"}"#);
    }

    #[test]
    fn every_kind_round_trips_exactly_including_binary_values() {
        let all_bytes: Vec<u8> = (0..=255).collect();
        for event in [
            put(1, "k", &all_bytes),
            put(2, "ключ/ü", b""),
            Event::Removed {
                seq: u64::MAX,
                key: "k".into(),
            },
            Event::Mutation {
                seq: 3,
                key: "k".into(),
            },
        ] {
            let bytes = event.encode().unwrap();
            assert_eq!(
                Event::decode(&bytes),
                Ok(event),
                "wire form must round-trip"
            );
        }
    }

    #[test]
    fn foreign_and_broken_payloads_are_not_events() {
        let cases: &[&[u8]] = &[
            b"",
            b"\"a string\"",
            b"42",
            b"null",
            b"[]",
            br#"{"kind":"put","seq":1,"key":"a","value":"aGk="#, // truncated
            br#"{"type":"put","seq":1,"key":"a"}"#,              // a foreign producer
            br#"{"kind":"upsert","seq":1,"key":"a"}"#,           // unknown kind
            br#"{"kind":"put","seq":"1","key":"a","value":""}"#, // wrong type
            br#"{"kind":"put","seq":-1,"key":"a","value":""}"#,  // negative seq
            br#"{"kind":"put","seq":1.5,"key":"a","value":""}"#,
            br#"{"kind":"put","seq":1,"key":7,"value":""}"#,
            br#"{"kind":"put","seq":1,"key":"a","value":"not base64!"}"#,
            br#"{"kind":"removed","key":"a"}"#, // missing seq
            &[0xff, 0xfe, 0x00],
        ];
        for bytes in cases {
            assert!(
                matches!(Event::decode(bytes), Err(NotAnEvent::Malformed(_))),
                "{:?} must be 'not an event'",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn zero_seq_and_empty_key_are_not_events() {
        assert_eq!(
            Event::decode(br#"{"kind":"removed","seq":0,"key":"a"}"#),
            Err(NotAnEvent::ZeroSeq)
        );
        assert_eq!(
            Event::decode(br#"{"kind":"removed","seq":1,"key":""}"#),
            Err(NotAnEvent::EmptyKey)
        );
    }

    #[test]
    fn unknown_extra_fields_are_tolerated_for_forward_compatibility() {
        let e = Event::decode(br#"{"kind":"removed","seq":4,"key":"a","origin":"w2"}"#);
        assert_eq!(
            e,
            Ok(Event::Removed {
                seq: 4,
                key: "a".into()
            })
        );
    }

    #[test]
    fn events_map_to_entries_with_their_operation() {
        let e = put(5, "a", b"v").into_entry(11);
        assert_eq!(
            (e.position, e.seq, e.op.clone(), e.value.clone()),
            (11, 5, Op::Put, b"v".to_vec())
        );
        assert_eq!(
            Event::Removed {
                seq: 6,
                key: "a".into()
            }
            .into_entry(12)
            .op,
            Op::Delete
        );
        assert_eq!(
            Event::Mutation {
                seq: 7,
                key: "a".into()
            }
            .into_entry(13)
            .op,
            Op::Mutation
        );
    }
}
