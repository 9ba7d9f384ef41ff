//! The source's messages: a [`Request`] for every port method a client calls on the
//! source host, the [`Response`] it answers with, and the wire forms of the port types
//! they carry. Each other service has its own file beside this one; the enums here carry
//! their calls and answers as variants, in an order kept so every variant keeps its tag.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tidemark::tidemark_core::{
    AnnouncePlan, AnnounceReport, Continuity, Entry, FeedInfo, Follow, Job, JobId, Lineage, Op,
};
use tidemark::{Claimed, OutboxRow, OutboxUpdate};

use super::jetstream::{JsAnswer, JsCall};
use super::queue::{QueueAnswer, QueueCall};
use super::sweeps::{SweepAnswer, SweepCall};

/// A client's request. Fields mirror the port methods of the same names.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// Source::put; `announced`: through the announcing source, which writes an outbox
    /// row in the same step as the write.
    Put {
        key: String,
        value: Vec<u8>,
        announced: bool,
    },
    /// Source::update.
    Update {
        key: String,
        value: Vec<u8>,
        expected: u64,
        announced: bool,
    },
    /// Source::remove.
    Remove { key: String, announced: bool },
    /// Source::watermark.
    Watermark,
    /// Source::changes_since.
    ChangesSince { since: u64 },
    /// Source::snapshot.
    Snapshot,
    /// Source::get.
    Get { key: String },
    /// Source::get_at: the value and the watermark, read at one point.
    GetAt { key: String },
    /// Source::first_available.
    FirstAvailable,
    /// Open the source's change log at `from`; the connection then streams items.
    OpenFeed { from: u64 },
    /// Open the events stream after `after` (a position); the connection then streams
    /// items.
    OpenEvents { after: Option<u64> },
    /// Publish an announcement to the events stream (`by`: the relay publishing it).
    Publish {
        key: String,
        payload: Vec<u8>,
        by: Option<String>,
    },
    /// Notify a wake channel.
    Notify { channel: String, payload: Vec<u8> },
    /// Listen on a wake channel; the connection then streams wakes.
    Listen { channel: String },
    /// Cursors::load: the events-stream position saved under `name`.
    LoadCursor { name: String },
    /// Cursors::save: save `position` under `name` (monotone).
    SaveCursor { name: String, position: u64 },
    /// Outbox::claim.
    Claim {
        owner: String,
        after: u64,
        max: usize,
        lease: Duration,
    },
    /// Outbox::complete.
    Complete {
        owner: String,
        updates: Vec<WireUpdate>,
    },
    /// Outbox::pending.
    PendingRows,
    /// Watch the outbox; the connection then streams `Changed` (or heartbeats).
    WatchOutbox,
    /// A call on the source host's job queue.
    Queue(QueueCall),
    /// A call on the source host's sweeper lock, schedules or sweep.
    Sweeps(SweepCall),
    /// A call on the source host's JetStream (last, so the other variants keep their wire
    /// tags).
    JetStream(JsCall),
    /// Source::lineage_at.
    LineageAt { seq: u64 },
    /// Source::changes_and_lineage: the changes since `since` and the lineage there, read
    /// at one point.
    ChangesAndLineage { since: u64 },
}

/// An announcement plan on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WirePlan {
    pub key: String,
    pub payload: Vec<u8>,
    pub publish: bool,
    pub notify: bool,
    #[serde(with = "crate::wire::job::opt")]
    pub job: Option<Job>,
    pub as_marker: bool,
}

/// What an announcement achieved, on the wire.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireReport {
    pub published: bool,
    pub notified: bool,
    pub enqueued: Option<JobId>,
    pub as_marker: bool,
}

/// An outbox row on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireRow {
    pub id: u64,
    pub seq: u64,
    pub plan: WirePlan,
    pub landed: WireReport,
}

/// A relay's record of one row, on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireUpdate {
    pub id: u64,
    pub landed: WireReport,
    pub done: bool,
}

impl From<AnnounceReport> for WireReport {
    fn from(r: AnnounceReport) -> Self {
        WireReport {
            published: r.published,
            notified: r.notified,
            enqueued: r.enqueued,
            as_marker: r.as_marker,
        }
    }
}

