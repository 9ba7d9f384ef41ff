//! A TCP proxy on 127.0.0.1 that puts faults between a client and a server on command:
//! latency with seeded jitter, a bandwidth cap, one direction stalled, every connection
//! reset, connections left half-open. tokio only; one task per connection.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Bytes read from one side per chunk; each chunk is delayed and forwarded whole.
const CHUNK: usize = 16 * 1024;
/// Chunks read ahead of a stalled or delayed writer before the reader stops reading (and
/// TCP's own flow control pushes back on the sender).
const QUEUED_CHUNKS: usize = 64;

/// Which way bytes flow through a [`FaultProxy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the client that connected to the proxy, to the server behind it.
    ToServer,
    /// From the server back to the client.
    ToClient,
}

/// The faults in force; every connection task watches them.
#[derive(Debug, Clone, Default)]
struct Faults {
    latency: Duration,
    jitter: Duration,
    /// Bytes a second each direction of each connection forwards at most.
    bandwidth: Option<u64>,
    stalled_to_server: bool,
    stalled_to_client: bool,
    /// Connections with an id below this forward nothing and stay open (half-open).
    frozen_below: u64,
    /// Raised by a reset: every connection opened before it closes with RST.
    resets: u64,
    /// The proxy was dropped: every connection closes with RST.
    closed: bool,
}

impl Faults {
    fn holds(&self, direction: Direction, id: u64) -> bool {
        let stalled = match direction {
            Direction::ToServer => self.stalled_to_server,
            Direction::ToClient => self.stalled_to_client,
        };
        stalled || id < self.frozen_below
    }
}

