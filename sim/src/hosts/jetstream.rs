//! The source host's JetStream: a KV bucket's stream (tidemark-jetstream's model, keeping
//! one revision per key) kept beside the memory source at the same seqs, and served over
//! the sim's wire as nats-server serves a bucket: stream info, the last message present,
//! a key's last message, and consumers whose deliveries carry the server's pending count.
//!
//! The stream takes every write the source host commits, at the write's seq; a restore
//! of the source puts back the stream's copy taken with the source's backup (same
//! identity: seqs alone tell a follower, as for every other kind). What the memory source
//! does to its own change log — compaction, the sweeps' trimming — leaves the stream
//! alone: a bucket keeps the last revision of every key, and its own compaction is the
//! overwrites themselves (its first sequence moves up as the oldest keys are rewritten).
//!
//! nats-server counts a new message in a consumer's pending count only when a queued
//! signal runs; the host runs [`Stream::signal`] at moments drawn from the seed, so the
//! counts lag as the server's do, and much longer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidemark::tidemark_core::Rng;
use tidemark_jetstream::model::{ConsumerId, Start, Stream};
use tokio::sync::Notify;
use turmoil::net::TcpStream;

use crate::checks::oracle::FeedSkips;
use crate::wire::{self, HEARTBEAT, JsAnswer, JsCall, JsDelivery, JsStart, Request, Response};

/// How many revisions per key the bucket keeps: one, where an overwrite removes the
/// revision a reader has not reached yet.
pub const HISTORY: usize = 1;

/// How long a consumer whose client asks for nothing lives on (nats-server's inactive
/// threshold for an ephemeral consumer): a partition sends no reset.
const INACTIVE: Duration = Duration::from_secs(5);

/// The longest the queued pending signals wait: far longer than nats-server's (a moment),
/// so that a replay meets a count that reads low often enough to be seen. A replay that
/// trusts the count is caught on 296 of seeds 0..300 (`--strategy trusts-pending`, with
/// the followers' deliveries one or two at a time); with at most 300 ms, on about 250.
const MAX_SIGNAL_LAG_MS: u64 = 2000;

#[derive(Debug)]
struct Shared {
    stream: Stream,
    /// The consumers that are followers' feeds, and whose.
    feeds: BTreeMap<ConsumerId, String>,
    /// The stream as the last backup took it.
    backup: Option<Stream>,
    /// Writes the stream refused (a seq at or below its last): the two are out of step.
    out_of_step: Vec<String>,
}

/// The bucket's stream beside the source, shared by the source host's incarnations (it
/// outlives crashes, like the source's disk). Cheap to clone.
#[derive(Clone, Debug)]
pub struct JetStream {
    shared: Arc<Mutex<Shared>>,
    /// Told of every write and restore: a consumer waiting for a message looks again. (A
    /// `Notify`, not a `watch`: a watch spreads its waiters over several lists at random,
    /// so the order they wake in, and the trace, would differ from run to run.)
    changed: Arc<Notify>,
    skips: FeedSkips,
    seed: u64,
    starts: Arc<AtomicU64>,
}

