//! The HTTP endpoint `--metrics ADDR` serves: Prometheus series at `/metrics`, and the
//! probes an orchestrator asks — `/healthz` (the process is alive and its follower
//! runs) and `/readyz` (the initial sync is done and the follower is not stalled, from
//! the library's [`Health`]). Any other path is 404.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tidemark::Health;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::error::CliError;

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read; a probe's is a few dozen bytes.
const MAX_HEAD: usize = 8 * 1024;
/// How often the recorder's upkeep runs (it drains histogram buckets; cheap).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// What the probes answer: the command's follower, as its loop last saw it.
#[derive(Clone, Debug)]
pub enum Probe {
    /// No follower runs yet (the source is being opened).
    Starting,
    /// The follower runs; its health.
    Running(Health),
    /// The follower ended (the command is stopping, or it failed).
    Ended(String),
}

/// Where the command tells the endpoint how its follower is.
#[derive(Clone, Debug)]
pub struct Probes(watch::Sender<Probe>);

impl Probes {
    /// Probes that no endpoint reads (no `--metrics`).
    pub fn unserved() -> Self {
        Probes(watch::channel(Probe::Starting).0)
    }

    /// The follower's state now.
    pub fn set(&self, probe: Probe) {
        self.0.send_replace(probe);
    }
}

/// Installs the Prometheus recorder and serves `/metrics`, `/healthz` and `/readyz` on
/// `addr` (`host:port`) for the rest of the process.
pub fn serve(addr: &str) -> Result<Probes, CliError> {
    let err = |reason: String| CliError::Metrics {
        addr: addr.to_owned(),
        reason,
    };
    let socket: SocketAddr = addr
        .parse()
        .map_err(|_| err("not an IP address and port (e.g. 127.0.0.1:9464)".into()))?;
    // Bound here, not in the task: a port in use is the command's error at once.
    let listener = std::net::TcpListener::bind(socket)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(TcpListener::from_std)
        .map_err(|e| err(e.to_string()))?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| err(e.to_string()))?;
    let (probes, seen) = watch::channel(Probe::Starting);
    tokio::spawn(upkeep(handle.clone()));
    tokio::spawn(accept(listener, handle, seen));
    tracing::info!(
        "serving Prometheus metrics on http://{socket}/metrics, probes on /healthz and /readyz"
    );
    Ok(Probes(probes))
}

async fn upkeep(handle: PrometheusHandle) {
    let mut every = tokio::time::interval(UPKEEP_EVERY);
    loop {
        every.tick().await;
        handle.run_upkeep();
    }
}

async fn accept(listener: TcpListener, handle: PrometheusHandle, probes: watch::Receiver<Probe>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let (handle, probes) = (handle.clone(), probes.clone());
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, &handle, &probes).await {
                        tracing::debug!("metrics endpoint: {e}");
                    }
                });
            }
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A response: status line, body, and whether the body is Prometheus's text format.
struct Reply {
    status: &'static str,
    body: String,
    prometheus: bool,
}

impl Reply {
    fn new(status: &'static str, body: impl Into<String>) -> Self {
        Reply {
            status,
            body: body.into(),
            prometheus: false,
        }
    }
}

/// What `method path` gets, given the follower's state.
fn route(method: &str, path: &str, handle: &PrometheusHandle, probe: &Probe) -> Reply {
    // A query string (`/metrics?x=1`) names the same resource.
    let path = path.split('?').next().unwrap_or(path);
    if method != "GET" && method != "HEAD" {
        return Reply::new("405 Method Not Allowed", "only GET\n");
    }
    match path {
        "/metrics" => Reply {
            prometheus: true,
            ..Reply::new("200 OK", handle.render())
        },
        "/healthz" => match probe {
            Probe::Running(h) => match h.followers.iter().find(|f| f.down.is_some()) {
                Some(f) => Reply::new("503 Service Unavailable", format!("not running: {f}\n")),
                None => Reply::new("200 OK", "alive: the follower is running\n"),
            },
            Probe::Starting => Reply::new(
                "503 Service Unavailable",
                "starting: the source is being opened\n",
            ),
            Probe::Ended(why) => Reply::new("503 Service Unavailable", format!("ended: {why}\n")),
        },
        "/readyz" => match probe {
            Probe::Running(h) if h.healthy() => Reply::new("200 OK", format!("ready: {h}\n")),
            Probe::Running(h) => {
                // Whose, and why: `mirror-b: not ready (Syncing, …)`, `…: stalled for 61s`.
                let why: Vec<String> = h.unhealthy().map(ToString::to_string).collect();
                Reply::new("503 Service Unavailable", format!("{}\n", why.join("; ")))
            }
            Probe::Starting => Reply::new(
                "503 Service Unavailable",
                "not ready: the source is being opened\n",
            ),
            Probe::Ended(why) => Reply::new(
                "503 Service Unavailable",
                format!("not ready: ended: {why}\n"),
            ),
        },
        _ => Reply::new("404 Not Found", "not found: /metrics, /healthz, /readyz\n"),
    }
}

async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    probes: &watch::Receiver<Probe>,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(r) => r?,
        Err(_) => return Ok(()),
    }
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        let reply = Reply::new("400 Bad Request", "bad request\n");
        return write(&mut stream, &reply, true).await;
    };
    let probe = probes.borrow().clone();
    let reply = route(method, path, handle, &probe);
    write(&mut stream, &reply, method != "HEAD").await
}

async fn write(stream: &mut TcpStream, reply: &Reply, body: bool) -> std::io::Result<()> {
    let content_type = if reply.prometheus {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reply.status,
        reply.body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if body {
        stream.write_all(reply.body.as_bytes()).await?;
    }
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tidemark::{FollowerHealth, Health, Phase};

    use super::*;

    fn health(ready: bool, stalled: bool, down: bool) -> Probe {
        Probe::Running(Health {
            followers: vec![FollowerHealth {
                name: "mirror-b".into(),
                phase: if ready { Phase::Live } else { Phase::Syncing },
                ready,
                watermark: 5,
                head: 9,
                stalled_for: stalled.then_some(Duration::from_secs(61)),
                down: down.then(|| "its task ended".to_owned()),
            }],
        })
    }

    #[test]
    fn probes_answer_from_the_followers_health_and_unknown_paths_are_404() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let status = |path: &str, probe: &Probe| route("GET", path, &handle, probe).status;
        let syncing = health(false, false, false);
        assert!(
            status("/healthz", &syncing).starts_with("200"),
            "alive while it syncs"
        );
        let r = route("GET", "/readyz", &handle, &syncing);
        assert!(
            r.status.starts_with("503"),
            "not ready before the initial sync"
        );
        assert!(
            r.body.contains("not ready") && r.body.contains("mirror-b"),
            "{}",
            r.body
        );
        assert!(status("/readyz", &health(true, false, false)).starts_with("200"));
        let stalled = route("GET", "/readyz", &handle, &health(true, true, false));
        assert!(
            stalled.status.starts_with("503"),
            "a stalled follower is not ready"
        );
        assert!(stalled.body.contains("stalled"), "{}", stalled.body);
        assert!(status("/healthz", &health(true, false, true)).starts_with("503"));
        assert!(status("/healthz", &Probe::Starting).starts_with("503"));
        assert!(status("/readyz?verbose", &Probe::Ended("x".into())).starts_with("503"));
        assert!(status("/metrics", &syncing).starts_with("200"));
        assert!(status("/", &syncing).starts_with("404"));
        assert!(status("/metricsz", &syncing).starts_with("404"));
        assert!(
            route("POST", "/readyz", &handle, &syncing)
                .status
                .starts_with("405")
        );
    }
}
