//! The body of the SQLite adapter's fuzz target, as a library function: `fuzz/` calls it
//! from libFuzzer, and a plain test replays it over the checked-in corpus. It panics on a
//! violated invariant, which is what a fuzzer looks for.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rusqlite::types::Value;
use tidemark::{Feed, FeedItem, FeedStream, Source};

use crate::db::SqliteDb;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn small(&mut self, below: u8) -> u8 {
        self.byte().unwrap_or(0) % below
    }

    fn bytes(&mut self) -> Vec<u8> {
        let n = usize::from(self.small(12));
        let take = n.min(self.0.len());
        let (head, rest) = self.0.split_at(take);
        self.0 = rest;
        head.to_vec()
    }

    fn int(&mut self) -> i64 {
        match self.small(8) {
            0 => i64::MIN,
            1 => i64::MAX,
            2 => -i64::from(self.small(8)),
            3 => {
                let mut n = 0i64;
                for _ in 0..8 {
                    n = (n << 8) | i64::from(self.byte().unwrap_or(0));
                }
                n
            }
            _ => i64::from(self.small(32)),
        }
    }

    /// A value of any SQLite type: what a foreign writer could leave in a column.
    fn value(&mut self) -> Value {
        match self.small(5) {
            0 => Value::Null,
            1 => Value::Integer(self.int()),
            2 => Value::Real(f64::from(self.small(200)) / 3.0),
            3 => Value::Blob(self.bytes()),
            _ => Value::Text(String::from_utf8_lossy(&self.bytes()).into_owned()),
        }
    }
}

/// Rows of any shape a foreign writer or a corrupt copy could leave in a tidemark file
/// (keys that are not UTF-8 or not text, negative and huge seqs, values of every type,
/// events that are not events), read back through every read path: the snapshot, changes
/// since any seq, the key listing, the change-log feed and the events feed. Each answers
/// with rows, a typed error, or counted skips; never a panic.
pub fn foreign_rows(data: &[u8]) {
    static FILES: AtomicU64 = AtomicU64::new(0);
    let path: PathBuf = std::env::temp_dir().join(format!(
        "tidemark-fuzz-{}-{}.db",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(read_back(&path, data));
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

async fn read_back(path: &std::path::Path, data: &[u8]) {
    let db = SqliteDb::open(path).await.expect("a fresh file opens");
    {
        let conn = rusqlite::Connection::open(path).expect("a second connection");
        let mut b = Bytes(data);
        while !b.0.is_empty() {
            // Constraint failures (NOT NULL, duplicate keys) are the schema doing its job.
            let _ = match b.small(4) {
                0 => conn.execute(
                    "INSERT OR REPLACE INTO registry (key, value, seq, deleted) VALUES (?1, ?2, ?3, ?4)",
                    rusqlite::params![b.value(), b.value(), b.int(), b.value()],
                ),
                1 => conn.execute(
                    "INSERT OR REPLACE INTO changelog (seq, key, deleted, value) VALUES (?1, ?2, ?3, ?4)",
                    rusqlite::params![b.int(), b.value(), b.value(), b.value()],
                ),
                2 => conn.execute(
                    "INSERT INTO events (key, payload, seq) VALUES (?1, ?2, ?3)",
                    rusqlite::params![b.value(), b.value(), b.value()],
                ),
                _ => conn.execute(
                    "UPDATE tidemark_meta SET value = ?2 WHERE name = ?1",
                    rusqlite::params![
                        ["watermark", "first_available"][usize::from(b.small(2))],
                        b.int()
                    ],
                ),
            };
        }
    }
    let source = db.source();
    let _ = source.snapshot().await;
    let _ = source.present_keys().await;
    for since in [0, 1, 5, u64::MAX] {
        let _ = source.changes_since(since).await;
    }
    for from in [1, 3] {
        if let Ok(opened) = Feed::open(&source, from, None).await {
            drain(opened.stream).await;
        }
    }
    if let Ok(opened) = Feed::open(&db.events(), 1, None).await {
        drain(opened.stream).await;
    }
}

/// Reads what a feed has without waiting for more.
async fn drain<S: FeedStream>(mut stream: S) {
    for _ in 0..64 {
        match tokio::time::timeout(Duration::from_millis(2), stream.next()).await {
            Ok(Some(Ok(FeedItem::Entry(_) | FeedItem::Undecodable { .. }))) => {}
            _ => return,
        }
    }
}
