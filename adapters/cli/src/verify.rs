//! `tidemark verify`: a mirror compared with its source, entry by entry.
//!
//! The mirror is read at its committed revision W (one read transaction), then the
//! source's snapshot, then the source's changes since W. Only what both positions cover
//! is compared, so a writer writing meanwhile raises no false alarm:
//!
//! - a key the source holds at a revision at or below W has not changed since W: the
//!   mirror must hold it, at that revision, with the same bytes (else it is *missing* or
//!   *wrong*); one above W changed after the mirror's position and is left out;
//! - a key the mirror holds and the source does not must have been removed after W (the
//!   changes since W say so) — else it is *extra*. When the source no longer holds its
//!   changes since W (compacted), the comparison is read again; if it still cannot say,
//!   such keys are counted as unconfirmed, never as extra.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tidemark::{Changes, Source};

use crate::error::CliError;
use crate::read::{self, Whose};
use crate::source::{Missing, NatsAuth, Opened, SourceSpec, open};

/// How many times a comparison is read when the source cannot say what changed since
/// the mirror's revision (a running mirror moves on meanwhile), and how long apart.
const ATTEMPTS: u32 = 3;
const AGAIN_AFTER: Duration = Duration::from_secs(1);

/// `tidemark verify`'s arguments.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The mirror's source: `nats://host:port/BUCKET` or a tidemark SQLite registry file.
    pub source: String,
    /// The mirror's file.
    pub file: PathBuf,
    /// The mirror's follower in FILE (default: the name `tidemark mirror` gives it, or
    /// the file's only follower).
    #[arg(long, value_name = "NAME")]
    pub follower: Option<String>,
    /// The source's keys under this prefix only, as the mirror was started with.
    #[arg(long, value_name = "PREFIX")]
    pub prefix: Option<String>,
    /// How many keys of each kind of difference to name.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub show: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub auth: NatsAuth,
}

/// What a comparison found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// The mirror's committed revision.
    pub mirror_revision: u64,
    /// The source's revision at its snapshot.
    pub source_revision: u64,
    /// Keys compared and equal.
    pub equal: u64,
    /// Keys changed in the source after the mirror's revision: not compared.
    pub left_out: u64,
    /// Keys the mirror holds and the source no longer does, where the source could not
    /// say whether they were removed before or after the mirror's revision.
    pub unconfirmed: u64,
    /// In the source at or below the mirror's revision, not in the mirror.
    pub missing: Vec<String>,
    /// In the mirror, removed from the source (or never in it) at or below its revision.
    pub extra: Vec<String>,
    /// In both, with another revision or other bytes: (key, source's, mirror's revision).
    pub wrong: Vec<(String, u64, u64)>,
}

impl Diff {
    /// Nothing missing, extra or wrong, and the mirror is not past its source.
    pub fn equal(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.wrong.is_empty() && !self.ahead()
    }

    /// The mirror's revision is past the source's: it holds another history (a source
    /// recreated or restored from an older copy).
    pub fn ahead(&self) -> bool {
        self.mirror_revision > self.source_revision
    }
}

/// One key's entry: revision and bytes.
type Held = (u64, Vec<u8>);

/// Compares a mirror (its entries at `mirror_revision`) with its source's snapshot (puts
/// with their revisions, at `source_revision`) and the keys the source changed since the
/// mirror's revision (`None`: the source could not say).
pub fn diff(
    mirror_revision: u64,
    mirror: &HashMap<String, Held>,
    source_revision: u64,
    source: &[(String, u64, Vec<u8>)],
    changed_since: Option<&HashSet<String>>,
) -> Diff {
    let mut d = Diff {
        mirror_revision,
        source_revision,
        ..Diff::default()
    };
    let mut in_source = HashSet::with_capacity(source.len());
    for (key, seq, value) in source {
        in_source.insert(key.as_str());
        if *seq > mirror_revision {
            d.left_out += 1;
            continue;
        }
        match mirror.get(key) {
            None => d.missing.push(key.clone()),
            Some((held, bytes)) if held != seq || bytes != value => {
                d.wrong.push((key.clone(), *seq, *held));
            }
            Some(_) => d.equal += 1,
        }
    }
    for key in mirror.keys().filter(|k| !in_source.contains(k.as_str())) {
        match changed_since {
            Some(changed) if changed.contains(key) => d.left_out += 1,
            Some(_) => d.extra.push(key.clone()),
            None => d.unconfirmed += 1,
        }
    }
    d.missing.sort_unstable();
    d.extra.sort_unstable();
    d.wrong.sort_unstable();
    d
}

/// Compares; exit 0 when equal, [`CliError::Differ`] (exit 1) when not, and any other
/// failure — bad arguments, a source or file that is not there — as
/// [`CliError::CannotCompare`] (exit 2).
pub async fn run(args: VerifyArgs) -> Result<(), CliError> {
    compare(args).await.map_err(|e| match e {
        CliError::Differ(_) => e,
        other => CliError::CannotCompare(Box::new(other)),
    })
}

