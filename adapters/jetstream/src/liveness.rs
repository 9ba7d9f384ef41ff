//! Whether a push consumer can still be trusted to deliver every message in order, and what
//! each heartbeat and flow-control request asks of its reader.
//!
//! A push consumer with flow control and idle heartbeats tells its reader four things
//! besides messages: a flow-control request (answer it or delivery stops), an idle
//! heartbeat (nothing to send for a heartbeat interval; it names the last consumer
//! sequence delivered), a stalled heartbeat (the server waits for a flow-control answer),
//! and silence. [`Liveness`] takes each of them, with what the reader had sent the server
//! when it arrived, and says what it means. It reads no clock: the reader reports the
//! ticks of its timer.
//!
//! Silence is judged twice. A consumer deleted — alone, or with its stream when a bucket
//! is deleted and made again — sends nothing more and no word that it is gone. So after a
//! heartbeat interval of silence (and a margin) [`Liveness`] has the reader ask the server
//! whether the consumer is still there (its consumer info: a read that cannot race, unlike
//! a count the server keeps approximately), and "no such consumer" ends the feed at once.
//! Any other answer, or none, leaves it to the backstop: three intervals of silence
//! ([`Failure::Silent`]).

use std::fmt;

/// How many stalled heartbeats in a row (no message between them), sent once the server
/// had the reader's answer, before the reader gives up on the consumer: one per heartbeat
/// interval, so about this many intervals.
pub const MAX_STALLS: u32 = 3;

/// The JetStream API error code of "consumer not found".
pub const CONSUMER_NOT_FOUND: u64 = 10_014;
/// The JetStream API error code of "stream not found".
pub const STREAM_NOT_FOUND: u64 = 10_059;

/// What the reader had sent the server when a batch of deliveries arrived.
///
/// A heartbeat says how the server stood when it sent it, and the server sends one only a
/// heartbeat interval after it last sent a message or heartbeat. Whatever the reader had
/// sent when that previous message arrived had reached the server by then, as long as a
/// round trip (and the reader's lag behind the client) is shorter than the interval —
/// what missed heartbeats assume already. So a heartbeat is judged by the `Sent` of the
/// message before it: by what the server surely had, not by what the reader sent since. A
/// reader its caller left alone for a while (a sink committing) then finds the heartbeats
/// the server sent meanwhile for what they are — it was waiting on the reader — and not
/// "nothing more to send" nor "stalled" after the reader answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// The consumer sequence acknowledged last (all up to it: the consumer acks all).
    pub acked: u64,
    /// Flow-control answers sent so far.
    pub answers: u64,
}

/// Why the consumer can no longer be trusted: the reader ends the feed and the follower
/// reopens from its own watermark + 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A consumer sequence was skipped: a message was lost between server and reader.
    Skipped {
        /// The consumer sequence read last.
        last: u64,
        /// The one that arrived.
        got: u64,
    },
    /// A heartbeat named another last consumer sequence than the one read.
    Misread {
        /// What the heartbeat says was delivered.
        delivered: u64,
        /// What was read.
        read: u64,
    },
    /// The server stays stalled on flow control whatever the reader answers.
    Stalled,
    /// Nothing at all (no message, no heartbeat) for three heartbeat intervals.
    Silent,
    /// Asked after a silent heartbeat interval, the server said the consumer is gone: it
    /// has no consumer of that name (or no such stream), or another one made since.
    Vanished,
    /// A message without the metadata of a delivery.
    NoMetadata,
    /// A status the consumer does not expect (the consumer was deleted, a leader changed).
    Status(u16),
    /// The client reconnected: the consumer may be gone.
    Reconnected,
    /// The client is not connected.
    Disconnected,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Skipped { last, got } => write!(f, "skipped from {last} to {got}"),
            Failure::Misread { delivered, read } => {
                write!(f, "delivered up to {delivered} but {read} arrived")
            }
            Failure::Stalled => f.write_str("stays stalled"),
            Failure::Silent => f.write_str("missed its heartbeats"),
            Failure::Vanished => f.write_str(
                "is gone: the server no longer has it (asked after a silent heartbeat interval)",
            ),
            Failure::NoMetadata => f.write_str("a message without metadata"),
            Failure::Status(code) => write!(f, "status {code}"),
            Failure::Reconnected => f.write_str("reconnected: the consumer may be gone"),
            Failure::Disconnected => f.write_str("disconnected from the server"),
        }
    }
}

