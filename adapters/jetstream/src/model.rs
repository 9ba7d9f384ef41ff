//! A model of a JetStream stream and its consumers that misbehaves as nats-server does, for
//! the property tests and the simulator.
//!
//! What it keeps of the server's behaviour (measured and read in nats-server 2.15):
//! - subjects keep at most `history` revisions: a write removes the oldest beyond that;
//! - a consumer delivers from a start seq, or the last message per subject present when it
//!   was made and then every later one, in stream order, skipping what was removed;
//! - its pending count is an estimate: a removal of a message it has not delivered lowers
//!   it at once, a new message raises it only when the server's queued signal runs
//!   ([`Stream::signal`]), so for a moment it reads one low;
//! - a consumer that its client left is deleted ([`Stream::delete_consumer`]); one of a
//!   stream put back from a backup is gone ([`Stream::restore`]);
//! - a stream deleted and made again has a new creation time, read off the server's clock,
//!   and seqs from 1; a stream restored from a backup keeps the backup's creation time and
//!   its messages' stored times (a single server's restore: the least a follower can be
//!   told, see [`Stream::restore`]);
//! - clocks: the stream stamps messages (and a recreated stream) with the server's clock,
//!   which the caller moves and which reads later at each stamp, as a nanosecond clock
//!   does between two stores; it is the server's, so a restore does not take it back: a
//!   message stored after a restore is stamped later than every message the restore lost
//!   ([`Stream::lineage_at`] tells the two histories apart by it).
//!
//! A simulator that keeps the stream beside a source of its own stores each write at the
//! source's seq ([`Stream::write_at`]), and asks each consumer which revisions an
//! overwrite removed before it delivered them ([`Stream::take_skipped`]): what a sparse
//! feed may never show its follower.
//!
//! Deterministic: no clock, no randomness; the test or simulator decides every step.

use std::collections::{BTreeMap, VecDeque};

/// A message in the model's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its seq.
    pub seq: u64,
    /// Its subject (a KV key).
    pub subject: String,
    /// Its value; `None` for a delete marker.
    pub value: Option<Vec<u8>>,
    /// The server's time when it was stored, in nanoseconds: the stamp of its mutation
    /// ([`Stream::lineage_at`]), later than every stamp the stream's server gave before.
    pub published_ns: u64,
}

/// A message as a consumer delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The message.
    pub message: Message,
    /// The consumer's pending count after it, as the server reports it.
    pub pending: u64,
}

/// Where a consumer starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// The last message per subject present when it is made, then every later one.
    LastPerSubject,
    /// Every message from this seq.
    Seq(u64),
}

/// A consumer of the model's stream. Ids are never used twice in a stream's life, through
/// its recreations and restores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConsumerId(usize);

#[derive(Clone, Debug)]
struct Consumer {
    /// Seqs of the last message per subject still to deliver (last-per-subject start).
    lss: VecDeque<u64>,
    /// The next seq to consider once `lss` is done.
    cursor: u64,
    /// What the server reports as pending.
    pending: u64,
    /// New messages not yet counted (the queued signal).
    unsignalled: u64,
    /// The highest seq delivered.
    delivered: u64,
    /// Revisions of its range it will never deliver, since the last
    /// [`Stream::take_skipped`].
    skipped: Vec<u64>,
}

/// A stream with its consumers.
#[derive(Clone, Debug)]
pub struct Stream {
    created: i128,
    history: usize,
    last_seq: u64,
    messages: BTreeMap<u64, Message>,
    /// The seqs of each subject's revisions present, oldest first.
    revisions: BTreeMap<String, VecDeque<u64>>,
    consumers: BTreeMap<ConsumerId, Consumer>,
    /// The id the next consumer gets.
    next_consumer: usize,
    /// The server's clock as the caller set it last.
    now_ns: u64,
    /// The last time the server's clock gave a stamp (a message, a creation): the next
    /// reads later, as a nanosecond clock does between two stores.
    stamped_ns: u64,
    /// Every write ever made, removed or not: what the source held at each seq.
    log: Vec<Message>,
}