async fn compare(args: VerifyArgs) -> Result<(), CliError> {
    let spec = SourceSpec::parse(&args.source)?;
    let prefix = args.prefix.as_deref();
    let default = spec.default_name("mirror", prefix);
    // The local file first: a wrong file is refused before any server is asked.
    let whose = {
        let (file, follower) = (args.file.clone(), args.follower.clone());
        tokio::task::spawn_blocking(move || {
            let db = read::open(&file)?;
            read::choose(&db, follower.as_deref(), false, Some(&default))
        })
        .await
        .map_err(|e| CliError::Usage(format!("reading the mirror failed: {e}")))??
    };
    let Whose::Follower(name) = whose else {
        return Err(CliError::Usage(format!(
            "{} holds no mirror (no persisted follower)",
            args.file.display()
        )));
    };
    let opened = open(
        &spec,
        &args.auth,
        "tidemark-verify",
        prefix,
        Missing::Refuse,
    )
    .await?;
    let d = match opened {
        Opened::Nats(bucket) => against(&bucket, &args.file, &name).await?,
        Opened::Sqlite(source) => against(&source, &args.file, &name).await?,
    };
    let header = format!(
        "{name} in {} at revision {}; {} at revision {}",
        args.file.display(),
        d.mirror_revision,
        spec.shown(),
        d.source_revision
    );
    if args.json {
        println!("{}", to_json(&d, &name, &args, &spec));
    } else {
        print!("{}", to_text(&d, &header, args.show));
    }
    if d.equal() {
        Ok(())
    } else {
        Err(CliError::Differ(format!(
            "{name} in {} differs from {}: {} missing, {} extra, {} wrong{}",
            args.file.display(),
            spec.shown(),
            d.missing.len(),
            d.extra.len(),
            d.wrong.len(),
            if d.ahead() {
                ", and its revision is past the source's"
            } else {
                ""
            }
        )))
    }
}

/// Reads the mirror, then the source, and compares them; again while the source cannot
/// say what changed since the mirror's revision.
async fn against<S: Source>(
    source: &S,
    file: &std::path::Path,
    name: &str,
) -> Result<Diff, CliError> {
    let mut attempt = 1;
    loop {
        let (mirror_revision, mirror) = read_mirror(file, name).await?;
        let snapshot = source.snapshot().await?;
        // After the snapshot: every removal the snapshot reflects is in it.
        let changed = match source.changes_since(mirror_revision).await? {
            Changes::Since { entries, .. } => Some(
                entries
                    .iter()
                    .map(|e| e.key.to_string())
                    .collect::<HashSet<_>>(),
            ),
            _ if attempt < ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(AGAIN_AFTER).await;
                continue;
            }
            _ => None,
        };
        let entries: Vec<(String, u64, Vec<u8>)> = snapshot
            .entries
            .into_iter()
            .map(|e| (e.key.to_string(), e.seq, e.value))
            .collect();
        return Ok(diff(
            mirror_revision,
            &mirror,
            snapshot.watermark,
            &entries,
            changed.as_ref(),
        ));
    }
}

/// The follower's committed revision and entries, from one read transaction.
async fn read_mirror(
    file: &std::path::Path,
    name: &str,
) -> Result<(u64, HashMap<String, Held>), CliError> {
    let (file, name) = (file.to_path_buf(), name.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut db = read::open(&file)?;
        let mut entries = HashMap::new();
        let revision = db.scan(
            tidemark_sqlite::Holder::Follower(&name),
            "",
            |key, seq, value| {
                entries.insert(key.to_owned(), (seq, value.to_vec()));
                std::ops::ControlFlow::Continue(())
            },
        )?;
        let Some(revision) = revision else {
            return Err(CliError::Usage(format!(
                "{} holds no follower {name:?}",
                file.display()
            )));
        };
        Ok((revision, entries))
    })
    .await
    .map_err(|e| CliError::Usage(format!("reading the mirror failed: {e}")))?
}

fn first<T: Clone>(items: &[T], show: usize) -> Vec<T> {
    items.iter().take(show).cloned().collect()
}

