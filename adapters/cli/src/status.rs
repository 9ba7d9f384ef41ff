//! `tidemark status`: what a tidemark SQLite file holds — registry, followers and their
//! watermarks, outbox, queue and dead letters, schedules, locks, cursors.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::{Value, json};
use tidemark_sqlite::{Report, Start};

use crate::error::CliError;

/// `tidemark status`'s arguments.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// A tidemark SQLite file (a registry, a mirror's cache, or both).
    pub file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Prints the file's report on stdout.
pub async fn run(args: &StatusArgs) -> Result<(), CliError> {
    // Read-only: a look must not migrate, create or switch the journal of a file a
    // running process (perhaps an older version) is using.
    let path = args.file.clone();
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() && m.len() == 0 => return Err(CliError::NotTidemark(path)),
        Ok(m) if !m.is_file() => {
            return Err(CliError::Usage(format!("{} is not a file", path.display())));
        }
        _ => {}
    }
    let report = tokio::task::spawn_blocking(move || tidemark_sqlite::read_report(&path))
        .await
        .map_err(|e| CliError::Usage(format!("status: {e}")))??;
    if args.json {
        println!("{}", to_json(&args.file, &report));
    } else {
        print!("{}", to_text(&args.file, &report));
    }
    Ok(())
}

fn start(s: Option<Start>) -> (Value, Value) {
    match s {
        Some(Start::Warm { resumed }) => (json!("warm"), json!(resumed)),
        Some(Start::Cold) => (json!("cold"), Value::Null),
        None => (Value::Null, Value::Null),
    }
}

/// The report as one JSON object.
pub fn to_json(path: &Path, r: &Report) -> Value {
    let followers: Vec<Value> = r
        .followers
        .iter()
        .map(|f| {
            let (last_start, resumed_from) = start(f.last_start);
            json!({
                "name": f.name,
                "watermark": f.watermark,
                "keys": f.keys,
                "starts": f.starts,
                "warm_starts": f.warm_starts,
                "last_start": last_start,
                "resumed_from": resumed_from,
                "history": f.history.map(|h| format!("{h:016x}")),
            })
        })
        .collect();
    json!({
        "file": path.display().to_string(),
        "registry": {
            "watermark": r.registry.watermark,
            "keys": r.registry.keys,
            "tombstones": r.registry.tombstones,
            "first_available": r.registry.first_available,
        },
        "followers": followers,
        "outbox": { "pending": r.outbox_pending },
        "queue": {
            "ready": r.queue.ready,
            "leased": r.queue.leased,
            "done": r.queue.done,
            "dead_letters": r.queue.dead,
        },
        "schedules": r.schedules.iter().map(|s| json!({
            "name": s.name,
            "interval_ms": u64::try_from(s.interval.as_millis()).unwrap_or(u64::MAX),
            "job": serde_json::from_str::<Value>(&s.job).unwrap_or_else(|_| json!(s.job)),
        })).collect::<Vec<_>>(),
        "locks": r.locks.iter().map(|l| json!({
            "name": l.name,
            "owner": l.owner,
            "expires_unix_ms": l.expires_ms,
        })).collect::<Vec<_>>(),
        "cursors": r.cursors.iter().map(|(name, position)| json!({
            "name": name,
            "position": position,
        })).collect::<Vec<_>>(),
        "events": { "head": r.events_head },
    })
}

/// The report as text for a person.
pub fn to_text(path: &Path, r: &Report) -> String {
    let mut out = String::new();
    let reg = &r.registry;
    let _ = writeln!(out, "{}", path.display());
    let _ = writeln!(
        out,
        "registry     revision {}, {} keys, {} tombstones, changes from {}",
        reg.watermark, reg.keys, reg.tombstones, reg.first_available
    );
    if r.followers.is_empty() {
        let _ = writeln!(out, "followers    none");
    }
    for f in &r.followers {
        let last = match f.last_start {
            Some(Start::Warm { resumed }) => format!("last start warm from {resumed}"),
            Some(Start::Cold) => "last start cold".to_owned(),
            None => "starts not recorded".to_owned(),
        };
        let history = f.history.map_or_else(
            || "history not stated".to_owned(),
            |h| format!("history {h:016x}"),
        );
        let _ = writeln!(
            out,
            "follower     {}: revision {}, {} keys, {} starts ({} warm), {last}, {history}",
            f.name, f.watermark, f.keys, f.starts, f.warm_starts
        );
    }
    let q = &r.queue;
    let _ = writeln!(out, "outbox       {} pending", r.outbox_pending);
    let _ = writeln!(
        out,
        "queue        {} ready, {} leased, {} done, {} dead letters",
        q.ready, q.leased, q.done, q.dead
    );
    for s in &r.schedules {
        let _ = writeln!(
            out,
            "schedule     {}: every {:?}, {}",
            s.name, s.interval, s.job
        );
    }
    for l in &r.locks {
        let owner = l.owner.as_deref().unwrap_or("(released)");
        let _ = writeln!(out, "lock         {}: {owner}", l.name);
    }
    for (name, position) in &r.cursors {
        let _ = writeln!(out, "cursor       {name}: position {position}");
    }
    let _ = writeln!(out, "events       head {}", r.events_head);
    out
}
