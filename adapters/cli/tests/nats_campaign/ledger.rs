//! What the writers know landed in the bucket: every mutation with its revision, from its
//! acknowledgement or, when the acknowledgement was lost, from reading the key back. A
//! bucket deleted and made again starts a new history (an epoch) whose revisions start
//! at 1 again: the ledger keeps one [`History`] per epoch, and a put's token names its
//! epoch (`w0.k3#2.57` is the 57th put of writer 0, into the bucket's third history).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// A mutation of a key. A put's value starts with a token (`key#n`) no other put has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Put(String),
    Delete,
    Purge,
    /// The server's marker of a put whose TTL ran out (limit markers).
    Expired,
}

impl Kind {
    pub fn removes(&self) -> bool {
        !matches!(self, Kind::Put(_))
    }
}

/// The token a value starts with: the bytes before its first `|`.
pub fn token(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == b'|').unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end.min(64)]).into_owned()
}

/// The token of the `n`th put of `key` into the bucket's history `epoch`.
pub fn make_token(key: &str, epoch: u32, n: u64) -> String {
    format!("{key}#{epoch}.{n}")
}

/// The history a put's token says it was written into (`None`: not a writer's token).
pub fn epoch_of(token: &str) -> Option<u32> {
    let (_, tail) = token.rsplit_once('#')?;
    tail.split_once('.')?.0.parse().ok()
}

/// A landed mutation, and when its publish was sent (the server stored it after that).
#[derive(Debug, Clone)]
pub struct Landed {
    /// The bucket's history it landed in (0 the first, 1 after one recreation, ...).
    pub epoch: u32,
    pub key: String,
    pub seq: u64,
    pub kind: Kind,
    pub sent: Instant,
}

/// A put with a TTL whose acknowledgement was lost and which expired before it was read
/// back: it landed strictly between `after` and `before` (its expiry marker), at a
/// revision no read can give any more.
#[derive(Debug, Clone)]
pub struct Unplaced {
    pub epoch: u32,
    pub key: String,
    pub token: String,
    pub after: u64,
    pub before: u64,
}

/// A put with a TTL whose history was replaced (the bucket made again) before its writer
/// read its expiry marker back: it may have expired, at a revision after `after` (its
/// own) that no read can give any more.
#[derive(Debug, Clone)]
pub struct ExpiryUnread {
    pub epoch: u32,
    pub key: String,
    pub after: u64,
}

/// Every landed mutation, by the history it landed in.
#[derive(Debug, Default)]
pub struct Ledger {
    histories: Vec<History>,
}

impl Ledger {
    /// A ledger of a round whose bucket was made `histories` times (once, plus once per
    /// recreation).
    pub fn new(histories: u32) -> Ledger {
        Ledger {
            histories: (0..histories.max(1)).map(|_| History::default()).collect(),
        }
    }

    /// Records a mutation; a revision given twice in one history means the server reused
    /// it (it lost acknowledged writes) or the writers' bookkeeping is wrong.
    pub fn record(&mut self, landed: &Landed) -> Result<(), String> {
        let epoch = landed.epoch as usize;
        if self.histories.len() <= epoch {
            self.histories.resize_with(epoch + 1, History::default);
        }
        self.histories[epoch].record(landed)
    }

    /// Records a put that landed at a revision known only within bounds.
    pub fn record_unplaced(&mut self, unplaced: &Unplaced) {
        let epoch = unplaced.epoch as usize;
        if self.histories.len() <= epoch {
            self.histories.resize_with(epoch + 1, History::default);
        }
        self.histories[epoch].unplaced.push(unplaced.clone());
    }

    /// Records a TTL'd put that may have expired unseen.
    pub fn record_expiry_unread(&mut self, unread: &ExpiryUnread) {
        let epoch = unread.epoch as usize;
        if self.histories.len() <= epoch {
            self.histories.resize_with(epoch + 1, History::default);
        }
        self.histories[epoch]
            .unread
            .push(unread.after_of(&unread.key));
    }

    /// The bucket's history `epoch`.
    pub fn history(&self, epoch: u32) -> Option<&History> {
        self.histories.get(epoch as usize)
    }

    /// The last history: the bucket as it is now.
    pub fn last(&self) -> &History {
        self.histories.last().unwrap_or(&EMPTY)
    }

    /// The index of the last history.
    pub fn last_epoch(&self) -> u32 {
        u32::try_from(self.histories.len().saturating_sub(1)).unwrap_or(u32::MAX)
    }

    /// Every history, with its epoch.
    pub fn histories(&self) -> impl Iterator<Item = (u32, &History)> {
        (0u32..).zip(self.histories.iter())
    }

    /// Every key ever written, in any history.
    pub fn all_keys(&self) -> std::collections::BTreeSet<String> {
        self.histories
            .iter()
            .flat_map(|h| h.keys().cloned())
            .collect()
    }

    /// When the last mutation that landed was sent.
    pub fn last_sent(&self) -> Option<Instant> {
        self.histories.iter().filter_map(History::last_sent).max()
    }

