//! Typed writes: a serde value stored as its JSON bytes, the form [`Json`](tidemark_core::Json)
//! decodes.

use std::future::Future;

use serde::Serialize;

use crate::error::{Error, Result, check_value};
use crate::ports::Source;

/// `value` as JSON bytes for a write of `key`: [`Error::Encode`] if it does not serialize
/// (a map with non-string keys, a failing `Serialize` impl), [`Error::ValueTooLarge`] if
/// its JSON is larger than any follower takes
/// ([`MAX_VALUE_BYTES`](tidemark_core::MAX_VALUE_BYTES)). A source may refuse less (its
/// own limit) when the bytes are written.
pub fn to_json<T: Serialize + ?Sized>(key: &str, value: &T) -> Result<Vec<u8>> {
    let bytes = serde_json::to_vec(value).map_err(|e| Error::Encode {
        key: tidemark_core::shorten(key, 64),
        reason: e.to_string(),
    })?;
    check_value(&bytes)?;
    Ok(bytes)
}

/// Typed writes on every [`Source`]: the value is stored as JSON, which a follower reads
/// back with [`Json`](tidemark_core::Json).
///
/// ```
/// use tidemark::{PutJson, Source};
/// use tidemark_memory::MemorySource;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> tidemark::Result<()> {
/// #[derive(serde::Serialize)]
/// struct Package { version: String }
///
/// let source = MemorySource::default();
/// let seq = source.put_json("pkg/a", &Package { version: "1.0.0".into() }).await?;
/// assert_eq!(source.get("pkg/a").await?.unwrap().value, br#"{"version":"1.0.0"}"#);
/// # let _ = seq;
/// # Ok(())
/// # }
/// ```
pub trait PutJson: Source {
    /// Writes `value` as JSON under `key` ([`Source::put`]); see [`to_json`] for the
    /// errors a value that cannot be written gets before anything is sent.
    fn put_json<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
    ) -> impl Future<Output = Result<u64>> + Send {
        let bytes = to_json(key, value);
        async move { self.put(key, bytes?).await }
    }

    /// Compare-and-set write of `value` as JSON ([`Source::update`]).
    fn update_json<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        expected: u64,
    ) -> impl Future<Output = Result<u64>> + Send {
        let bytes = to_json(key, value);
        async move { self.update(key, bytes?, expected).await }
    }
}

impl<S: Source + ?Sized> PutJson for S {}