fn to_json(d: &Diff, name: &str, args: &VerifyArgs, spec: &SourceSpec) -> serde_json::Value {
    json!({
        "equal": d.equal(),
        "follower": name,
        "file": args.file.display().to_string(),
        "source": spec.shown(),
        "mirror_revision": d.mirror_revision,
        "source_revision": d.source_revision,
        "mirror_ahead": d.ahead(),
        "compared": d.equal + d.missing.len() as u64 + d.wrong.len() as u64 + d.extra.len() as u64,
        "equal_keys": d.equal,
        "left_out": d.left_out,
        "unconfirmed": d.unconfirmed,
        "missing": { "count": d.missing.len(), "first": first(&d.missing, args.show) },
        "extra": { "count": d.extra.len(), "first": first(&d.extra, args.show) },
        "wrong": {
            "count": d.wrong.len(),
            "first": first(&d.wrong, args.show).iter().map(|(key, source, mirror)| json!({
                "key": key, "source_revision": source, "mirror_revision": mirror,
            })).collect::<Vec<_>>(),
        },
    })
}

fn named(keys: &[String], show: usize) -> String {
    let mut s = keys
        .iter()
        .take(show)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > show {
        s.push_str(", …");
    }
    s
}

fn to_text(d: &Diff, header: &str, show: usize) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let compared = d.equal + (d.missing.len() + d.wrong.len() + d.extra.len()) as u64;
    let _ = writeln!(out, "{header}");
    let _ = writeln!(
        out,
        "{compared} keys compared; {} changed in the source since the mirror's revision (left out)",
        d.left_out
    );
    if d.unconfirmed > 0 {
        let _ = writeln!(
            out,
            "{} keys only in the mirror could not be checked: the source no longer holds its changes since the mirror's revision",
            d.unconfirmed
        );
    }
    if d.ahead() {
        let _ = writeln!(
            out,
            "the mirror's revision is past the source's: it holds another history (a source recreated or restored)"
        );
    }
    if !d.missing.is_empty() {
        let _ = writeln!(
            out,
            "missing {} (in the source, not in the mirror): {}",
            d.missing.len(),
            named(&d.missing, show)
        );
    }
    if !d.extra.is_empty() {
        let _ = writeln!(
            out,
            "extra   {} (in the mirror, not in the source): {}",
            d.extra.len(),
            named(&d.extra, show)
        );
    }
    if !d.wrong.is_empty() {
        let keys: Vec<String> = d
            .wrong
            .iter()
            .map(|(k, s, m)| format!("{k} (source revision {s}, mirror {m})"))
            .collect();
        let _ = writeln!(
            out,
            "wrong   {} (another value or revision): {}",
            d.wrong.len(),
            named(&keys, show)
        );
    }
    let _ = writeln!(out, "{}", if d.equal() { "equal" } else { "not equal" });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirror(entries: &[(&str, u64, &str)]) -> HashMap<String, Held> {
        entries
            .iter()
            .map(|(k, s, v)| ((*k).to_owned(), (*s, v.as_bytes().to_vec())))
            .collect()
    }

    fn source(entries: &[(&str, u64, &str)]) -> Vec<(String, u64, Vec<u8>)> {
        entries
            .iter()
            .map(|(k, s, v)| ((*k).to_owned(), *s, v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn only_what_both_positions_cover_is_compared() {
        // The mirror at 5; the source at 9 wrote c at 7 and removed d at 8 meanwhile.
        let m = mirror(&[("a", 1, "x"), ("b", 2, "y"), ("d", 4, "w")]);
        let s = source(&[("a", 1, "x"), ("b", 2, "y"), ("c", 7, "z")]);
        let changed: HashSet<String> = ["c", "d"].map(String::from).into();
        let d = diff(5, &m, 9, &s, Some(&changed));
        assert!(
            d.equal(),
            "writes after the mirror's revision are no alarm: {d:?}"
        );
        assert_eq!((d.equal, d.left_out), (2, 2));
    }

    #[test]
    fn a_change_behind_the_mirrors_back_is_named() {
        let m = mirror(&[("a", 1, "x"), ("b", 2, "stale"), ("e", 3, "ghost")]);
        let s = source(&[("a", 1, "x"), ("b", 2, "y"), ("c", 4, "z")]);
        let d = diff(5, &m, 5, &s, Some(&HashSet::new()));
        assert!(!d.equal());
        assert_eq!(
            d.missing,
            ["c"],
            "in the source at or below 5, not in the mirror"
        );
        assert_eq!(
            d.extra,
            ["e"],
            "removed at or below 5 (no change since says otherwise)"
        );
        assert_eq!(
            d.wrong,
            [("b".to_owned(), 2, 2)],
            "same revision, other bytes"
        );
    }

    #[test]
    fn keys_only_in_the_mirror_are_unconfirmed_when_the_source_cannot_say() {
        let m = mirror(&[("e", 3, "ghost")]);
        let d = diff(5, &m, 9, &[], None);
        assert!(d.equal(), "no false alarm without the changes since: {d:?}");
        assert_eq!(d.unconfirmed, 1);
    }

    #[test]
    fn a_mirror_past_its_source_is_not_equal() {
        let d = diff(9, &HashMap::new(), 5, &[], Some(&HashSet::new()));
        assert!(d.ahead() && !d.equal());
    }
}
