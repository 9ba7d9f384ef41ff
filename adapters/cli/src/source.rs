//! What a SOURCE argument names: a NATS KV bucket (`nats://host:port/BUCKET`) or a SQLite
//! registry file, and how to reach it.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use tidemark_nats::{KvBucket, NatsOptions};
use tidemark_sqlite::{SqliteDb, SqliteSource};
use tracing::info;

use crate::endpoint::Probes;
use crate::error::CliError;

/// How to authenticate to NATS. Secrets may come from the environment instead of the
/// command line (where other users of the machine could read them), and never appear in
/// logs or errors.
#[derive(Args, Debug, Clone, Default)]
pub struct NatsAuth {
    /// A `.creds` file (JWT and nkey seed, as `nsc` writes it).
    #[arg(long, env = "TIDEMARK_NATS_CREDS", value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// An nkey user seed (`SU...`).
    #[arg(
        long,
        env = "TIDEMARK_NATS_NKEY",
        hide_env_values = true,
        value_name = "SEED"
    )]
    pub nkey: Option<String>,
    /// A user name (with --password or TIDEMARK_NATS_PASSWORD).
    #[arg(long, env = "TIDEMARK_NATS_USER", value_name = "USER")]
    pub user: Option<String>,
    /// The user's password (prefer the TIDEMARK_NATS_PASSWORD variable).
    #[arg(
        long,
        env = "TIDEMARK_NATS_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub password: Option<String>,
    /// A token (prefer the TIDEMARK_NATS_TOKEN variable).
    #[arg(
        long,
        env = "TIDEMARK_NATS_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,
    /// A CA certificate (PEM) to trust the server's TLS certificate with.
    #[arg(long, env = "TIDEMARK_NATS_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) for mutual TLS, with --tls-key.
    #[arg(
        long,
        env = "TIDEMARK_NATS_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "TIDEMARK_NATS_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
}

/// A source to follow, as `mirror` and `watch` take it.
#[derive(Args, Debug)]
pub struct FollowArgs {
    /// `nats://host:port/BUCKET` (also `tls://`, several hosts comma-separated) or a
    /// tidemark SQLite registry file.
    pub source: String,
    /// Follow only the keys under this prefix (on NATS, filtered by the server).
    #[arg(long, value_name = "PREFIX")]
    pub prefix: Option<String>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464) at /metrics, and
    /// probes at /healthz (the follower runs) and /readyz (synced and not stalled).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// How long the follower may stay behind without progress before /readyz says it
    /// stalled, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub stall_after: u64,
    /// Wait for a source that does not exist yet (a bucket not yet created, a registry
    /// file not yet written) instead of failing at once.
    #[arg(long)]
    pub wait_for_source: bool,
    #[command(flatten)]
    pub auth: NatsAuth,
}

impl FollowArgs {
    /// Whether a missing source is waited for.
    pub fn missing(&self) -> Missing {
        if self.wait_for_source {
            Missing::Wait
        } else {
            Missing::Refuse
        }
    }

    /// How long the follower may be behind without progress before it is stalled.
    pub fn stall_after(&self) -> Duration {
        Duration::from_secs(self.stall_after)
    }

    /// The endpoint `--metrics` asks for, serving from now on, or probes nobody reads.
    pub fn probes(&self) -> Result<Probes, CliError> {
        match &self.metrics {
            Some(addr) => crate::endpoint::serve(addr),
            None => Ok(Probes::unserved()),
        }
    }
}

/// Where changes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// A KV bucket on these servers.
    Nats {
        /// Server URLs, without credentials.
        servers: Vec<String>,
        /// Credentials written in the URL (`user:password@` or `token@`).
        user_password: Option<(String, String)>,
        /// A token written in the URL.
        token: Option<String>,
        /// The bucket.
        bucket: String,
    },
    /// A tidemark SQLite registry file.
    Sqlite(PathBuf),
}

