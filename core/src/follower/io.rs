//! What goes in and out of a follower: the facts a driver reports ([`Input`]) and the
//! decisions it carries out ([`Output`]), grouped by who acts on them.

use std::sync::Arc;

use crate::entry::Entry;
use crate::follower::status::Diagnostic;
use crate::lineage::Lineage;

/// Ties a result to the request that asked for it. Results carrying an old token (a feed
/// that was since closed, a request that was since retried) are ignored and counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// How a follower must follow its feed. It is a property of the feed, not a setting: a
/// driver takes it from the feed it is given ([`FeedInfo::follow`] once open), so a
/// follower cannot be wired to a feed it cannot follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Follow {
    /// The feed is the source's own history (a change log, a KV watch): replay it from
    /// watermark+1 and keep following it. Entries move the watermark; ready once the
    /// replay reaches the feed's head.
    Replay,
    /// No feed: read the source's changes since the watermark on start and on every wake
    /// (the wake runner). Ready after the first reconcile. Never polls.
    WakeOnly,
    /// The feed is a stream of announcements that may miss, repeat or reorder changes (a
    /// writer can crash between commit and announce): reconcile from the source first —
    /// ready after that — then apply announcements as they come (per-key seqs keep them
    /// never-older), and reconcile again on every wake. Only a reconcile moves the
    /// watermark.
    Announcements,
}

impl Follow {
    /// Whether the follower keeps a feed open.
    #[must_use]
    pub fn uses_feed(self) -> bool {
        matches!(self, Follow::Replay | Follow::Announcements)
    }

    /// Whether the initial sync reads the source rather than replaying the feed.
    #[must_use]
    pub fn syncs_by_reconcile(self) -> bool {
        matches!(self, Follow::WakeOnly | Follow::Announcements)
    }
}

/// What a feed promises about the seqs it delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// Every seq appears, in order (a SQLite or memory change stream): a jump past
    /// watermark+1 is a gap, and the follower reconciles from its watermark.
    Gapless,
    /// Seqs may be skipped (a KV bucket keeping only the latest revision per key): the
    /// server's ordered delivery and head make it complete, and a replay from the start
    /// holds the latest entry of every key, however much history was compacted.
    Sparse,
    /// Every seq of the part of the source the feed carries appears in order, the rest
    /// are skipped (a change log read over a key prefix): no gap can be seen, and a replay
    /// from a compacted start misses keys, so it resyncs like a gapless feed.
    Filtered,
    /// [`Sparse`](Self::Sparse), from a source whose only limit is a history per key (a KV
    /// bucket without an age, count or size limit): a message leaves it only when its key
    /// is written again — the newer revision follows in the feed — or is purged on purpose,
    /// which leaves no trace. A first available seq past the follower's start is then no
    /// compaction: the follower lists the source's keys once, removes what it holds that
    /// the listing lacks, and resumes instead of resyncing in full.
    PerKey,
}

/// What a feed reported when it opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedInfo {
    /// The first seq the feed can still serve; 0 or 1 when nothing was ever compacted.
    /// Above the requested start it means history was compacted away.
    pub first_available: u64,
    /// The feed's last seq when it opened (0 for an empty source). For a replayed feed it
    /// is the source's: the initial sync is complete once the watermark reaches it. Take
    /// it from the stream's state (its last sequence), not from a consumer's pending count
    /// alone.
    pub head: u64,
    /// What the feed promises about seqs.
    pub continuity: Continuity,
    /// Whether the feed keeps a durable cursor that wants a checkpoint per entry.
    pub checkpoints: bool,
    /// How the feed must be followed. A follower that was told otherwise follows the feed.
    pub follow: Follow,
    /// What the source says of its history, with the stamp of its entry at the seq before
    /// the one the feed was opened at (the follower's watermark): a follower holding
    /// another takes the new history ([`Lineage`]). A feed that is not the source's own
    /// history (announcements) leaves it unknown.
    pub lineage: Lineage,
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
            follow: Follow::Replay,
            lineage: Lineage::default(),
        }
    }

    /// A KV bucket's history whose only limit is its history per key
    /// ([`Continuity::PerKey`]): as [`kv`](Self::kv), and a first available seq past the
    /// start is no compaction.
    #[must_use]
    pub fn kv_per_key(first_available: u64, head: u64) -> Self {
        FeedInfo {
            continuity: Continuity::PerKey,
            ..FeedInfo::kv(first_available, head)
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
            follow: Follow::Replay,
            lineage: Lineage::default(),
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
            follow: Follow::Announcements,
            lineage: Lineage::default(),
        }
    }

    /// The same feed, saying what its source says of its history (see
    /// [`lineage`](Self::lineage)).
    #[must_use]
    pub fn with_lineage(mut self, lineage: Lineage) -> Self {
        self.lineage = lineage;
        self
    }

    /// The same feed with a durable cursor that wants a checkpoint per entry.
    #[must_use]
    pub fn with_checkpoints(mut self) -> Self {
        self.checkpoints = true;
        self
    }

    /// A source's change log read over a key prefix: only the prefix's entries, in seq
    /// order ([`Continuity::Filtered`]); `head` from [`FeedInfo::filtered_head`].
    #[must_use]
    pub fn filtered_log(first_available: u64, head: u64) -> Self {
        FeedInfo {
            continuity: Continuity::Filtered,
            ..FeedInfo::change_log(first_available, head)
        }
    }

    /// The head a feed that delivers only part of a source's entries (a key prefix, the
    /// latest revision per key) reports when opened at `from`: the seq of the last entry
    /// it will deliver (`last_delivered`), or, when none at or past `from` is its,
    /// `from - 1` capped by the source's own last seq. A follower already caught up is then
    /// ready at once (the source's last seq may belong to another key, or name a message
    /// that is gone: an expired value, a purged delete marker), and one whose source went
    /// back (a last seq below `from - 1`) still sees a head behind its watermark.
    #[must_use]
    pub fn filtered_head(last_delivered: u64, source_last: u64, from: u64) -> u64 {
        last_delivered.max(source_last.min(from.saturating_sub(1)))
    }
}

