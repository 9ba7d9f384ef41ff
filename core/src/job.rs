//! Jobs and their JSON form: the built-in maintenance jobs and the user's own kinds.

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// A job, JSON tagged by `"kind"`: the built-in `{"kind":"pack_housekeeping","key":"a"}` and
/// `{"kind":"sweep"}`, or any other kind a user defines ([`Job::custom`]).
///
/// Decoding is total over tagged objects: a kind tidemark does not know becomes
/// [`Job::Custom`] and is kept as it was written, so a queue can hold, list and hand out
/// jobs of kinds only the user's runner knows (and dead-letter them if no handler does).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Job {
    /// Housekeeping for one key after it changed.
    PackHousekeeping {
        /// The key that changed.
        key: String,
    },
    /// A periodic sweep over everything.
    Sweep,
    /// A kind the user defines, kept as its JSON object.
    Custom(CustomJob),
}

/// The built-in kinds, in the form they have always had on disk and on streams.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum BuiltIn {
    PackHousekeeping { key: String },
    Sweep,
}

/// The kinds tidemark itself defines; a user's job may not take one of them.
pub const BUILT_IN_KINDS: [&str; 2] = ["pack_housekeeping", "sweep"];

/// The kind a queue gives bytes that are no job at all (not JSON, or not tagged), so they
/// can be kept and listed as a dead letter: `{"kind":"tidemark_undecodable","text":"..."}`
/// with the bytes as (lossy) text. No user job may take it.
pub const UNDECODABLE_KIND: &str = "tidemark_undecodable";

/// A user-defined job: a JSON object whose `"kind"` is not a built-in one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CustomJob {
    kind: String,
    // The whole object, `"kind"` included, in serde_json's canonical (sorted-key) form.
    json: String,
}

impl CustomJob {
    /// Its kind.
    #[must_use]
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The whole JSON object, `"kind"` included.
    #[must_use]
    pub fn json(&self) -> &str {
        &self.json
    }

    /// Reads it as the user's type (`T` is typically an enum tagged by `"kind"`).
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.json)
    }
}

/// Why a value cannot be a user job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// It did not serialize.
    #[error("job could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    /// It serialized to something other than a JSON object with a string `"kind"`.
    #[error(
        "a job must serialize to a JSON object with a string \"kind\" (use #[serde(tag = \"kind\")])"
    )]
    NotTagged,
    /// Its kind is one tidemark defines.
    #[error("job kind {0:?} is built in; a user job needs a kind of its own")]
    BuiltInKind(String),
}

impl Job {
    /// A user job from any serde type that serializes to an object tagged by `"kind"`
    /// (`#[derive(Serialize)] #[serde(tag = "kind")]`) with a kind that is not built in.
    pub fn custom<T: Serialize + ?Sized>(value: &T) -> Result<Job, JobError> {
        let value = serde_json::to_value(value)?;
        let kind = kind_of(&value).ok_or(JobError::NotTagged)?.to_owned();
        if BUILT_IN_KINDS.contains(&kind.as_str()) || kind == UNDECODABLE_KIND {
            return Err(JobError::BuiltInKind(kind));
        }
        Ok(Job::Custom(CustomJob {
            kind,
            json: value.to_string(),
        }))
    }

    /// Stands for stored bytes that [`Job::decode`] refuses, so a queue can keep them as a
    /// dead letter an operator can see (kind [`UNDECODABLE_KIND`], the bytes as lossy text).
    #[must_use]
    pub fn undecodable(bytes: &[u8]) -> Job {
        let value = serde_json::json!({
            "kind": UNDECODABLE_KIND,
            "text": String::from_utf8_lossy(bytes),
        });
        Job::Custom(CustomJob {
            kind: UNDECODABLE_KIND.to_owned(),
            json: value.to_string(),
        })
    }

    /// Its kind, as the `"kind"` field says.
    #[must_use]
    pub fn kind(&self) -> &str {
        match self {
            Job::PackHousekeeping { .. } => "pack_housekeeping",
            Job::Sweep => "sweep",
            Job::Custom(c) => &c.kind,
        }
    }

    /// What a pending copy of it is known by, for coalescing: a queue that still holds a
    /// job with this key, not yet leased, returns that job's id instead of enqueueing
    /// another, so pending housekeeping is bounded by the keys written, not by the writes.
    /// `pack_housekeeping` coalesces per key (the job reads the key's current state when
    /// it runs, so one run after the last write does the work of all); sweeps (one per
    /// scheduled tick) and a user's kinds never do.
    #[must_use]
    pub fn coalesce_key(&self) -> Option<String> {
        match self {
            Job::PackHousekeeping { key } => Some(format!("pack_housekeeping/{key}")),
            Job::Sweep | Job::Custom(_) => None,
        }
    }

    /// Whether it goes before every other ready job: sweeps do, so a backlog of
    /// housekeeping never delays retention.
    #[must_use]
    pub fn is_priority(&self) -> bool {
        matches!(self, Job::Sweep)
    }