/// What a heartbeat asks of the reader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Heard {
    /// Nothing more to send now: the reader is in step with the server.
    Idle,
    /// Nothing to report (a heartbeat the server sent while it waited on the reader).
    Skip,
    /// The server waits for the answer to this flow-control request: answer it.
    Answer(String),
}

/// A heartbeat's decision: acknowledge what was read first (a capped consumer), then what
/// it means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// Acknowledge everything read so far (the last message read) before anything else.
    pub ack: bool,
    /// What it means.
    pub heard: Heard,
}

/// What the server answered when the reader asked for its consumer's info, as
/// [`Tick::Ask`] has it do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsumerInfo {
    /// It has a consumer of that name, created at `created` (nanoseconds since the Unix
    /// epoch).
    Found {
        /// When the server created it.
        created: i128,
    },
    /// It answered with the JetStream API error `code`.
    Refused {
        /// The error code (`err_code`), e.g. [`CONSUMER_NOT_FOUND`].
        code: u64,
    },
    /// No answer: the request failed or timed out.
    NoAnswer,
}

/// What a tick of the reader's timer asks of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Tick {
    /// Nothing: read on.
    Wait,
    /// Silent for a heartbeat interval: ask the server for the consumer's info, without
    /// holding up delivery, and report its answer with [`Liveness::on_consumer_info`].
    /// Asked at most once at a time, and not again until another interval passes.
    Ask,
}

/// A reply the reader handed to the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    /// Acknowledged every message up to this consumer sequence.
    Ack(u64),
    /// Answered this flow-control request.
    Answer(&'a str),
}

/// The judgement of one push consumer's reader.
#[derive(Clone, Debug)]
pub struct Liveness {
    last_consumer_seq: u64,
    /// What the reader had sent when the batch being read arrived.
    batch_sent: Sent,
    /// The same for the last message or heartbeat read: what the server had when it sent
    /// the heartbeat that follows.
    before: Sent,
    /// What the reader has sent so far.
    sent: Sent,
    /// The flow-control request answered last, and the count of answers its first answer
    /// made: a stalled heartbeat naming it that the server sent once it had the answer
    /// says the answer was lost.
    answered: Option<(String, u64)>,
    /// The reader's own time (its ticks) since it last answered a flow-control request.
    since_answer_ns: u64,
    cap: Option<u64>,
    ack_every: Option<u64>,
    /// The consumer sequence of the last message read, while it is not acknowledged.
    unacked: Option<u64>,
    stalls: u32,
    /// Silence so far, in nanoseconds of ticks.
    silent_ns: u64,
    silent_limit_ns: u64,
    traffic: bool,
    heartbeat_ns: u64,
    /// When the server created the consumer, if the reader said.
    created: Option<i128>,
    /// The silence at which the reader next asks whether the consumer is still there.
    ask_at_ns: u64,
    /// A question is out: none again until it is answered.
    asking: bool,
}