/// A decision for the driver to carry out, in order. Grouped by who acts on it: a port
/// ([`Request`]), the cache or worker ([`Apply`]), whoever awaits the follower
/// ([`Notice`]), and the log ([`Diagnostic`], for logs only: nothing else may act on one).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Output<V> {
    /// Ask a port something.
    Request(Request),
    /// Change the cache (or call the worker).
    Apply(Apply<V>),
    /// Tell whoever waits on the follower.
    Notice(Notice),
    /// Something to log.
    Diagnostic(Diagnostic),
}

/// A call to a port. Those that ask something back are answered with the input named,
/// carrying the request's token.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
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
    /// Read a full snapshot of the source; answer [`Input::Snapshot`] (after zero or more
    /// [`Input::SnapshotPart`]s) or [`Input::RequestFailed`].
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
    /// List the keys the source holds now, with its watermark read first; answer
    /// [`Input::Keys`] or [`Input::RequestFailed`] (a source that cannot list: the check
    /// is tried again at the next interval, never with a backoff).
    ListKeys {
        /// The request's token.
        token: Token,
    },
    /// Save the feed's durable cursor at `position` (monotone: never lower than before).
    /// A driver with a durable sink saves it only after the sink committed the entries
    /// before it.
    Checkpoint {
        /// The position observed.
        position: u64,
    },
}

impl Request {
    /// The token an answer to this request must carry (none for a close or a
    /// checkpoint, which ask nothing back).
    #[must_use]
    pub fn token(&self) -> Option<Token> {
        match self {
            Request::LookupSource { token }
            | Request::OpenFeed { token, .. }
            | Request::Reconcile { token, .. }
            | Request::Snapshot { token }
            | Request::Fetch { token, .. }
            | Request::ListKeys { token } => Some(*token),
            Request::CloseFeed { .. } | Request::Checkpoint { .. } => None,
        }
    }
}

/// A change to the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Apply<V> {
    /// Upsert `key`.
    Put {
        /// The key, shared with the follower's index (and the feed's entry).
        key: Arc<str>,
        /// The seq of this value.
        seq: u64,
        /// The decoded value.
        value: V,
    },
    /// Remove `key`.
    Remove {
        /// The key.
        key: Arc<str>,
        /// The seq of the removal.
        seq: u64,
    },
    /// Each key keeps the value the sink holds for it, now as of its seq: a new history's
    /// entries whose values equal the held ones (asked only of a sink that said what it
    /// holds: [`Follower::handle_input_with`](crate::Follower::handle_input_with)). In
    /// order with the other changes of the batch, and in the same commit.
    Restamp {
        /// The keys and their new seqs.
        keys: Vec<(Arc<str>, u64)>,
    },
}

/// What the follower tells whoever waits on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Notice {
    /// The initial sync is complete: the cache holds every current entry of the source.
    /// Emitted once (again only after a [`Input::SinkFailed`] took readiness back).
    Ready {
        /// The watermark at that moment.
        watermark: u64,
    },
    /// A read of the source (a reconcile, or a resync from a snapshot) was applied: what
    /// it caught up. This answers a caller who asked for a reconcile.
    CaughtUp(CaughtUp),
    /// The follower stopped; it will decide nothing more.
    Stopped,
}

