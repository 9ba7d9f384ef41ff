//! Key prefixes: the part of a source a follower keeps.

use crate::limits::{KeyProblem, MAX_KEY_BYTES, check_key};

/// A key prefix: a follower (and a source view) over it holds exactly the keys that begin
/// with it, byte for byte. Built with [`KeyPrefix::new`], which refuses what no key could
/// begin with (empty, longer than a key, control characters); an adapter may refuse more
/// (NATS: whole subject tokens, no wildcards).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyPrefix(String);

impl KeyPrefix {
    /// The prefix `prefix`.
    ///
    /// # Errors
    /// The [`KeyProblem`] of a prefix that is empty, longer than
    /// [`MAX_KEY_BYTES`], or holds a control character.
    pub fn new(prefix: impl Into<String>) -> Result<KeyPrefix, KeyProblem> {
        let prefix = prefix.into();
        check_key(&prefix, MAX_KEY_BYTES)?;
        Ok(KeyPrefix(prefix))
    }

    /// Whether `key` is under this prefix.
    #[must_use]
    pub fn matches(&self, key: &str) -> bool {
        key.as_bytes().starts_with(self.0.as_bytes())
    }

    /// The prefix itself.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for KeyPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for KeyPrefix {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_matches_keys_that_begin_with_it_and_no_other() {
        let p = KeyPrefix::new("orders/").unwrap();
        assert!(p.matches("orders/1"));
        assert!(p.matches("orders/"), "the prefix itself is a key under it");
        assert!(!p.matches("orders"), "a shorter key is not under it");
        assert!(!p.matches("orders2/1"));
        assert!(!p.matches("xorders/1"));
    }

    #[test]
    fn prefixes_no_key_could_begin_with_are_refused() {
        assert_eq!(KeyPrefix::new(""), Err(KeyProblem::Empty));
        assert_eq!(
            KeyPrefix::new("a\nb"),
            Err(KeyProblem::ControlCharacter),
            "no key holds a control character"
        );
        assert!(matches!(
            KeyPrefix::new("k".repeat(MAX_KEY_BYTES + 1)),
            Err(KeyProblem::TooLong { .. })
        ));
    }
}
