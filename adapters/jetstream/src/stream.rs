//! What stream info says, and what it means: the first seq a replay can serve, the head an
//! initial sync must reach, whether a moved first sequence is compaction, and whether the
//! stream is the one read before.

/// A stream's state as its info reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamState {
    /// Messages it holds.
    pub messages: u64,
    /// The seq of its first message (or, when empty, one past the last).
    pub first_seq: u64,
    /// The seq of the last message ever stored (which may be gone).
    pub last_seq: u64,
}

/// The first seq a replay from the stream can still serve.
#[must_use]
pub fn first_available(state: &StreamState) -> u64 {
    if state.messages == 0 {
        state.last_seq + 1
    } else {
        state.first_seq.max(1)
    }
}

/// What a read of the last message present (for the view's subjects) found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LastPresent {
    /// The last message present has this seq.
    At(u64),
    /// No message is present for the view's subjects.
    None,
}

impl LastPresent {
    /// Its seq, 0 when none.
    #[must_use]
    pub fn seq(self) -> u64 {
        match self {
            LastPresent::At(seq) => seq,
            LastPresent::None => 0,
        }
    }
}

/// The head an initial sync must reach: the seq of the last message still present, which
/// every replay delivers (0 if none). The stream's last sequence can name a message that
/// is gone (a purged delete marker), which no replay would reach; so it is never the head
/// on its own.
#[must_use]
pub fn head(state: &StreamState, last: LastPresent) -> u64 {
    if state.messages == 0 { 0 } else { last.seq() }
}

/// Whether a view reading the subjects `filter` holds every message its stream holds: the
/// stream takes exactly those subjects (`subjects`, from its config) and copies nothing
/// from another stream (`copies`: a mirror or sources, whose messages keep subjects of
/// their own). Such a view is read without a subject filter: nats-server answers an
/// unfiltered consumer's pending count and first message from its totals, where a
/// wildcard filter — even one naming every subject of the stream — walks its index of
/// every subject the stream holds, once when the consumer is created and once at its
/// first message.
#[must_use]
pub fn whole_stream(subjects: &[String], copies: bool, filter: &str) -> bool {
    !copies && matches!(subjects, [only] if only == filter)
}

/// Whether a consumer of a view reads the stream unfiltered: only a view of the whole
/// stream ([`whole_stream`]), and when it asks for the last message per subject
/// (`last_per_subject`, which nats-server refuses without a filter) only on a stream that
/// keeps one message per subject (`per_subject`, its config's limit), where "all from the
/// first" delivers the same messages (nats-server itself starts such a consumer at the
/// first seq: `consumer.selectStartingSeqNo`). A stream that keeps more revisions (or was
/// changed to since its config was read) would deliver each of them: the same final value
/// per key, in order, at more cost.
#[must_use]
pub fn read_unfiltered(whole: bool, per_subject: i64, last_per_subject: bool) -> bool {
    whole && (!last_per_subject || per_subject == 1)
}

/// Where the read of the last message present for a view looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LastRead {
    /// At the message with this seq, the stream's last: when it is still there, it is the
    /// last message present of a view that holds the whole stream (nothing is stored
    /// above the last seq). When it is gone, look [`BySubjects`](Self::BySubjects).
    AtSeq(u64),
    /// The server's lookup of the last message for the view's subjects, which for a
    /// wildcard walks every subject the stream holds.
    BySubjects,
}

/// Where to read the last message present of a view ([`whole_stream`] or not) of a stream
/// in `state`.
#[must_use]
pub fn last_read(whole: bool, state: &StreamState) -> LastRead {
    if whole && state.messages > 0 && state.last_seq > 0 {
        LastRead::AtSeq(state.last_seq)
    } else {
        LastRead::BySubjects
    }
}

/// The limits a stream's config sets on what it keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Revisions kept per subject (a KV bucket's history); 0 or less: no such limit.
    pub per_subject: i64,
    /// The age limit, in nanoseconds (0: none).
    pub max_age_ns: u64,
    /// The message count limit (0 or less: none).
    pub max_messages: i64,
    /// The byte limit (0 or less: none).
    pub max_bytes: i64,
    /// Whether messages may carry a TTL of their own.
    pub message_ttl: bool,
}

/// Whether a message leaves the stream only when its subject is written again (its newer
/// revision stays) or is purged on purpose: a per-subject history and no other limit that
/// can drop a subject's latest message. A first sequence that moved past a follower's
/// start then says that what is gone was written again or purged, and a listing of the
/// keys — not a full resync — finds what the purges took
/// (`Continuity::PerKey` in the core).
#[must_use]
pub fn per_key_only(limits: &Limits) -> bool {
    limits.per_subject > 0
        && limits.max_age_ns == 0
        && limits.max_messages <= 0
        && limits.max_bytes <= 0
        && !limits.message_ttl
}

/// A stream's identity: when the server created it, in nanoseconds since the Unix epoch. A
/// stream deleted and made again has another, and its seqs start again at 1.
pub type Created = i128;

/// The kinds of read that each report a new stream once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// The feed.
    Feed,
    /// Changes since a seq.
    Changes,
    /// A snapshot.
    Snapshot,
}