impl Liveness {
    /// A reader of a consumer whose heartbeat interval is `heartbeat_ns`; with `cap`, the
    /// consumer holds at most that many messages unacknowledged (`max_ack_pending`) and
    /// the reader acknowledges every quarter of it.
    #[must_use]
    pub fn new(heartbeat_ns: u64, cap: Option<u64>) -> Self {
        let cap = cap.map(|c| c.max(1));
        Liveness {
            last_consumer_seq: 0,
            batch_sent: Sent::default(),
            before: Sent::default(),
            sent: Sent::default(),
            answered: None,
            since_answer_ns: heartbeat_ns,
            cap,
            ack_every: cap.map(|c| (c / 4).max(1)),
            unacked: None,
            stalls: 0,
            silent_ns: 0,
            silent_limit_ns: heartbeat_ns.saturating_mul(3),
            traffic: false,
            heartbeat_ns,
            created: None,
            ask_at_ns: first_ask(heartbeat_ns),
            asking: false,
        }
    }

    /// The same, for a consumer the server created at `created` (nanoseconds since the Unix
    /// epoch): a consumer of its name created at another time is another one.
    #[must_use]
    pub fn created_at(mut self, created: i128) -> Self {
        self.created = Some(created);
        self
    }

    /// The consumer sequence read last.
    #[must_use]
    pub fn last_consumer_seq(&self) -> u64 {
        self.last_consumer_seq
    }

    /// A batch of deliveries arrived, taken off the client when the reader had sent
    /// `sent`.
    pub fn on_batch(&mut self, sent: Sent) {
        self.batch_sent = sent;
    }

    /// A message at `consumer_seq`. `Ok(true)`: hand it on and acknowledge up to it first
    /// (a capped consumer, every quarter of the cap); `Ok(false)`: hand it on.
    ///
    /// # Errors
    /// [`Failure::Skipped`] when a consumer sequence was skipped.
    pub fn on_message(&mut self, consumer_seq: u64) -> Result<bool, Failure> {
        self.heard();
        if consumer_seq != self.last_consumer_seq + 1 {
            return Err(Failure::Skipped {
                last: self.last_consumer_seq,
                got: consumer_seq,
            });
        }
        self.last_consumer_seq = consumer_seq;
        self.before = self.batch_sent;
        self.stalls = 0;
        let Some(every) = self.ack_every else {
            return Ok(false);
        };
        self.unacked = Some(consumer_seq);
        if consumer_seq % every == 0 {
            self.unacked = None;
            return Ok(true);
        }
        Ok(false)
    }

    /// A flow-control request: the reader answers it (or delivery stops).
    pub fn on_flow_control(&mut self) {
        self.heard();
    }

    /// An idle heartbeat naming `last_consumer` as the last consumer sequence delivered,
    /// and, when the server waits on flow control, the request it waits for (`stalled`).
    ///
    /// # Errors
    /// [`Failure::Misread`] when it names another last sequence than the one read;
    /// [`Failure::Stalled`] after more than [`MAX_STALLS`] stalled heartbeats in a row
    /// that the server sent once it had the reader's answer.
    pub fn on_heartbeat(
        &mut self,
        last_consumer: Option<u64>,
        stalled: Option<&str>,
    ) -> Result<Heartbeat, Failure> {
        self.heard();
        // What the server surely had when it sent this heartbeat, and what it has for the
        // next one.
        let before = std::mem::replace(&mut self.before, self.batch_sent);
        // Everything delivered before a heartbeat arrived before it.
        if let Some(last) = last_consumer
            && last != self.last_consumer_seq
        {
            return Err(Failure::Misread {
                delivered: last,
                read: self.last_consumer_seq,
            });
        }
        if let Some(stalled) = stalled {
            // Sent before the server had the reader's answer (the reader was not
            // reading: its caller paused), it says nothing: read on.
            if let Some((answered, count)) = &self.answered
                && answered == stalled
                && before.answers < *count
            {
                return Ok(Heartbeat {
                    ack: false,
                    heard: Heard::Skip,
                });
            }
            // The server sends one stalled heartbeat an interval. Those read before half an
            // interval of the reader's own time passed since it answered were sent before:
            // read in one burst after the process stood still (SIGSTOP, a host swapped
            // out), which the reader cannot see — one interval's evidence, not one each.
            // The next, an interval on, is judged (the NATS campaign, seed 60105).
            if self.since_answer_ns < self.heartbeat_ns / 2 {
                return Ok(Heartbeat {
                    ack: false,
                    heard: Heard::Skip,
                });
            }
            // It missed the answer: answer again. If answers keep getting lost, give up.
            self.stalls += 1;
            if self.stalls > MAX_STALLS {
                return Err(Failure::Stalled);
            }
            return Ok(Heartbeat {
                ack: false,
                heard: Heard::Answer(stalled.to_owned()),
            });
        }
        // A capped consumer acknowledges the rest of what was read: so no message it read
        // is left to expire, and so a server the cap held back delivers on.
        let ack = self.unacked.take().is_some();
        if let Some(cap) = self.cap
            && self.last_consumer_seq.saturating_sub(before.acked) >= cap
        {
            // As far as the server knew when it sent this, the cap was full: it was
            // waiting on the reader, not out of messages.
            return Ok(Heartbeat {
                ack,
                heard: Heard::Skip,
            });
        }
        Ok(Heartbeat {
            ack,
            heard: Heard::Idle,
        })
    }

