//! Decoding values: bytes from the source into the user's type.

use std::convert::Infallible;
use std::fmt::Display;
use std::marker::PhantomData;

/// Turns a value's bytes into the user's type.
///
/// The error type is the user's choice (anything displayable). A failure is not an error
/// of the follower: the entry is logged with its key and error, counted as poison, and
/// skipped, and the watermark moves past it so a poison entry can never wedge a follower.
pub trait Decode {
    /// The decoded value.
    type Value;
    /// Why bytes could not be decoded.
    type Error: Display;

    /// Decodes the value stored under `key`. Takes the bytes by value so that a decoder
    /// that keeps them (like [`RawBytes`]) copies nothing.
    fn decode(&self, key: &str, bytes: Vec<u8>) -> Result<Self::Value, Self::Error>;

    /// Whether a value a sink holds and a newly decoded one are the same value, so that a
    /// new history's entry carrying it can keep the held one rather than store a second
    /// copy until the switch (see [`Cached`](crate::Cached)). The default says never:
    /// correct for any value, only costlier. Say `true` only for values no reader can
    /// tell apart.
    fn same(&self, held: &Self::Value, new: &Self::Value) -> bool {
        let _ = (held, new);
        false
    }
}

/// Keeps the bytes as they are.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawBytes;

impl Decode for RawBytes {
    type Value = Vec<u8>;
    type Error = Infallible;

    fn decode(&self, _key: &str, bytes: Vec<u8>) -> Result<Vec<u8>, Infallible> {
        Ok(bytes)
    }

    fn same(&self, held: &Vec<u8>, new: &Vec<u8>) -> bool {
        held == new
    }
}

/// Decodes UTF-8 text.
#[derive(Clone, Copy, Debug, Default)]
pub struct Utf8;

impl Decode for Utf8 {
    type Value = String;
    type Error = std::string::FromUtf8Error;

    fn decode(&self, _key: &str, bytes: Vec<u8>) -> Result<String, Self::Error> {
        String::from_utf8(bytes)
    }

    fn same(&self, held: &String, new: &String) -> bool {
        held == new
    }
}

/// Decodes JSON into any `T: Deserialize`.
pub struct Json<T>(PhantomData<fn() -> T>);

impl<T> Json<T> {
    /// A JSON decoder for `T`.
    #[must_use]
    pub fn new() -> Self {
        Json(PhantomData)
    }
}

impl<T> Default for Json<T> {
    fn default() -> Self {
        Json::new()
    }
}

impl<T> Clone for Json<T> {
    fn clone(&self) -> Self {
        Json::new()
    }
}

impl<T> std::fmt::Debug for Json<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Json")
    }
}

impl<T: serde::de::DeserializeOwned> Decode for Json<T> {
    type Value = T;
    type Error = serde_json::Error;

    fn decode(&self, _key: &str, bytes: Vec<u8>) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&bytes)
    }
}

/// A decoder made from a function, for one-off decoders: `decode_fn(|key, bytes| ...)`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeFn<F>(F);

/// Wraps a function `Fn(&str, Vec<u8>) -> Result<V, E>` as a [`Decode`].
pub fn decode_fn<F, V, E>(f: F) -> DecodeFn<F>
where
    F: Fn(&str, Vec<u8>) -> Result<V, E>,
    E: Display,
{
    DecodeFn(f)
}

impl<F, V, E> Decode for DecodeFn<F>
where
    F: Fn(&str, Vec<u8>) -> Result<V, E>,
    E: Display,
{
    type Value = V;
    type Error = E;

    fn decode(&self, key: &str, bytes: Vec<u8>) -> Result<V, E> {
        (self.0)(key, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bytes_keeps_the_bytes() {
        assert_eq!(RawBytes.decode("k", vec![0, 255]).unwrap(), vec![0, 255]);
    }

    #[test]
    fn utf8_rejects_invalid_text_with_a_displayable_error() {
        assert_eq!(Utf8.decode("k", b"hi".to_vec()).unwrap(), "hi");
        let err = Utf8.decode("k", vec![0xff]).unwrap_err();
        assert!(!err.to_string().is_empty());
    }

    #[test]
    fn json_decodes_user_types() {
        #[derive(serde::Deserialize, PartialEq, Debug)]
        struct Pack {
            size: u32,
        }
        let d = Json::<Pack>::new();
        assert_eq!(
            d.decode("k", br#"{"size":3}"#.to_vec()).unwrap(),
            Pack { size: 3 }
        );
        assert!(d.decode("k", b"{".to_vec()).is_err());
    }

    #[test]
    fn a_function_with_its_own_error_type_is_a_decoder() {
        #[derive(Debug)]
        struct TooShort(usize);
        impl Display for TooShort {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "only {} bytes", self.0)
            }
        }
        let d = decode_fn(|_key: &str, b: Vec<u8>| {
            if b.len() < 2 {
                Err(TooShort(b.len()))
            } else {
                Ok(b.len())
            }
        });
        assert_eq!(d.decode("k", vec![1, 2, 3]).unwrap(), 3);
        assert_eq!(
            d.decode("k", vec![1]).unwrap_err().to_string(),
            "only 1 bytes"
        );
    }
}