/// Which stream each kind of read last found, against the stream the handle saw when the
/// reader was made: the first of each kind of read to find another one is told it is a
/// new history.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    /// The stream the reader started from (the handle's latest when the reader was made).
    start: Option<Created>,
    feed: Option<Created>,
    changes: Option<Created>,
    snapshot: Option<Created>,
}

impl Identity {
    /// A reader that starts from `start`, the stream its handle knows now (`None`: none
    /// yet; the first stream found is then taken as the one it follows).
    #[must_use]
    pub fn starting_from(start: Option<Created>) -> Self {
        Identity {
            start,
            ..Identity::default()
        }
    }

    /// Whether `stream`, found by a read of kind `reader`, is not the one that kind of
    /// read last found (or, before it found any, the one the reader started from): a new
    /// history. It is taken as found, so each kind of read reports a new stream once.
    pub fn is_new(&mut self, reader: Reader, stream: Created) -> bool {
        let slot = match reader {
            Reader::Feed => &mut self.feed,
            Reader::Changes => &mut self.changes,
            Reader::Snapshot => &mut self.snapshot,
        };
        let before = slot.or(self.start).unwrap_or(stream);
        *slot = Some(stream);
        before != stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_per_subject_history_makes_a_moved_first_sequence_no_compaction() {
        let kv = Limits {
            per_subject: 1,
            max_messages: -1,
            max_bytes: -1,
            ..Limits::default()
        };
        assert!(per_key_only(&kv));
        for lossy in [
            Limits {
                max_age_ns: 1,
                ..kv
            },
            Limits {
                max_messages: 10,
                ..kv
            },
            Limits {
                max_bytes: 10,
                ..kv
            },
            Limits {
                message_ttl: true,
                ..kv
            },
            Limits {
                per_subject: 0,
                ..kv
            },
        ] {
            assert!(!per_key_only(&lossy), "{lossy:?} can drop a latest message");
        }
    }

    #[test]
    fn each_kind_of_read_reports_a_new_stream_once() {
        let mut id = Identity::starting_from(Some(1));
        assert!(!id.is_new(Reader::Feed, 1));
        assert!(id.is_new(Reader::Feed, 2));
        assert!(!id.is_new(Reader::Feed, 2));
        assert!(
            id.is_new(Reader::Snapshot, 2),
            "the snapshot had not seen it"
        );
        let mut fresh = Identity::starting_from(Some(2));
        assert!(
            !fresh.is_new(Reader::Changes, 2),
            "a reader made after the recreate follows the new stream"
        );
        let mut blank = Identity::starting_from(None);
        assert!(!blank.is_new(Reader::Feed, 9));
        assert!(blank.is_new(Reader::Feed, 10));
    }

    #[test]
    fn the_head_is_the_last_present_message() {
        let state = StreamState {
            messages: 3,
            first_seq: 4,
            last_seq: 9,
        };
        assert_eq!(head(&state, LastPresent::At(7)), 7);
        assert_eq!(head(&StreamState::default(), LastPresent::At(7)), 0);
        assert_eq!(first_available(&state), 4);
        let empty = StreamState {
            messages: 0,
            first_seq: 10,
            last_seq: 9,
        };
        assert_eq!(first_available(&empty), 10);
    }

    #[test]
    fn only_a_view_of_every_subject_of_a_stream_that_copies_nothing_is_whole() {
        let bucket = ["$KV.b.>".to_owned()];
        assert!(whole_stream(&bucket, false, "$KV.b.>"));
        assert!(
            !whole_stream(&bucket, false, "$KV.b.orders.>"),
            "a prefix view must keep its filter, or it would deliver other keys"
        );
        assert!(
            !whole_stream(&bucket, true, "$KV.b.>"),
            "a mirror or sourced stream may hold messages on subjects of their own"
        );
        let more = ["$KV.b.>".to_owned(), "other.>".to_owned()];
        assert!(
            !whole_stream(&more, false, "$KV.b.>"),
            "a stream that takes other subjects holds messages outside the view"
        );
        assert!(!whole_stream(&[], false, "$KV.b.>"));
    }

    #[test]
    fn last_per_subject_reads_unfiltered_only_where_it_is_all() {
        assert!(read_unfiltered(true, 1, true));
        assert!(
            !read_unfiltered(true, 5, true),
            "with a history, all from the first would deliver every revision"
        );
        assert!(
            read_unfiltered(true, 5, false),
            "a resume reads every revision anyway"
        );
        assert!(!read_unfiltered(false, 1, true));
        assert!(!read_unfiltered(false, 1, false));
    }

    #[test]
    fn the_last_message_of_a_whole_view_is_read_by_seq() {
        let state = StreamState {
            messages: 3,
            first_seq: 4,
            last_seq: 9,
        };
        assert_eq!(last_read(true, &state), LastRead::AtSeq(9));
        assert_eq!(
            last_read(false, &state),
            LastRead::BySubjects,
            "a filtered view's last message may sit below the stream's last"
        );
        let empty = StreamState {
            messages: 0,
            first_seq: 10,
            last_seq: 9,
        };
        assert_eq!(last_read(true, &empty), LastRead::BySubjects);
    }
}
