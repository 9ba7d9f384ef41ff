//! Why a command failed, in one line an operator can act on.

use std::path::PathBuf;

/// A command's failure. Printed as one line (`tidemark: <why>`), with a non-zero exit.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The arguments do not make sense together.
    #[error("{0}")]
    Usage(String),
    /// NATS could not be reached, refused the credentials, or TLS failed.
    #[error(transparent)]
    Connect(#[from] tidemark_nats::ConnectError),
    /// A file is not a tidemark database (or is damaged, or newer).
    #[error(transparent)]
    Sqlite(#[from] tidemark_sqlite::Error),
    /// The source (a NATS bucket, a registry file) does not exist, or the server would not
    /// say whether it does.
    #[error("{0}")]
    NoSource(String),
    /// What was asked for is not there (a key, a follower).
    #[error("{0}")]
    NotFound(String),
    /// `verify` compared a mirror with its source and they differ (exit 1).
    #[error("{0}")]
    Differ(String),
    /// `verify` could not compare (exit 2): why.
    #[error(transparent)]
    CannotCompare(Box<CliError>),
    /// An empty file: not a tidemark database.
    #[error("{0}: not a tidemark database (the file is empty)")]
    NotTidemark(PathBuf),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A port or driver failed.
    #[error(transparent)]
    Runtime(#[from] tidemark::Error),
    /// The metrics endpoint could not be served.
    #[error("cannot serve metrics on {addr}: {reason}")]
    Metrics {
        /// The address asked for.
        addr: String,
        /// Why.
        reason: String,
    },
}

impl CliError {
    /// The process's exit code: 2 for usage errors (as clap's own) and comparisons that
    /// could not be made, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::CannotCompare(_) => 2,
            _ => 1,
        }
    }
}
