//! What a follower shows: where it is, what it has done, and what it logs.

use std::time::Duration;

/// Where a follower is, for an operator.
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
    /// Times the sink failed and the follower went back to its last commit.
    pub rewinds: u64,
    /// Values removed because they aged out where the source drops them silently.
    pub expired: u64,
    /// Keys removed because a listing of the source no longer had them.
    pub vanished: u64,
    /// Entries (and warm-start keys) passed because their key is outside the follower's
    /// prefix ([`Follower::within`](crate::Follower::within)).
    pub outside: u64,
    /// Times the path to the source answered again after a stall with no reconnect
    /// ([`Input::Resumed`](crate::Input::Resumed)), each a reason to retry at once.
    pub resumes: u64,
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
    /// The seed of its jitter: with the same inputs, the same seed replays the run.
    pub seed: u64,
    /// What it knows of its source's history at its watermark (see
    /// [`Lineage`](crate::lineage::Lineage)).
    pub lineage: crate::lineage::Lineage,
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
    /// An announcement's seq is further past the source's last known watermark than
    /// [`FollowerConfig::max_ahead`](crate::FollowerConfig::max_ahead) allows.
    SeqAhead {
        /// The source's last known watermark.
        known: u64,
    },
    /// An announcement the source's own answer does not confirm (a foreign producer, a
    /// corrupt or replayed payload): what it put in the cache was replaced by the
    /// source's state.
    Unconfirmed,
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
    /// The sink failed to apply or commit; the follower went back to its last commit.
    SinkFailed,
    /// Not a backoff: a cached value reaches its age limit.
    Expiry,
    /// Not a backoff: the periodic listing of the source's keys is due.
    PresenceCheck,
    /// Not a backoff: announcements applied to the cache await a read of the source that
    /// confirms them ([`FollowerConfigBuilder::confirm_after`](crate::FollowerConfigBuilder::confirm_after)).
    Confirm,
    /// A durable cursor's save failed: it is asked for again
    /// ([`Input::CheckpointFailed`](crate::Input::CheckpointFailed)). Not a backoff of the
    /// source's path: the follower is not backing off while it waits.
    Checkpoint,
}

/// Something a driver should log. None of these stop the follower, and nothing but a log
/// may act on one: what a caller awaits comes as a [`Notice`](crate::Notice).
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
    /// The feed can no longer serve watermark+1, but its source keeps only a history per
    /// key ([`Continuity::PerKey`](crate::Continuity::PerKey)): what is gone was written
    /// again or purged. The follower lists the source's keys once and resumes.
    Rewritten {
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
    /// A read of the source contradicted what the follower knows of its history (another
    /// history id, or another stamp at its watermark: a source recreated, or restored from
    /// a backup and written past the watermark since). The follower takes the new
    /// history: it resyncs, and the snapshot replaces the cache whatever seqs it held
    /// (counted in [`Counters::resets`]).
    HistoryChanged {
        /// The follower's watermark.
        watermark: u64,
        /// What the follower knew of its history at the watermark.
        held: crate::lineage::Lineage,
        /// What the read said.
        read: crate::lineage::Lineage,
    },
    /// The feed delivered the entry at the watermark with another stamp than the one the
    /// follower holds there: the feed was opened on another history than the one the cache
    /// now holds (a read of the source restored from a backup went past the restore while
    /// the feed still delivered what it read before). The feed is closed and opened again
    /// from watermark+1, where its opening checks the source's history at the watermark.
    FeedOfAnotherHistory {
        /// The follower's watermark.
        watermark: u64,
        /// The stamp the follower holds at the watermark.
        held: u64,
        /// The stamp the feed's entry carried.
        fed: u64,
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
    /// The feed declared another way of following than the follower was set up for; the
    /// follower follows the feed.
    FollowChanged {
        /// How it followed before.
        from: crate::follower::Follow,
        /// How the feed says it must be followed.
        to: crate::follower::Follow,
    },
    /// The sink failed; the follower went back to its last commit.
    Rewound {
        /// The watermark it went back to.
        watermark: u64,
        /// The sink's failure.
        error: String,
    },
    /// A listing of the source's keys failed (or the source cannot list); it is tried
    /// again at the next interval.
    ListingFailed {
        /// The failure, as the driver reported it.
        error: String,
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