/// What one reconcile or resync caught up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaughtUp {
    /// Puts applied.
    pub applied: usize,
    /// Keys removed.
    pub removed: usize,
    /// The applied watermark afterwards.
    pub watermark: u64,
    /// Whether it was a full resync from a snapshot.
    pub resynced: bool,
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
    /// known, skipped over like a poison entry.
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
    /// The feed's head moved up before the follower reached it: a read that cannot race
    /// found the source past the head the feed reported when it opened (a key overwritten
    /// while the initial sync read its old revision is only above it). A replayed feed's
    /// initial sync is complete only once the watermark reaches this head too.
    FeedHead {
        /// The feed's token.
        token: Token,
        /// The new head.
        head: u64,
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
    /// What the read asked for under `token` (a reconcile, a snapshot, a listing) says of the
    /// source's history: the history, and the stamp of the source's entry at the seq the
    /// read names — a reconcile's `since`, a snapshot's watermark ([`Lineage`]). Reported
    /// just before the read's result (before its first part); a driver whose source cannot
    /// tell reports nothing. A reconcile whose lineage contradicts the follower's is not
    /// applied: the follower takes the new history, and the snapshot it reads replaces the
    /// cache whatever seqs it held.
    ///
    /// Read the lineage a reconcile reports *after* its changes (a restore between the two
    /// is then seen), and the one a snapshot reports *before* its entries (the follower
    /// keeps it with the snapshot's watermark: a restore between them is then seen by the
    /// next read).
    Lineage {
        /// The read's token.
        token: Token,
        /// What it says.
        lineage: Lineage,
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
    /// A part of a snapshot read part by part: some of its entries, in the source's key
    /// order, and the watermark the whole snapshot was read at. Zero or more parts, then
    /// [`Input::Snapshot`] with the rest (its `entries` may be empty) end the answer to
    /// one [`Request::Snapshot`]; a driver may also answer with the one
    /// [`Input::Snapshot`] alone.
    ///
    /// While parts arrive the follower keeps only what it needs: the keys named, and the
    /// entries that differ from its cache (every one when the snapshot is of a new
    /// history). The last part then changes the cache exactly as the whole snapshot would
    /// have. A part for another token is ignored like any stale answer. A part whose
    /// watermark differs from the first's (parts from different points in time) fails the
    /// read: what was kept is dropped and the snapshot read again after the failure
    /// backoff. Should the index change between parts (a value that expired after its
    /// part passed without its entry being kept, keys remembered), the follower drops what
    /// it kept and asks for the snapshot again under a new token; [`Input::SinkFailed`]
    /// and [`Input::RequestFailed`] for the token drop it too, and what they schedule
    /// reads again.
    SnapshotPart {
        /// The request's token.
        token: Token,
        /// Some of the current entries (puts), in key order.
        entries: Vec<Entry>,
        /// The source's watermark at the snapshot: the same in every part.
        source_watermark: u64,
    },
    /// A snapshot: every current entry of the source, and its watermark. After
    /// [`Input::SnapshotPart`]s, the last part: the entries no part carried.
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
        /// The source's watermark when the value was read (or read before it), where the
        /// driver knows it: the head of the history the source serves (its leader's or
        /// primary's, not a lagging replica's). A writer announces after it commits, so a
        /// head below the marker's seq says that history never made the marker's change (a
        /// marker of a history a restore or a recreation replaced): on an announcements
        /// stream the marker is passed, counted as unconfirmed, and the source read whole.
        /// A value older than the marker from a source whose head has passed it (a replica
        /// behind) is settled by a read of the whole source too, the marker judged again
        /// behind it. `None`: absence is taken as a removal, and an older value as a
        /// replica behind.
        source_watermark: Option<u64>,
    },
    /// The keys the source holds (a listing asked for by [`Request::ListKeys`]), and its
    /// watermark read before the listing. Its [`Input::Lineage`], read after the listing
    /// and reported before it, names the follower's watermark: a listing of another
    /// history drops nothing, and the follower takes the new history.
    Keys {
        /// The request's token.
        token: Token,
        /// Every key the source may hold (a key listed need not hold a value; a key not
        /// listed holds none).
        keys: Vec<String>,
        /// The source's watermark, read before the listing.
        source_watermark: u64,
    },
    /// A lookup, reconcile, snapshot, fetch or listing failed.
    RequestFailed {
        /// The request's token.
        token: Token,
        /// The failure, for the log.
        error: String,
    },
    /// A wake arrived: catch up from the source.
    Wake,
    /// The path to the source is back (the client reconnected, a supervisor restarts the
    /// follower): whatever waits out a backoff is tried now. The backoffs keep their
    /// attempt counts until something succeeds, so a source that is still away is not
    /// hammered; the first success then forgets the outage's failures
    /// ([`Backoff::outage_over`](crate::Backoff::outage_over)).
    Reconnected,
    /// The path to the source answers again after it stopped answering, with no
    /// reconnect (a server paused and continued: see [`Probes`](crate::Probes)): as
    /// [`Reconnected`](Self::Reconnected), whatever waits out a backoff is tried now, and
    /// it is counted ([`Counters::resumes`](crate::Counters::resumes)).
    Resumed,
    /// The sink could not take or commit what was applied since the last
    /// [`Follower::commit`](crate::Follower::commit): the follower goes back to that point (watermark, keys,
    /// readiness), closes its feed and reopens it after the failure backoff, so every
    /// change since is decided again.
    SinkFailed {
        /// The failure, for the log.
        error: String,
    },
    /// The save of a [`Request::Checkpoint`] failed (the store was away, or a reconnect
    /// cut it): the follower asks for it again after the failure backoff, and at once
    /// when the path is back, unless a later checkpoint asked for meanwhile supersedes it.
    /// Without this an entry observed last before an outage stayed unsaved until the next
    /// one arrived, however long that took.
    CheckpointFailed {
        /// The position whose save failed.
        position: u64,
        /// The failure, for the log.
        error: String,
    },
    /// Stop: close the feed and decide nothing more.
    Stop,
}
