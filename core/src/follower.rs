//! The follower: decides how a cache stays converged with its source.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use crate::backoff::Backoff;
use crate::config::{FollowerConfig, Sync};
use crate::decode::Decode;
use crate::entry::{CacheChange, Entry, Op};
use crate::limits::KeyProblem;
use crate::rng::Rng;
use crate::time::Time;

/// Entries buffered while a marker's fetch is outstanding, at most.
const MAX_HELD: usize = 4096;

// The key index is hashed with foldhash seeded from the follower's configured seed: the
// same on every run (std's `RandomState` reads OS randomness), keyed per follower, and a
// fraction of SipHash's cost on the sync hot path. Nothing iterates it into an output
// without sorting first.
type Index = HashMap<String, u64, foldhash::fast::FixedState>;

/// Ties a result to the request that asked for it. Results carrying an old token (a feed
/// that was since closed, a request that was since retried) are ignored and counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// What a feed promises about the seqs it delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// Every seq appears, in order (a SQLite or memory change stream): a jump past
    /// watermark+1 is a gap, and the follower reconciles from its watermark.
    Gapless,
    /// Seqs may be skipped (a KV bucket keeping only the latest revision per key): the
    /// server's ordered delivery and head make it complete.
    Sparse,
}

/// What a feed reported when it opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedInfo {
    /// The first seq the feed can still serve; 0 or 1 when nothing was ever compacted.
    /// Above the requested start it means history was compacted away.
    pub first_available: u64,
    /// The source's last seq when the feed opened (0 for an empty source): the initial
    /// sync is complete once the watermark reaches it. Take it from the stream's state
    /// (its last sequence), not from a consumer's pending count alone.
    pub head: u64,
    /// What the feed promises about seqs.
    pub continuity: Continuity,
    /// Whether the feed keeps a durable cursor that wants a checkpoint per entry.
    pub checkpoints: bool,
}

impl FeedInfo {
    /// A source's own change log: every seq in order (gapless), keyed by seq, no cursor.
    #[must_use]
    pub fn change_log(first_available: u64, head: u64) -> Self {
        FeedInfo {
            first_available,
            head,
            continuity: Continuity::Gapless,
            checkpoints: false,
        }
    }

    /// A KV bucket's history: the latest revision per key (sparse), keyed by revision, no
    /// cursor.
    #[must_use]
    pub fn kv(first_available: u64, head: u64) -> Self {
        FeedInfo {
            first_available,
            head,
            continuity: Continuity::Sparse,
            checkpoints: false,
        }
    }

    /// A durable stream of announcements: its own positions, seqs that may skip, repeat or
    /// reorder (sparse), a cursor checkpointed per entry, nothing compacted that a
    /// reconcile cannot cover. `head` is the highest seq among the entries still unread.
    #[must_use]
    pub fn announcements(head: u64) -> Self {
        FeedInfo {
            first_available: 0,
            head,
            continuity: Continuity::Sparse,
            checkpoints: true,
        }
    }
}

/// Why a feed entry (or feed payload) was skipped as invalid.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidReason {
    /// The seq was zero.
    ZeroSeq,
    /// The key was empty.
    EmptyKey,
    /// The key was longer than the configured limit.
    KeyTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contained a control character.
    ControlCharacterInKey,
    /// The value was larger than the configured limit.
    ValueTooLarge {
        /// Its length in bytes.
        len: usize,
    },
    /// The operation is unknown to this version.
    UnknownOperation(String),
    /// The feed delivered bytes that are not an entry (not an event, invalid UTF-8 key…).
    Undecodable(String),
    /// A source row that a reconcile or snapshot cannot carry (a marker, for instance).
    UnexpectedInRows,
}

/// What kind of failure a backoff answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cause {
    /// The source (bucket) could not be looked up.
    Lookup,
    /// The feed failed to open or failed mid-stream.
    FeedFailed,
    /// The feed ended cleanly; reopen soon.
    FeedEnded,
    /// A reconcile, snapshot or fetch failed.
    RequestFailed,
}