/// A TCP proxy on 127.0.0.1 between clients and one upstream address (a nats-server's
/// client port, which [`NatsServer`](crate::NatsServer) keeps across restarts), with
/// faults put on and taken off by command:
///
/// - [`set_latency`](Self::set_latency): each chunk of bytes is held `latency` plus a
///   jitter drawn from the proxy's seed, in order (a later chunk never overtakes);
/// - [`cap_bandwidth`](Self::cap_bandwidth): each direction of each connection forwards
///   at most so many bytes a second (a chunk, then a pause as long as the chunk takes at
///   that rate), until [`uncap_bandwidth`](Self::uncap_bandwidth) or a heal;
/// - [`stall`](Self::stall): one direction forwards nothing until [`heal`](Self::heal);
///   the sender's writes succeed until the buffers fill;
/// - [`half_open`](Self::half_open): every connection open now forwards nothing either
///   way and is not closed (no FIN, no RST), as behind a dead NAT entry; new connections
///   flow;
/// - [`reset_all`](Self::reset_all): every open connection is closed with RST on both
///   sides.
///
/// A connection accepted while the upstream refuses (a killed server) is reset at once.
/// Dropping the proxy stops accepting and resets every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: Arc<watch::Sender<Faults>>,
    next_id: Arc<AtomicU64>,
    open: Arc<AtomicUsize>,
    accepting: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards each connection to `upstream`.
    /// `seed` decides every jitter drawn, per connection and direction.
    pub async fn start(upstream: SocketAddr, seed: u64) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let faults = Arc::new(watch::Sender::new(Faults::default()));
        let next_id = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let accepting = tokio::spawn(accept(
            listener,
            upstream,
            seed,
            Arc::clone(&faults),
            Arc::clone(&next_id),
            Arc::clone(&open),
        ));
        Ok(Self {
            addr,
            faults,
            next_id,
            open,
            accepting,
        })
    }

    /// The address clients connect to.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address as a NATS URL, `nats://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// How many connections it has accepted.
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// How many connections are open now.
    #[must_use]
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Holds every chunk `latency` plus a jitter in `[0, jitter]` (both directions), from
    /// now on; zero for both takes latency off.
    pub fn set_latency(&self, latency: Duration, jitter: Duration) {
        self.faults.send_modify(|f| {
            f.latency = latency;
            f.jitter = jitter;
        });
    }

    /// Forwards at most `bytes_per_sec` each way on every connection, old and new, from
    /// now on (at least one byte a second).
    pub fn cap_bandwidth(&self, bytes_per_sec: u64) {
        self.faults
            .send_modify(|f| f.bandwidth = Some(bytes_per_sec.max(1)));
    }

    /// Takes the bandwidth cap off; a pause under way ends at once.
    pub fn uncap_bandwidth(&self) {
        self.faults.send_modify(|f| f.bandwidth = None);
    }

    /// Stops forwarding in `direction` on every connection, old and new, until
    /// [`heal`](Self::heal). Nothing is lost: held bytes flow once healed.
    pub fn stall(&self, direction: Direction) {
        self.faults.send_modify(|f| match direction {
            Direction::ToServer => f.stalled_to_server = true,
            Direction::ToClient => f.stalled_to_client = true,
        });
    }

    /// Stops forwarding either way on every connection open now, without closing any, until
    /// [`heal`](Self::heal) (they flow on, nothing lost) or [`reset_all`](Self::reset_all).
    pub fn half_open(&self) {
        let below = self.next_id.load(Ordering::SeqCst);
        self.faults.send_modify(|f| f.frozen_below = below);
    }

    /// Closes every open connection with RST on both sides (half-open ones too).
    pub fn reset_all(&self) {
        self.faults.send_modify(|f| f.resets += 1);
    }

    /// Takes off latency, the bandwidth cap, stalls and half-open connections; closes
    /// nothing.
    pub fn heal(&self) {
        self.faults.send_modify(|f| {
            f.latency = Duration::ZERO;
            f.jitter = Duration::ZERO;
            f.bandwidth = None;
            f.stalled_to_server = false;
            f.stalled_to_client = false;
            f.frozen_below = 0;
        });
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.faults.send_modify(|f| f.closed = true);
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    seed: u64,
    faults: Arc<watch::Sender<Faults>>,
    next_id: Arc<AtomicU64>,
    open: Arc<AtomicUsize>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of descriptors, say: wait rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let id = next_id.fetch_add(1, Ordering::SeqCst);
        let control = faults.subscribe();
        let open = Arc::clone(&open);
        open.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            connection(id, client, upstream, seed, control).await;
            open.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Forwards one connection both ways until both sides end, an error, or a reset (then both
/// sockets close with RST).
async fn connection(
    id: u64,
    mut client: TcpStream,
    upstream: SocketAddr,
    seed: u64,
    mut control: watch::Receiver<Faults>,
) {
    let resets_at_open = control.borrow().resets;
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        let _ = client.set_zero_linger();
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let seed = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let to_server = pump(
            Direction::ToServer,
            id,
            client_read,
            server_write,
            control.clone(),
            seed,
        );
        let to_client = pump(
            Direction::ToClient,
            id,
            server_read,
            client_write,
            control.clone(),
            !seed,
        );
        let reset = control.wait_for(|f| f.closed || f.resets > resets_at_open);
        tokio::select! {
            ended = async { tokio::try_join!(to_server, to_client) } => {
                if ended.is_ok() {
                    return; // Both sides closed cleanly; FINs were forwarded.
                }
            }
            _ = reset => {}
        }
    }
    // A reset, or an error on one side: the other side gets an RST too.
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
}

/// Moves bytes one way: a reader queues chunks with their arrival time, a writer forwards
/// each once its latency has passed and nothing holds its direction.
async fn pump(
    direction: Direction,
    id: u64,
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    mut control: watch::Receiver<Faults>,
    seed: u64,
) -> io::Result<()> {
    let (queue, mut queued) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUED_CHUNKS);
    let read = async move {
        loop {
            let mut chunk = vec![0; CHUNK];
            let n = from.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<_, io::Error>(());
            }
            chunk.truncate(n);
            if queue.send((Instant::now(), chunk)).await.is_err() {
                return Ok(());
            }
        }
    };
    let write = async move {
        let mut jitter = SplitMix64(seed);
        let mut last_due = Instant::now();
        while let Some((arrived, chunk)) = queued.recv().await {
            let (latency, spread) = {
                let f = control.borrow();
                (f.latency, f.jitter)
            };
            let due = (arrived + latency + jitter.up_to(spread)).max(last_due);
            tokio::time::sleep_until(due).await;
            last_due = due;
            let _ = control.wait_for(|f| !f.holds(direction, id)).await;
            to.write_all(&chunk).await?;
            paced(&mut control, chunk.len()).await;
        }
        to.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}

