//! `tidemark get`, `ls` and `dump`: the entries a tidemark file holds — a mirror's cache
//! or the registry — read-only, beside a process writing the file.

use std::io::{BufWriter, Write as _};
use std::ops::ControlFlow;
use std::path::PathBuf;

use base64::Engine as _;
use clap::Args;
use serde_json::{Value, json};
use tidemark_sqlite::{Holder, ReadOnlyDb};

use crate::error::CliError;

/// Which entries of a tidemark file.
#[derive(Args, Debug, Clone)]
pub struct FileArgs {
    /// A tidemark SQLite file (a mirror's cache, a registry, or both).
    pub file: PathBuf,
    /// Read this follower's cache (default: the file's only follower; a file with none
    /// is read as a registry).
    #[arg(long, value_name = "NAME", conflicts_with = "registry")]
    pub follower: Option<String>,
    /// Read the file's registry rather than a follower's cache.
    #[arg(long)]
    pub registry: bool,
}

/// `tidemark get`'s arguments.
#[derive(Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    pub file: FileArgs,
    /// The key.
    pub key: String,
    /// Print a JSON object (key, seq, value) instead of the value.
    #[arg(long)]
    pub json: bool,
}

/// `tidemark ls`'s arguments.
#[derive(Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub file: FileArgs,
    /// Only the keys that start with this.
    #[arg(long, value_name = "PREFIX", default_value = "")]
    pub prefix: String,
}

/// `tidemark dump`'s arguments.
#[derive(Args, Debug)]
pub struct DumpArgs {
    #[command(flatten)]
    pub file: FileArgs,
    /// Only the keys that start with this.
    #[arg(long, value_name = "PREFIX", default_value = "")]
    pub prefix: String,
    /// One JSON object a line: key, seq, and value (UTF-8 text) or value_base64.
    #[arg(long)]
    pub json: bool,
}

/// Whose entries a command reads, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Whose {
    /// The registry.
    Registry,
    /// A follower's cache.
    Follower(String),
}

impl Whose {
    /// As the sqlite crate names it.
    pub fn holder(&self) -> Holder<'_> {
        match self {
            Whose::Registry => Holder::Registry,
            Whose::Follower(name) => Holder::Follower(name),
        }
    }

    /// For messages.
    pub fn shown(&self) -> String {
        match self {
            Whose::Registry => "the registry".to_owned(),
            Whose::Follower(name) => format!("follower {name}"),
        }
    }
}

/// Opens `path` read-only (it must exist and be a tidemark file).
pub fn open(path: &std::path::Path) -> Result<ReadOnlyDb, CliError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() == 0 => Err(CliError::NotTidemark(path.to_path_buf())),
        Ok(m) if !m.is_file() => Err(CliError::Usage(format!("{} is not a file", path.display()))),
        _ => Ok(ReadOnlyDb::open(path)?),
    }
}

/// Picks whose entries to read: the follower asked for (which the file must hold), the
/// registry if asked for, else the file's only follower, else the registry.
pub fn choose(
    db: &ReadOnlyDb,
    follower: Option<&str>,
    registry: bool,
    default: Option<&str>,
) -> Result<Whose, CliError> {
    if registry {
        return Ok(Whose::Registry);
    }
    let names = db.follower_names()?;
    let file = db.path().display();
    if let Some(name) = follower {
        if names.iter().any(|n| n == name) {
            return Ok(Whose::Follower(name.to_owned()));
        }
        return Err(CliError::Usage(format!(
            "{file} holds no follower {name:?} ({})",
            held(&names)
        )));
    }
    if let Some(name) = default.filter(|d| names.iter().any(|n| n == d)) {
        return Ok(Whose::Follower(name.to_owned()));
    }
    match names.as_slice() {
        [] => Ok(Whose::Registry),
        [only] => Ok(Whose::Follower(only.clone())),
        _ => Err(CliError::Usage(format!(
            "{file} holds several followers ({}): choose one with --follower NAME",
            held(&names)
        ))),
    }
}

fn held(names: &[String]) -> String {
    if names.is_empty() {
        "it holds none".to_owned()
    } else {
        format!("it holds {}", names.join(", "))
    }
}

/// A value as JSON: text if it is UTF-8, base64 otherwise.
fn entry_json(key: &str, seq: u64, value: &[u8]) -> Value {
    match std::str::from_utf8(value) {
        Ok(text) => json!({ "key": key, "seq": seq, "value": text }),
        Err(_) => json!({
            "key": key,
            "seq": seq,
            "value_base64": base64::engine::general_purpose::STANDARD.encode(value),
        }),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CliError> + Send + 'static,
) -> Result<T, CliError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CliError::Usage(format!("the read failed: {e}")))?
}

/// Prints one key's value.
pub async fn get(args: GetArgs) -> Result<(), CliError> {
    blocking(move || {
        let db = open(&args.file.file)?;
        let whose = choose(&db, args.file.follower.as_deref(), args.file.registry, None)?;
        let Some((seq, value)) = db.get(whose.holder(), &args.key)? else {
            return Err(CliError::NotFound(format!(
                "{}: no key {:?} in {}",
                args.file.file.display(),
                args.key,
                whose.shown()
            )));
        };
        let mut out = std::io::stdout().lock();
        let written = if args.json {
            writeln!(out, "{}", entry_json(&args.key, seq, &value))
        } else {
            out.write_all(&value).and_then(|()| writeln!(out))
        };
        // A closed pipe is the reader's choice, not a failure.
        drop(written);
        Ok(())
    })
    .await
}

/// Prints keys, or entries, in key order.
async fn scan(
    file: FileArgs,
    prefix: String,
    line: fn(&str, u64, &[u8]) -> String,
) -> Result<(), CliError> {
    blocking(move || {
        let mut db = open(&file.file)?;
        let whose = choose(&db, file.follower.as_deref(), file.registry, None)?;
        let mut out = BufWriter::new(std::io::stdout().lock());
        let mut closed = false;
        db.scan(whose.holder(), &prefix, |key, seq, value| {
            if writeln!(out, "{}", line(key, seq, value)).is_err() {
                closed = true;
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        })?;
        if !closed {
            drop(out.flush());
        }
        Ok(())
    })
    .await
}

/// Prints the keys, one a line.
pub async fn ls(args: LsArgs) -> Result<(), CliError> {
    scan(args.file, args.prefix, |key, _, _| key.to_owned()).await
}

/// Prints every entry, one a line.
pub async fn dump(args: DumpArgs) -> Result<(), CliError> {
    if args.json {
        scan(args.file, args.prefix, |key, seq, value| {
            entry_json(key, seq, value).to_string()
        })
        .await
    } else {
        scan(args.file, args.prefix, |key, seq, value| {
            format!("{key} @{seq} = {}", String::from_utf8_lossy(value))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_text_when_it_is_utf8_and_base64_otherwise() {
        assert_eq!(
            entry_json("k", 3, b"hi"),
            json!({ "key": "k", "seq": 3, "value": "hi" })
        );
        assert_eq!(
            entry_json("k", 3, &[0xff, 0x00]),
            json!({ "key": "k", "seq": 3, "value_base64": "/wA=" }),
            "bytes that are not UTF-8 survive the trip through JSON"
        );
    }
}