impl From<WireReport> for AnnounceReport {
    fn from(w: WireReport) -> Self {
        AnnounceReport {
            published: w.published,
            notified: w.notified,
            enqueued: w.enqueued,
            as_marker: w.as_marker,
        }
    }
}

impl From<OutboxRow> for WireRow {
    fn from(r: OutboxRow) -> Self {
        WireRow {
            id: r.id,
            seq: r.seq,
            plan: WirePlan {
                key: r.plan.key,
                payload: r.plan.payload,
                publish: r.plan.publish,
                notify: r.plan.notify,
                job: r.plan.job,
                as_marker: r.plan.as_marker,
            },
            landed: r.landed.into(),
        }
    }
}

impl From<WireRow> for OutboxRow {
    fn from(w: WireRow) -> Self {
        OutboxRow {
            id: w.id,
            seq: w.seq,
            plan: AnnouncePlan {
                key: w.plan.key,
                payload: w.plan.payload,
                publish: w.plan.publish,
                notify: w.plan.notify,
                job: w.plan.job,
                as_marker: w.plan.as_marker,
            },
            landed: w.landed.into(),
        }
    }
}

impl From<OutboxUpdate> for WireUpdate {
    fn from(u: OutboxUpdate) -> Self {
        WireUpdate {
            id: u.id,
            landed: u.landed.into(),
            done: u.done,
        }
    }
}

impl From<WireUpdate> for OutboxUpdate {
    fn from(w: WireUpdate) -> Self {
        OutboxUpdate {
            id: w.id,
            landed: w.landed.into(),
            done: w.done,
        }
    }
}

/// What a claim got, on the wire.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireClaimed {
    pub rows: Vec<WireRow>,
    pub held_by_others: Option<Duration>,
}

impl From<Claimed> for WireClaimed {
    fn from(c: Claimed) -> Self {
        WireClaimed {
            rows: c.rows.into_iter().map(WireRow::from).collect(),
            held_by_others: c.held_by_others,
        }
    }
}

impl From<WireClaimed> for Claimed {
    fn from(w: WireClaimed) -> Self {
        Claimed {
            rows: w.rows.into_iter().map(OutboxRow::from).collect(),
            held_by_others: w.held_by_others,
        }
    }
}

/// An entry on the wire.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireEntry {
    /// Feed position.
    pub position: u64,
    /// Source seq.
    pub seq: u64,
    /// Key.
    pub key: String,
    /// `put`, `delete`, `purge`, `mutation`, or anything else.
    pub op: String,
    /// Value bytes (puts only).
    pub value: Vec<u8>,
    /// The source's stamp of the mutation.
    pub stamp: Option<u64>,
}

/// A source's history and a stamp, on the wire (see [`Lineage`]).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireLineage {
    pub history: Option<u64>,
    pub stamp: Option<u64>,
}

impl From<Lineage> for WireLineage {
    fn from(l: Lineage) -> Self {
        WireLineage {
            history: l.history,
            stamp: l.stamp,
        }
    }
}

impl From<WireLineage> for Lineage {
    fn from(w: WireLineage) -> Self {
        Lineage::new(w.history, w.stamp)
    }
}

impl From<Entry> for WireEntry {
    fn from(e: Entry) -> Self {
        let op = match e.op {
            Op::Put => "put".to_owned(),
            Op::Delete => "delete".to_owned(),
            Op::Purge => "purge".to_owned(),
            Op::Mutation => "mutation".to_owned(),
            Op::Unknown(name) => name,
            _ => "unknown".to_owned(),
        };
        WireEntry {
            position: e.position,
            seq: e.seq,
            key: e.key.to_string(),
            op,
            value: e.value,
            stamp: e.stamp,
        }
    }
}

impl From<WireEntry> for Entry {
    fn from(w: WireEntry) -> Self {
        let op = match w.op.as_str() {
            "put" => Op::Put,
            "delete" => Op::Delete,
            "purge" => Op::Purge,
            "mutation" => Op::Mutation,
            _ => Op::Unknown(w.op),
        };
        Entry::new(w.position, w.seq, w.key, op, w.value).stamped(w.stamp)
    }
}