impl Stream {
    /// An empty stream created at `created` (nanoseconds since the Unix epoch; the
    /// server's clock reads later from then on), keeping `history` revisions per subject
    /// (at least 1).
    #[must_use]
    pub fn new(created: i128, history: usize) -> Self {
        Stream {
            created,
            stamped_ns: crate::history(created).unwrap_or(0),
            history: history.max(1),
            last_seq: 0,
            messages: BTreeMap::new(),
            revisions: BTreeMap::new(),
            consumers: BTreeMap::new(),
            next_consumer: 0,
            now_ns: 0,
            log: Vec::new(),
        }
    }

    /// Deletes the stream and makes it again, as the server does: created at the server's
    /// clock now (later than every stamp it gave the old stream: another history), no
    /// messages, seqs from 1, every consumer gone. Returns the new creation time.
    pub fn recreate(&mut self) -> i128 {
        let created = i128::from(self.tick());
        *self = Stream {
            now_ns: self.now_ns,
            next_consumer: self.next_consumer,
            ..Stream::new(created, self.history)
        };
        created
    }

    /// Puts `backup` (a copy of this stream taken earlier) back in place of the stream, as
    /// a restore from a backup does: its messages and seqs, their stored times, and its
    /// identity (its creation time: what a single nats-server's restore keeps; one in a
    /// cluster, or of 2.15's backup format, gets a new one, which a follower tells at
    /// once); the writes made since are gone, the next ones reuse their seqs with later
    /// stored times (the server's clock is not restored), and every consumer is gone (a
    /// restore restarts the server, and ephemeral consumers do not survive it).
    pub fn restore(&mut self, backup: &Stream) {
        *self = Stream {
            consumers: BTreeMap::new(),
            next_consumer: self.next_consumer,
            now_ns: self.now_ns.max(backup.now_ns),
            stamped_ns: self.stamped_ns.max(backup.stamped_ns),
            ..backup.clone()
        };
    }

    /// [`restore`](Self::restore) as nats-server 2.15 does it (a backup of its own format,
    /// `RestoreStreamV2`), and as any server in a cluster does: the backup's messages and
    /// their stored times, with a new creation time off the server's clock (another
    /// history). Returns the new creation time.
    pub fn restore_anew(&mut self, backup: &Stream) -> i128 {
        self.restore(backup);
        self.created = i128::from(self.tick());
        self.created
    }

    /// Its identity: its creation time, in nanoseconds since the Unix epoch.
    #[must_use]
    pub fn created(&self) -> i128 {
        self.created
    }

    /// The message at `seq`, while the stream holds it.
    #[must_use]
    pub fn message(&self, seq: u64) -> Option<&Message> {
        self.messages.get(&seq)
    }

    /// The stored time of the message at `seq` (nanoseconds since the Unix epoch), `None`
    /// if the stream no longer holds it (overwritten beyond the history, purged) or never
    /// did (0, above the last seq, a seq a source beside it skipped).
    #[must_use]
    pub fn stored_at(&self, seq: u64) -> Option<u64> {
        self.messages.get(&seq).map(|m| m.published_ns)
    }

    /// What a read from the stream leader says of the history at `seq`, as the NATS
    /// adapter's `Source::lineage_at` reads it: the stream's creation time, and the stored
    /// time of its message at `seq` while the stream holds it ([`crate::StreamLineage`]).
    /// A recreated stream has another history; a restored one the same history, and
    /// another stamp at every seq written again since.
    #[must_use]
    pub fn lineage_at(&self, seq: u64) -> crate::StreamLineage {
        crate::StreamLineage::read(self.created, self.stored_at(seq))
    }

    /// The server's clock read for a stamp: now, or later than the last stamp.
    fn tick(&mut self) -> u64 {
        self.stamped_ns = self.now_ns.max(self.stamped_ns + 1);
        self.stamped_ns
    }

