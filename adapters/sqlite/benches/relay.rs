//! Relay throughput on one SQLite file: outbox rows relayed per second with each row's
//! legs run one at a time (a commit per publish, notify and enqueue: the relay before
//! batching, reproduced by ports that keep the default one-at-a-time batch methods) and
//! with the legs batched (one transaction per leg per chunk), measured in the same run
//! with their ratio. The writes are announced (`pack_housekeeping` on each), over 10,000
//! keys, so the enqueue leg coalesces as it does in production.
//!
//! `cargo bench -p tidemark-sqlite --bench relay -- --rows N --runs R` (default 50,000
//! rows, 3 runs). Without `--bench` (as under `cargo test --benches`) it is a tiny smoke
//! run.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use tidemark::tidemark_core::{Job, JobId, Legs};
use tidemark::{
    Announcer, JobCounts, JobRecord, JobRetention, JobState, Leased, Publish, Queue, Relay, Result,
    Wake,
};
use tidemark_sqlite::{SqliteDb, Write};

/// A port that runs batches one item at a time: what the relay paid before batching.
#[derive(Clone, Debug)]
struct OneByOne<T>(T);

impl<P: Publish> Publish for OneByOne<P> {
    async fn publish(&self, key: &str, payload: Vec<u8>) -> Result<u64> {
        self.0.publish(key, payload).await
    }
}

impl<W: Wake> Wake for OneByOne<W> {
    type Listener = W::Listener;
    async fn notify(&self, channel: &str, payload: Vec<u8>) -> Result<()> {
        self.0.notify(channel, payload).await
    }
    async fn listen(&self, channel: &str) -> Result<W::Listener> {
        self.0.listen(channel).await
    }
}

impl<Q: Queue> Queue for OneByOne<Q> {
    async fn enqueue(&self, job: Job) -> Result<JobId> {
        self.0.enqueue(job).await
    }
    async fn enqueue_tick(&self, tick: &tidemark::TickKey, job: Job) -> Result<Option<JobId>> {
        self.0.enqueue_tick(tick, job).await
    }
    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        self.0.get(id).await
    }
    async fn lease(&self, visibility: Duration) -> Result<Option<Leased>> {
        self.0.lease(visibility).await
    }
    async fn ack(&self, lease: &Leased) -> Result<()> {
        self.0.ack(lease).await
    }
    async fn fail(&self, lease: &Leased, error: &str, retry_after: Duration) -> Result<JobState> {
        self.0.fail(lease, error, retry_after).await
    }
    async fn renew(&self, lease: &Leased, visibility: Duration) -> Result<()> {
        self.0.renew(lease, visibility).await
    }
    async fn dead_letter(&self, lease: &Leased, error: &str) -> Result<()> {
        self.0.dead_letter(lease, error).await
    }
    async fn dead_letters(&self, after: Option<JobId>, limit: usize) -> Result<Vec<JobRecord>> {
        self.0.dead_letters(after, limit).await
    }
    async fn requeue(&self, id: JobId) -> Result<JobId> {
        self.0.requeue(id).await
    }
    async fn counts(&self) -> Result<JobCounts> {
        self.0.counts().await
    }
    async fn remove_finished(&self, retention: JobRetention) -> Result<u64> {
        self.0.remove_finished(retention).await
    }
}

/// Writes `rows` announced puts over 10,000 keys in batches of 100.
async fn fill(db: &SqliteDb, rows: u64) {
    let src = db.announced_source(Legs::default());
    let mut i = 0;
    while i < rows {
        let end = (i + 100).min(rows);
        src.write_batch(
            (i..end)
                .map(|k| Write::Put(format!("key/{:05}", k % 10_000), vec![b'x'; 100]))
                .collect(),
        )
        .await
        .unwrap();
        i = end;
    }
}

/// Rows relayed per second by one drain of a fresh file holding `rows` pending rows.
async fn rate(rows: u64, batched: bool) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let db = SqliteDb::open(dir.path().join("relay.db")).await.unwrap();
    fill(&db, rows).await;
    let started = Instant::now();
    let report = if batched {
        db.relay(db.events(), db.wake(), db.queue(), "bench")
            .drain()
            .await
            .unwrap()
    } else {
        Relay::new(
            db.outbox(),
            Announcer::new(
                OneByOne(db.events()),
                OneByOne(db.wake()),
                OneByOne(db.queue()),
                "bench",
            ),
            "bench-one-by-one",
        )
        .drain()
        .await
        .unwrap()
    };
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(report.done, rows, "every row relayed");
    rows as f64 / secs
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let full = argv.iter().any(|a| a == "--bench");
    let get = |name: &str, default: u64| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .map_or(default, |v| v.parse().unwrap())
    };
    let (rows, runs) = if full {
        (get("--rows", 50_000), get("--runs", 3))
    } else {
        (500, 1)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!("relay: {rows} announced rows over 10,000 keys, one drain per figure");
        println!(
            "{:>4} {:>16} {:>14} {:>7}",
            "run", "one-by-one rows/s", "batched rows/s", "ratio"
        );
        for run in 1..=runs {
            let before = rate(rows, false).await;
            let after = rate(rows, true).await;
            println!(
                "{run:>4} {before:>16.0} {after:>14.0} {:>6.1}x",
                after / before
            );
        }
    });
}
