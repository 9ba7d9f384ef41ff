//! Limits on keys and values: one rule for the follower and every source.

/// The longest key accepted by default, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The largest value accepted by default, in bytes (8 MiB).
pub const MAX_VALUE_BYTES: usize = 8 * 1024 * 1024;

/// How many keys to make room for at once, before an initial sync, when a feed says
/// `pending` entries are still to come: the follower's index and a sink that keeps its
/// keys in memory (the cache) presize by it rather than growing (and rehashing) a dozen
/// times on the way. For a KV bucket's first sync that count is the number of keys; for a
/// stream replayed from its start it counts every message, so it is only a hint, bounded
/// (2^17 keys, a few MiB of table) so that a long history of a few keys cannot reserve
/// much.
#[must_use]
pub fn presize_for(pending: u64) -> usize {
    usize::try_from(pending.min(PRESIZE_LIMIT)).unwrap_or(0) + 1
}

/// The first presize's bound: 2^17 keys.
const PRESIZE_LIMIT: u64 = 1 << 17;

/// How many more keys to make room for when a table presized by [`presize_for`] fills
/// during the same initial sync, holding `held` keys, and the feed says `pending` entries
/// are still to come: all of them, but at most four times the keys the sync has shown to
/// be there so far (and at least the first bound). Growing by doubling instead, a 1M-key
/// sync rehashed its table at 229k, 459k and 918k keys (1.6M moves, a quarter of the
/// follower task's time in the `follower_task` bench); with this it rehashes once, at
/// 229k. A count that is a stream's history rather than its keys can thus leave a table
/// at most about five times the keys it held when it filled, where doubling leaves two.
#[must_use]
pub fn presize_more(pending: u64, held: usize) -> usize {
    let bound = u64::try_from(held)
        .unwrap_or(u64::MAX)
        .saturating_mul(4)
        .max(PRESIZE_LIMIT);
    usize::try_from(pending.min(bound))
        .unwrap_or(usize::MAX)
        .saturating_add(1)
}

/// Why a key is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The key is empty.
    Empty,
    /// The key is longer than the limit.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contains an ASCII control character.
    ControlCharacter,
}

impl KeyProblem {
    /// A short description for an error message.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            KeyProblem::Empty => "empty",
            KeyProblem::TooLong { .. } => "longer than the key limit",
            KeyProblem::ControlCharacter => "contains a control character",
        }
    }
}

/// Checks `key` against the rules every tidemark source and follower applies: not empty,
/// at most `max_bytes` long, no ASCII control characters.
pub fn check_key(key: &str, max_bytes: usize) -> Result<(), KeyProblem> {
    if key.is_empty() {
        Err(KeyProblem::Empty)
    } else if key.len() > max_bytes {
        Err(KeyProblem::TooLong { len: key.len() })
    } else if key.bytes().any(|b| b.is_ascii_control()) {
        Err(KeyProblem::ControlCharacter)
    } else {
        Ok(())
    }
}

/// `key` cut to at most `max` bytes on a character boundary, for logs and errors.
#[must_use]
pub fn shorten(key: &str, max: usize) -> String {
    let mut cut = key.len().min(max);
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    key[..cut].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_by_one_rule() {
        assert_eq!(check_key("pkg/a", 8), Ok(()));
        assert_eq!(check_key("", 8), Err(KeyProblem::Empty));
        assert_eq!(
            check_key("123456789", 8),
            Err(KeyProblem::TooLong { len: 9 })
        );
        assert_eq!(check_key("a\tb", 8), Err(KeyProblem::ControlCharacter));
    }

    #[test]
    fn a_presize_after_the_first_is_bounded_by_the_keys_held() {
        assert_eq!(
            presize_more(770_624, 229_376),
            770_625,
            "all that is to come"
        );
        assert_eq!(presize_more(u64::MAX, 229_376), 4 * 229_376 + 1);
        assert_eq!(
            presize_more(u64::MAX, 10),
            (1 << 17) + 1,
            "never below the first"
        );
        assert_eq!(presize_more(0, 10), 1);
    }

    #[test]
    fn shortening_respects_character_boundaries() {
        assert_eq!(shorten("ééé", 3), "é");
        assert_eq!(shorten("abc", 64), "abc");
    }
}