    /// Moves the server's clock to `now_ns` (never back).
    pub fn set_now(&mut self, now_ns: u64) {
        self.now_ns = self.now_ns.max(now_ns);
    }

    /// The stream's state, as its info reports it.
    #[must_use]
    pub fn state(&self) -> crate::StreamState {
        crate::StreamState {
            messages: self.messages.len() as u64,
            first_seq: self
                .messages
                .keys()
                .next()
                .copied()
                .unwrap_or(self.last_seq + 1),
            last_seq: self.last_seq,
        }
    }

    /// Stores a put of `value` (or, with `None`, a delete marker) under `subject`; returns
    /// its seq. The subject's revisions beyond the history go, and every consumer that had
    /// not delivered one counts it off at once; the new message is counted only at the
    /// next [`signal`](Self::signal).
    pub fn write(&mut self, subject: &str, value: Option<Vec<u8>>) -> u64 {
        let seq = self.last_seq + 1;
        let stored = self.write_at(seq, subject, value);
        debug_assert!(stored, "the next seq is always above the last");
        seq
    }

    /// [`write`](Self::write) at `seq`, which a source beside the stream gave the write
    /// (the seqs between the last one stored and `seq` are never used). Returns whether
    /// it was stored: not when `seq` is not above the last seq stored.
    #[must_use = "a write at or below the last seq stored is not stored"]
    pub fn write_at(&mut self, seq: u64, subject: &str, value: Option<Vec<u8>>) -> bool {
        if seq <= self.last_seq {
            return false;
        }
        self.last_seq = seq;
        let message = Message {
            seq,
            subject: subject.to_owned(),
            value,
            published_ns: self.tick(),
        };
        self.log.push(message.clone());
        self.messages.insert(seq, message);
        let revisions = self.revisions.entry(subject.to_owned()).or_default();
        revisions.push_back(seq);
        let mut removed = Vec::new();
        while revisions.len() > self.history {
            removed.extend(revisions.pop_front());
        }
        for old in removed {
            self.remove(old);
        }
        for c in self.consumers.values_mut() {
            c.unsignalled += 1;
        }
        true
    }

    /// Purges every message of `subject` (no marker left), as `purge_deletes` or a purge by
    /// subject does.
    pub fn purge_subject(&mut self, subject: &str) {
        let seqs: Vec<u64> = self
            .revisions
            .remove(subject)
            .map(Vec::from)
            .unwrap_or_default();
        for seq in seqs {
            self.remove(seq);
        }
    }

    fn remove(&mut self, seq: u64) {
        if self.messages.remove(&seq).is_none() {
            return;
        }
        for c in self.consumers.values_mut() {
            if c.lss.contains(&seq) || seq >= c.cursor {
                // nats-server's decStreamPending: at once.
                c.pending = c.pending.saturating_sub(1);
                c.skipped.push(seq);
            }
            c.lss.retain(|&s| s != seq);
        }
    }

    /// Runs the server's queued signals: every consumer counts the new messages.
    pub fn signal(&mut self) {
        for c in self.consumers.values_mut() {
            c.pending += std::mem::take(&mut c.unsignalled);
        }
    }

    /// The last message present (the read that cannot race), if any.
    #[must_use]
    pub fn last_present(&self) -> Option<u64> {
        self.messages.keys().next_back().copied()
    }

    /// The last message present of `subject`.
    #[must_use]
    pub fn last_of(&self, subject: &str) -> Option<&Message> {
        self.revisions
            .get(subject)
            .and_then(|r| r.back())
            .and_then(|seq| self.messages.get(seq))
    }

    /// What a reader reading at this moment finds: the latest message of every subject
    /// present (delete markers included).
    #[must_use]
    pub fn latest(&self) -> BTreeMap<String, Message> {
        self.revisions
            .iter()
            .filter_map(|(s, r)| Some((s.clone(), self.messages.get(r.back()?)?.clone())))
            .collect()
    }