/// Something a driver should log. None of these stop the follower.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Diagnostic {
    /// A value could not be decoded; the entry was skipped and the watermark moved on.
    DecodeFailed {
        /// Its key.
        key: String,
        /// Its seq.
        seq: u64,
        /// The decoder's error, displayed.
        error: String,
    },
    /// An entry was invalid and skipped.
    InvalidEntry {
        /// Its seq (0 if unknown).
        seq: u64,
        /// Its key (may be empty or shortened).
        key: String,
        /// Why.
        reason: InvalidReason,
    },
    /// A gapless feed jumped past seqs the follower has not seen; it reconciles.
    Gap {
        /// The seq that should have come next.
        expected: u64,
        /// The seq that came.
        got: u64,
    },
    /// A feed delivered a seq lower than one it delivered before.
    SeqRegressed {
        /// The highest seq seen on this feed.
        previous: u64,
        /// The lower seq that came after it.
        got: u64,
    },
    /// The feed can no longer serve watermark+1; the follower resyncs from a snapshot.
    Compacted {
        /// The seq the follower asked for.
        wanted: u64,
        /// The first seq the feed can serve.
        first_available: u64,
    },
    /// The feed's head is below the watermark: its newest entries were purged, or the
    /// source is a new history. The follower resyncs from a snapshot.
    HeadBehind {
        /// The feed's head.
        head: u64,
        /// The follower's watermark.
        watermark: u64,
    },
    /// The source is behind the follower's watermark (a bucket deleted and recreated, a
    /// database restored from an old backup): a new history. The cache was replaced by the
    /// source's snapshot and the watermark set to the source's, lower than before.
    SourceReset {
        /// The follower's watermark before.
        watermark: u64,
        /// The source's watermark, now the follower's.
        source_watermark: u64,
    },
    /// A resync finished.
    Resynced {
        /// Keys removed because the source no longer has them.
        removed: usize,
        /// The watermark afterwards.
        watermark: u64,
    },
    /// A reconcile finished: what it caught up.
    Reconciled {
        /// Puts applied.
        applied: usize,
        /// Keys removed.
        removed: usize,
        /// The watermark afterwards.
        watermark: u64,
    },
    /// The follower waits before trying again.
    BackingOff {
        /// What failed.
        cause: Cause,
        /// Failures in a row under this cause.
        attempt: u32,
        /// How long it waits.
        delay: Duration,
        /// The failure, as the driver reported it.
        error: String,
    },
}

/// A decision for the driver to carry out, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Output<V> {
    /// Look the source up (a bucket by name); answer [`Input::SourceFound`] or
    /// [`Input::RequestFailed`].
    LookupSource {
        /// The request's token.
        token: Token,
    },
    /// Open the feed at seq `from` (watermark+1); answer [`Input::FeedOpened`] then
    /// entries, or [`Input::FeedFailed`]. A feed with a durable cursor may resume after
    /// `after_position` instead, the last position checkpointed.
    OpenFeed {
        /// The feed's token; every input about this feed carries it.
        token: Token,
        /// The first seq wanted.
        from: u64,
        /// The last position checkpointed, if any.
        after_position: Option<u64>,
    },
    /// Close the feed opened under `token`; the follower ignores anything more from it.
    CloseFeed {
        /// The feed's token.
        token: Token,
    },
    /// Read the source's changes (puts and removals with their seqs) since `since`;
    /// answer [`Input::Changes`], [`Input::ChangesUnavailable`] or [`Input::RequestFailed`].
    Reconcile {
        /// The request's token.
        token: Token,
        /// The watermark to read after.
        since: u64,
    },
    /// Read a full snapshot of the source; answer [`Input::Snapshot`] or
    /// [`Input::RequestFailed`].
    Snapshot {
        /// The request's token.
        token: Token,
    },
    /// Read `key`'s current value (a mutation marker at `seq` named it); answer
    /// [`Input::Fetched`] or [`Input::RequestFailed`].
    Fetch {
        /// The request's token.
        token: Token,
        /// The key to read.
        key: String,
        /// The marker's seq.
        seq: u64,
    },
    /// Upsert `key` in the cache.
    Put {
        /// The key.
        key: String,
        /// The seq of this value.
        seq: u64,
        /// The decoded value.
        value: V,
    },
    /// Remove `key` from the cache.
    Remove {
        /// The key.
        key: String,
        /// The seq of the removal.
        seq: u64,
    },
    /// Save the feed's durable cursor at `position` (monotone: never lower than before).
    Checkpoint {
        /// The position observed.
        position: u64,
    },
    /// The initial sync is complete: the cache holds every current entry of the source.
    /// Emitted once.
    Ready {
        /// The watermark at that moment.
        watermark: u64,
    },
    /// Something to log.
    Diagnostic(Diagnostic),
    /// The follower stopped; it will decide nothing more.
    Stopped,
}

/// A fact the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Input {
    /// The source was found.
    SourceFound {
        /// The lookup's token.
        token: Token,
    },
    /// The feed opened.
    FeedOpened {
        /// The feed's token.
        token: Token,
        /// What it reported.
        info: FeedInfo,
    },
    /// The feed delivered an entry.
    Entry {
        /// The feed's token.
        token: Token,
        /// The entry.
        entry: Entry,
    },
    /// The feed delivered something that is not an entry (a payload that is not an event,
    /// a key that is not UTF-8). It is counted, checkpointed past and, where its seq is
    /// known, skipped over.
    Undecodable {
        /// The feed's token.
        token: Token,
        /// Its position on the feed.
        position: u64,
        /// Its seq, if the feed knows it.
        seq: Option<u64>,
        /// What was wrong.
        reason: String,
    },
    /// The feed failed to open or failed mid-stream.
    FeedFailed {
        /// The feed's token.
        token: Token,
        /// The failure, for the log.
        error: String,
    },
    /// The feed ended cleanly (a server restart, a consumer deleted).
    FeedEnded {
        /// The feed's token.
        token: Token,
    },
    /// A reconcile's result: every change after the requested seq, in seq order, and the
    /// source's watermark when it was read.
    Changes {
        /// The request's token.
        token: Token,
        /// Puts and removals.
        changes: Vec<Entry>,
        /// The source's watermark.
        source_watermark: u64,
    },
    /// The source can no longer serve changes since the requested seq (tombstones were
    /// compacted): the follower resyncs.
    ChangesUnavailable {
        /// The request's token.
        token: Token,
        /// The first seq the source can serve.
        first_available: u64,
    },
    /// A snapshot: every current entry of the source, and its watermark.
    Snapshot {
        /// The request's token.
        token: Token,
        /// The current entries (puts).
        entries: Vec<Entry>,
        /// The source's watermark.
        source_watermark: u64,
    },
    /// A fetch's result: the key's current value and its seq, or `None` if absent.
    Fetched {
        /// The request's token.
        token: Token,
        /// The value and the seq it was written at.
        value: Option<(u64, Vec<u8>)>,
    },
    /// A lookup, reconcile, snapshot or fetch failed.
    RequestFailed {
        /// The request's token.
        token: Token,
        /// The failure, for the log.
        error: String,
    },
    /// A wake arrived: catch up from the source.
    Wake,
    /// Stop: close the feed and decide nothing more.
    Stop,
}