impl SourceSpec {
    /// Reads a SOURCE argument.
    pub fn parse(arg: &str) -> Result<Self, CliError> {
        let Some((scheme, rest)) = arg.split_once("://") else {
            return Ok(SourceSpec::Sqlite(PathBuf::from(arg)));
        };
        if !matches!(scheme, "nats" | "tls") {
            return Err(CliError::Usage(format!(
                "unknown source scheme {scheme:?}: use nats://host:port/BUCKET, tls://host:port/BUCKET or a SQLite file"
            )));
        }
        let (authority, bucket) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket = bucket.trim_end_matches('/');
        if bucket.is_empty() || bucket.contains('/') {
            return Err(CliError::Usage(format!(
                "a NATS source names one bucket: {scheme}://host:port/BUCKET"
            )));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (mut user_password, mut token) = (None, None);
        match userinfo.map(|u| u.split_once(':')) {
            None => {}
            Some(Some((user, password))) => {
                user_password = Some((user.to_owned(), password.to_owned()));
            }
            Some(None) => token = userinfo.map(str::to_owned),
        }
        let servers: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("{scheme}://{h}"))
            .collect();
        if servers.is_empty() {
            return Err(CliError::Usage(format!(
                "no server in the source: {scheme}://host:port/BUCKET"
            )));
        }
        Ok(SourceSpec::Nats {
            servers,
            user_password,
            token,
            bucket: bucket.to_owned(),
        })
    }

    /// A name for a follower of this source (of `prefix`'s keys only, if given: another
    /// prefix is another cache).
    pub fn default_name(&self, verb: &str, prefix: Option<&str>) -> String {
        let name = match self {
            SourceSpec::Nats { bucket, .. } => format!("{verb}-{bucket}"),
            SourceSpec::Sqlite(path) => format!(
                "{verb}-{}",
                path.file_stem()
                    .map_or("registry".into(), |s| s.to_string_lossy())
            ),
        };
        match prefix {
            Some(p) => format!("{name}[{p}]"),
            None => name,
        }
    }

    /// The servers of a NATS source (no credentials); empty for a file.
    pub fn servers(&self) -> String {
        match self {
            SourceSpec::Nats { servers, .. } => servers.join(","),
            SourceSpec::Sqlite(_) => String::new(),
        }
    }

    /// What to tell an operator when the source does not exist.
    pub fn missing(&self) -> String {
        match self {
            SourceSpec::Nats { bucket, .. } => format!(
                "bucket {bucket} does not exist on {} (check the name, create it, or pass --wait-for-source to wait for it)",
                self.servers()
            ),
            SourceSpec::Sqlite(path) => format!(
                "registry {} does not exist (check the path, or pass --wait-for-source to wait for it)",
                path.display()
            ),
        }
    }

    /// Where it is, for logs (no credentials).
    pub fn shown(&self) -> String {
        match self {
            SourceSpec::Nats {
                servers, bucket, ..
            } => format!("bucket {bucket} on {}", servers.join(",")),
            SourceSpec::Sqlite(path) => format!("registry {}", path.display()),
        }
    }
}

/// A source opened and ready to follow.
pub enum Opened {
    /// A NATS KV bucket (source and feed).
    Nats(KvBucket),
    /// A SQLite registry (its change log is the feed).
    Sqlite(SqliteSource),
}