    /// A reply was handed to the client; returns what the reader has now sent, which the
    /// reader stamps on the batches that arrive from now on.
    pub fn on_sent(&mut self, reply: Reply<'_>) -> Sent {
        match reply {
            Reply::Ack(seq) => self.sent.acked = self.sent.acked.max(seq),
            Reply::Answer(subject) => {
                self.sent.answers += 1;
                self.since_answer_ns = 0;
                if self.answered.as_ref().is_none_or(|(s, _)| s != subject) {
                    self.answered = Some((subject.to_owned(), self.sent.answers));
                }
            }
        }
        self.sent
    }

    /// The reader's timer ticked after `tick_ns`. [`Tick::Ask`]: ask the server whether the
    /// consumer is still there.
    ///
    /// # Errors
    /// [`Failure::Silent`] after three heartbeat intervals of nothing at all.
    pub fn on_tick(&mut self, tick_ns: u64) -> Result<Tick, Failure> {
        self.since_answer_ns = self.since_answer_ns.saturating_add(tick_ns);
        if std::mem::take(&mut self.traffic) {
            self.silent_ns = 0;
        } else {
            self.silent_ns = self.silent_ns.saturating_add(tick_ns);
        }
        if self.silent_ns >= self.silent_limit_ns {
            return Err(Failure::Silent);
        }
        if !self.asking && self.silent_ns >= self.ask_at_ns {
            self.asking = true;
            return Ok(Tick::Ask);
        }
        Ok(Tick::Wait)
    }

    /// The answer to the question [`Tick::Ask`] asked.
    ///
    /// # Errors
    /// [`Failure::Vanished`] when the server has no such consumer or stream, or another
    /// consumer of its name. Whatever happened since the question, the consumer is gone.
    pub fn on_consumer_info(&mut self, info: ConsumerInfo) -> Result<(), Failure> {
        self.asking = false;
        let gone = match info {
            ConsumerInfo::Found { created } => self.created.is_some_and(|c| c != created),
            ConsumerInfo::Refused { code } => {
                code == CONSUMER_NOT_FOUND || code == STREAM_NOT_FOUND
            }
            ConsumerInfo::NoAnswer => false,
        };
        if gone {
            return Err(Failure::Vanished);
        }
        // There, or no telling: ask again only after another interval (the backstop of
        // three intervals stands).
        self.ask_at_ns = self
            .ask_at_ns
            .max(self.silent_ns.saturating_add(self.heartbeat_ns));
        Ok(())
    }

    /// Something arrived from the consumer: it is not silent.
    fn heard(&mut self) {
        self.traffic = true;
        self.silent_ns = 0;
        self.ask_at_ns = first_ask(self.heartbeat_ns);
    }
}

