//! Connection options: servers, credentials and TLS, passed through to async-nats.

use std::fmt;
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind};

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// No server URL was given.
    #[error("no NATS server URL given")]
    NoServers,
    /// The credentials file could not be read or parsed.
    #[error("cannot use credentials file {path:?}: {source}")]
    Credentials {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// More than one way to authenticate was set; say which one to use.
    #[error("more than one authentication method set ({methods}): choose one")]
    ConflictingAuth {
        /// The methods set, comma-separated.
        methods: String,
    },
    /// The nkey seed is not a valid user seed (`SU…`); nothing was sent to a server.
    #[error("the nkey seed is not a valid user seed: {reason}")]
    InvalidNkey {
        /// Why.
        reason: String,
    },
    /// The server refused the credentials (wrong user or password, token, nkey or JWT).
    #[error(
        "NATS server {servers} rejected the credentials (authorization violation): check the \
         user/password, token, nkey or credentials file"
    )]
    Unauthorized {
        /// The servers tried.
        servers: String,
    },
    /// TLS failed (a missing or wrong CA, client certificate or key; a server without TLS).
    #[error("TLS with NATS server {servers} failed: {reason}")]
    Tls {
        /// The servers tried.
        servers: String,
        /// The client's explanation.
        reason: String,
    },
    /// The servers could not be reached or the handshake failed.
    #[error("cannot connect to NATS server {servers}: {reason}")]
    Unreachable {
        /// The servers tried.
        servers: String,
        /// The client's explanation.
        reason: String,
    },
}

/// How to reach and authenticate to NATS. Every option is passed through to async-nats.
///
/// ```no_run
/// # async fn f() -> Result<(), tidemark_nats::ConnectError> {
/// use tidemark_nats::NatsOptions;
/// let client = NatsOptions::new(["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"])
///     .name("registry-mirror")
///     .credentials_file("/etc/nats/mirror.creds")
///     .ca_certificate("/etc/nats/ca.pem")
///     .connect()
///     .await?;
/// # drop(client); Ok(()) }
/// ```
///
/// Authentication: at most one of [`credentials_file`](Self::credentials_file) (JWT and
/// nkey seed, the `.creds` file `nsc` writes), [`nkey`](Self::nkey) (a seed),
/// [`user_password`](Self::user_password) or [`token`](Self::token). TLS:
/// [`ca_certificate`](Self::ca_certificate) trusts a private CA,
/// [`client_certificate`](Self::client_certificate) presents a certificate for mutual
/// TLS, [`require_tls`](Self::require_tls) refuses a plain-text server. A `tls://` URL also
/// requires TLS.
#[derive(Clone, Default)]
pub struct NatsOptions {
    servers: Vec<String>,
    name: Option<String>,
    credentials_file: Option<PathBuf>,
    nkey: Option<String>,
    user_password: Option<(String, String)>,
    token: Option<String>,
    ca_certificates: Vec<PathBuf>,
    client_certificate: Option<(PathBuf, PathBuf)>,
    require_tls: bool,
    connection_timeout: Option<Duration>,
    request_timeout: Option<Duration>,
    max_reconnect_delay: Option<Duration>,
}

/// The longest wait between two reconnect attempts unless set: async-nats' own default
/// grows to 4 s, which a follower would then wait after the server is back.
pub const DEFAULT_MAX_RECONNECT_DELAY: Duration = Duration::from_millis(250);

impl fmt::Debug for NatsOptions {
    // Never prints secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let servers: Vec<String> = self.servers.iter().map(|url| redact_url(url)).collect();
        f.debug_struct("NatsOptions")
            .field("servers", &servers)
            .field("name", &self.name)
            .field("credentials_file", &self.credentials_file)
            .field("nkey", &self.nkey.as_ref().map(|_| "<redacted>"))
            .field(
                "user",
                &self.user_password.as_ref().map(|(user, _)| user.as_str()),
            )
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("ca_certificates", &self.ca_certificates)
            .field("client_certificate", &self.client_certificate)
            .field("require_tls", &self.require_tls)
            .finish_non_exhaustive()
    }
}

impl NatsOptions {
    /// Options for these server URLs (`nats://host:port`, `tls://host:port`, or a bare
    /// `host:port`). The client fails over between them. A password or token in a URL
    /// (`nats://user:password@host`, `nats://token@host`) is never shown: `Debug`, errors
    /// and logs print `<redacted>` in its place. It may hold `/`, `?`, `#`, `@`, `:` or
    /// `%`, percent-encoded or not: the userinfo ends at the URL's last `@` (so an `@` in
    /// a path, which a server URL has no use for, is read as one). async-nats does not
    /// send credentials written in a URL, so this type does not hand them to it (where its
    /// logs would show them): use [`user_password`](Self::user_password) or
    /// [`token`](Self::token).
    #[must_use]
    pub fn new<I, S>(servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        NatsOptions {
            servers: servers.into_iter().map(Into::into).collect(),
            ..NatsOptions::default()
        }
    }

