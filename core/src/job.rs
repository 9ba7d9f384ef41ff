//! Maintenance jobs and their JSON form.

use serde::{Deserialize, Serialize};

/// A maintenance job, JSON tagged by `"kind"`: `{"kind":"pack_housekeeping","key":"a"}`,
/// `{"kind":"sweep"}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Job {
    /// Housekeeping for one key after it changed.
    PackHousekeeping {
        /// The key that changed.
        key: String,
    },
    /// A periodic sweep over everything.
    Sweep,
}

impl Job {
    /// The JSON form.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Reads the JSON form; anything else is an error the caller can count.
    pub fn decode(bytes: &[u8]) -> Result<Job, serde_json::Error> {
        serde_json::from_slice(bytes)
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

    #[test]
    fn jobs_are_tagged_by_kind_and_round_trip() {
        let pack = Job::PackHousekeeping { key: "a".into() };
        assert_eq!(
            pack.encode().unwrap(),
            br#"{"kind":"pack_housekeeping","key":"a"}"#
        );
        assert_eq!(Job::Sweep.encode().unwrap(), br#"{"kind":"sweep"}"#);
        for job in [pack, Job::Sweep] {
            assert_eq!(Job::decode(&job.encode().unwrap()).unwrap(), job);
        }
        assert!(Job::decode(br#"{"kind":"reboot"}"#).is_err());
    }
}