    /// What the source held at `seq`: the last write at or below it of every subject
    /// written by then (delete markers included), whether or not the stream still has it.
    #[must_use]
    pub fn state_at(&self, seq: u64) -> BTreeMap<String, Message> {
        let mut state = BTreeMap::new();
        for m in self.log.iter().take_while(|m| m.seq <= seq) {
            state.insert(m.subject.clone(), m.clone());
        }
        state
    }

    /// Makes a consumer starting at `start`, its pending count exact at creation.
    pub fn consumer(&mut self, start: Start) -> ConsumerId {
        let (lss, cursor, skipped) = match start {
            Start::LastPerSubject => {
                let mut lss: Vec<u64> = self
                    .revisions
                    .values()
                    .filter_map(|r| r.back().copied())
                    .collect();
                lss.sort_unstable();
                // Every revision but the last of each subject: never delivered.
                let skipped = self
                    .log
                    .iter()
                    .map(|m| m.seq)
                    .filter(|seq| lss.binary_search(seq).is_err())
                    .collect();
                (VecDeque::from(lss), self.last_seq + 1, skipped)
            }
            Start::Seq(seq) => {
                let from = seq.max(1);
                // What was removed from its range before it was made.
                let skipped = self
                    .log
                    .iter()
                    .map(|m| m.seq)
                    .filter(|seq| *seq >= from && !self.messages.contains_key(seq))
                    .collect();
                (VecDeque::new(), from, skipped)
            }
        };
        let pending = lss.len() as u64 + self.messages.range(cursor..).count() as u64;
        let id = ConsumerId(self.next_consumer);
        self.next_consumer += 1;
        self.consumers.insert(
            id,
            Consumer {
                lss,
                cursor,
                pending,
                unsignalled: 0,
                delivered: 0,
                skipped,
            },
        );
        id
    }

    /// Deletes a consumer (its client left, or its inactivity threshold passed).
    pub fn delete_consumer(&mut self, id: ConsumerId) {
        self.consumers.remove(&id);
    }

    /// Whether the consumer exists (not deleted, nor gone with a recreate or restore).
    #[must_use]
    pub fn has_consumer(&self, id: ConsumerId) -> bool {
        self.consumers.contains_key(&id)
    }

    /// The revisions of the consumer's range it will never deliver, since the last call:
    /// those an overwrite (or a purge) removed before it was made — for a last-per-subject
    /// consumer, every revision but the last of each subject — and those removed before
    /// it delivered them. What its reader never sees: each had a newer revision of its
    /// subject stored (an overwrite) or none left (a purge).
    pub fn take_skipped(&mut self, id: ConsumerId) -> Vec<u64> {
        self.consumers
            .get_mut(&id)
            .map(|c| std::mem::take(&mut c.skipped))
            .unwrap_or_default()
    }