    /// The JSON form.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        match self {
            // Kept verbatim: what was decoded is what is written back.
            Job::Custom(c) => Ok(c.json.clone().into_bytes()),
            _ => serde_json::to_vec(self),
        }
    }

    /// Reads the JSON form: a built-in kind (strictly), or any other JSON object with a
    /// string `"kind"` as [`Job::Custom`]. Anything else is an error the caller can count.
    pub fn decode(bytes: &[u8]) -> Result<Job, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Reads it as `T`: the built-in kinds as [`Job`] itself, a user's kinds as the user's
    /// type.
    pub fn decode_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        match self {
            Job::Custom(c) => c.decode(),
            _ => serde_json::from_value(serde_json::to_value(self)?),
        }
    }
}

fn kind_of(value: &Value) -> Option<&str> {
    value.as_object()?.get("kind")?.as_str()
}

impl Serialize for Job {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Job::PackHousekeeping { key } => {
                BuiltIn::PackHousekeeping { key: key.clone() }.serialize(serializer)
            }
            Job::Sweep => BuiltIn::Sweep.serialize(serializer),
            Job::Custom(c) => serde_json::from_str::<Value>(&c.json)
                .map_err(serde::ser::Error::custom)?
                .serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Job {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        let Some(kind) = kind_of(&value) else {
            return Err(D::Error::custom(
                "a job is a JSON object with a string \"kind\"",
            ));
        };
        if BUILT_IN_KINDS.contains(&kind) {
            return Ok(
                match serde_json::from_value(value).map_err(D::Error::custom)? {
                    BuiltIn::PackHousekeeping { key } => Job::PackHousekeeping { key },
                    BuiltIn::Sweep => Job::Sweep,
                },
            );
        }
        Ok(Job::Custom(CustomJob {
            kind: kind.to_owned(),
            json: value.to_string(),
        }))
    }
}

/// A queue's identifier for an enqueued job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "job-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    enum Mine {
        Resize { id: u64, width: u32 },
        Email { to: String },
    }

    #[test]
    fn jobs_are_tagged_by_kind_and_round_trip() {
        let pack = Job::PackHousekeeping { key: "a".into() };
        assert_eq!(
            pack.encode().unwrap(),
            br#"{"kind":"pack_housekeeping","key":"a"}"#
        );
        assert_eq!(Job::Sweep.encode().unwrap(), br#"{"kind":"sweep"}"#);
        let custom = Job::custom(&Mine::Email { to: "x".into() }).unwrap();
        for job in [pack, Job::Sweep, custom] {
            assert_eq!(Job::decode(&job.encode().unwrap()).unwrap(), job);
            let via_serde: Job =
                serde_json::from_value(serde_json::to_value(&job).unwrap()).unwrap();
            assert_eq!(via_serde, job, "serde and encode agree");
        }
    }

    #[test]
    fn existing_built_in_json_still_decodes() {
        assert_eq!(Job::decode(br#"{"kind":"sweep"}"#).unwrap(), Job::Sweep);
        assert_eq!(
            Job::decode(br#"{"key":"a","kind":"pack_housekeeping"}"#).unwrap(),
            Job::PackHousekeeping { key: "a".into() }
        );
        assert!(
            Job::decode(br#"{"kind":"pack_housekeeping"}"#).is_err(),
            "a built-in kind is decoded strictly"
        );
    }

    #[test]
    fn user_jobs_keep_their_kind_and_decode_as_the_users_type() {
        let job = Job::custom(&Mine::Resize { id: 7, width: 640 }).unwrap();
        assert_eq!(job.kind(), "resize");
        assert_eq!(
            job.decode_as::<Mine>().unwrap(),
            Mine::Resize { id: 7, width: 640 }
        );
        let unknown = Job::decode(br#"{"kind":"reboot","now":true}"#).unwrap();
        assert_eq!(
            unknown.kind(),
            "reboot",
            "an unknown kind is kept, not refused"
        );
        assert!(unknown.decode_as::<Mine>().is_err());
        assert_eq!(Job::Sweep.decode_as::<Job>().unwrap(), Job::Sweep);
    }

    #[test]
    fn what_is_not_a_tagged_object_is_refused() {
        for bad in [
            &b"not json"[..],
            b"[1]",
            b"{}",
            br#"{"kind":3}"#,
            b"\"sweep\"",
        ] {
            assert!(
                Job::decode(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(matches!(Job::custom(&5), Err(JobError::NotTagged)));
        assert!(matches!(
            Job::custom(&serde_json::json!({"kind": "sweep"})),
            Err(JobError::BuiltInKind(_))
        ));
        let kept = Job::undecodable(b"not json");
        assert_eq!(kept.kind(), UNDECODABLE_KIND);
        assert_eq!(
            Job::decode(&kept.encode().unwrap()).unwrap(),
            kept,
            "bytes that are no job are kept as a job that round-trips"
        );
    }
}
