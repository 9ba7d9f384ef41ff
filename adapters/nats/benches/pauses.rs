//! The NATS feed read the way a durable sink reads it: a turn of 16,384 entries, then a
//! pause while the batch is committed (a SQLite transaction), and so on, over 1,000,000
//! keys (`TIDEMARK_BENCH_SYNC_KEYS` to change). Prints the time the reads took beside the
//! pauses, and how long the feed kept the reader waiting after each pause: a push
//! consumer whose flow control falls out of step with a reader that pauses waits for
//! the next heartbeat, a second, per pause; one whose client drops what overflows its
//! subscription's channel fails with a consumer sequence gap (what bounded a 1M-key cold
//! start into SQLite). The peak resident memory shows what the pauses cost to buffer.
//!
//! `cargo bench -p tidemark-nats --bench pauses`
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use tidemark_nats::KvBucket;

const TURN: u32 = 16_384;

fn main() {
    common::run_bench(
        "pauses",
        "cargo bench -p tidemark-nats --bench pauses",
        run(),
    );
}

/// The most memory this process had resident (`VmHWM`), as the kernel says it.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l.trim_start_matches("VmHWM:").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

async fn run() {
    let n: u32 = std::env::var("TIDEMARK_BENCH_SYNC_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let (_server, client) = common::filled_bucket(
        "pauses",
        n,
        |i| format!("k{i}"),
        |i| Bytes::from(format!("v-{i}-................................")),
    )
    .await;
    let b = KvBucket::new(client.clone(), "pauses").unwrap();
    for pause in [
        Duration::ZERO,
        Duration::from_millis(50),
        Duration::from_millis(300),
    ] {
        let t = Instant::now();
        let mut feed = tidemark::Feed::open(&b, 1, None)
            .await
            .expect("open")
            .stream;
        let (mut read, mut paused, mut first_waits) = (0u32, Duration::ZERO, Vec::new());
        while read < n {
            let asked = Instant::now();
            match tidemark::FeedStream::next(&mut feed).await {
                Some(Ok(_)) => read += 1,
                other => panic!("feed ended: {other:?}"),
            }
            if read % TURN == 1 && read > 1 {
                first_waits.push(asked.elapsed());
            }
            if read % TURN == 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
                paused += pause;
            }
        }
        let total = t.elapsed();
        first_waits.sort();
        let slow = first_waits
            .iter()
            .filter(|w| **w > Duration::from_millis(500))
            .count();
        println!(
            "pause {pause:?} per {TURN} entries: {n} entries in {total:.2?} ({paused:.2?} paused, {:.2?} reading); first read after a pause: median {:.2?}, max {:.2?}, {slow} of {} over 500 ms",
            total.saturating_sub(paused),
            first_waits
                .get(first_waits.len() / 2)
                .copied()
                .unwrap_or_default(),
            first_waits.last().copied().unwrap_or_default(),
            first_waits.len()
        );
        println!(
            "  peak resident memory of this process so far: {}",
            peak_rss()
        );
    }
}