impl JetStream {
    /// An empty bucket whose signal moments are drawn from `seed`, recording what its
    /// followers' feeds never delivered in `skips`.
    #[must_use]
    pub fn new(seed: u64, skips: FeedSkips) -> Self {
        JetStream {
            shared: Arc::new(Mutex::new(Shared {
                stream: Stream::new(1, HISTORY),
                feeds: BTreeMap::new(),
                backup: None,
                out_of_step: Vec::new(),
            })),
            changed: Arc::new(Notify::new()),
            skips,
            seed,
            starts: Arc::default(),
        }
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores the source's write of `key` at `seq` (`None`: a removal, a delete marker).
    pub fn mirror(&self, seq: u64, key: &str, value: Option<Vec<u8>>) {
        {
            let mut shared = self.shared();
            if !shared.stream.write_at(seq, key, value) {
                let last = shared.stream.state().last_seq;
                shared.out_of_step.push(format!(
                    "the source wrote {key} at {seq}, at or below the stream's last seq {last}"
                ));
            }
            let Shared { stream, feeds, .. } = &mut *shared;
            for (id, follower) in feeds.iter() {
                self.skips.record(follower, stream.take_skipped(*id));
            }
        }
        self.changed.notify_waiters();
    }

    /// Keeps a copy of the stream, taken with the source's backup.
    pub fn backup(&self) {
        let mut shared = self.shared();
        shared.backup = Some(shared.stream.clone());
    }

    /// Puts the last backup's copy back, with the source's restore to `head`: every
    /// consumer ends, and the seqs above `head` are another history's. `keep`: the backup
    /// stays for the next restore (the source made anew each time from one backup).
    pub fn restore(&self, head: u64, keep: bool) {
        {
            let mut shared = self.shared();
            let backup = if keep {
                shared.backup.clone()
            } else {
                shared.backup.take()
            };
            if let Some(backup) = backup {
                shared.stream.restore(&backup);
                shared.feeds.clear();
            }
        }
        self.skips.restored(head);
        self.changed.notify_waiters();
    }

    /// What went wrong keeping the stream beside the source (empty: in step).
    #[must_use]
    pub fn out_of_step(&self) -> Vec<String> {
        self.shared().out_of_step.clone()
    }

    /// Runs the server's queued pending signals at moments drawn from the seed (and the
    /// host's incarnation), for as long as the source host lives.
    pub async fn signals(&self) {
        let start = self.starts.fetch_add(1, Ordering::SeqCst);
        let mut rng = Rng::new(self.seed ^ 0x7369_676e_616c ^ (start << 40));
        loop {
            let lag = 1 + rng.next_u64() % MAX_SIGNAL_LAG_MS;
            tokio::time::sleep(Duration::from_millis(lag)).await;
            self.shared().stream.signal();
        }
    }

    /// Answers one call, on a connection of its own.
    pub async fn serve(&self, call: JsCall, mut stream: TcpStream) -> std::io::Result<()> {
        let answer = match call {
            JsCall::Consume {
                start,
                headers_only,
                feed_of,
            } => {
                return self.consume(start, headers_only, feed_of, stream).await;
            }
            JsCall::Next { .. } => Response::Failed("no consumer on this connection".into()),
            read => self.read(read).into(),
        };
        wire::write(&mut stream, &answer).await
    }

    /// What the stream says to a read of its facts.
    fn read(&self, call: JsCall) -> JsAnswer {
        let shared = self.shared();
        let s = &shared.stream;
        match call {
            JsCall::LastPresent => JsAnswer::LastPresent(s.last_present()),
            JsCall::Last { key } => JsAnswer::Last {
                message: s.last_of(&key).map(|m| (m.seq, m.value.clone())),
                last_seq: s.state().last_seq,
            },
            // `Info` (a consumer's calls are `serve`'s own).
            _ => {
                let state = s.state();
                JsAnswer::State {
                    messages: state.messages,
                    first_seq: state.first_seq,
                    last_seq: state.last_seq,
                    history: HISTORY as u64,
                }
            }
        }
    }

    /// Makes a consumer and delivers its messages in the batches its client asks for,
    /// until the client leaves (or asks for nothing for [`INACTIVE`]); then deletes it.
    async fn consume(
        &self,
        start: JsStart,
        headers_only: bool,
        feed_of: Option<String>,
        mut stream: TcpStream,
    ) -> std::io::Result<()> {
        let id = {
            let mut shared = self.shared();
            let id = shared.stream.consumer(match start {
                JsStart::LastPerKey => Start::LastPerSubject,
                JsStart::Seq(seq) => Start::Seq(seq),
            });
            if let Some(follower) = feed_of {
                self.skips.record(&follower, shared.stream.take_skipped(id));
                shared.feeds.insert(id, follower);
            }
            id
        };
        // Deleted however this ends: the client left, or the host crashed.
        let _consumer = Consumer { js: self, id };
        wire::write(&mut stream, &Response::from(JsAnswer::Consuming)).await?;
        loop {
            let call = tokio::time::timeout(INACTIVE, wire::read_untimed::<Request>(&mut stream));
            let max = match call.await {
                Ok(Ok(Request::JetStream(JsCall::Next { max }))) => max,
                // Gone quiet, gone, or asking something else: the consumer ends.
                _ => return Ok(()),
            };
            let answer = self.next_batch(id, max, headers_only).await;
            wire::write(&mut stream, &answer).await?;
        }
    }

    /// Up to `max` deliveries of consumer `id`, waiting a heartbeat interval for one when
    /// it has nothing to send now; none then is an idle heartbeat.
    async fn next_batch(&self, id: ConsumerId, max: u32, headers_only: bool) -> Response {
        for waited in [false, true] {
            let batch = {
                let mut shared = self.shared();
                if !shared.stream.has_consumer(id) {
                    return Response::Failed("consumer not found".into());
                }
                let stream = &mut shared.stream;
                std::iter::from_fn(|| stream.deliver(id))
                    .take(max.max(1) as usize)
                    .map(|d| JsDelivery {
                        seq: d.message.seq,
                        key: d.message.subject,
                        value: d
                            .message
                            .value
                            .map(|v| if headers_only { Vec::new() } else { v }),
                        pending: d.pending,
                    })
                    .collect::<Vec<_>>()
            };
            if !batch.is_empty() || waited {
                return JsAnswer::Batch(batch).into();
            }
            tokio::select! {
                biased;
                () = self.changed.notified() => {}
                () = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
        JsAnswer::Batch(Vec::new()).into()
    }
}

/// A consumer of the stream, deleted when the connection that made it ends.
struct Consumer<'a> {
    js: &'a JetStream,
    id: ConsumerId,
}

impl Drop for Consumer<'_> {
    fn drop(&mut self) {
        let mut shared = self.js.shared();
        shared.stream.delete_consumer(self.id);
        shared.feeds.remove(&self.id);
    }
}
