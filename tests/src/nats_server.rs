//! Real `nats-server` processes, run with the server's own facilities: it picks its client
//! port (`-p -1`) and reports it in a ports file (`--ports_file_dir`), binds 127.0.0.1
//! only and keeps JetStream storage in a temporary directory.
//!
//! Every process is stopped by the PID of the child this module spawned, never by name:
//! the child is `kill_on_drop`, so a failing or panicking test leaves nothing running.

use std::ffi::OsString;
use std::fs::{self, File};
use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::fault_proxy::FaultProxy;
use crate::nats_bin::{NatsServerBin, NatsVersion, PROVISION_HINT};

const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// From spawn to the ports file, JetStream recovery included.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const JETSTREAM_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// A server without a JetStream meta leader drops requests; the default timeout is 10 s.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const LOG_FILE: &str = "nats-server.log";

/// What can go wrong with nats-server. `Debug` prints the `Display` text, so `.expect(…)`
/// shows the whole explanation.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// No usable binary: none, not runnable, or older than [`MIN_VERSION`](crate::MIN_VERSION)
    /// (then `found` is its version). The message says how to get one.
    #[error("{problem}; {PROVISION_HINT}")]
    Unusable {
        /// What was found and what is wrong with it.
        problem: String,
        /// The version of a binary that is too old.
        found: Option<NatsVersion>,
    },
    /// The server did not start, come up, answer a client or ready JetStream (in 30 s).
    #[error("nats-server {0}")]
    Server(String),
    /// The operation needs a running server; the one on this port is stopped.
    #[error("nats-server on port {0} is not running")]
    NotRunning(u16),
}

impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

fn failure(doing: &str) -> impl FnOnce(std::io::Error) -> HarnessError + '_ {
    move |e| HarnessError::Server(format!("{doing}: {e}"))
}

/// What to start beyond the defaults (JetStream, 127.0.0.1, a port the server picks,
/// temporary storage, no auth).
#[derive(Debug, Clone, Default)]
pub struct NatsServerOptions {
    user_password: Option<(String, String)>,
    args: Vec<OsString>,
    name: Option<String>,
}

impl NatsServerOptions {
    /// The defaults.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Require this user and password (`--user`, `--pass`); [`NatsServer::connect`] sends them.
    #[must_use]
    pub fn user_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user_password = Some((user.into(), password.into()));
        self
    }

    /// Appends a raw argument: `--tls`, or `-c` and a config file for settings without a flag.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }
}