/// Connects to the NATS servers a source names; the client and the name after the
/// servers (a bucket, a queue).
pub async fn connect(
    spec: &SourceSpec,
    auth: &NatsAuth,
    client_name: &str,
) -> Result<(async_nats::Client, String), CliError> {
    let SourceSpec::Nats {
        servers,
        user_password,
        token,
        bucket,
    } = spec
    else {
        return Err(CliError::Usage("not a NATS source".into()));
    };
    let mut options = NatsOptions::new(servers.iter().map(String::as_str)).name(client_name);
    if let Some(path) = &auth.creds {
        options = options.credentials_file(path);
    }
    if let Some(seed) = &auth.nkey {
        options = options.nkey(seed);
    }
    match (&auth.user, &auth.password, user_password) {
        (Some(user), password, _) => {
            options = options.user_password(user, password.clone().unwrap_or_default());
        }
        (None, Some(_), _) => {
            return Err(CliError::Usage("--password needs --user".into()));
        }
        (None, None, Some((user, password))) => {
            options = options.user_password(user, password);
        }
        (None, None, None) => {}
    }
    if let Some(t) = auth.token.as_ref().or(token.as_ref()) {
        options = options.token(t);
    }
    if let Some(ca) = &auth.tls_ca {
        options = options.ca_certificate(ca);
    }
    if let (Some(cert), Some(key)) = (&auth.tls_cert, &auth.tls_key) {
        options = options.client_certificate(cert, key);
    }
    Ok((options.connect().await?, bucket.clone()))
}

/// Whether a source may be missing when it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// A source that does not exist is an error ([`CliError::NoSource`]) at once.
    Refuse,
    /// A bucket that does not exist is followed anyway (the follower retries until it
    /// appears); a registry file that does not exist is waited for.
    Wait,
}

/// How long a NATS server that answers nothing about a bucket (JetStream starting,
/// no responders) is asked again before the command gives up.
const EXISTS_PATIENCE: Duration = Duration::from_secs(10);

/// How often a missing registry file is looked for again.
const FILE_POLL: Duration = Duration::from_millis(250);

/// Connects to the NATS servers, or opens the registry file; over `prefix`'s keys only, if
/// given (filtered on the NATS server). A bucket or file that does not exist is refused
/// or waited for, as `missing` says; a registry file is never made up.
pub async fn open(
    spec: &SourceSpec,
    auth: &NatsAuth,
    client_name: &str,
    prefix: Option<&str>,
    missing: Missing,
) -> Result<Opened, CliError> {
    match spec {
        SourceSpec::Nats { .. } => {
            let (client, bucket) = connect(spec, auth, client_name).await?;
            // Asked to wait, one question is enough: the follower retries whatever the
            // answer, as it always did.
            let patience = match missing {
                Missing::Refuse => EXISTS_PATIENCE,
                Missing::Wait => Duration::ZERO,
            };
            match (bucket_exists(&client, &bucket, patience).await, missing) {
                (Ok(true), _) => {}
                (Ok(false), Missing::Wait) => info!(
                    "bucket {bucket} does not exist (yet) on {}: waiting for it",
                    spec.servers()
                ),
                (Err(e), Missing::Wait) => {
                    info!("cannot tell whether bucket {bucket} exists ({e}): following it anyway")
                }
                (Ok(false), Missing::Refuse) => return Err(CliError::NoSource(spec.missing())),
                (Err(e), Missing::Refuse) => return Err(e),
            }
            let bucket = KvBucket::new(client, bucket)?;
            Ok(Opened::Nats(match prefix {
                Some(p) => bucket.with_prefix(p)?,
                None => bucket,
            }))
        }
        SourceSpec::Sqlite(path) => {
            let absent = || std::fs::metadata(path).is_err_and(|e| e.kind() == ErrorKind::NotFound);
            let db = if absent() {
                if missing == Missing::Refuse {
                    return Err(CliError::NoSource(spec.missing()));
                }
                info!(
                    "registry {} does not exist (yet): waiting for it",
                    path.display()
                );
                while absent() {
                    tokio::time::sleep(FILE_POLL).await;
                }
                // Its maker may still be writing its first pages (an empty file, a
                // header without a schema): give it a moment before judging the file.
                let appeared = Instant::now();
                loop {
                    match open_existing(path).await {
                        Ok(db) => break db,
                        Err(_) if appeared.elapsed() < EXISTS_PATIENCE => {
                            tokio::time::sleep(FILE_POLL).await;
                        }
                        Err(e) => return Err(e),
                    }
                }
            } else {
                open_existing(path).await?
            };
            let source = db.source();
            Ok(Opened::Sqlite(match prefix {
                Some(p) => source.with_prefix(p)?,
                None => source,
            }))
        }
    }
}

