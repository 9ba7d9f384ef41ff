//! Real `nats-server` processes, run with the server's own facilities: it picks its client
//! port (`-p -1`) and reports it in a ports file (`--ports_file_dir`), writes its PID file
//! (`-P`), binds 127.0.0.1 only and keeps JetStream storage in a temporary directory.
//!
//! Every process is stopped by the PID of the child this module spawned, never by name:
//! the child is `kill_on_drop`, so a failing or panicking test leaves nothing running. If
//! the test process itself is SIGKILLed no destructor runs; a small `sh` watchdog per server
//! then kills the PID in the server's own PID file and removes its directory.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::nats_bin::{NatsServerBin, NatsVersion, PROVISION_HINT};

const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// From spawn to the ports file, JetStream recovery included.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a restart keeps trying while its fixed ports are still held by someone.
const RESTART_PATIENCE: Duration = Duration::from_secs(10);
/// Sets of route ports a cluster tries when one was taken between choosing and binding.
const CLUSTER_ATTEMPTS: u32 = 3;
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const JETSTREAM_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// A server without a JetStream meta leader drops requests; the default timeout is 10 s.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const PID_FILE: &str = "nats.pid";
const LOG_FILE: &str = "nats-server.log";
/// Once the test process (`$1`) is gone, kills the PID the server wrote to `$2/nats.pid`
/// (the harness deletes that file as soon as it has reaped the process) and removes `$2`.
const WATCHDOG: &str = r#"while kill -0 "$1" 2>/dev/null; do sleep 1; done
kill -9 "$(cat "$2/nats.pid" 2>/dev/null)" 2>/dev/null; sleep 1; rm -rf -- "$2""#;

/// What can go wrong finding, starting or stopping nats-server. `Debug` prints the
/// `Display` text, so `.expect(…)` shows the whole explanation.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// No usable binary: none found, not runnable, no version, or older than
    /// [`MIN_VERSION`](crate::MIN_VERSION) (then `found` is its version). The message says how to get one.
    #[error("{problem}; {PROVISION_HINT}")]
    Unusable {
        /// What was found and what is wrong with it.
        problem: String,
        /// The version of a binary that is too old.
        found: Option<NatsVersion>,
    },
    /// An operating-system call the harness needs failed (what it was doing, why).
    #[error("{0}: {1}")]
    Io(String, #[source] io::Error),
    /// The server did not come up, or did not stop when asked (what, and its log's end).
    #[error("nats-server {0}")]
    Server(String),
    /// The operation needs a running server; the one on this port is stopped.
    #[error("nats-server on port {0} is not running")]
    NotRunning(u16),
    /// A client could not connect to these URLs.
    #[error("could not connect to {0}: {1}")]
    Connect(String, #[source] async_nats::ConnectError),
    /// JetStream did not answer within 30 s (the last error).
    #[error("JetStream was not ready after {JETSTREAM_READY_TIMEOUT:?}: {0}")]
    JetStreamNotReady(String),
}

impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

fn io_error(context: &str) -> impl FnOnce(io::Error) -> HarnessError + '_ {
    move |source| HarnessError::Io(context.to_owned(), source)
}

/// What to start beyond the defaults (JetStream, 127.0.0.1, a port the server picks,
/// temporary storage, no monitoring port, no auth).
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
/// [`kill9`](Self::kill9), [`stop`](Self::stop), [`restart`](Self::restart). Dropping it
/// kills the process.
#[derive(Debug)]
pub struct NatsServer {
    bin: NatsServerBin,
    options: NatsServerOptions,
    /// 0 until the first start reports the port the server chose.
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    watchdog: Option<std::process::Child>,
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        drop(self.child.take()); // `kill_on_drop`: SIGKILL to the PID we spawned.
        if let Some(watchdog) = &mut self.watchdog {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }
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
        let dir = dir.map_err(io_error("creating the server's temporary directory"))?;
        // Without `sh`, only the guard for a SIGKILLed test process is missing.
        let mut watchdog = std::process::Command::new("sh");
        watchdog.args(["-c", WATCHDOG, "tidemark-nats-watchdog"]);
        watchdog.arg(std::process::id().to_string()).arg(dir.path());
        let watchdog = watchdog.stdin(Stdio::null()).spawn().ok();
        Ok(Self {
            bin,
            options,
            port: 0,
            dir,
            child: None,
            watchdog,
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
        connected.map_err(|e| HarnessError::Connect(url, e))
    }

    /// Kills the process with SIGKILL and reaps it; the storage stays for a restart.
    pub async fn kill9(&mut self) -> Result<(), HarnessError> {
        let mut child = self.child.take().ok_or(self.not_running())?;
        let _ = child.start_kill(); // Fails only if it has exited already.
        let reaped = child.wait().await.map_err(io_error("reaping nats-server"));
        // Its PID may be reused now: the watchdog must not find it.
        let _ = fs::remove_file(self.dir.path().join(PID_FILE));
        reaped.map(drop)
    }

    /// Stops the server with SIGTERM (sent by `nats-server --signal`, so no other tool is
    /// needed) and waits for it; kills it after 10 s. The storage stays for a restart.
    pub async fn stop(&mut self) -> Result<(), HarnessError> {
        let not_running = self.not_running();
        let child = self.child.as_mut().ok_or(not_running)?;
        let pid = child.id().unwrap_or(0);
        let mut term = Command::new(&self.bin.path);
        let term = term
            .arg("--signal")
            .arg(format!("term={pid}"))
            .stdout(Stdio::null());
        let stopped = match term.status().await {
            Ok(status) if status.success() => {
                let exited = tokio::time::timeout(STOP_TIMEOUT, child.wait()).await;
                exited.is_ok()
            }
            _ => false,
        };
        self.kill9().await?;
        let error = format!("(pid {pid}) did not stop on SIGTERM in {STOP_TIMEOUT:?}; killed");
        stopped.then_some(()).ok_or(HarnessError::Server(error))
    }

    /// Starts the server again on the same port with the same storage, as after a crash (a
    /// running one is killed first). While it exits at once (a port still held by someone)
    /// it is tried again for up to 10 s. JetStream may need a moment more:
    /// [`wait_jetstream_ready`].
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        if self.child.is_some() {
            self.kill9().await?;
        }
        let give_up = Instant::now() + RESTART_PATIENCE;
        loop {
            self.spawn()?;
            match self.wait_ready().await {
                Err(HarnessError::Server(_)) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                done => return done,
            }
        }
    }