/// After `bytes` were forwarded under a bandwidth cap, waits as long as they take at its
/// rate; the wait ends early when the cap is taken off (checked every 50 ms).
async fn paced(control: &mut watch::Receiver<Faults>, bytes: usize) {
    let Some(rate) = control.borrow().bandwidth else {
        return;
    };
    let until = Instant::now() + Duration::from_secs_f64(bytes as f64 / rate as f64);
    while Instant::now() < until && control.borrow().bandwidth.is_some() {
        let step = (Instant::now() + Duration::from_millis(50)).min(until);
        tokio::time::sleep_until(step).await;
    }
}

/// SplitMix64, the jitter's generator: the same seed gives the same delays.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A duration in `[0, max]`, to the microsecond.
    fn up_to(&mut self, max: Duration) -> Duration {
        let micros = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        match micros {
            0 => Duration::ZERO,
            m => Duration::from_micros(self.next_u64() % (m + 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A server on 127.0.0.1 that echoes every byte back.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    /// A server on 127.0.0.1 that reports every byte it receives and sends nothing.
    async fn sink_server() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, rx)
    }

    async fn round_trip(stream: &mut TcpStream, bytes: &[u8], within: Duration) -> Option<Vec<u8>> {
        stream.write_all(bytes).await.unwrap();
        let mut back = vec![0; bytes.len()];
        match tokio::time::timeout(within, stream.read_exact(&mut back)).await {
            Ok(read) => {
                read.unwrap();
                Some(back)
            }
            Err(_) => None,
        }
    }

    const LONG: Duration = Duration::from_secs(5);
    const SHORT: Duration = Duration::from_millis(300);

    #[tokio::test]
    async fn forwards_every_byte_both_ways_in_order() {
        let proxy = FaultProxy::start(echo_server().await, 1).await.unwrap();
        assert!(proxy.addr().ip().is_loopback(), "binds 127.0.0.1 only");
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let back = round_trip(&mut stream, &payload, LONG).await;
        assert!(
            back == Some(payload),
            "a healthy proxy must pass bytes through unchanged"
        );
        assert_eq!(proxy.accepted(), 1);
    }

    #[tokio::test]
    async fn latency_delays_each_round_trip_and_heal_takes_it_off() {
        let proxy = FaultProxy::start(echo_server().await, 2).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.set_latency(Duration::from_millis(100), Duration::from_millis(20));
        let started = Instant::now();
        assert!(round_trip(&mut stream, b"ping", LONG).await.is_some());
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200),
            "100 ms each way must hold a round trip at least 200 ms, took {took:?}"
        );
        proxy.heal();
        let started = Instant::now();
        assert!(round_trip(&mut stream, b"ping", LONG).await.is_some());
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "healed, a round trip on loopback is fast again: {:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_stalled_direction_holds_bytes_and_heal_delivers_them() {
        let (upstream, mut received) = sink_server().await;
        let proxy = FaultProxy::start(upstream, 3).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.stall(Direction::ToServer);
        stream.write_all(b"held").await.unwrap();
        let early = tokio::time::timeout(SHORT, received.recv()).await;
        assert!(
            early.is_err(),
            "a stalled direction must forward nothing: {early:?}"
        );
        proxy.heal();
        let late = tokio::time::timeout(LONG, received.recv()).await;
        assert_eq!(
            late.ok().flatten().as_deref(),
            Some(&b"held"[..]),
            "once healed, what was held arrives: a stall loses nothing"
        );
    }

    #[tokio::test]
    async fn a_bandwidth_cap_holds_a_transfer_to_its_rate_and_loses_nothing() {
        let (upstream, mut received) = sink_server().await;
        let proxy = FaultProxy::start(upstream, 5).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.cap_bandwidth(256 * 1024);
        let sent: Vec<u8> = (0..512 * 1024u32).map(|i| (i % 251) as u8).collect();
        let started = Instant::now();
        stream.write_all(&sent).await.unwrap();
        let mut got = Vec::new();
        while got.len() < sent.len() {
            let part = tokio::time::timeout(Duration::from_secs(10), received.recv()).await;
            got.extend(
                part.ok()
                    .flatten()
                    .expect("the transfer goes on under the cap"),
            );
        }
        let took = started.elapsed();
        assert_eq!(
            got, sent,
            "a capped connection delivers every byte, in order"
        );
        // 512 KiB at 256 KiB/s: the first chunk goes at once, the rest are paced.
        assert!(
            took >= Duration::from_millis(1_500),
            "512 KiB under a cap of 256 KiB/s must take about 2 s, took {took:?}"
        );
        proxy.uncap_bandwidth();
        assert_eq!(proxy.faults.borrow().bandwidth, None);
    }

    #[tokio::test]
    async fn a_stall_of_replies_lets_requests_through() {
        let proxy = FaultProxy::start(echo_server().await, 4).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.stall(Direction::ToClient);
        assert_eq!(
            round_trip(&mut stream, b"one", SHORT).await,
            None,
            "replies must be held while the direction to the client is stalled"
        );
        proxy.heal();
        let mut back = vec![0; 3];
        tokio::time::timeout(LONG, stream.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            back, b"one",
            "the request went through; its held reply arrives on heal"
        );
    }

    #[tokio::test]
    async fn reset_all_resets_the_client_at_once() {
        let proxy = FaultProxy::start(echo_server().await, 5).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut stream, b"up", LONG).await.is_some());
        proxy.reset_all();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(LONG, stream.read(&mut buf)).await;
        let error = read.expect("a reset must reach the client promptly");
        assert!(
            matches!(&error, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "the client must see a reset, not a clean end: {error:?}"
        );
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            round_trip(&mut again, b"new", LONG).await.is_some(),
            "connections made after a reset flow"
        );
    }

    #[tokio::test]
    async fn half_open_connections_stay_open_silent_and_new_ones_flow() {
        let proxy = FaultProxy::start(echo_server().await, 6).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut old, b"up", LONG).await.is_some());
        proxy.half_open();
        let mut buf = [0u8; 4];
        old.write_all(b"lost")
            .await
            .expect("a half-open connection still takes writes");
        let read = tokio::time::timeout(SHORT, old.read(&mut buf)).await;
        assert!(
            read.is_err(),
            "a half-open connection neither answers nor closes: {read:?}"
        );
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            round_trip(&mut new, b"new", LONG).await.is_some(),
            "a connection made after the fault flows"
        );
        proxy.heal();
        let read = tokio::time::timeout(LONG, old.read_exact(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(_))) && &buf == b"lost",
            "healed, the held bytes flow on: {read:?}"
        );
        assert_eq!(proxy.open_connections(), 2);
    }

    #[tokio::test]
    async fn a_refused_upstream_resets_the_client() {
        let free = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let gone = free.local_addr().unwrap();
        drop(free);
        let proxy = FaultProxy::start(gone, 7).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(LONG, stream.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Err(ref e)) if e.kind() == io::ErrorKind::ConnectionReset),
            "a client of a dead server must be reset, as the server's own port would: {read:?}"
        );
    }

    #[test]
    fn jitter_replays_from_its_seed_and_stays_in_bounds() {
        let max = Duration::from_millis(30);
        let draws = |seed| {
            let mut rng = SplitMix64(seed);
            (0..1000).map(|_| rng.up_to(max)).collect::<Vec<_>>()
        };
        assert_eq!(
            draws(9),
            draws(9),
            "the same seed must give the same delays"
        );
        assert_ne!(draws(9), draws(10), "another seed must give other delays");
        assert!(
            draws(9).iter().all(|d| *d <= max),
            "jitter must stay within its bound"
        );
        assert_eq!(SplitMix64(1).up_to(Duration::ZERO), Duration::ZERO);
    }
}