    /// The connection name the server shows in its monitoring (`connz`).
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Authenticates with a credentials file (a user JWT and its nkey seed).
    #[must_use]
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials_file = Some(path.into());
        self
    }

    /// Authenticates with an nkey seed (`SU…`).
    #[must_use]
    pub fn nkey(mut self, seed: impl Into<String>) -> Self {
        self.nkey = Some(seed.into());
        self
    }

    /// Authenticates with a user and password.
    #[must_use]
    pub fn user_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user_password = Some((user.into(), password.into()));
        self
    }

    /// Authenticates with a token.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Trusts the CA certificate(s) in this PEM file for the server's certificate.
    #[must_use]
    pub fn ca_certificate(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_certificates.push(path.into());
        self
    }

    /// Presents this client certificate and key (PEM files) for mutual TLS.
    #[must_use]
    pub fn client_certificate(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_certificate = Some((cert.into(), key.into()));
        self
    }

    /// Refuses to talk to a server without TLS.
    #[must_use]
    pub fn require_tls(mut self, required: bool) -> Self {
        self.require_tls = required;
        self
    }

    /// How long one connection attempt may take (async-nats' default otherwise).
    #[must_use]
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = Some(timeout);
        self
    }

    /// How long a request (a JetStream API call, a publish acknowledgement) may take.
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    /// The longest wait between two attempts to reconnect to a server that went away
    /// ([`DEFAULT_MAX_RECONNECT_DELAY`] unless set). The waits grow from 1 ms to this and
    /// are shortened by up to half at random, so clients do not reconnect in lockstep.
    #[must_use]
    pub fn max_reconnect_delay(mut self, delay: Duration) -> Self {
        self.max_reconnect_delay = Some(delay);
        self
    }

    /// The async-nats options these stand for, to add settings this type does not carry.
    /// A client connected with them does not report its reconnects to followers: use
    /// [`connect`](Self::connect) for that.
    ///
    /// # Errors
    /// [`ConnectError::ConflictingAuth`] if more than one authentication method is set,
    /// [`ConnectError::InvalidNkey`] for a seed that is not a user seed, and
    /// [`ConnectError::Credentials`] if the credentials file cannot be read.
    pub async fn to_connect_options(&self) -> Result<async_nats::ConnectOptions, ConnectError> {
        self.check_auth()?;
        let mut o = match &self.credentials_file {
            Some(path) => async_nats::ConnectOptions::with_credentials_file(path.clone())
                .await
                .map_err(|source| ConnectError::Credentials {
                    path: path.clone(),
                    source,
                })?,
            None => async_nats::ConnectOptions::new(),
        };
        if let Some(seed) = &self.nkey {
            o = o.nkey(seed.clone());
        }
        if let Some((user, password)) = &self.user_password {
            o = o.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            o = o.token(token.clone());
        }
        for ca in &self.ca_certificates {
            o = o.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_certificate {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        if self.require_tls {
            o = o.require_tls(true);
        }
        if let Some(name) = &self.name {
            o = o.name(name);
        }
        if let Some(t) = self.connection_timeout {
            o = o.connection_timeout(t);
        }
        if let Some(t) = self.request_timeout {
            o = o.request_timeout(Some(t));
        }
        let cap = self
            .max_reconnect_delay
            .unwrap_or(DEFAULT_MAX_RECONNECT_DELAY);
        let jitter = std::collections::hash_map::RandomState::new();
        o = o.reconnect_delay_callback(move |attempts| reconnect_delay(attempts, cap, &jitter));
        Ok(o)
    }

    /// At most one authentication method, and an nkey seed that is one: mistakes a
    /// caller can fix are reported before any server is asked.
    fn check_auth(&self) -> Result<(), ConnectError> {
        let methods: Vec<&str> = [
            (self.credentials_file.is_some(), "credentials file"),
            (self.nkey.is_some(), "nkey"),
            (self.user_password.is_some(), "user/password"),
            (self.token.is_some(), "token"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect();
        if methods.len() > 1 {
            return Err(ConnectError::ConflictingAuth {
                methods: methods.join(", "),
            });
        }
        if let Some(seed) = &self.nkey {
            let pair = nkeys::KeyPair::from_seed(seed).map_err(|e| ConnectError::InvalidNkey {
                reason: e.to_string(),
            })?;
            if pair.key_pair_type() != nkeys::KeyPairType::User {
                return Err(ConnectError::InvalidNkey {
                    reason: format!("a {:?} seed, not a user seed", pair.key_pair_type()),
                });
            }
        }
        Ok(())
    }

    /// Connects. Once connected, the client reconnects on its own after a server restart
    /// (attempts paced by [`max_reconnect_delay`](Self::max_reconnect_delay)); every
    /// [`KvBucket`](crate::KvBucket) and [`NatsEvents`](crate::NatsEvents) over this
    /// client reports each reconnect to its followers
    /// ([`Source::reconnects`](tidemark::Source::reconnects)), which then retry at once
    /// and reopen from their watermark.
    ///
    /// # Errors
    /// A [`ConnectError`] saying whether the servers were unreachable, refused the
    /// credentials, or TLS failed.
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        if self.servers.is_empty() {
            return Err(ConnectError::NoServers);
        }
        let shown: Vec<String> = self.servers.iter().map(|url| redact_url(url)).collect();
        let servers = shown.join(",");
        let (options, reconnects) = crate::reconnects::counting(self.to_connect_options().await?);
        // async-nats ignores credentials in URLs but logs the URLs it tries.
        let bare: Vec<String> = self
            .servers
            .iter()
            .map(|url| without_userinfo(url))
            .collect();
        let client = options.connect(bare.as_slice()).await.map_err(|e| {
            let reason = self.scrub(e.to_string());
            match e.kind() {
                ConnectErrorKind::AuthorizationViolation => ConnectError::Unauthorized { servers },
                ConnectErrorKind::Tls => ConnectError::Tls { servers, reason },
                // async-nats reports a rejected server certificate (unknown issuer, wrong
                // name, expired) as an I/O error from the handshake: it is still TLS, and
                // the caller's fix is the CA or certificate, not the network.
                _ if is_certificate_failure(&reason) => ConnectError::Tls { servers, reason },
                _ => ConnectError::Unreachable { servers, reason },
            }
        })?;
        crate::reconnects::register(&client, reconnects);
        Ok(client)
    }

    /// `text` with every secret these options hold (passwords and tokens, in URLs or
    /// set) replaced, for a message from the client that might quote one.
    fn scrub(&self, mut text: String) -> String {
        // A URL's secret as written and as it stands decoded (`s3cr%23t` is `s3cr#t`).
        let in_urls = self
            .servers
            .iter()
            .filter_map(|url| url_secret(url))
            .flat_map(|secret| [secret.to_owned(), percent_decoded(secret)]);
        let set = [
            self.user_password
                .as_ref()
                .map(|(_, password)| password.as_str()),
            self.token.as_deref(),
            self.nkey.as_deref(),
        ];
        let mut secrets: Vec<String> = in_urls
            .chain(set.into_iter().flatten().map(str::to_owned))
            .collect();
        // The longest first: a secret inside another must not leave the other's rest.
        secrets.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
        for secret in secrets {
            if !secret.is_empty() {
                text = text.replace(&secret, REDACTED);
            }
        }
        text
    }
}

/// The wait before reconnect attempt `attempts` (from 1): 0 for the first, then 1 ms
/// doubling up to `cap`, less up to half at random (from `jitter`, drawn per client).
fn reconnect_delay(attempts: usize, cap: Duration, jitter: &impl BuildHasher) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exp = u32::try_from(attempts - 2).unwrap_or(u32::MAX).min(20);
    let full = Duration::from_millis(1u64 << exp).min(cap);
    // 0..=1023 parts in 2048 of the delay taken off.
    let off = jitter.hash_one(attempts) % 1024;
    full - full.mul_f64(off as f64 / 2048.0)
}

/// What stands in for a secret in `Debug`, errors and logs.
const REDACTED: &str = "<redacted>";

/// Splits `url` into what precedes its userinfo (the scheme), the userinfo, and the rest
/// (`@host:port…`); `None` if it has no userinfo.
///
/// The userinfo ends at the last `@` after the scheme, wherever it stands: a password
/// may hold `/`, `?`, `#`, `@` or `:` unencoded, which a strict URL parser would take
/// for the end of the authority (and then show the rest of the password as host, path
/// or fragment). A server URL has no use for an `@` in a path; one written there
/// (percent-encode it as `%40`) is taken for the end of a userinfo and never shown.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let start = scheme_end(url);
    let at = start + url[start..].rfind('@')?;
    Some((&url[..start], &url[start..at], &url[at..]))
}