    /// Spawns the process, on a port of the server's choice the first time, on the same
    /// port afterwards; its log (stderr) goes to `nats-server.log` in its directory.
    fn spawn(&mut self) -> Result<(), HarnessError> {
        let dir = self.dir.path();
        let log = File::create(dir.join(LOG_FILE)).map_err(io_error("creating the log"))?;
        let port = match self.port {
            0 => "-1".to_owned(), // The server chooses.
            port => port.to_string(),
        };
        let mut command = Command::new(&self.bin.path);
        command.args(["--jetstream", "--addr", "127.0.0.1", "--port", &port]);
        command.arg("--store_dir").arg(dir.join("store"));
        command.arg("--pid").arg(dir.join(PID_FILE));
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
        self.child = Some(command.spawn().map_err(io_error("spawning nats-server"))?);
        Ok(())
    }

    /// Waits for the current process's ports file, which the server writes once every
    /// listener (client, routes) is up, and takes the client port from it.
    async fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            let not_running = self.not_running();
            let child = self.child.as_mut().ok_or(not_running)?;
            if let Some(status) = child.try_wait().map_err(io_error("checking the server"))? {
                self.kill9().await?;
                return Err(self.failed(&format!("exited ({status}) before it was ready")));
            }
            if let Some(port) = child.id().and_then(|pid| client_port(self.dir.path(), pid)) {
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
        let not_running = self.not_running();
        let child = self.child.as_mut().ok_or(not_running)?;
        match child.try_wait().map_err(io_error("checking the server"))? {
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

    fn not_running(&self) -> HarnessError {
        HarnessError::NotRunning(self.port)
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
    let ready = || async {
        js.query_account()
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    };
    retry_jetstream(ready).await
}

/// Retries `attempt` with backoff for up to [`JETSTREAM_READY_TIMEOUT`].
async fn retry_jetstream<F, Fut>(mut attempt: F) -> Result<(), HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    let mut backoff = Duration::from_millis(25);
    loop {
        match attempt().await {
            Ok(()) => return Ok(()),
            Err(last) if started.elapsed() > JETSTREAM_READY_TIMEOUT => {
                return Err(HarnessError::JetStreamNotReady(last));
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
}

impl NatsCluster {
    /// Starts `size` nodes routed to each other and waits until a stream replicated to all
    /// of them (at most 5) can be created, for up to 30 s. Client ports are the servers'
    /// choice; route ports must be known to every node, so they are chosen free by binding
    /// port 0, and chosen again should one be taken before its node binds it.
    pub async fn start(size: usize) -> Result<Self, HarnessError> {
        static CLUSTERS: AtomicU64 = AtomicU64::new(0);
        let bin = NatsServerBin::find()?;
        let id = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let name = format!("tidemark-{}-{id}", std::process::id());
        let mut attempt = 1;
        let cluster = loop {
            let free = (0..size).map(|_| TcpListener::bind((LOOPBACK, 0))?.local_addr());
            let free = free.collect::<io::Result<Vec<_>>>();
            let free = free.map_err(io_error("choosing route ports"))?;
            let routes: Vec<String> = free.iter().map(|a| format!("nats://{a}")).collect();
            let mut nodes = Vec::with_capacity(size);
            for (index, route) in routes.iter().enumerate() {
                let options = NatsServerOptions::new().arg("--cluster").arg(route);
                let mut options = options.arg("--cluster_name").arg(&name);
                options = options.arg("--routes").arg(routes.join(","));
                options.name = Some(format!("n{index}"));
                let mut node = NatsServer::new(bin.clone(), options)?;
                node.spawn()?; // All before waiting on any: a node needs its routes.
                nodes.push(node);
            }
            let mut ready = Ok(());
            for node in &mut nodes {
                ready = ready.and(node.wait_ready().await);
            }
            match ready {
                Ok(()) => break Self { nodes },
                Err(HarnessError::Server(_)) if attempt < CLUSTER_ATTEMPTS => attempt += 1,
                Err(error) => return Err(error),
            }
        };
        let mut js = jetstream::new(cluster.connect().await?);
        js.set_timeout(PROBE_TIMEOUT);
        let config = stream::Config {
            name: "TIDEMARK_HARNESS_READY".to_owned(),
            num_replicas: size.min(5),
            storage: stream::StorageType::Memory,
            ..Default::default()
        };
        retry_jetstream(|| async {
            let created = js.create_stream(config.clone()).await;
            created.map_err(|e| format!("cluster {name}: {e}"))?;
            let deleted = js.delete_stream(&config.name).await;
            deleted.map(drop).map_err(|e| e.to_string())
        })
        .await?;
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

    /// Connects a client that knows every node, so it fails over when one dies.
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        let urls: Vec<String> = self.nodes.iter().map(NatsServer::url).collect();
        let connected = async_nats::connect(urls.as_slice()).await;
        connected.map_err(|e| HarnessError::Connect(urls.join(","), e))
    }
}