/// How long one question about a bucket may go unanswered before it is asked again: on a
/// cluster only the stream's leader answers, and a question sent to a leader that stopped
/// gets no reply at all; the client's own 10 s timeout would spend the whole patience on
/// it while another node takes the lead (campaign seed 30013: the mirror gave up 10 s
/// after asking a paused leader, and started again 7.9 s after the cluster healed).
const QUESTION_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the server holds `bucket`: `false` only when JetStream says there is no such
/// stream. A server that answers nothing else for `patience` (no JetStream, or one still
/// starting) is an error. A question out when the client reconnects is asked again at
/// once: its answer was due on the connection that dropped, and waiting for it would
/// spend the request timeout (and most of the patience) on nothing; so is one unanswered
/// for [`QUESTION_TIMEOUT`].
async fn bucket_exists(
    client: &async_nats::Client,
    bucket: &str,
    patience: Duration,
) -> Result<bool, CliError> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::GetStreamErrorKind;
    let js = async_nats::jetstream::new(client.clone());
    let mut reconnects = tidemark::Source::reconnects(&KvBucket::new(client.clone(), bucket)?);
    let started = Instant::now();
    loop {
        if let Some(r) = &mut reconnects {
            r.mark_unchanged();
        }
        let asked = tokio::select! {
            biased;
            answer = tokio::time::timeout(QUESTION_TIMEOUT, js.get_stream(format!("KV_{bucket}"))) => Some(answer),
            () = reconnected(&mut reconnects) => None,
        };
        let why = match asked {
            None => "the client reconnected while it was asked".to_owned(),
            Some(Err(_)) => format!("no answer within {}s", QUESTION_TIMEOUT.as_secs()),
            Some(Ok(Ok(_))) => return Ok(true),
            Some(Ok(Err(e))) => match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    return Ok(false);
                }
                _ => e.to_string(),
            },
        };
        // Right after a server starts, JetStream answers "no responders" for a moment.
        if started.elapsed() >= patience {
            return Err(CliError::NoSource(format!(
                "no JetStream answer about bucket {bucket} within {}s: {why}",
                patience.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Resolves when the client beneath `reconnects` reconnects (never without one).
async fn reconnected(reconnects: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(r) = reconnects
        && r.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// Opens a tidemark file that must already exist.
pub async fn open_existing(path: &Path) -> Result<SqliteDb, CliError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() > 0 => Ok(SqliteDb::open(path).await?),
        Ok(m) if m.is_file() => Err(CliError::NotTidemark(path.to_path_buf())),
        Ok(_) => Err(CliError::Usage(format!("{} is not a file", path.display()))),
        Err(e) => Err(CliError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nats_source_names_servers_bucket_and_credentials_apart() {
        let spec = SourceSpec::parse("nats://u:secret@h1:4222,h2:4223/packages").ok();
        assert_eq!(
            spec,
            Some(SourceSpec::Nats {
                servers: vec!["nats://h1:4222".into(), "nats://h2:4223".into()],
                user_password: Some(("u".into(), "secret".into())),
                token: None,
                bucket: "packages".into(),
            })
        );
        assert!(
            !spec.is_some_and(|s| s.shown().contains("secret")),
            "a password in the URL is never shown"
        );
    }

    #[test]
    fn anything_without_a_scheme_is_a_file_and_a_bad_url_is_a_usage_error() {
        assert_eq!(
            SourceSpec::parse("reg.db").ok(),
            Some(SourceSpec::Sqlite("reg.db".into()))
        );
        for bad in [
            "nats://h:4222",
            "nats://h:4222/",
            "nats://h/a/b",
            "http://h/b",
            "nats:///b",
        ] {
            assert!(
                matches!(SourceSpec::parse(bad), Err(CliError::Usage(_))),
                "{bad} is refused"
            );
        }
    }
}