/// The silence after which the reader first asks whether its consumer is still there: a
/// heartbeat interval and a quarter, so a heartbeat that is merely late rarely costs a
/// request.
fn first_ask(heartbeat_ns: u64) -> u64 {
    heartbeat_ns.saturating_add(heartbeat_ns / 4)
}

/// What the client's connection says of a consumer made on it: it is gone with a
/// reconnect (an ephemeral consumer does not survive a server restart), and useless while
/// disconnected.
///
/// # Errors
/// [`Failure::Reconnected`] or [`Failure::Disconnected`].
pub fn connection(connects_at_open: u64, connects: u64, connected: bool) -> Result<(), Failure> {
    if connects != connects_at_open {
        return Err(Failure::Reconnected);
    }
    if !connected {
        return Err(Failure::Disconnected);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skipped_consumer_sequence_fails() {
        let mut l = Liveness::new(1_000, None);
        assert_eq!(l.on_message(1), Ok(false));
        assert_eq!(l.on_message(3), Err(Failure::Skipped { last: 1, got: 3 }));
    }

    #[test]
    fn a_heartbeat_naming_another_last_sequence_fails() {
        let mut l = Liveness::new(1_000, None);
        assert_eq!(l.on_message(1), Ok(false));
        assert_eq!(
            l.on_heartbeat(Some(2), None),
            Err(Failure::Misread {
                delivered: 2,
                read: 1
            })
        );
    }

    #[test]
    fn a_stalled_heartbeat_sent_before_the_answer_arrived_is_skipped() {
        let mut l = Liveness::new(1_000, None);
        l.on_flow_control();
        l.on_sent(Reply::Answer("fc.1"));
        // The batch with the heartbeat was taken before the answer went out.
        let beat = l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard);
        assert_eq!(beat, Ok(Heard::Skip), "the server had not had the answer");
        l.on_batch(Sent {
            acked: 0,
            answers: 1,
        });
        let beat = l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard);
        assert_eq!(beat, Ok(Heard::Skip), "judged by the batch before it");
        assert_eq!(l.on_tick(500), Ok(Tick::Wait));
        let beat = l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard);
        assert_eq!(beat, Ok(Heard::Answer("fc.1".into())), "lost: answer again");
    }

    #[test]
    fn stalled_heartbeats_read_in_a_burst_after_the_answer_count_once_an_interval() {
        let mut l = Liveness::new(1_000, None);
        l.on_flow_control();
        l.on_sent(Reply::Answer("fc.1"));
        l.on_batch(Sent {
            acked: 0,
            answers: 1,
        });
        // Sent one an interval while the process stood still, read one after another.
        assert_eq!(
            l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard),
            Ok(Heard::Skip),
            "judged by the batch before it"
        );
        for _ in 0..2 * MAX_STALLS {
            assert_eq!(
                l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard),
                Ok(Heard::Skip),
                "read before half an interval of the reader's time passed since its answer"
            );
        }
        // The server still stalled an interval on: it lost the answer.
        for _ in 0..MAX_STALLS {
            assert_eq!(l.on_tick(500), Ok(Tick::Wait));
            let beat = l.on_heartbeat(None, Some("fc.1")).map(|h| h.heard);
            assert_eq!(beat, Ok(Heard::Answer("fc.1".into())));
            l.on_sent(Reply::Answer("fc.1"));
        }
        assert_eq!(l.on_tick(500), Ok(Tick::Wait));
        assert_eq!(l.on_heartbeat(None, Some("fc.1")), Err(Failure::Stalled));
    }

    #[test]
    fn stalls_past_the_limit_fail() {
        let mut l = Liveness::new(1_000, None);
        for _ in 0..MAX_STALLS {
            let beat = l.on_heartbeat(None, Some("fc.9")).map(|h| h.heard);
            assert_eq!(beat, Ok(Heard::Answer("fc.9".into())));
        }
        assert_eq!(l.on_heartbeat(None, Some("fc.9")), Err(Failure::Stalled));
    }

    #[test]
    fn a_capped_consumer_held_back_by_its_cap_is_not_idle() {
        let mut l = Liveness::new(1_000, Some(8));
        for seq in 1..=8 {
            assert_eq!(
                l.on_message(seq),
                Ok(seq % 2 == 0),
                "every quarter of the cap"
            );
        }
        let beat = l.on_heartbeat(Some(8), None);
        assert_eq!(
            beat,
            Ok(Heartbeat {
                ack: false,
                heard: Heard::Skip
            }),
            "the server had no ack when it sent this: the cap of 8 was full"
        );
        l.on_sent(Reply::Ack(8));
        l.on_batch(Sent {
            acked: 8,
            answers: 0,
        });
        let beat = l.on_heartbeat(Some(8), None).map(|h| h.heard);
        assert_eq!(
            beat,
            Ok(Heard::Skip),
            "judged by what the server had when it sent the heartbeat before it"
        );
        let beat = l.on_heartbeat(Some(8), None).map(|h| h.heard);
        assert_eq!(beat, Ok(Heard::Idle), "the server had the ack of 8");
    }

    #[test]
    fn an_idle_heartbeat_acknowledges_the_rest_of_what_was_read() {
        let mut l = Liveness::new(1_000, Some(8));
        for seq in 1..=3 {
            l.on_message(seq).ok();
        }
        let beat = l.on_heartbeat(Some(3), None);
        assert_eq!(
            beat,
            Ok(Heartbeat {
                ack: true,
                heard: Heard::Idle
            })
        );
    }

    #[test]
    fn three_heartbeat_intervals_of_silence_fail() {
        let mut l = Liveness::new(1_000, None);
        l.on_message(1).ok();
        assert_eq!(
            l.on_tick(500),
            Ok(Tick::Wait),
            "traffic since the last tick"
        );
        assert_eq!(l.on_tick(1_000), Ok(Tick::Wait));
        assert_eq!(l.on_tick(1_000), Ok(Tick::Ask), "an interval and more: ask");
        assert_eq!(
            l.on_tick(1_000),
            Err(Failure::Silent),
            "a question never answered leaves the backstop"
        );
    }

    /// Ticks of `tick` of silence until the piece asks (at most `limit` ticks), from a
    /// reader that just heard from the consumer.
    fn ticks_to_ask(l: &mut Liveness, tick: u64, limit: u32) -> Result<Option<u32>, Failure> {
        for n in 1..=limit {
            if l.on_tick(tick)? == Tick::Ask {
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    const CREATED: i128 = 1_700_000_000_000_000_000;

    #[test]
    fn a_heartbeat_interval_of_silence_asks_whether_the_consumer_is_there() {
        let mut l = Liveness::new(1_000, None).created_at(CREATED);
        l.on_message(1).ok();
        assert_eq!(l.on_tick(250), Ok(Tick::Wait), "the message came this tick");
        assert_eq!(
            ticks_to_ask(&mut l, 250, 12),
            Ok(Some(5)),
            "asked once silent for an interval and a quarter (5 ticks of 250), well before \
             the three intervals of the backstop"
        );
    }

    #[test]
    fn an_answer_that_it_is_there_keeps_waiting_and_asks_again_only_an_interval_later() {
        let mut l = Liveness::new(1_000, None).created_at(CREATED);
        assert_eq!(ticks_to_ask(&mut l, 250, 12), Ok(Some(5)));
        assert_eq!(
            l.on_consumer_info(ConsumerInfo::Found { created: CREATED }),
            Ok(()),
            "there: keep waiting"
        );
        assert_eq!(
            ticks_to_ask(&mut l, 250, 3),
            Ok(None),
            "not asked again before another interval passes"
        );
        assert_eq!(l.on_tick(250), Ok(Tick::Ask), "another interval: ask again");
        assert_eq!(
            l.on_consumer_info(ConsumerInfo::Found { created: CREATED }),
            Ok(())
        );
        assert_eq!(
            ticks_to_ask(&mut l, 250, 12),
            Err(Failure::Silent),
            "a consumer there that sends nothing still ends on the backstop"
        );
    }

    #[test]
    fn one_question_at_a_time() {
        let mut l = Liveness::new(1_000, None);
        assert_eq!(ticks_to_ask(&mut l, 250, 12), Ok(Some(5)));
        // The answer is slow; messages come and go meanwhile.
        l.on_message(1).ok();
        assert_eq!(
            ticks_to_ask(&mut l, 250, 20),
            Err(Failure::Silent),
            "no second question while the first is out"
        );
    }

    #[test]
    fn a_consumer_gone_from_the_server_fails_at_once() {
        for (answer, why) in [
            (
                ConsumerInfo::Refused {
                    code: CONSUMER_NOT_FOUND,
                },
                "no such consumer",
            ),
            (
                ConsumerInfo::Refused {
                    code: STREAM_NOT_FOUND,
                },
                "no such stream",
            ),
            (
                ConsumerInfo::Found {
                    created: CREATED + 1,
                },
                "another consumer of its name, created since",
            ),
        ] {
            let mut l = Liveness::new(1_000, None).created_at(CREATED);
            assert_eq!(ticks_to_ask(&mut l, 250, 12), Ok(Some(5)));
            assert_eq!(l.on_consumer_info(answer), Err(Failure::Vanished), "{why}");
        }
    }

    #[test]
    fn an_answer_that_tells_nothing_keeps_the_backstop() {
        for answer in [
            ConsumerInfo::NoAnswer,
            // JetStream temporarily unavailable (a cluster without a leader).
            ConsumerInfo::Refused { code: 10_008 },
        ] {
            let mut l = Liveness::new(1_000, None).created_at(CREATED);
            assert_eq!(ticks_to_ask(&mut l, 250, 12), Ok(Some(5)));
            assert_eq!(l.on_consumer_info(answer), Ok(()), "{answer:?}");
            assert_eq!(
                ticks_to_ask(&mut l, 250, 12),
                Ok(Some(4)),
                "{answer:?}: asked again an interval later"
            );
            assert_eq!(l.on_consumer_info(answer), Ok(()));
            assert_eq!(
                ticks_to_ask(&mut l, 250, 12),
                Err(Failure::Silent),
                "{answer:?}: the backstop ends it"
            );
        }
    }

    #[test]
    fn messages_and_heartbeats_put_the_question_off() {
        let mut l = Liveness::new(1_000, None);
        for _ in 0..4 {
            assert_eq!(l.on_tick(250), Ok(Tick::Wait));
        }
        l.on_message(1).ok();
        assert_eq!(
            ticks_to_ask(&mut l, 250, 12),
            Ok(Some(6)),
            "a message starts the silence again (the tick after it hears it)"
        );
        assert_eq!(l.on_consumer_info(ConsumerInfo::NoAnswer), Ok(()));
        l.on_heartbeat(Some(1), None).ok();
        assert_eq!(
            ticks_to_ask(&mut l, 250, 12),
            Ok(Some(6)),
            "so does a heartbeat"
        );
        assert_eq!(l.on_consumer_info(ConsumerInfo::NoAnswer), Ok(()));
        for _ in 0..3 {
            assert_eq!(l.on_tick(250), Ok(Tick::Wait));
        }
        l.on_flow_control();
        assert_eq!(
            ticks_to_ask(&mut l, 250, 12),
            Ok(Some(6)),
            "so does a flow-control request"
        );
    }

    #[test]
    fn a_reconnect_ends_the_consumer() {
        assert_eq!(connection(1, 1, true), Ok(()));
        assert_eq!(connection(1, 2, true), Err(Failure::Reconnected));
        assert_eq!(connection(1, 1, false), Err(Failure::Disconnected));
    }
}
