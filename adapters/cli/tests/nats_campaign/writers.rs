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
//! In a round with TTLs (one node only, one round in three: [`crate::schedule::Schedule`])
//! the bucket writes limit markers and a writer gives some puts a TTL of one or two
//! seconds. The server then writes the key's expiry marker, which no writer's
//! acknowledgement tells of: the writer leaves such a key alone until the put's TTL has
//! passed and it has read the marker back (two equal reads) and recorded it, so the
//! ledger holds it at its revision. A TTL'd put whose acknowledgement was lost and which
//! expired before it was read back is recorded as landed between the revision before it
//! and its marker (its own revision is gone with it).
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

use crate::ledger::{ExpiryUnread, Kind, Landed, Unplaced, make_token, token};

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
/// The first draw of a put with a TTL, in a round with TTLs (a pause in the others).
const TTL: u64 = 85;
/// How long the server's expiry markers live: past any round, so every marker a follower
/// could see is there to read back.
pub const MARKER_TTL: Duration = Duration::from_secs(300);

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
    /// Puts with a TTL (counted in `puts` too), their expiry markers read back, and
    /// those that expired before a lost acknowledgement was resolved.
    pub ttl_puts: u64,
    pub expired: u64,
    pub ttl_unplaced: u64,
    /// Puts with a TTL whose bucket was made again before their marker was read back.
    pub expiry_unread: u64,
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
        self.ttl_puts += o.ttl_puts;
        self.expired += o.expired;
        self.ttl_unplaced += o.ttl_unplaced;
        self.expiry_unread += o.expiry_unread;
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
    /// Until when puts with a TTL are drawn (`None`: a round without TTLs).
    ttl_until: Option<Instant>,
    /// Keys whose last write is a put with a TTL: its revision, and when it was sent and
    /// its TTL ran out at the earliest.
    expiring: HashMap<String, Expiring>,
    /// What landed.
    pub landed: Vec<Landed>,
    /// Puts with a TTL that landed at a revision no read can give any more.
    pub unplaced: Vec<Unplaced>,
    /// Puts with a TTL whose history was replaced before their marker was read back.
    pub unread: Vec<ExpiryUnread>,
    pub counts: WriteCounts,
}

/// A put with a TTL whose expiry marker is not recorded yet.
#[derive(Debug, Clone, Copy)]
struct Expiring {
    seq: u64,
    ends: std::time::Instant,
}

