//! Jobs on the wire, for `#[serde(with = "crate::wire::job")]` on a [`Job`] field (and
//! [`opt`] on an optional one).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tidemark::tidemark_core::Job;

/// A job on the wire: the built-in kinds as themselves, any other as its JSON object (a
/// user's job is a JSON object by definition). `Job`'s own serde form is a JSON object
/// tagged by `"kind"`, which only a self-describing format can read back.
#[derive(Serialize, Deserialize)]
enum WireJob {
    PackHousekeeping(String),
    Sweep,
    Json(String),
}

impl WireJob {
    fn of(job: &Job) -> Result<Self, serde_json::Error> {
        Ok(match job {
            Job::PackHousekeeping { key } => WireJob::PackHousekeeping(key.clone()),
            Job::Sweep => WireJob::Sweep,
            other => WireJob::Json(serde_json::to_string(other)?),
        })
    }

    fn into_job(self) -> Result<Job, serde_json::Error> {
        Ok(match self {
            WireJob::PackHousekeeping(key) => Job::PackHousekeeping { key },
            WireJob::Sweep => Job::Sweep,
            WireJob::Json(json) => serde_json::from_str(&json)?,
        })
    }
}

/// Writes `job` as a wire job.
pub fn serialize<S: Serializer>(job: &Job, s: S) -> Result<S::Ok, S::Error> {
    WireJob::of(job)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

/// Reads a wire job.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Job, D::Error> {
    WireJob::deserialize(d)?
        .into_job()
        .map_err(serde::de::Error::custom)
}

/// `#[serde(with = "...")]` for an optional [`Job`] field of a wire message.
pub mod opt {
    use super::{Deserialize, Deserializer, Job, Serialize, Serializer, WireJob};

    /// Writes `job`, if any, as a wire job.
    pub fn serialize<S: Serializer>(job: &Option<Job>, s: S) -> Result<S::Ok, S::Error> {
        job.as_ref()
            .map(WireJob::of)
            .transpose()
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }

    /// Reads an optional wire job.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Job>, D::Error> {
        Option::<WireJob>::deserialize(d)?
            .map(WireJob::into_job)
            .transpose()
            .map_err(serde::de::Error::custom)
    }
}
