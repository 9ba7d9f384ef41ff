//! Writers straight to nats-server (not through the proxy): puts, deletes, purges, rapid
//! overwrites of one key and values near the bucket's size limit, each a JetStream
//! publish whose acknowledgement gives its revision. A write whose acknowledgement is lost
//! (a killed or stopped server) is read back once the server answers, so the ledger is
//! exact either way. Each acknowledged write is then announced on the round's events
//! stream (fire and forget, as a writer's announcement is: one lost with a killed server
//! is the crash window a reconcile closes); one put in eight as a bare mutation marker
//! unless `--no-markers` is given. Each write holds the round's bucket gate (read): a
//! recreation of the bucket takes it whole, so every write lands in one known history and
//! writers go on into the new one, their revisions starting again at 1.
//!
//! On a cluster a lost acknowledgement is read back only once no node fault holds and the
//! bucket's group has a leader that has heard every replica within the last 2 s, and then
//! 1.5 s later: a leader cut from its peers answers reads of its own store while the
//! proposal it took waits for a quorum, which it may still get once healed, so a read
//! back before then would call a write lost that lands later.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::connection::State;
use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use tidemark::tidemark_core::{Event, Rng};
use tokio::sync::{RwLock, watch};
use tokio::time::{Instant, sleep, timeout};

use crate::ledger::{Kind, Landed, make_token, token};

/// The bucket's `max_value_size`; big writes land within 256 bytes of it.
pub const VALUE_LIMIT: usize = 128 * 1024;
/// How long a write waits for its acknowledgement before it is read back instead.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// On a cluster, how recently the leader must have heard every replica (raft heartbeats
/// are 1 s apart) before a lost acknowledgement is read back, and how long after that:
/// past a heartbeat, by when a proposal the leader held while cut off is committed.
const HEARD_WITHIN: Duration = Duration::from_secs(2);
const HELD_PROPOSAL: Duration = Duration::from_millis(1500);
/// How long a lost acknowledgement may take to resolve (the server is healed well before).
const RESOLVE_WITHIN: Duration = Duration::from_secs(90);

/// The first draw of a write near the size limit.
const BIG: u64 = 77;

/// What the writers did.
#[derive(Debug, Default, Clone, Copy)]
pub struct WriteCounts {
    pub puts: u64,
    pub overwrites: u64,
    pub big: u64,
    pub deletes: u64,
    pub purges: u64,
    /// Writes whose acknowledgement was lost: read back, found landed or not.
    pub unacked_landed: u64,
    pub unacked_lost: u64,
    /// Announcements sent (puts with their value, removals, markers).
    pub announced: u64,
}

impl WriteCounts {
    pub fn add(&mut self, o: &WriteCounts) {
        self.puts += o.puts;
        self.overwrites += o.overwrites;
        self.big += o.big;
        self.deletes += o.deletes;
        self.purges += o.purges;
        self.unacked_landed += o.unacked_landed;
        self.unacked_lost += o.unacked_lost;
        self.announced += o.announced;
    }

    pub fn landed(&self) -> u64 {
        self.puts + self.deletes + self.purges
    }
}

/// Where the writers write and how they announce.
pub struct Writes<'a> {
    pub bucket: &'a str,
    /// The events stream's subject prefix.
    pub events: &'a str,
    /// Announce one put in eight as a bare mutation marker.
    pub markers: bool,
    /// The bucket's history, held to write.
    pub gate: &'a Arc<RwLock<u32>>,
    /// While set, most writes are values near the size limit (a fault that pauses a
    /// follower sets it, so the server's flow control has bytes to hold back).
    pub flood: &'a Arc<AtomicBool>,
    /// On a cluster: set while a fault holds a node (killed, stopped, cut off).
    pub node_fault: Option<&'a Arc<AtomicBool>>,
}

/// One writer: the only one to write its keys, so its acknowledgements order them.
pub struct Writer {
    id: usize,
    keys: Vec<String>,
    rng: Rng,
    client: async_nats::Client,
    js: jetstream::Context,
    stream: jetstream::stream::Stream,
    bucket: String,
    /// The events stream's subject prefix, announced on.
    events: String,
    /// Whether one put in eight is announced as a bare mutation marker.
    markers: bool,
    /// The bucket's history now (held to write; the recreation takes it whole), and the
    /// one this writer's `last` revisions are of.
    gate: Arc<RwLock<u32>>,
    epoch: u32,
    flood: Arc<AtomicBool>,
    node_fault: Option<Arc<AtomicBool>>,
    last: HashMap<String, u64>,
    tokens: u64,
    /// What landed.
    pub landed: Vec<Landed>,
    pub counts: WriteCounts,
}