/// How a write whose acknowledgement was lost turned out.
enum Resolved {
    Landed(u64),
    Lost,
    /// A put with a TTL that landed and expired: its marker's revision.
    Expired(u64),
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
            ttl_until: None,
            expiring: HashMap::new(),
            landed: Vec::new(),
            unplaced: Vec::new(),
            unread: Vec::new(),
            counts: WriteCounts::default(),
        })
    }

    /// Draws puts with a TTL until `until` (the bucket writes limit markers).
    pub fn ttl_until(&mut self, until: Option<Instant>) {
        self.ttl_until = until;
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
            // A TTL'd put past its end has its marker read back at once: before the bucket
            // may be made again (which leaves it unread).
            let due = self
                .expiring
                .iter()
                .filter(|(_, e)| e.ends <= std::time::Instant::now())
                .map(|(k, e)| (e.ends, k.clone()))
                .min();
            if let Some((_, due)) = due {
                self.settle_expiry(&due, false).await?;
            }
            let key = self.keys[(self.rng.next_u64() % self.keys.len() as u64) as usize].clone();
            // A key whose TTL'd put has not expired yet (or whose marker is not read back
            // yet) is left alone: only so is its marker's revision certain.
            if self.expiring.contains_key(&key) {
                self.settle_expiry(&key, false).await?;
                if self.expiring.contains_key(&key) {
                    sleep(Duration::from_millis(5)).await;
                    continue;
                }
            }
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
                BIG..TTL => {
                    let len = VALUE_LIMIT - (self.rng.next_u64() % 256) as usize;
                    self.put(&key, len).await?;
                    self.counts.big += 1;
                }
                TTL..95 if self.ttl_until.is_some_and(|u| Instant::now() < u) => {
                    let ttl = Duration::from_secs(1 + self.rng.next_u64() % 2);
                    let len = self.small_len();
                    self.put_with_ttl(&key, len, Some(ttl)).await?;
                }
                _ => {
                    let pause = Duration::from_millis(20 + self.rng.next_u64() % 130);
                    let _ = timeout(pause, stop.changed()).await;
                }
            }
            sleep(Duration::from_millis(1 + self.rng.next_u64() % 5)).await;
        }
        // Every TTL'd put's marker, read back once it is there.
        let keys: Vec<String> = self.expiring.keys().cloned().collect();
        for key in keys {
            self.settle_expiry(&key, true).await?;
        }
        Ok(self)
    }

    /// The bucket was made again: its TTL'd puts went with the old history, and their
    /// markers (landed or not) with them; each may have expired unseen.
    fn forget_expiring(&mut self) {
        for (key, e) in self.expiring.drain() {
            self.counts.expiry_unread += 1;
            self.unread.push(ExpiryUnread {
                epoch: self.epoch,
                key,
                after: e.seq,
            });
        }
    }

    /// Records the expiry marker of `key`'s TTL'd put once its TTL has passed and two
    /// equal reads show the marker as the key's last message. Without `wait`, tries once
    /// (the writer goes on with another key); with it, until the marker is there.
    async fn settle_expiry(&mut self, key: &str, wait: bool) -> Result<(), String> {
        let gate = Arc::clone(&self.gate);
        let held = gate.read().await;
        if *held != self.epoch {
            self.forget_expiring();
            return Ok(());
        }
        let started = Instant::now();
        loop {
            let Some(e) = self.expiring.get(key).copied() else {
                return Ok(());
            };
            if started.elapsed() > RESOLVE_WITHIN {
                return Err(format!(
                    "writer {}: the TTL'd put of {key} at {} left no expiry marker within \
                     {RESOLVE_WITHIN:?} of its end",
                    self.id, e.seq
                ));
            }
            if std::time::Instant::now() < e.ends {
                if !wait {
                    return Ok(());
                }
                sleep(e.ends - std::time::Instant::now()).await;
                continue;
            }
            match self.stable_last(key).await {
                Some(Some((seq, Kind::Expired))) if seq > e.seq => {
                    self.expiring.remove(key);
                    self.last.insert(key.to_owned(), seq);
                    self.counts.expired += 1;
                    self.landed.push(Landed {
                        epoch: self.epoch,
                        key: key.to_owned(),
                        seq,
                        kind: Kind::Expired,
                        // The server wrote it once the TTL had run from the put's store,
                        // after it was sent.
                        sent: e.ends,
                    });
                    return Ok(());
                }
                Some(Some((seq, Kind::Put(_)))) if seq == e.seq => {}
                Some(other) => {
                    return Err(format!(
                        "writer {}: {key} holds {other:?}, neither its TTL'd put at {} nor \
                         that put's expiry marker, yet only this writer writes it",
                        self.id, e.seq
                    ));
                }
                None => {}
            }
            if !wait {
                return Ok(());
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    fn small_len(&mut self) -> usize {
        1 + (self.rng.next_u64() % 300) as usize
    }

    async fn put(&mut self, key: &str, len: usize) -> Result<(), String> {
        self.put_with_ttl(key, len, None).await
    }

    async fn put_with_ttl(
        &mut self,
        key: &str,
        len: usize,
        ttl: Option<Duration>,
    ) -> Result<(), String> {
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
        let mut headers = HeaderMap::new();
        if let Some(ttl) = ttl {
            headers.insert("Nats-TTL", ttl.as_secs().to_string().as_str());
            self.counts.ttl_puts += 1;
        }
        self.write(key, headers, value.into(), Kind::Put(token), ttl)
            .await
    }

    /// Takes the bucket's history `epoch` as the one written: a new one has no revision of
    /// this writer's keys yet.
    fn enter(&mut self, epoch: u32) -> u32 {
        if epoch != self.epoch {
            self.forget_expiring();
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
        self.write(key, headers, Bytes::new(), kind, None).await
    }

    /// Publishes one mutation and records where it landed, reading the key back if the
    /// acknowledgement does not come.
    async fn write(
        &mut self,
        key: &str,
        headers: HeaderMap,
        value: Bytes,
        kind: Kind,
        ttl: Option<Duration>,
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
            Ok(Err(_)) | Err(_) => match self.resolve(key, &kind, ttl.is_some()).await? {
                Resolved::Landed(seq) => {
                    self.counts.unacked_landed += 1;
                    Some(seq)
                }
                Resolved::Lost => {
                    self.counts.unacked_lost += 1;
                    self.uncount(&kind);
                    None
                }
                Resolved::Expired(marker) => {
                    self.counts.unacked_landed += 1;
                    self.counts.ttl_unplaced += 1;
                    self.counts.expired += 1;
                    let after = self.last.get(key).copied().unwrap_or(0);
                    if let Kind::Put(token) = &kind {
                        self.unplaced.push(Unplaced {
                            epoch: self.epoch,
                            key: key.to_owned(),
                            token: token.clone(),
                            after,
                            before: marker,
                        });
                    }
                    self.last.insert(key.to_owned(), marker);
                    self.landed.push(Landed {
                        epoch: self.epoch,
                        key: key.to_owned(),
                        seq: marker,
                        kind: Kind::Expired,
                        sent: sent + ttl.unwrap_or_default(),
                    });
                    return Ok(());
                }
            },
        };
        if let Some(seq) = seq {
            self.last.insert(key.to_owned(), seq);
            if let Some(ttl) = ttl {
                self.expiring.insert(
                    key.to_owned(),
                    Expiring {
                        seq,
                        ends: sent + ttl,
                    },
                );
            }
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
            Kind::Delete | Kind::Purge | Kind::Expired => Event::of_write(seq, key, None),
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
            Kind::Expired => {}
        }
    }

    /// Whether a write whose acknowledgement was lost landed, and at which revision: once
    /// the connection is up and flushed (the publish has left the client), the key's last
    /// message read twice, 200 ms apart, the same (the server has stored what it took).
    /// Only this writer writes the key, so anything above what it knew is that write.
    ///
    /// A put with a TTL (`ttl`) may have landed and expired since: an expiry marker above
    /// what the writer knew can only be its own (the writer leaves a key with a TTL'd put
    /// alone until its marker is recorded).
    async fn resolve(&mut self, key: &str, kind: &Kind, ttl: bool) -> Result<Resolved, String> {
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
            if !self.readable().await {
                continue;
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
                Some((seq, got)) if seq > known && got == *kind => Ok(Resolved::Landed(seq)),
                Some((seq, Kind::Expired)) if seq > known && ttl => Ok(Resolved::Expired(seq)),
                Some((seq, got)) if seq > known => Err(format!(
                    "writer {}: {key} holds {got:?} at {seq}, not the {kind:?} whose \
                     acknowledgement was lost, yet only this writer writes it",
                    self.id
                )),
                _ => Ok(Resolved::Lost),
            };
        }
    }

    /// `key`'s last message (its revision and mutation; `None` inside: none), once the
    /// connection is up and the server answers; `None` when it is not (yet) to be had. On
    /// a cluster only with no node fault and a leader that heard every replica, and read
    /// twice, 200 ms apart, the same, as in [`resolve`](Self::resolve).
    async fn stable_last(&self, key: &str) -> Option<Option<(u64, Kind)>> {
        if !self.readable().await {
            return None;
        }
        let first = self.last_of(key).await.ok()?;
        if self.node_fault.is_none() {
            // One node answers with what it stored: a marker read is there to stay.
            return Some(first);
        }
        sleep(Duration::from_millis(200)).await;
        let second = self.last_of(key).await.ok()?;
        (first == second).then_some(first)
    }

    /// Whether what a read of the bucket finds now is what the server stored: the
    /// connection is up and flushed (every publish has left the client), and on a cluster
    /// no node fault is on and the group's leader heard every replica, then
    /// [`HELD_PROPOSAL`] passed (a proposal held for a quorum has landed or is lost).
    async fn readable(&self) -> bool {
        if self.client.connection_state() != State::Connected {
            return false;
        }
        if !matches!(timeout(ACK_TIMEOUT, self.client.flush()).await, Ok(Ok(()))) {
            return false;
        }
        if let Some(node_fault) = &self.node_fault {
            if node_fault.load(Ordering::Relaxed) || !self.group_heard().await {
                return false;
            }
            sleep(HELD_PROPOSAL).await;
        }
        true
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

/// The mutation a KV message carries; a marker the server wrote (no `KV-Operation`, a
/// `Nats-Marker-Reason`) is an expiry.
pub fn kind_of(headers: &HeaderMap, payload: &[u8]) -> Kind {
    if headers.get("Nats-Marker-Reason").is_some() {
        return Kind::Expired;
    }
    match headers.get("KV-Operation").map(|v| v.as_str()) {
        Some("DEL") => Kind::Delete,
        Some("PURGE") => Kind::Purge,
        _ => Kind::Put(token(payload)),
    }
}