/// Where `url`'s scheme (`nats://`) ends; 0 if it has none. Only letters, digits, `+`, `-`
/// and `.` make a scheme, so a `://` inside a password of a URL written without one
/// (`user:pa://ss@host`) is not taken for it.
fn scheme_end(url: &str) -> usize {
    match url.find("://") {
        Some(i)
            if url[..i].starts_with(|c: char| c.is_ascii_alphabetic())
                && url[..i]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) =>
        {
            i + 3
        }
        _ => 0,
    }
}

/// `text` with its `%XX` escapes decoded (an invalid one kept as written), for the
/// password a percent-encoded URL stands for.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The secret in `url`'s userinfo: the password of `user:password@`, or the token of
/// `token@`.
fn url_secret(url: &str) -> Option<&str> {
    let (_, userinfo, _) = split_userinfo(url)?;
    Some(
        userinfo
            .split_once(':')
            .map_or(userinfo, |(_, password)| password),
    )
}

/// `url` with its secret redacted (`nats://user:<redacted>@host`, `nats://<redacted>@host`),
/// for `Debug` and errors. The user name stays: it helps diagnosis and is not a secret.
fn redact_url(url: &str) -> String {
    match split_userinfo(url) {
        Some((scheme, userinfo, rest)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}{user}:{REDACTED}{rest}"),
            None => format!("{scheme}{REDACTED}{rest}"),
        },
        None => url.to_owned(),
    }
}

