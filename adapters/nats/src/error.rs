//! How NATS failures become the runtime's [`Error`](tidemark::Error).

use std::fmt::Display;

use tidemark::Error;

/// A retryable failure of `port`: the server is unreachable, restarting (503, no
/// responders), the bucket or stream is missing, or a request timed out. Drivers back off
/// and try again.
pub(crate) fn unavailable(port: &'static str, error: impl Display) -> Error {
    Error::unavailable(port, error.to_string())
}

/// Why a key cannot be a KV key or a subject token, if it cannot.
pub(crate) fn check_key(key: &str) -> Result<(), Error> {
    let refuse = |reason: &'static str| {
        let mut shown = key.to_owned();
        if shown.len() > 128 {
            let mut cut = 128;
            while !shown.is_char_boundary(cut) {
                cut -= 1;
            }
            shown.truncate(cut);
        }
        Err(Error::InvalidKey { key: shown, reason })
    };
    if key.is_empty() {
        return refuse("empty");
    }
    if key.starts_with('.') || key.ends_with('.') || key.contains("..") {
        return refuse("a NATS key cannot start or end with '.' or hold an empty token");
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'_' | b'=' | b'.'))
    {
        return refuse("a NATS key holds only letters, digits and - / _ = .");
    }
    Ok(())
}

/// Why a name cannot be a stream, consumer or bucket name, if it cannot.
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
    {
        return Err(Error::InvalidKey {
            key: name.chars().take(128).collect(),
            reason: "a NATS name holds only letters, digits, - and _",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_nats_refuses_are_typed_errors() {
        for bad in ["", "a b", "a\nb", ".a", "a.", "a..b", "a*", "a>", "ü"] {
            assert!(
                matches!(check_key(bad), Err(Error::InvalidKey { .. })),
                "{bad:?} must be refused before it reaches the server"
            );
        }
        for good in ["a", "pkg/a.b", "A-Z_0=9"] {
            assert!(check_key(good).is_ok(), "{good:?} is a valid KV key");
        }
        assert!(check_name("consumer_1-a").is_ok());
        assert!(check_name("a.b").is_err(), "dots split subjects");
    }
}