/// One nats-server with JetStream on 127.0.0.1, on the port it chose at its first start and
/// keeps across restarts, with storage in a temporary directory it owns. Faults:
/// [`kill9`](Self::kill9), [`restart`](Self::restart), [`pause`](Self::pause) and
/// [`resume`](Self::resume). Dropping it kills the process (a paused one too).
#[derive(Debug)]
pub struct NatsServer {
    bin: NatsServerBin,
    options: NatsServerOptions,
    /// 0 until the first start reports the port the server chose.
    port: u16,
    dir: TempDir,
    /// `kill_on_drop`: dropping it sends SIGKILL to the PID we spawned.
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server with the default options; see [`NatsServer::start_with`].
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(NatsServerOptions::new()).await
    }

    /// Starts a server and waits until its ports file says its listeners are up.
    pub async fn start_with(options: NatsServerOptions) -> Result<Self, HarnessError> {
        let mut server = Self::new(NatsServerBin::find()?, options)?;
        server.spawn()?;
        server.wait_ready().await?;
        Ok(server)
    }

    fn new(bin: NatsServerBin, options: NatsServerOptions) -> Result<Self, HarnessError> {
        let dir = tempfile::Builder::new().prefix("tidemark-nats-").tempdir();
        let dir = dir.map_err(failure("creating the server's temporary directory"))?;
        let (port, child) = (0, None);
        Ok(Self {
            bin,
            options,
            port,
            dir,
            child,
        })
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://{LOOPBACK}:{}", self.port)
    }

    /// The client port; the same across restarts.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The PID of the running process, `None` while stopped.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Connects a client, with the user and password the server requires if any.
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        let mut options = async_nats::ConnectOptions::new();
        if let Some((user, password)) = self.options.user_password.clone() {
            options = options.user_and_password(user, password);
        }
        let url = self.url();
        let connected = options.connect(url.as_str()).await;
        connected.map_err(|e| HarnessError::Server(format!("at {url}: cannot connect: {e}")))
    }

    /// Kills the process with SIGKILL and reaps it; the storage stays for a restart.
    pub async fn kill9(&mut self) -> Result<(), HarnessError> {
        let mut child = self
            .child
            .take()
            .ok_or(HarnessError::NotRunning(self.port))?;
        let _ = child.start_kill(); // Fails only if it has exited already.
        child.wait().await.map_err(failure("reaping nats-server"))?;
        Ok(())
    }

    /// Stops the process with SIGSTOP, sent to the PID this harness spawned: it holds its
    /// sockets open and answers nothing until [`resume`](Self::resume) (or a kill).
    pub fn pause(&mut self) -> Result<(), HarnessError> {
        self.signal("-STOP")
    }

    /// Lets a [`pause`](Self::pause)d process run on with SIGCONT (harmless on a running one).
    pub fn resume(&mut self) -> Result<(), HarnessError> {
        self.signal("-CONT")
    }

    /// Sends `signal` to the PID of the child this harness spawned (never by name).
    fn signal(&mut self, signal: &str) -> Result<(), HarnessError> {
        let pid = self.pid().ok_or(HarnessError::NotRunning(self.port))?;
        let sent = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .map_err(failure("running kill"))?;
        match sent.success() {
            true => Ok(()),
            false => Err(HarnessError::Server(format!(
                "kill {signal} {pid} failed ({sent})"
            ))),
        }
    }

    /// Starts the server again on the same port with the same storage, as after a crash (a
    /// running one is killed first). JetStream may need a moment more:
    /// [`wait_jetstream_ready`].
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        if self.child.is_some() {
            self.kill9().await?;
        }
        self.spawn()?;
        self.wait_ready().await
    }

    /// Spawns the process, on a port of the server's choice the first time, on the same
    /// port afterwards; its log (stderr) goes to `nats-server.log` in its directory.
    fn spawn(&mut self) -> Result<(), HarnessError> {
        let dir = self.dir.path();
        let log = File::create(dir.join(LOG_FILE)).map_err(failure("creating the log"))?;
        let port = match self.port {
            0 => "-1".to_owned(), // The server chooses.
            port => port.to_string(),
        };
        let mut command = Command::new(&self.bin.path);
        command.args(["--jetstream", "--addr", "127.0.0.1", "--port", &port]);
        command.arg("--store_dir").arg(dir.join("store"));
        command.arg("--ports_file_dir").arg(dir);
        if let Some((user, password)) = &self.options.user_password {
            command.args(["--user", user, "--pass", password]);
        }
        if let Some(name) = &self.options.name {
            command.args(["--server_name", name]);
        }
        command.args(&self.options.args).kill_on_drop(true);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(command.spawn().map_err(failure("spawning nats-server"))?);
        Ok(())
    }

    /// Waits for the current process's ports file, which the server writes once every
    /// listener (client, routes) is up, and takes the client port from it.
    async fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            if let Err(e) = self.check_alive() {
                let _ = self.kill9().await; // Reaps it and forgets its PID.
                return Err(e);
            }
            let pid = self.pid().unwrap_or(0);
            if let Some(port) = client_port(self.dir.path(), pid) {
                self.port = port;
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(self.failed(&format!("wrote no ports file within {START_TIMEOUT:?}")));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Fails, with the end of its log, if the process has exited on its own.
    pub fn check_alive(&mut self) -> Result<(), HarnessError> {
        let child = self
            .child
            .as_mut()
            .ok_or(HarnessError::NotRunning(self.port))?;
        match child.try_wait().map_err(failure("checking the server"))? {
            Some(status) => Err(self.failed(&format!("exited ({status})"))),
            None => Ok(()),
        }
    }

    /// [`HarnessError::Server`] saying `what` happened, with the end of the log.
    fn failed(&self, what: &str) -> HarnessError {
        let log = fs::read(self.dir.path().join(LOG_FILE)).unwrap_or_default();
        let tail = String::from_utf8_lossy(&log[log.len().saturating_sub(8 * 1024)..]);
        let port = self.port;
        HarnessError::Server(format!("on port {port} {what}; end of its log:\n{tail}"))
    }
}