/// Where a follower is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Looking the source up.
    Starting,
    /// The initial sync is underway.
    Syncing,
    /// Ready and following.
    Live,
    /// Waiting to retry after a failure.
    BackingOff,
    /// Replacing the cache from a snapshot after compaction.
    Resyncing,
    /// Stopped.
    Stopped,
}

/// What a follower has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Puts applied to the cache.
    pub applied: u64,
    /// Removals applied to the cache.
    pub removed: u64,
    /// Entries skipped because their seq was at or below the watermark, or older than
    /// the key's value in the cache.
    pub stale: u64,
    /// Values that failed to decode (skipped).
    pub poison: u64,
    /// Invalid entries skipped (bad seq, key or size; unknown operation; undecodable).
    pub invalid: u64,
    /// Gaps detected on gapless feeds.
    pub gaps: u64,
    /// Full resyncs from a snapshot.
    pub resyncs: u64,
    /// Resyncs that found the source behind the watermark (a new history).
    pub resets: u64,
    /// Reconciles completed.
    pub reconciles: u64,
    /// Feed reopenings after the first open.
    pub reopens: u64,
    /// Marker fetches completed.
    pub fetches: u64,
    /// Results that arrived for a closed feed or a superseded request (ignored).
    pub ignored: u64,
}

/// Everything an operator wants to see of one follower.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// Its name.
    pub name: String,
    /// Where it is.
    pub phase: Phase,
    /// Its applied watermark.
    pub watermark: u64,
    /// Whether the initial sync completed.
    pub ready: bool,
    /// Keys in its cache.
    pub keys: usize,
    /// What it has done.
    pub counters: Counters,
}

#[derive(Clone, Debug)]
struct OpenFeed {
    token: Token,
    from: u64,
    info: Option<FeedInfo>,
    last_seq: u64,
}

#[derive(Clone, Debug)]
enum Request {
    Lookup,
    Reconcile,
    Snapshot,
    Fetch {
        key: String,
        seq: u64,
        position: u64,
    },
}

/// The sans-IO follower state machine.
///
/// It decides; it never does. The driver reports facts with
/// [`handle_input`](Self::handle_input) and [`handle_timeout`](Self::handle_timeout), and
/// carries out decisions taken from [`poll_output`](Self::poll_output).
///
/// **The driving contract:** after every input or timeout, drain `poll_output` until it
/// returns `None`, carrying out each output in order; then sleep until
/// [`poll_timeout`](Self::poll_timeout) ([`timeout_cause`](Self::timeout_cause) says which
/// backoff that deadline ends). Results of requests (open, reconcile, snapshot, fetch) are
/// reported with the token the request carried.
///
/// Methods come in four families: getters (`&self`), `handle_*` (a fact arrived),
/// `poll_*` (the next decision), and constructors.
#[derive(Debug)]
pub struct Follower<D: Decode> {
    config: FollowerConfig,
    decoder: D,
    rng: Rng,
    watermark: u64,
    index: Index,
    /// Removals applied above the watermark (announcements mode): a late, older put for
    /// such a key must not bring it back. Pruned as the watermark passes them.
    tombstones: BTreeMap<String, u64>,
    ready: bool,
    found: bool,
    stopped: bool,
    out: VecDeque<Output<D::Value>>,
    counters: Counters,
    next_token: u64,
    feed: Option<OpenFeed>,
    request: Option<(Token, Request)>,
    /// When to reopen the feed, and which backoff (feed failed or ended) that ends.
    reopen_at: Option<(Time, Cause)>,
    retry_at: Option<(Time, Request)>,
    held: VecDeque<Entry>,
    rewake: bool,
    last_checkpoint: Option<u64>,
    opened_once: bool,
    lookup_backoff: Backoff,
    failure_backoff: Backoff,
    end_backoff: Backoff,
}

impl<D: Decode> Follower<D> {
    /// A follower with an empty cache. Its first output asks the driver to look the
    /// source up.
    pub fn new(config: FollowerConfig, decoder: D) -> Self {
        Self::resume(config, decoder, 0, std::iter::empty())
    }