    /// The consumer's next delivery, or `None` when it has nothing to send now (it would
    /// send an idle heartbeat after a heartbeat interval).
    pub fn deliver(&mut self, id: ConsumerId) -> Option<Delivery> {
        let c = self.consumers.get_mut(&id)?;
        let seq = if let Some(seq) = c.lss.pop_front() {
            seq
        } else {
            let seq = *self.messages.range(c.cursor..).next()?.0;
            c.cursor = seq + 1;
            seq
        };
        c.delivered = c.delivered.max(seq);
        c.pending = c.pending.saturating_sub(1);
        let message = self.messages.get(&seq)?.clone();
        Some(Delivery {
            message,
            pending: c.pending,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overwrite_of_an_undelivered_revision_reads_one_low_until_the_signal() {
        let mut s = Stream::new(1, 1);
        s.write("a", Some(b"1".to_vec()));
        s.write("b", Some(b"1".to_vec()));
        let c = s.consumer(Start::LastPerSubject);
        let first = s.deliver(c).expect("a");
        assert_eq!(first.pending, 1, "b is still to come");
        s.write("b", Some(b"2".to_vec()));
        // b's old revision went undelivered: counted off at once; its new one not yet.
        let next = s.deliver(c).expect("b's new revision");
        assert_eq!((next.message.seq, next.pending), (3, 0));
        s.write("a", Some(b"2".to_vec()));
        assert_eq!(s.deliver(c).map(|d| d.pending), Some(0));
    }

    #[test]
    fn writes_at_a_sources_seqs_and_the_revisions_a_consumer_never_delivered() {
        let mut s = Stream::new(1, 1);
        assert!(s.write_at(3, "a", Some(b"1".to_vec())));
        assert!(s.write_at(5, "b", Some(b"1".to_vec())));
        assert!(!s.write_at(5, "c", None), "a seq already used is refused");
        assert_eq!(s.state().last_seq, 5);
        let c = s.consumer(Start::LastPerSubject);
        assert_eq!(s.deliver(c).map(|d| d.message.seq), Some(3));
        assert!(s.write_at(9, "b", Some(b"2".to_vec())));
        assert!(s.write_at(10, "a", Some(b"2".to_vec())));
        assert_eq!(
            s.take_skipped(c),
            vec![5],
            "b's revision 5 went before it was delivered; a's 3 was delivered"
        );
        assert!(s.take_skipped(c).is_empty(), "each is told once");
        let late = s.consumer(Start::Seq(4));
        assert_eq!(
            s.take_skipped(late),
            vec![5],
            "removed from its range before it was made"
        );
        let last = s.consumer(Start::LastPerSubject);
        assert_eq!(
            s.take_skipped(last),
            vec![3, 5],
            "all but the last revisions"
        );
        s.delete_consumer(c);
        assert!(!s.has_consumer(c));
        assert_eq!(s.deliver(c), None);
    }

    #[test]
    fn a_restored_stream_has_the_backups_messages_and_no_consumers() {
        let mut s = Stream::new(1, 1);
        s.write("a", Some(b"1".to_vec()));
        let backup = s.clone();
        let c = s.consumer(Start::Seq(1));
        s.write("a", Some(b"2".to_vec()));
        s.write("b", Some(b"1".to_vec()));
        s.restore(&backup);
        assert!(!s.has_consumer(c), "a restore ends every consumer");
        assert_eq!(s.last_present(), Some(1));
        assert_eq!(s.write("c", None), 2, "the next write reuses the seq");
        assert_eq!(s.created(), 1, "a restore keeps the stream's identity");
        let d = s.consumer(Start::Seq(1));
        assert_ne!(c, d, "no id is used twice");
    }

    #[test]
    fn a_restore_anew_keeps_the_messages_and_their_times_under_a_new_history() {
        let mut s = Stream::new(1, 1);
        s.write("a", Some(b"1".to_vec()));
        let backup = s.clone();
        s.write("b", Some(b"1".to_vec()));
        let created = s.restore_anew(&backup);
        assert!(created > 1);
        assert_eq!(s.lineage_at(1), backup.lineage_at(1).with_history(created));
        assert_eq!(
            s.lineage_at(2).stamp,
            None,
            "the write after the backup is gone"
        );
    }

    #[test]
    fn a_recreated_stream_starts_again_at_one() {
        let mut s = Stream::new(1, 1);
        s.write("a", None);
        let created = s.recreate();
        assert!(created > 1, "a new creation time, off the server's clock");
        assert_eq!(s.write("a", Some(vec![])), 1);
        assert_eq!(s.created(), created);
        assert_eq!(s.lineage_at(1).history, crate::history(created));
    }
}

/// What a push consumer's server side sends its reader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wire {
    /// A message, at consumer sequence `consumer_seq`.
    Message {
        /// Its consumer sequence.
        consumer_seq: u64,
    },
    /// A flow-control request: the server sends nothing more until it is answered.
    FlowControl {
        /// The request (its reply subject, as a number).
        id: u64,
    },
    /// An idle heartbeat naming the last consumer sequence sent, and, while the server
    /// waits for a flow-control answer, that request (a stalled heartbeat).
    Heartbeat {
        /// The last consumer sequence sent.
        last: u64,
        /// The request the server waits for.
        stalled: Option<u64>,
    },
}

/// The server side of a push consumer with flow control, idle heartbeats and an optional
/// cap on unacknowledged messages, in ticks of a clock the caller moves: it sends what it
/// may each tick, and a heartbeat after `heartbeat` ticks of sending nothing.
#[derive(Clone, Debug)]
pub struct PushServer {
    /// Messages that exist to deliver (consumer sequences 1..=available).
    available: u64,
    sent: u64,
    acked: u64,
    cap: Option<u64>,
    fc_every: u64,
    since_fc: u64,
    waiting: Option<u64>,
    requests: u64,
    heartbeat: u64,
    quiet: u64,
    per_tick: u64,
    /// Deleted (alone or with its stream): it sends nothing more, and no word of it.
    gone: bool,
}

impl PushServer {
    /// A consumer that sends up to `per_tick` messages a tick, asks for flow control every
    /// `fc_every` messages, holds at most `cap` unacknowledged, and sends a heartbeat after
    /// `heartbeat` quiet ticks.
    #[must_use]
    pub fn new(per_tick: u64, fc_every: u64, cap: Option<u64>, heartbeat: u64) -> Self {
        PushServer {
            available: 0,
            sent: 0,
            acked: 0,
            cap,
            fc_every: fc_every.max(1),
            since_fc: 0,
            waiting: None,
            requests: 0,
            heartbeat: heartbeat.max(1),
            quiet: 0,
            per_tick: per_tick.max(1),
            gone: false,
        }
    }

    /// The consumer is deleted, as nats-server deletes a push consumer (or its stream):
    /// from now on it sends nothing, and tells its reader nothing.
    pub fn vanish(&mut self) {
        self.gone = true;
    }

    /// Whether the server still has the consumer (what its consumer info says).
    #[must_use]
    pub fn is_there(&self) -> bool {
        !self.gone
    }

    /// `n` more messages exist to deliver (writes to the stream).
    pub fn stored(&mut self, n: u64) {
        self.available += n;
    }

    /// Messages that exist to deliver, so far.
    #[must_use]
    pub fn available(&self) -> u64 {
        self.available
    }

    /// One tick: what the server sends.
    pub fn tick(&mut self) -> Vec<Wire> {
        let mut out = Vec::new();
        if self.gone {
            return out;
        }
        while self.waiting.is_none()
            && self.sent < self.available
            && (out.len() as u64) < self.per_tick
            && self.cap.is_none_or(|c| self.sent - self.acked < c)
        {
            self.sent += 1;
            self.since_fc += 1;
            out.push(Wire::Message {
                consumer_seq: self.sent,
            });
            if self.since_fc >= self.fc_every {
                self.since_fc = 0;
                self.requests += 1;
                self.waiting = Some(self.requests);
                out.push(Wire::FlowControl { id: self.requests });
            }
        }
        if out.is_empty() {
            self.quiet += 1;
            if self.quiet >= self.heartbeat {
                self.quiet = 0;
                out.push(Wire::Heartbeat {
                    last: self.sent,
                    stalled: self.waiting,
                });
            }
        } else {
            self.quiet = 0;
        }
        out
    }

    /// Whether the cap holds back messages that exist to deliver: a heartbeat sent now
    /// says the server waits on the reader, not that it has nothing to send.
    #[must_use]
    pub fn held_back(&self) -> bool {
        !self.gone
            && self.sent < self.available
            && self.cap.is_some_and(|c| self.sent - self.acked >= c)
    }

    /// The reader acknowledged everything up to `consumer_seq`.
    pub fn on_ack(&mut self, consumer_seq: u64) {
        self.acked = self.acked.max(consumer_seq.min(self.sent));
    }

    /// The reader answered flow-control request `id`.
    pub fn on_answer(&mut self, id: u64) {
        if self.waiting == Some(id) {
            self.waiting = None;
        }
    }
}