impl Writer {
    /// A writer of keys `w<id>.k0…` on `client`, its choices drawn from `seed`.
    pub async fn new(
        id: usize,
        seed: u64,
        keys: usize,
        client: async_nats::Client,
        to: &Writes<'_>,
    ) -> Result<Writer, String> {
        let mut js = jetstream::new(client.clone());
        js.set_timeout(ACK_TIMEOUT);
        let stream = js
            .get_stream(format!("KV_{}", to.bucket))
            .await
            .map_err(|e| format!("writer {id}: the bucket's stream: {e}"))?;
        Ok(Writer {
            id,
            keys: (0..keys).map(|k| format!("w{id}.k{k}")).collect(),
            rng: Rng::new(seed),
            client,
            js,
            stream,
            bucket: to.bucket.to_owned(),
            events: to.events.to_owned(),
            markers: to.markers,
            gate: Arc::clone(to.gate),
            flood: Arc::clone(to.flood),
            node_fault: to.node_fault.cloned(),
            epoch: 0,
            last: HashMap::new(),
            tokens: 0,
            landed: Vec::new(),
            counts: WriteCounts::default(),
        })
    }

    /// Writes every key once and removes a few, so followers start on a bucket with
    /// history: present keys and delete and purge markers.
    pub async fn preload(&mut self) -> Result<(), String> {
        for key in self.keys.clone() {
            let len = self.small_len();
            self.put(&key, len).await?;
        }
        for key in self.keys.clone() {
            match self.rng.next_u64() % 5 {
                0 => self.remove(&key, Kind::Delete).await?,
                1 => self.remove(&key, Kind::Purge).await?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Writes until `stop` says so; returns itself with what landed.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) -> Result<Writer, String> {
        while !*stop.borrow_and_update() {
            let key = self.keys[(self.rng.next_u64() % self.keys.len() as u64) as usize].clone();
            let draw = match self.flood.load(Ordering::Relaxed) {
                true if self.rng.next_u64() % 4 != 0 => BIG,
                _ => self.rng.next_u64() % 100,
            };
            match draw {
                0..45 => {
                    let len = self.small_len();
                    self.put(&key, len).await?;
                }
                45..57 => {
                    // Rapid overwrites of one key: no pause between them.
                    for _ in 0..5 + self.rng.next_u64() % 20 {
                        let len = self.small_len();
                        self.put(&key, len).await?;
                        self.counts.overwrites += 1;
                        if *stop.borrow() {
                            break;
                        }
                    }
                }
                57..69 => self.remove(&key, Kind::Delete).await?,
                69..77 => self.remove(&key, Kind::Purge).await?,
                BIG..85 => {
                    let len = VALUE_LIMIT - (self.rng.next_u64() % 256) as usize;
                    self.put(&key, len).await?;
                    self.counts.big += 1;
                }
                _ => {
                    let pause = Duration::from_millis(20 + self.rng.next_u64() % 130);
                    let _ = timeout(pause, stop.changed()).await;
                }
            }
            sleep(Duration::from_millis(1 + self.rng.next_u64() % 5)).await;
        }
        Ok(self)
    }

    fn small_len(&mut self) -> usize {
        1 + (self.rng.next_u64() % 300) as usize
    }

    async fn put(&mut self, key: &str, len: usize) -> Result<(), String> {
        let gate = Arc::clone(&self.gate);
        let held = gate.read().await;
        let epoch = self.enter(*held);
        self.tokens += 1;
        let token = make_token(key, epoch, self.tokens);
        let mut value = format!("{token}|").into_bytes();
        let fill = (self.tokens % 26) as u8;
        value.extend(
            (value.len()..len.max(value.len())).map(|i| b'a' + ((i % 26) as u8 + fill) % 26),
        );
        self.counts.puts += 1;
        self.write(key, HeaderMap::new(), value.into(), Kind::Put(token))
            .await
    }

    /// Takes the bucket's history `epoch` as the one written: a new one has no revision of
    /// this writer's keys yet.
    fn enter(&mut self, epoch: u32) -> u32 {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.last.clear();
        }
        epoch
    }

    async fn remove(&mut self, key: &str, kind: Kind) -> Result<(), String> {
        let gate = Arc::clone(&self.gate);
        let held = gate.read().await;
        self.enter(*held);
        let mut headers = HeaderMap::new();
        match kind {
            Kind::Purge => {
                headers.insert("KV-Operation", "PURGE");
                headers.insert("Nats-Rollup", "sub");
                self.counts.purges += 1;
            }
            _ => {
                headers.insert("KV-Operation", "DEL");
                self.counts.deletes += 1;
            }
        }
        self.write(key, headers, Bytes::new(), kind).await
    }

    /// Publishes one mutation and records where it landed, reading the key back if the
    /// acknowledgement does not come.
    async fn write(
        &mut self,
        key: &str,
        headers: HeaderMap,
        value: Bytes,
        kind: Kind,
    ) -> Result<(), String> {
        let subject = format!("$KV.{}.{key}", self.bucket);
        let sent = std::time::Instant::now();
        let written = value.clone();
        let published = async {
            let ack = self
                .js
                .publish_with_headers(subject, headers, value)
                .await?;
            ack.await
        };
        let seq = match timeout(ACK_TIMEOUT * 2, published).await {
            Ok(Ok(ack)) => {
                self.announce(ack.sequence, key, &kind, &written).await;
                Some(ack.sequence)
            }
            Ok(Err(_)) | Err(_) => {
                let seq = self.resolve(key, &kind).await?;
                match seq {
                    Some(_) => self.counts.unacked_landed += 1,
                    None => {
                        self.counts.unacked_lost += 1;
                        self.uncount(&kind);
                    }
                }
                seq
            }
        };
        if let Some(seq) = seq {
            self.last.insert(key.to_owned(), seq);
            self.landed.push(Landed {
                epoch: self.epoch,
                key: key.to_owned(),
                seq,
                kind,
                sent,
            });
        }
        Ok(())
    }

    /// Announces the write acknowledged at `seq` on the events stream, without waiting
    /// for the stream's acknowledgement.
    async fn announce(&mut self, seq: u64, key: &str, kind: &Kind, value: &[u8]) {
        let event = match kind {
            Kind::Put(_) if self.markers && self.rng.next_u64() % 8 == 0 => Event::Mutation {
                seq,
                key: key.to_owned(),
            },
            Kind::Put(_) => Event::of_write(seq, key, Some(value)),
            Kind::Delete | Kind::Purge => Event::of_write(seq, key, None),
        };
        let Ok(payload) = event.encode() else {
            return;
        };
        let subject = format!("{}.{key}", self.events);
        if self.client.publish(subject, payload.into()).await.is_ok() {
            self.counts.announced += 1;
        }
    }

    fn uncount(&mut self, kind: &Kind) {
        match kind {
            Kind::Put(_) => self.counts.puts -= 1,
            Kind::Delete => self.counts.deletes -= 1,
            Kind::Purge => self.counts.purges -= 1,
        }
    }

    /// Whether a write whose acknowledgement was lost landed, and at which revision: once
    /// the connection is up and flushed (the publish has left the client), the key's last
    /// message read twice, 200 ms apart, the same (the server has stored what it took).
    /// Only this writer writes the key, so anything above what it knew is that write.
    async fn resolve(&mut self, key: &str, kind: &Kind) -> Result<Option<u64>, String> {
        let started = Instant::now();
        let known = self.last.get(key).copied().unwrap_or(0);
        loop {
            if started.elapsed() > RESOLVE_WITHIN {
                return Err(format!(
                    "writer {}: could not learn within {RESOLVE_WITHIN:?} whether its {kind:?} \
                     of {key} landed",
                    self.id
                ));
            }
            sleep(Duration::from_millis(50)).await;
            if self.client.connection_state() != State::Connected {
                continue;
            }
            if !matches!(timeout(ACK_TIMEOUT, self.client.flush()).await, Ok(Ok(()))) {
                continue;
            }
            if let Some(node_fault) = &self.node_fault {
                if node_fault.load(Ordering::Relaxed) || !self.group_heard().await {
                    continue;
                }
                sleep(HELD_PROPOSAL).await;
            }
            sleep(Duration::from_millis(200)).await;
            let Ok(first) = self.last_of(key).await else {
                continue;
            };
            sleep(Duration::from_millis(200)).await;
            let Ok(second) = self.last_of(key).await else {
                continue;
            };
            if first != second {
                continue;
            }
            return match first {
                Some((seq, got)) if seq > known && got == *kind => Ok(Some(seq)),
                Some((seq, got)) if seq > known => Err(format!(
                    "writer {}: {key} holds {got:?} at {seq}, not the {kind:?} whose \
                     acknowledgement was lost, yet only this writer writes it",
                    self.id
                )),
                _ => Ok(None),
            };
        }
    }

    /// Whether the bucket's group has a leader that has heard from every replica within
    /// [`HEARD_WITHIN`], and every replica is current: no proposal is held for a quorum.
    async fn group_heard(&self) -> bool {
        let mut stream = self.stream.clone();
        let Ok(Ok(info)) = timeout(ACK_TIMEOUT, stream.info()).await else {
            return false;
        };
        info.cluster.as_ref().is_some_and(|c| {
            c.leader.is_some()
                && c.replicas
                    .iter()
                    .all(|r| r.current && !r.offline && r.active < HEARD_WITHIN)
        })
    }

    /// The last message of `key`'s subject: its revision and mutation, `None` if none.
    async fn last_of(&self, key: &str) -> Result<Option<(u64, Kind)>, String> {
        let subject = format!("$KV.{}.{key}", self.bucket);
        let read = timeout(
            ACK_TIMEOUT,
            self.stream.get_last_raw_message_by_subject(&subject),
        );
        match read.await {
            Err(_) => Err("timed out".to_owned()),
            Ok(Ok(m)) => Ok(Some((m.sequence, kind_of(&m.headers, &m.payload)))),
            Ok(Err(e)) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Ok(Err(e)) => Err(e.to_string()),
        }
    }
}

/// The mutation a KV message carries.
pub fn kind_of(headers: &HeaderMap, payload: &[u8]) -> Kind {
    match headers.get("KV-Operation").map(|v| v.as_str()) {
        Some("DEL") => Kind::Delete,
        Some("PURGE") => Kind::Purge,
        _ => Kind::Put(token(payload)),
    }
}
