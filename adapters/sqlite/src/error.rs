//! The crate's one error type: what can go wrong opening a database file. Once open, the
//! ports speak [`tidemark::Error`]; an SQLite failure there is
//! [`tidemark::Error::Unavailable`] (retryable: a busy file, a full disk).

use std::path::PathBuf;

/// Why a database file could not be opened as a tidemark database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file exists but is not an SQLite database (wrong header, random bytes).
    #[error("{path}: not an SQLite database")]
    NotADatabase {
        /// The file.
        path: PathBuf,
    },
    /// The file is shorter than its own header says: it was cut off.
    #[error("{path}: truncated ({len} bytes on disk, header says {expected})")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length on disk.
        len: u64,
        /// The length its header promises.
        expected: u64,
    },
    /// SQLite reports the file as damaged (a malformed page or schema).
    #[error("{path}: corrupt database: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// SQLite's explanation.
        detail: String,
    },
    /// A valid SQLite database that belongs to something else (another application id, or
    /// tables that are not ours): tidemark will not write into it.
    #[error("{path}: not a tidemark database: {reason}")]
    Foreign {
        /// The file.
        path: PathBuf,
        /// What gave it away.
        reason: String,
    },
    /// Written by a newer tidemark: this version cannot read its schema.
    #[error("{path}: schema version {found} is newer than this build supports ({supported})")]
    NewerSchema {
        /// The file.
        path: PathBuf,
        /// The file's schema version.
        found: i64,
        /// The newest this build knows.
        supported: i64,
    },
    /// Written by an older tidemark and not yet migrated; a read-only open (such as
    /// [`read_report`](crate::read_report)) will not migrate it. Any read-write open
    /// ([`SqliteDb::open`](crate::SqliteDb::open), which every follower, relay and writer
    /// does) migrates it in place.
    #[error(
        "{path}: schema version {found} is older than this build's ({supported}); a read-only look does not migrate it (opening it read-write, as any tidemark process does, will)"
    )]
    OlderSchema {
        /// The file.
        path: PathBuf,
        /// The file's schema version.
        found: i64,
        /// The version this build reads.
        supported: i64,
    },
    /// The file could not be read or created.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// Any other SQLite failure while opening (a lock held too long, a read-only file).
    #[error("{path}: {source}")]
    Sqlite {
        /// The file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
}

impl Error {
    /// Classifies an SQLite failure met while opening `path`.
    pub(crate) fn from_sqlite(path: &std::path::Path, e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        let path = path.to_path_buf();
        match e.sqlite_error_code() {
            Some(ErrorCode::NotADatabase) => Error::NotADatabase { path },
            Some(ErrorCode::DatabaseCorrupt) => Error::Corrupt {
                path,
                detail: e.to_string(),
            },
            _ => Error::Sqlite { path, source: e },
        }
    }
}

impl From<Error> for tidemark::Error {
    fn from(e: Error) -> Self {
        tidemark::Error::unavailable("sqlite", e.to_string())
    }
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Maps an SQLite failure inside a port call to the runtime's error.
pub(crate) fn unavailable(port: &'static str, e: &rusqlite::Error) -> tidemark::Error {
    tidemark::Error::unavailable(port, e.to_string())
}