/// `url` without userinfo, for async-nats.
fn without_userinfo(url: &str) -> String {
    match split_userinfo(url) {
        Some((scheme, _, rest)) => format!("{scheme}{}", &rest[1..]),
        None => url.to_owned(),
    }
}

fn is_certificate_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("certificate") || m.contains("tls handshake") || m.contains("unknownissuer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delays_grow_to_the_cap_and_differ_between_clients() {
        let cap = Duration::from_millis(250);
        let a = std::collections::hash_map::RandomState::new();
        let b = std::collections::hash_map::RandomState::new();
        assert_eq!(
            reconnect_delay(1, cap, &a),
            Duration::ZERO,
            "the first retry is at once"
        );
        for attempts in 2..200 {
            let d = reconnect_delay(attempts, cap, &a);
            assert!(d <= cap, "attempt {attempts}: {d:?} over the cap");
        }
        assert!(
            reconnect_delay(100, cap, &a) >= cap / 2,
            "at most half is taken off, so a server that is down is not asked more than \
             a few times a second"
        );
        let schedule = |s: &std::collections::hash_map::RandomState| -> Vec<Duration> {
            (10..30).map(|n| reconnect_delay(n, cap, s)).collect()
        };
        assert_ne!(
            schedule(&a),
            schedule(&b),
            "two clients must not reconnect in lockstep"
        );
    }

    #[test]
    fn url_secrets_are_redacted_and_the_rest_kept() {
        let cases = [
            (
                "nats://u:p4ss@h:4222",
                "nats://u:<redacted>@h:4222",
                "nats://h:4222",
            ),
            (
                "nats://tok@h:4222",
                "nats://<redacted>@h:4222",
                "nats://h:4222",
            ),
            ("tls://u:p@ss@h", "tls://u:<redacted>@h", "tls://h"),
            ("u:p@h:1", "u:<redacted>@h:1", "h:1"),
            // The userinfo ends at the last `@`, so what a strict parser takes for the
            // end of the authority (`/`, `?`, `#`) stays inside the password.
            (
                "nats://u:s3cr#t@h:4222",
                "nats://u:<redacted>@h:4222",
                "nats://h:4222",
            ),
            (
                "nats://u:s3/c?r#e@t:%40@h:4222",
                "nats://u:<redacted>@h:4222",
                "nats://h:4222",
            ),
            ("nats://t/k#n@h", "nats://<redacted>@h", "nats://h"),
            // Without a scheme, a `://` in the password is not taken for one.
            ("u:pa://ss@h:1", "u:<redacted>@h:1", "h:1"),
            // An `@` in a path is taken for the end of a userinfo: over-redacted, never
            // shown.
            ("nats://h:4222/x@y", "nats://h:<redacted>@y", "nats://y"),
            ("nats://h:4222", "nats://h:4222", "nats://h:4222"),
        ];
        for (url, redacted, bare) in cases {
            assert_eq!(redact_url(url), redacted, "{url}");
            assert_eq!(without_userinfo(url), bare, "{url}");
        }
        let options = NatsOptions::new(["nats://u:p4ss@h"]).token("t0k");
        assert_eq!(
            options.scrub("p4ss and t0k".to_owned()),
            "<redacted> and <redacted>"
        );
        let encoded = NatsOptions::new(["nats://u:s3cr%23t%2Fx@h"]);
        assert_eq!(
            encoded.scrub("s3cr%23t%2Fx, s3cr#t/x".to_owned()),
            "<redacted>, <redacted>",
            "a percent-encoded password is hidden as written and as decoded"
        );
    }
}