    /// Every key present now (in the last history), with its revision and token.
    pub fn now(&self) -> BTreeMap<String, (u64, String)> {
        self.last().now()
    }
}

static EMPTY: History = History {
    keys: BTreeMap::new(),
    by_seq: None,
    unplaced: Vec::new(),
    unread: Vec::new(),
};

/// Every landed mutation of one history of the bucket, by key and revision.
#[derive(Debug, Default)]
pub struct History {
    keys: BTreeMap<String, BTreeMap<u64, (Kind, Instant)>>,
    by_seq: Option<HashMap<u64, String>>,
    unplaced: Vec<Unplaced>,
    /// TTL'd puts (key, revision) that may have expired at a revision after theirs.
    unread: Vec<(String, u64)>,
}

impl ExpiryUnread {
    fn after_of(&self, key: &str) -> (String, u64) {
        (key.to_owned(), self.after)
    }
}

impl History {
    fn record(&mut self, landed: &Landed) -> Result<(), String> {
        let Landed {
            epoch,
            key,
            seq,
            kind,
            sent,
        } = landed.clone();
        let by_seq = self.by_seq.get_or_insert_with(HashMap::new);
        if let Some(other) = by_seq.insert(seq, key.clone()) {
            return Err(format!(
                "revision {seq} of history {epoch} acknowledged twice ({other} and {key}): the \
                 server reused a revision, so it lost an acknowledged write"
            ));
        }
        self.keys.entry(key).or_default().insert(seq, (kind, sent));
        Ok(())
    }

    /// Whether `token` of `key` is a put that landed somewhere strictly between two
    /// revisions around `seq` (its revision unknown), and no other mutation landed at
    /// `seq`: shown at `seq`, it may be there.
    pub fn unplaced_at(&self, key: &str, token: &str, seq: u64) -> bool {
        let free = self
            .by_seq
            .as_ref()
            .is_none_or(|by_seq| !by_seq.contains_key(&seq));
        free && self
            .unplaced
            .iter()
            .any(|u| u.key == key && u.token == token && u.after < seq && seq < u.before)
    }

    /// Whether `key` at revision `w` may be other than the ledger says: a put of unknown
    /// revision, or a TTL'd put that may have expired unseen before `w`.
    pub fn unplaced_around(&self, key: &str, w: u64) -> bool {
        self.unplaced
            .iter()
            .any(|u| u.key == key && u.after < w && w < u.before)
            || self
                .state_at(key, w)
                .is_some_and(|(seq, _)| self.may_have_expired(key, seq))
    }

    /// Whether the put of `key` at `seq` had a TTL and may have expired unseen.
    pub fn may_have_expired(&self, key: &str, seq: u64) -> bool {
        self.unread.iter().any(|(k, s)| k == key && *s == seq)
    }

    /// Every key ever written.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.keys.keys()
    }

    /// The mutation of `key` at `seq`, if one landed there.
    pub fn at(&self, key: &str, seq: u64) -> Option<&Kind> {
        self.keys.get(key)?.get(&seq).map(|(k, _)| k)
    }

    /// `key` as the bucket held it at revision `w`: its put's revision and token, or
    /// `None` if absent (never written, deleted or purged).
    pub fn state_at(&self, key: &str, w: u64) -> Option<(u64, &str)> {
        match self.keys.get(key)?.range(..=w).next_back()? {
            (seq, (Kind::Put(token), _)) => Some((*seq, token.as_str())),
            _ => None,
        }
    }

    /// When the first mutation of `key` after revision `w` was sent, if there is one.
    pub fn next_sent_after(&self, key: &str, w: u64) -> Option<Instant> {
        let (_, (_, sent)) = self.keys.get(key)?.range(w + 1..).next()?;
        Some(*sent)
    }

    /// Whether `key` was mutated after revision `w`.
    pub fn changed_after(&self, key: &str, w: u64) -> bool {
        self.keys
            .get(key)
            .is_some_and(|m| m.range(w + 1..).next().is_some())
    }

    /// Whether a delete or purge of `key` landed strictly between `after` and `before`
    /// (no upper bound with `None`).
    pub fn removed_between(&self, key: &str, after: u64, before: Option<u64>) -> bool {
        let Some(m) = self.keys.get(key) else {
            return false;
        };
        let upper = before.unwrap_or(u64::MAX);
        after < upper
            && (m.range(after + 1..upper).any(|(_, (k, _))| k.removes())
                // An expiry unseen, at a revision above its put's.
                || self
                    .unread
                    .iter()
                    .any(|(k, s)| k == key && after <= *s && *s + 1 < upper))
    }

    /// When the last mutation that landed was sent.
    pub fn last_sent(&self) -> Option<Instant> {
        self.keys
            .values()
            .flat_map(|m| m.values().map(|(_, sent)| *sent))
            .max()
    }

    /// Every key present now, with its revision and token.
    pub fn now(&self) -> BTreeMap<String, (u64, String)> {
        self.keys
            .keys()
            .filter_map(|k| {
                let (seq, token) = self.state_at(k, u64::MAX)?;
                Some((k.clone(), (seq, token.to_owned())))
            })
            .collect()
    }
}
