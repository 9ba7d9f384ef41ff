//! Running the built `tidemark` binary: processes stopped by the test that started them
//! (by PID, even when it fails), `status --json`, a metrics scrape.
#![allow(dead_code, clippy::unwrap_used, clippy::missing_panics_doc)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tidemark_tests::NatsServer;

/// The binary cargo built for these tests.
pub fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .env_remove("TIDEMARK_NATS_PASSWORD")
        .env_remove("TIDEMARK_NATS_USER")
        .env_remove("TIDEMARK_NATS_TOKEN")
        .env_remove("TIDEMARK_NATS_NKEY")
        .env_remove("TIDEMARK_NATS_CREDS");
    cmd
}

/// Runs `tidemark args…` to completion.
pub fn run(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

/// A real nats-server, or a failure that says how to get one (never a skip).
pub async fn server() -> NatsServer {
    match NatsServer::start().await {
        Ok(s) => s,
        Err(e) => panic!("a real nats-server is required for these tests: {e}"),
    }
}

/// A running `tidemark` process: its stdout and stderr lines as they come; killed (by its
/// PID, SIGKILL) when dropped, so a failing test leaves nothing running.
pub struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Running {
    /// Starts `tidemark args…`.
    pub fn start(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
        }
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `limit` for a line containing `what`; returns it.
    pub fn wait_line(&mut self, what: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        if let Some(l) = self.seen.iter().find(|l| l.contains(what)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {what:?} within {limit:?}; it printed:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Sends SIGKILL to its PID and reaps it.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Sends SIGTERM to its PID; waits up to `limit` for it to exit; its exit status and
    /// everything it printed.
    pub fn terminate(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {}", self.pid());
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Whatever it printed last is still in the pipes.
                std::thread::sleep(Duration::from_millis(100));
                while let Ok(line) = self.lines.try_recv() {
                    self.seen.push(line);
                }
                return (status, self.seen.join("\n"));
            }
            assert!(
                Instant::now() < deadline,
                "it did not exit within {limit:?} of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A loopback address with a port free right now.
pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// `tidemark status FILE --json`.
pub fn status_json(file: &Path) -> Value {
    let out = run(&["status", file.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The follower called `name` in a status report.
pub fn follower<'a>(status: &'a Value, name: &str) -> Option<&'a Value> {
    status["followers"]
        .as_array()?
        .iter()
        .find(|f| f["name"] == name)
}

/// Polls `cond` every 100 ms until it holds; panics with `what` after `limit`.
pub fn eventually(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The body of `GET path` on `addr` (HTTP/1.1, one request).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}

/// The value of the first sample of `series` (a name with its labels' opening brace, or
/// a bare name) in a Prometheus scrape.
pub fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Creates the KV bucket `name` (history 1), retrying while JetStream starts.
pub async fn kv_bucket(
    client: &async_nats::Client,
    name: &str,
) -> async_nats::jetstream::kv::Store {
    let js = async_nats::jetstream::new(client.clone());
    let started = Instant::now();
    loop {
        match js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: name.into(),
                history: 1,
                ..Default::default()
            })
            .await
        {
            Ok(store) => return store,
            // Right after start, JetStream may answer "no responders" for a moment.
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("creating bucket {name}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("cannot create bucket {name}: {e}"),
        }
    }
}

/// The status line and body of `GET path` on `addr`.
pub fn http_status(addr: SocketAddr, path: &str) -> (String, String) {
    let reply = http_get(addr, path).unwrap_or_default();
    let status = reply.lines().next().unwrap_or_default().to_owned();
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