/// A feed's opening report on the wire.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireFeedInfo {
    /// First seq servable.
    pub first_available: u64,
    /// Head at open.
    pub head: u64,
    /// Gapless (true) or sparse.
    pub gapless: bool,
    /// A change log read over a key prefix (neither gapless nor sparse).
    #[serde(default)]
    pub filtered: bool,
    /// Wants checkpoints.
    pub checkpoints: bool,
    /// A stream of announcements (true) or the source's own history.
    pub announcements: bool,
    /// What the feed said of its source's history.
    pub lineage: WireLineage,
}

impl From<FeedInfo> for WireFeedInfo {
    fn from(i: FeedInfo) -> Self {
        WireFeedInfo {
            first_available: i.first_available,
            head: i.head,
            gapless: i.continuity == Continuity::Gapless,
            filtered: i.continuity == Continuity::Filtered,
            checkpoints: i.checkpoints,
            announcements: i.follow == Follow::Announcements,
            lineage: i.lineage.into(),
        }
    }
}

impl From<WireFeedInfo> for FeedInfo {
    fn from(w: WireFeedInfo) -> Self {
        FeedInfo {
            first_available: w.first_available,
            head: w.head,
            continuity: match (w.gapless, w.filtered) {
                (true, _) => Continuity::Gapless,
                (false, true) => Continuity::Filtered,
                (false, false) => Continuity::Sparse,
            },
            checkpoints: w.checkpoints,
            follow: if w.announcements {
                Follow::Announcements
            } else {
                Follow::Replay
            },
            lineage: w.lineage.into(),
        }
    }
}

/// The source host's answer. Fields mirror the port results of the same names.
#[allow(missing_docs)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Response {
    /// A seq (put, update, watermark, first available).
    Seq(u64),
    /// A removal's seq, or none if the key was absent.
    MaybeSeq(Option<u64>),
    /// Changes since a seq and the watermark.
    Changes {
        entries: Vec<WireEntry>,
        watermark: u64,
    },
    /// The source can no longer serve changes since the requested seq.
    Compacted { first_available: u64 },
    /// A snapshot.
    Snapshot {
        entries: Vec<WireEntry>,
        watermark: u64,
        lineage: WireLineage,
    },
    /// A value and its seq, or none.
    Value(Option<(u64, Vec<u8>)>),
    /// A value and the source's watermark, read at one point.
    ValueAt {
        value: Option<(u64, Vec<u8>)>,
        watermark: u64,
    },
    /// The feed opened; items follow.
    FeedOpened(WireFeedInfo),
    /// A feed item.
    Item(WireEntry),
    /// An item on the feed that is not an entry.
    Undecodable {
        position: u64,
        seq: Option<u64>,
        reason: String,
    },
    /// A wake.
    Wake(Vec<u8>),
    /// Nothing happened for a while, but the connection is alive (a partition sends no
    /// reset, so silence must be told apart from a dead link).
    Heartbeat,
    /// Done.
    Ok,
    /// The server's port failed; the message says why.
    Failed(String),
    /// The stream ended cleanly.
    End,
    /// Rows claimed from the outbox.
    Claimed(WireClaimed),
    /// The outbox changed (a watch's item).
    Changed,
    /// A job queue call's answer.
    Queue(QueueAnswer),
    /// A retention call's answer.
    Sweeps(SweepAnswer),
    /// The head a feed's initial sync must reach moved up (last, so the other variants
    /// keep their wire tags).
    Head(u64),
    /// A JetStream call's answer.
    JetStream(JsAnswer),
    /// What the source says of its history at a seq.
    Lineage(WireLineage),
    /// Changes (or their compaction) and the lineage at the seq they were asked since.
    ChangesAndLineage(Box<Response>, WireLineage),
}

impl From<JsAnswer> for Response {
    fn from(a: JsAnswer) -> Self {
        Response::JetStream(a)
    }
}