/// The client port in the ports file process `pid` wrote to `dir` (`<exe>_<pid>.ports`:
/// `{"nats":["nats://127.0.0.1:4222"],…}`); `None` while absent or half-written.
fn client_port(dir: &Path, pid: u32) -> Option<u16> {
    let suffix = format!("_{pid}.ports");
    let mut files = fs::read_dir(dir).ok()?.flatten();
    let file = files.find(|f| f.file_name().to_string_lossy().ends_with(&suffix))?;
    let ports: serde_json::Value = serde_json::from_slice(&fs::read(file.path()).ok()?).ok()?;
    ports["nats"][0].as_str()?.rsplit(':').next()?.parse().ok()
}

/// Waits until JetStream answers an account-info request through `client`, for up to 30 s:
/// right after a (re)start, and until a cluster has a meta leader, requests fail.
pub async fn wait_jetstream_ready(client: &async_nats::Client) -> Result<(), HarnessError> {
    let mut js = jetstream::new(client.clone());
    js.set_timeout(PROBE_TIMEOUT);
    let started = Instant::now();
    let mut backoff = Duration::from_millis(25);
    loop {
        match js.query_account().await {
            Ok(_) => return Ok(()),
            Err(e) if started.elapsed() > JETSTREAM_READY_TIMEOUT => {
                let what = format!("JetStream not ready after {JETSTREAM_READY_TIMEOUT:?}");
                return Err(HarnessError::Server(format!("{what}: {e}")));
            }
            Err(_) => tokio::time::sleep(backoff).await,
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// A JetStream cluster of nodes `n0`, `n1`, … on 127.0.0.1: kill, restart or connect to one
/// through [`nodes`](Self::nodes). Dropping the cluster kills every node.
#[derive(Debug)]
pub struct NatsCluster {
    /// The nodes, in index order (node `i` is named `n<i>`).
    pub nodes: Vec<NatsServer>,
    /// Started with [`start_with_route_links`](Self::start_with_route_links): the proxies
    /// every route between two nodes goes through; empty otherwise.
    pub links: Vec<RouteLink>,
    /// Where the linked nodes say they can be reached for routes: nothing behind it.
    _route_sink: Option<RouteSink>,
}

/// One direction of the routes between two nodes of a [`NatsCluster`]: node `from` dials
/// node `to`'s route port through `proxy`, so the proxy's faults act on the routes
/// between them.
#[derive(Debug)]
pub struct RouteLink {
    /// The node that dials.
    pub from: usize,
    /// The node dialled.
    pub to: usize,
    /// Between them.
    pub proxy: FaultProxy,
}

/// A port on 127.0.0.1 that resets every connection at once: what a linked node
/// advertises as its route address, so a node that learns of another by gossip (an
/// implicit route) cannot reach it around the links; its explicit route, through a link,
/// is the only one that holds.
#[derive(Debug)]
struct RouteSink {
    addr: std::net::SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl RouteSink {
    async fn start() -> Result<Self, HarnessError> {
        let listener = tokio::net::TcpListener::bind((LOOPBACK, 0)).await;
        let listener = listener.map_err(failure("binding the route sink"))?;
        let addr = listener
            .local_addr()
            .map_err(failure("the route sink's port"))?;
        let accepting = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let _ = stream.set_zero_linger(); // RST, not FIN.
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
        Ok(Self { addr, accepting })
    }
}

impl Drop for RouteSink {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl NatsCluster {
    /// Starts `size` nodes routed to each other and waits until JetStream answers, for up
    /// to 30 s. Client ports are the servers' choice; route ports must be known to every
    /// node, so they are chosen free by binding port 0.
    pub async fn start(size: usize) -> Result<Self, HarnessError> {
        Self::start_inner(size, None).await
    }

    /// Starts `size` nodes as [`start`](Self::start) does, but each node dials each other
    /// one through a [`RouteLink`] of its own (a [`FaultProxy`] whose jitter is drawn from
    /// `seed`), so a node can be cut from the others: stall or reset every link
    /// [`links_of`](Self::links_of) it. Nodes advertise a route address that resets every
    /// connection, so no route is made around the links, and tell clients no other node's
    /// URL (`--no_advertise`), so a client reaches only the URLs it was given (proxies of
    /// its own, say).
    pub async fn start_with_route_links(size: usize, seed: u64) -> Result<Self, HarnessError> {
        Self::start_inner(size, Some(seed)).await
    }

    /// Route ports are chosen free by binding port 0 and let go before the nodes bind
    /// them, so another process (or a route link's own listener) may take one meanwhile:
    /// a node then exits with "address already in use", and the cluster is started again
    /// on other ports, a few times at most.
    async fn start_inner(size: usize, linked: Option<u64>) -> Result<Self, HarnessError> {
        const ATTEMPTS: usize = 4;
        let mut attempt = 1;
        loop {
            match Self::start_once(size, linked).await {
                Err(e)
                    if attempt < ATTEMPTS && e.to_string().contains("address already in use") =>
                {
                    attempt += 1;
                }
                started => return started,
            }
        }
    }

    async fn start_once(size: usize, linked: Option<u64>) -> Result<Self, HarnessError> {
        static CLUSTERS: AtomicU64 = AtomicU64::new(0);
        let bin = NatsServerBin::find()?;
        let id = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let name = format!("tidemark-{}-{id}", std::process::id());
        let free = (0..size).map(|_| TcpListener::bind((LOOPBACK, 0))?.local_addr());
        let free = free.collect::<std::io::Result<Vec<_>>>();
        let free = free.map_err(failure("choosing route ports"))?;
        let routes: Vec<String> = free.iter().map(|a| format!("nats://{a}")).collect();
        let mut links = Vec::new();
        let mut sink = None;
        if let Some(seed) = linked {
            sink = Some(RouteSink::start().await?);
            for (from, to) in (0..size).flat_map(|f| (0..size).map(move |t| (f, t))) {
                if from == to {
                    continue;
                }
                let link_seed = seed ^ ((from * size + to) as u64).wrapping_mul(0x9E37_79B9);
                let proxy = FaultProxy::start(free[to], link_seed).await;
                let proxy = proxy.map_err(failure("starting a route link"))?;
                links.push(RouteLink { from, to, proxy });
            }
        }
        let mut nodes = Vec::with_capacity(size);
        for (index, route) in routes.iter().enumerate() {
            let options = NatsServerOptions::new().arg("--cluster").arg(route);
            let mut options = options.arg("--cluster_name").arg(&name);
            options = match &sink {
                None => options.arg("--routes").arg(routes.join(",")),
                Some(sink) => {
                    let own = links.iter().filter(|l| l.from == index);
                    let own: Vec<String> = own.map(|l| l.proxy.url()).collect();
                    let options = options.arg("--routes").arg(own.join(","));
                    let options = options
                        .arg("--cluster_advertise")
                        .arg(sink.addr.to_string());
                    options.arg("--no_advertise")
                }
            };
            options.name = Some(format!("n{index}"));
            let mut node = NatsServer::new(bin.clone(), options)?;
            node.spawn()?; // All before waiting on any: a node needs its routes.
            nodes.push(node);
        }
        for node in &mut nodes {
            node.wait_ready().await?;
        }
        let cluster = Self {
            nodes,
            links,
            _route_sink: sink,
        };
        wait_jetstream_ready(&cluster.connect().await?).await?;
        Ok(cluster)
    }

    /// The index of the node with this server name (as JetStream names leaders).
    #[must_use]
    pub fn index_of(&self, server_name: &str) -> Option<usize> {
        let name = Some(server_name);
        self.nodes
            .iter()
            .position(|n| n.options.name.as_deref() == name)
    }

    /// The proxies of the routes to and from node `node` (none unless the cluster was
    /// started with [`start_with_route_links`](Self::start_with_route_links)): stall or
    /// reset them all and the node is cut from the others.
    pub fn links_of(&self, node: usize) -> impl Iterator<Item = &FaultProxy> {
        let touching = move |l: &&RouteLink| l.from == node || l.to == node;
        self.links.iter().filter(touching).map(|l| &l.proxy)
    }

    /// Every node's client URL.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Connects a client that knows every node, so it fails over when one dies.
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        let urls = self.urls();
        let connected = async_nats::connect(urls.as_slice()).await;
        let urls = urls.join(",");
        connected.map_err(|e| HarnessError::Server(format!("at {urls}: cannot connect: {e}")))
    }
}