    /// A follower restarting warm from a persisted cache: its watermark and the key and
    /// seq of every entry it holds. It resumes from `watermark`+1 and catches up only the
    /// delta.
    pub fn resume(
        config: FollowerConfig,
        decoder: D,
        watermark: u64,
        keys: impl IntoIterator<Item = (String, u64)>,
    ) -> Self {
        let mut index = Index::with_hasher(foldhash::fast::FixedState::with_seed(config.seed));
        index.extend(keys);
        let mut f = Follower {
            rng: Rng::new(config.seed),
            lookup_backoff: Backoff::new(config.lookup_backoff),
            failure_backoff: Backoff::new(config.failure_backoff),
            end_backoff: Backoff::new(config.end_backoff),
            config,
            decoder,
            watermark,
            index,
            tombstones: BTreeMap::new(),
            ready: false,
            found: false,
            stopped: false,
            out: VecDeque::new(),
            counters: Counters::default(),
            next_token: 0,
            feed: None,
            request: None,
            reopen_at: None,
            retry_at: None,
            held: VecDeque::new(),
            rewake: false,
            last_checkpoint: None,
            opened_once: false,
        };
        f.send(Request::Lookup);
        f
    }

    /// Tells the follower the seqs at which its cache holds `keys`, for a driver that
    /// resumed it with only some of its keys ([`resume`](Self::resume) with the keys a
    /// delta touched) and now reads changes to others. It keeps the higher of what it
    /// knew and what it is told; the watermark does not move. Without this, a removal of
    /// a key the follower never heard of decides nothing, and the cache keeps the key.
    pub fn remember(&mut self, keys: impl IntoIterator<Item = (String, u64)>) {
        for (key, seq) in keys {
            let known = self.index.entry(key).or_insert(0);
            *known = (*known).max(seq);
        }
    }

    // ---- getters ----

