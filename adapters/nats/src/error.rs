//! How NATS failures become the runtime's [`Error`](tidemark::Error).

use std::fmt::Display;

use tidemark::Error;

/// A retryable failure of `port`: the server is unreachable, restarting (503, no
/// responders), the bucket or stream is missing, or a request timed out. Drivers back off
/// and try again.
pub(crate) fn unavailable(port: &'static str, error: impl Display) -> Error {
    Error::unavailable(port, error.to_string())
}

/// Why a key cannot be a KV key or a subject token, if it cannot: first the rule every
/// follower applies (so nothing is committed that no cache would take), then NATS' own.
pub(crate) fn check_key(key: &str) -> Result<(), Error> {
    tidemark::check_key(key)?;
    let refuse = |reason: &'static str| {
        Err(Error::InvalidKey {
            key: tidemark::tidemark_core::shorten(key, 128),
            reason,
        })
    };
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

/// `prefix` as the [`KeyPrefix`](tidemark::tidemark_core::KeyPrefix) of a bucket view:
/// whole subject tokens (`orders` or `orders.eu`, a trailing `.` allowed), so the server
/// can filter on `orders.eu.>`. The view holds the keys that begin with the tokens and a
/// `.`. Empty tokens, wildcards and characters no KV key holds are refused.
pub(crate) fn check_prefix(prefix: &str) -> Result<tidemark::tidemark_core::KeyPrefix, Error> {
    let tokens = prefix.strip_suffix('.').unwrap_or(prefix);
    check_key(tokens).map_err(|e| match e {
        Error::InvalidKey { reason, .. } => Error::InvalidKey {
            key: tidemark::tidemark_core::shorten(prefix, 128),
            reason,
        },
        other => other,
    })?;
    tidemark::key_prefix(&format!("{tokens}."))
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
        let too_long = "k".repeat(tidemark::tidemark_core::MAX_KEY_BYTES + 1);
        assert!(
            matches!(check_key(&too_long), Err(Error::InvalidKey { .. })),
            "a key longer than followers take must be refused before it is written"
        );
        for good in ["a", "pkg/a.b", "A-Z_0=9"] {
            assert!(check_key(good).is_ok(), "{good:?} is a valid KV key");
        }
        assert!(check_name("consumer_1-a").is_ok());
    }

    #[test]
    fn prefixes_are_whole_tokens_without_wildcards() {
        for bad in [
            "",
            ".",
            "orders..eu",
            ".orders",
            "orders.*",
            "orders.>",
            "*",
            ">",
            "a b",
            "orders..",
        ] {
            assert!(
                matches!(check_prefix(bad), Err(Error::InvalidKey { .. })),
                "{bad:?} cannot be filtered on the server as a key prefix"
            );
        }
        assert_eq!(check_prefix("orders.eu").unwrap().as_str(), "orders.eu.");
        assert_eq!(
            check_prefix("orders.eu.").unwrap().as_str(),
            "orders.eu.",
            "a trailing dot names the same tokens"
        );
        assert!(check_name("a.b").is_err(), "dots split subjects");
    }
}