    /// The applied watermark: every change up to this seq is reflected in the cache. The
    /// cache may hold some later values too (from a marker's fetch, or announcements,
    /// which move the watermark only through a reconcile); per-key seqs keep those from
    /// ever being replaced by older ones.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.watermark
    }

    /// Whether the initial sync completed.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Where the follower is.
    #[must_use]
    pub fn phase(&self) -> Phase {
        if self.stopped {
            Phase::Stopped
        } else if self.reopen_at.is_some() || self.retry_at.is_some() {
            Phase::BackingOff
        } else if matches!(self.request, Some((_, Request::Snapshot))) {
            Phase::Resyncing
        } else if !self.found {
            Phase::Starting
        } else if !self.ready {
            Phase::Syncing
        } else {
            Phase::Live
        }
    }

    /// What it has done so far.
    #[must_use]
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The seq of `key`'s value in the cache, if the cache holds it.
    #[must_use]
    pub fn seq_of(&self, key: &str) -> Option<u64> {
        self.index.get(key).copied()
    }

    /// How many keys the cache holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the cache is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &FollowerConfig {
        &self.config
    }

    /// A snapshot for an operator.
    #[must_use]
    pub fn status(&self) -> Status {
        Status {
            name: self.config.name.clone(),
            phase: self.phase(),
            watermark: self.watermark,
            ready: self.ready,
            keys: self.index.len(),
            counters: self.counters,
        }
    }

    // ---- poll_* ----

    /// The next decision, if any.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output<D::Value>> {
        self.out.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        self.next_timer().map(|(at, _)| at)
    }

    /// Why [`poll_timeout`](Self::poll_timeout) asks to be woken: the backoff its deadline
    /// ends (a lookup, a feed that failed or ended, a request that failed). `None` when no
    /// timeout is pending. For a driver's logs and an operator's status.
    #[must_use]
    pub fn timeout_cause(&self) -> Option<Cause> {
        self.next_timer().map(|(_, cause)| cause)
    }

    fn next_timer(&self) -> Option<(Time, Cause)> {
        let retry = self.retry_at.as_ref().map(|(at, request)| {
            let cause = match request {
                Request::Lookup => Cause::Lookup,
                _ => Cause::RequestFailed,
            };
            (*at, cause)
        });
        match (self.reopen_at, retry) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    // ---- handle_* ----

    /// Time passed: retries whose backoff is over happen now.
    pub fn handle_timeout(&mut self, now: Time) {
        if self.stopped {
            return;
        }
        if self.retry_at.as_ref().is_some_and(|(t, _)| *t <= now)
            && let Some((_, request)) = self.retry_at.take()
        {
            self.send(request);
        }
        if self.reopen_at.is_some_and(|(t, _)| t <= now) {
            self.reopen_at = None;
            self.maybe_open_feed();
        }
    }

    /// A fact happened at `now`.
    pub fn handle_input(&mut self, input: Input, now: Time) {
        if self.stopped {
            return;
        }
        match input {
            Input::SourceFound { token } => {
                if self
                    .take_request(token, |r| matches!(r, Request::Lookup))
                    .is_some()
                {
                    self.found = true;
                    self.lookup_backoff.reset();
                    if self.config.sync.syncs_by_reconcile() && !self.ready {
                        self.send(Request::Reconcile);
                    } else {
                        self.maybe_open_feed();
                    }
                }
            }
            Input::FeedOpened { token, info } => self.on_feed_opened(token, info, now),
            Input::Entry { token, entry } => {
                if !self.feed_is(token, true) {
                    self.counters.ignored += 1;
                } else if matches!(self.request, Some((_, Request::Fetch { .. }))) {
                    if self.held.len() >= MAX_HELD {
                        // The fetch is slow to come back: stop buffering and let the feed
                        // redeliver from watermark+1 once it has.
                        self.drop_feed();
                    } else {
                        self.held.push_back(entry);
                    }
                } else {
                    self.on_entry(entry);
                }
            }
            Input::Undecodable {
                token,
                position,
                seq,
                reason,
            } => {
                if !self.feed_is(token, true) {
                    self.counters.ignored += 1;
                    return;
                }
                self.invalid(
                    seq.unwrap_or(0),
                    String::new(),
                    InvalidReason::Undecodable(reason),
                );
                if let Some(seq) = seq
                    && seq > self.watermark
                    && !self.gapless()
                {
                    self.advance_on_feed(seq);
                }
                self.checkpoint(position);
            }
            Input::FeedFailed { token, error } => {
                if self.feed_is(token, false) {
                    self.drop_feed();
                    self.schedule_reopen(Cause::FeedFailed, error, now);
                } else {
                    self.counters.ignored += 1;
                }
            }
            Input::FeedEnded { token } => {
                if self.feed_is(token, false) {
                    self.drop_feed();
                    self.schedule_reopen(Cause::FeedEnded, "feed ended".into(), now);
                } else {
                    self.counters.ignored += 1;
                }
            }
            Input::Changes {
                token,
                changes,
                source_watermark,
            } => {
                if self
                    .take_request(token, |r| matches!(r, Request::Reconcile))
                    .is_some()
                {
                    self.failure_backoff.healthy(now);
                    self.on_changes(changes, source_watermark);
                }
            }
            Input::ChangesUnavailable {
                token,
                first_available,
            } => {
                if self
                    .take_request(token, |r| matches!(r, Request::Reconcile))
                    .is_some()
                {
                    let wanted = self.watermark + 1;
                    self.diag(Diagnostic::Compacted {
                        wanted,
                        first_available,
                    });
                    self.resync();
                }
            }
            Input::Snapshot {
                token,
                entries,
                source_watermark,
            } => {
                if self
                    .take_request(token, |r| matches!(r, Request::Snapshot))
                    .is_some()
                {
                    self.failure_backoff.healthy(now);
                    self.on_snapshot(entries, source_watermark);
                }
            }
            Input::Fetched { token, value } => {
                if let Some(Request::Fetch { key, seq, position }) =
                    self.take_request(token, |r| matches!(r, Request::Fetch { .. }))
                {
                    self.failure_backoff.healthy(now);
                    self.on_fetched(key, seq, position, value);
                }
            }
            Input::RequestFailed { token, error } => {
                if let Some(request) = self.take_request(token, |_| true) {
                    let (cause, backoff) = match request {
                        Request::Lookup => (Cause::Lookup, &mut self.lookup_backoff),
                        _ => (Cause::RequestFailed, &mut self.failure_backoff),
                    };
                    let delay = backoff.next_delay(now, &mut self.rng);
                    let attempt = backoff.attempt();
                    self.retry_at = Some((now.saturating_add(delay), request));
                    self.diag(Diagnostic::BackingOff {
                        cause,
                        attempt,
                        delay,
                        error,
                    });
                }
            }
            Input::Wake => {
                if !self.found
                    || matches!(self.request, Some((_, Request::Snapshot | Request::Lookup)))
                {
                    // The coming sync or resync reads the source anyway.
                } else if self.request.is_some() || self.retry_at.is_some() {
                    // A wake during a catch-up must cause another, or a commit that landed
                    // after the source was read would wait for the next wake.
                    self.rewake = true;
                } else {
                    self.send(Request::Reconcile);
                }
            }
            Input::Stop => {
                if let Some(feed) = self.feed.take() {
                    self.out.push_back(Output::CloseFeed { token: feed.token });
                }
                self.request = None;
                self.retry_at = None;
                self.reopen_at = None;
                self.held.clear();
                self.stopped = true;
                self.out.push_back(Output::Stopped);
            }
        }
    }

    // ---- internals ----

    fn token(&mut self) -> Token {
        self.next_token += 1;
        Token(self.next_token)
    }

    fn diag(&mut self, d: Diagnostic) {
        self.out.push_back(Output::Diagnostic(d));
    }

    fn send(&mut self, request: Request) {
        let token = self.token();
        let output = match &request {
            Request::Lookup => Output::LookupSource { token },
            Request::Reconcile => Output::Reconcile {
                token,
                since: self.watermark,
            },
            Request::Snapshot => Output::Snapshot { token },
            Request::Fetch { key, seq, .. } => Output::Fetch {
                token,
                key: key.clone(),
                seq: *seq,
            },
        };
        self.request = Some((token, request));
        self.out.push_back(output);
    }

    fn take_request(&mut self, token: Token, kind: impl Fn(&Request) -> bool) -> Option<Request> {
        match &self.request {
            Some((t, r)) if *t == token && kind(r) => self.request.take().map(|(_, r)| r),
            _ => {
                self.counters.ignored += 1;
                None
            }
        }
    }

    /// Opens the feed if it should be open and nothing stands in the way.
    fn maybe_open_feed(&mut self) {
        if !self.config.sync.uses_feed()
            || self.stopped
            || !self.found
            || self.feed.is_some()
            || self.request.is_some()
            || self.retry_at.is_some()
            || self.reopen_at.is_some()
        {
            return;
        }
        if self.opened_once {
            self.counters.reopens += 1;
        }
        self.opened_once = true;
        let token = self.token();
        let from = self.watermark + 1;
        self.feed = Some(OpenFeed {
            token,
            from,
            info: None,
            last_seq: 0,
        });
        self.out.push_back(Output::OpenFeed {
            token,
            from,
            after_position: self.last_checkpoint,
        });
    }

    /// What follows a finished request: a pending wake, then the feed.
    fn settle(&mut self) {
        if self.stopped || self.request.is_some() {
            return;
        }
        if self.rewake {
            self.rewake = false;
            self.send(Request::Reconcile);
            return;
        }
        self.maybe_open_feed();
    }

    fn feed_is(&self, token: Token, opened: bool) -> bool {
        self.feed
            .as_ref()
            .is_some_and(|f| f.token == token && (!opened || f.info.is_some()))
    }

    /// Whether the feed is the source's own history (a change log, a KV watch): its seqs
    /// arrive in order, so an entry moves the watermark, a jump is a gap, and its head is
    /// the source's. An announcements stream is none of these; only a reconcile speaks for
    /// the source there.
    fn feed_speaks_for_source(&self) -> bool {
        self.config.sync == Sync::Feed
    }

    /// Whether a jump past watermark+1 is a gap: on a gapless feed, and only where feed
    /// entries move the watermark (announcements do not, so every jump would look like one).
    fn gapless(&self) -> bool {
        self.feed_speaks_for_source()
            && self
                .feed
                .as_ref()
                .and_then(|f| f.info)
                .is_some_and(|i| i.continuity == Continuity::Gapless)
    }

    fn drop_feed(&mut self) {
        if let Some(feed) = self.feed.take() {
            self.out.push_back(Output::CloseFeed { token: feed.token });
        }
        self.held.clear();
    }

    fn schedule_reopen(&mut self, cause: Cause, error: String, now: Time) {
        let backoff = match cause {
            Cause::FeedEnded => &mut self.end_backoff,
            _ => &mut self.failure_backoff,
        };
        let delay = backoff.next_delay(now, &mut self.rng);
        let attempt = backoff.attempt();
        self.reopen_at = Some((now.saturating_add(delay), cause));
        self.diag(Diagnostic::BackingOff {
            cause,
            attempt,
            delay,
            error,
        });
    }

    fn on_feed_opened(&mut self, token: Token, info: FeedInfo, now: Time) {
        let Some(feed) = self
            .feed
            .as_mut()
            .filter(|f| f.token == token && f.info.is_none())
        else {
            self.counters.ignored += 1;
            return;
        };
        feed.info = Some(info);
        let from = feed.from;
        self.failure_backoff.healthy(now);
        self.end_backoff.healthy(now);
        // A sparse feed replayed into an empty cache is itself a full sync: the server keeps
        // the latest entry of every key, so a compacted prefix hides nothing we hold.
        let empty_replay =
            info.continuity == Continuity::Sparse && self.watermark == 0 && self.index.is_empty();
        // Only a replayed change feed reports the source's head; an announcements stream
        // reports its own.
        if self.feed_speaks_for_source() && info.head < self.watermark {
            // Behind us: either the newest entries were purged (a resync sorts that out) or
            // this is a new history; the snapshot's watermark tells which.
            let watermark = self.watermark;
            self.diag(Diagnostic::HeadBehind {
                head: info.head,
                watermark,
            });
            self.drop_feed();
            self.resync();
            return;
        }
        if info.first_available > from && !empty_replay {
            self.diag(Diagnostic::Compacted {
                wanted: from,
                first_available: info.first_available,
            });
            self.drop_feed();
            self.resync();
            return;
        }
        self.check_ready(info.head);
    }

    /// The feed or the source cannot bring the cache up to date from its watermark: resync
    /// from a snapshot.
    fn resync(&mut self) {
        self.counters.resyncs += 1;
        if self.feed.is_some() {
            self.drop_feed();
        }
        self.send(Request::Snapshot);
    }

    /// A replayed feed completes the initial sync once the watermark reaches its head;
    /// other modes become ready from a reconcile.
    fn check_ready(&mut self, head: u64) {
        if !self.ready && self.feed_speaks_for_source() && self.watermark >= head {
            self.become_ready();
        }
    }

    fn become_ready(&mut self) {
        if !self.ready {
            self.ready = true;
            self.out.push_back(Output::Ready {
                watermark: self.watermark,
            });
        }
    }

    fn advance(&mut self, seq: u64) {
        if seq > self.watermark {
            self.watermark = seq;
            if !self.tombstones.is_empty() {
                self.tombstones.retain(|_, s| *s > seq);
            }
        }
    }

    /// Makes room in an empty key index for the `pending` entries the feed says are still
    /// to come in an initial sync, rather than growing (and rehashing) it a dozen times on
    /// the way. For a KV bucket's first sync that count is the number of keys; for a stream
    /// replayed from its start it counts every message, so it is only a hint: taken once,
    /// and bounded (2^17 entries, at most about 8 MiB of index) so a long history of a few
    /// keys cannot reserve much.
    fn presize(&mut self, pending: u64) {
        const LIMIT: u64 = 1 << 17;
        let want = usize::try_from(pending.min(LIMIT)).unwrap_or(0) + 1;
        if self.index.capacity() - self.index.len() < want {
            self.index.reserve(want);
        }
    }

    fn checkpoint(&mut self, position: u64) {
        let wants = self
            .feed
            .as_ref()
            .and_then(|f| f.info)
            .is_some_and(|i| i.checkpoints);
        if wants && self.last_checkpoint.is_none_or(|last| position > last) {
            self.last_checkpoint = Some(position);
            self.out.push_back(Output::Checkpoint { position });
        }
    }

    fn invalid(&mut self, seq: u64, key: String, reason: InvalidReason) {
        self.counters.invalid += 1;
        let key = if key.len() > 128 {
            crate::limits::shorten(&key, 128)
        } else {
            key
        };
        self.diag(Diagnostic::InvalidEntry { seq, key, reason });
    }

    fn check_key(&self, key: &str) -> Result<(), InvalidReason> {
        crate::limits::check_key(key, self.config.max_key_bytes).map_err(|p| match p {
            KeyProblem::Empty => InvalidReason::EmptyKey,
            KeyProblem::TooLong { len } => InvalidReason::KeyTooLong { len },
            KeyProblem::ControlCharacter => InvalidReason::ControlCharacterInKey,
        })
    }

    fn on_entry(&mut self, entry: Entry) {
        let Entry {
            position,
            seq,
            key,
            op,
            value,
            pending,
        } = entry;
        if let Some(pending) = pending
            && !self.ready
            && self.index.is_empty()
        {
            self.presize(pending);
        }
        if seq == 0 {
            self.invalid(0, key, InvalidReason::ZeroSeq);
            self.checkpoint(position);
            return;
        }
        let (last_seq, head) = match self.feed.as_mut() {
            Some(f) => {
                let last = f.last_seq;
                f.last_seq = f.last_seq.max(seq);
                (last, f.info.map_or(0, |i| i.head))
            }
            None => (0, 0),
        };
        if seq <= self.watermark {
            if seq < last_seq {
                self.diag(Diagnostic::SeqRegressed {
                    previous: last_seq,
                    got: seq,
                });
            }
            self.counters.stale += 1;
            self.checkpoint(position);
            return;
        }
        if seq > self.watermark + 1 && self.gapless() {
            self.counters.gaps += 1;
            self.diag(Diagnostic::Gap {
                expected: self.watermark + 1,
                got: seq,
            });
            self.drop_feed();
            if self.request.is_none() {
                self.send(Request::Reconcile);
            }
            return;
        }
        if op == Op::Mutation && self.check_key(&key).is_ok() && !self.newer_in_cache(&key, seq) {
            self.send(Request::Fetch { key, seq, position });
            return;
        }
        self.apply(seq, key, op, value);
        self.advance_on_feed(seq);
        self.checkpoint(position);
        self.check_ready(head);
    }

    /// The seq of the newest change the cache reflects for `key`: its value, or a removal
    /// applied above the watermark.
    fn key_seq(&self, key: &str) -> Option<u64> {
        let held = self.index.get(key).copied();
        if self.tombstones.is_empty() {
            return held;
        }
        held.max(self.tombstones.get(key).copied())
    }

    fn newer_in_cache(&self, key: &str, seq: u64) -> bool {
        self.key_seq(key).is_some_and(|s| s >= seq)
    }

    /// A feed entry at `seq` was handled. Feeds that deliver in seq order move the
    /// watermark; an announcements stream can reorder and lose entries, so there only a
    /// reconcile moves it, and per-key seqs (with tombstones) keep applies never-older.
    fn advance_on_feed(&mut self, seq: u64) {
        if self.feed_speaks_for_source() {
            self.advance(seq);
        }
    }

    /// Applies one change above the watermark, with the per-key never-older rule.
    /// Returns (puts applied, removals applied).
    fn apply(&mut self, seq: u64, key: String, op: Op, value: Vec<u8>) -> (usize, usize) {
        if let Err(reason) = self.check_key(&key) {
            self.invalid(seq, key, reason);
            return (0, 0);
        }
        match op.cache_change() {
            CacheChange::Upsert => {
                if value.len() > self.config.max_value_bytes {
                    self.invalid(seq, key, InvalidReason::ValueTooLarge { len: value.len() });
                    return (0, 0);
                }
                if !self.tombstones.is_empty() && self.tombstones.get(key.as_str()) >= Some(&seq) {
                    self.counters.stale += 1;
                    return (0, 0);
                }
                // One hash lookup for a key the cache holds, one more to insert a new one:
                // this is the hot path of every sync.
                let held = self.index.get_mut(key.as_str());
                if held.as_deref().is_some_and(|&have| have >= seq) {
                    self.counters.stale += 1;
                    return (0, 0);
                }
                match self.decoder.decode(&key, value) {
                    Ok(value) => {
                        match held {
                            Some(have) => *have = seq,
                            None => {
                                self.index.insert(key.clone(), seq);
                            }
                        }
                        if !self.tombstones.is_empty() {
                            self.tombstones.remove(key.as_str());
                        }
                        self.counters.applied += 1;
                        self.out.push_back(Output::Put { key, seq, value });
                        (1, 0)
                    }
                    Err(e) => {
                        self.counters.poison += 1;
                        let error = e.to_string();
                        self.diag(Diagnostic::DecodeFailed { key, seq, error });
                        (0, 0)
                    }
                }
            }
            CacheChange::Remove => {
                if self.newer_in_cache(&key, seq) {
                    self.counters.stale += 1;
                    return (0, 0);
                }
                if self.config.sync == Sync::Announcements && seq > self.watermark {
                    self.tombstones.insert(key.clone(), seq);
                }
                if self.index.remove(key.as_str()).is_none() {
                    return (0, 0);
                }
                self.counters.removed += 1;
                self.out.push_back(Output::Remove { key, seq });
                (0, 1)
            }
            CacheChange::Fetch => {
                self.invalid(seq, key, InvalidReason::UnexpectedInRows);
                (0, 0)
            }
            CacheChange::Skip => {
                let Op::Unknown(name) = op else { return (0, 0) };
                self.invalid(seq, key, InvalidReason::UnknownOperation(name));
                (0, 0)
            }
        }
    }

    fn on_fetched(&mut self, key: String, seq: u64, position: u64, value: Option<(u64, Vec<u8>)>) {
        self.counters.fetches += 1;
        match value {
            // The value may be newer than the marker; the index keeps its own seq so an
            // older entry for the key arriving later is skipped.
            Some((value_seq, bytes)) => {
                self.apply(value_seq.max(seq), key, Op::Put, bytes);
            }
            None => {
                self.apply(seq, key, Op::Delete, Vec::new());
            }
        }
        self.advance_on_feed(seq);
        self.checkpoint(position);
        let head = self
            .feed
            .as_ref()
            .and_then(|f| f.info)
            .map_or(u64::MAX, |i| i.head);
        self.check_ready(head);
        while self.request.is_none()
            && let Some(entry) = self.held.pop_front()
        {
            self.on_entry(entry);
        }
        self.settle();
    }

    fn on_changes(&mut self, changes: Vec<Entry>, source_watermark: u64) {
        self.counters.reconciles += 1;
        if source_watermark < self.watermark {
            // The source is behind what we applied: only a snapshot can say what it holds.
            self.resync();
            return;
        }
        let floor = self.watermark;
        let (mut applied, mut removed, mut top) = (0, 0, source_watermark);
        for change in changes {
            top = top.max(change.seq);
            if change.seq == 0 {
                self.invalid(0, change.key, InvalidReason::ZeroSeq);
            } else if change.seq <= floor {
                self.counters.stale += 1;
            } else {
                let (a, r) = self.apply(change.seq, change.key, change.op, change.value);
                applied += a;
                removed += r;
            }
        }
        self.advance(top);
        let watermark = self.watermark;
        self.diag(Diagnostic::Reconciled {
            applied,
            removed,
            watermark,
        });
        // A reconcile reads the source up to its watermark: whatever the cache held before,
        // it now holds every current entry.
        self.become_ready();
        self.settle();
    }

    fn on_snapshot(&mut self, entries: Vec<Entry>, source_watermark: u64) {
        let reset = source_watermark < self.watermark;
        if reset {
            // A new history: seqs held from the old one mean nothing against it. Forget
            // them, so every snapshot entry is applied and every other key removed.
            self.counters.resets += 1;
            let watermark = self.watermark;
            self.diag(Diagnostic::SourceReset {
                watermark,
                source_watermark,
            });
            self.watermark = 0;
            self.tombstones.clear();
            for seq in self.index.values_mut() {
                *seq = 0;
            }
        }
        let present: HashSet<&str> = entries.iter().map(|e| e.key.as_str()).collect();
        // A key missing from the snapshot is gone, unless the cache holds it at a seq past
        // the snapshot (applied from a fetch or an announcement after it was read).
        let mut gone: Vec<String> = self
            .index
            .iter()
            .filter(|(k, seq)| **seq <= source_watermark && !present.contains(k.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        drop(present);
        gone.sort_unstable();
        let removal_seq = source_watermark.max(self.watermark);
        for key in &gone {
            self.index.remove(key.as_str());
            self.counters.removed += 1;
            self.out.push_back(Output::Remove {
                key: key.clone(),
                seq: removal_seq,
            });
        }
        let mut top = source_watermark;
        for entry in entries {
            top = top.max(entry.seq);
            if entry.seq == 0 {
                self.invalid(0, entry.key, InvalidReason::ZeroSeq);
            } else if entry.op != Op::Put {
                self.invalid(entry.seq, entry.key, InvalidReason::UnexpectedInRows);
            } else if self.index.get(entry.key.as_str()) != Some(&entry.seq) {
                self.apply(entry.seq, entry.key, Op::Put, entry.value);
            }
        }
        self.advance(top);
        let watermark = self.watermark;
        self.diag(Diagnostic::Resynced {
            removed: gone.len(),
            watermark,
        });
        self.become_ready();
        self.settle();
    }
}
