//! Mirrors a NATS KV bucket into a local cache and prints what changes, until Ctrl-C.
//!
//! ```sh
//! cargo run -p tidemark-nats --example kv_mirror -- nats://127.0.0.1:4222 registry
//! ```
//!
//! The bucket must exist (`nats kv add registry`); until it does, the follower retries
//! with backoff and says so in its status. Write to it from another shell
//! (`nats kv put registry pkg/a 1.0.0`) and watch the changes arrive; stop the server and
//! start it again, and the mirror resumes from its watermark.

use std::time::Duration;

use tidemark::Change;
use tidemark::spawn_cache;
use tidemark::{FollowerConfig, RawBytes};
use tidemark_nats::{KvBucket, NatsOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let bucket = args.next().unwrap_or_else(|| "registry".into());

    let client = NatsOptions::new([url.as_str()])
        .name("tidemark-kv-mirror")
        .connect()
        .await?;
    let kv = KvBucket::new(client, bucket.as_str())?;
    let config = FollowerConfig::builder("kv-mirror").build()?;
    let (cache, follower) = spawn_cache(config, RawBytes, kv.clone(), kv);
    let mut changes = cache.subscribe();

    // The URL may carry a user and password: print only where it points.
    let server = url.rsplit('@').next().unwrap_or(&url);
    println!("syncing bucket {bucket} from {server} ...");
    let mut progress = tokio::time::interval(Duration::from_secs(5));
    progress.tick().await;
    // One Ctrl-C listener for the whole run, so a press between two turns is not missed.
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            biased;
            _ = &mut ctrl_c => break,
            change = changes.recv() => match change {
                Ok(Change::Ready { watermark }) => {
                    println!("ready: {} keys at revision {watermark}", cache.len());
                }
                Ok(Change::Put { key, seq }) if cache.is_ready() => {
                    let value = cache.get(&key).unwrap_or_default();
                    println!("put     {key} @{seq} = {}", String::from_utf8_lossy(&value));
                }
                Ok(Change::Removed { key, seq }) if cache.is_ready() => {
                    println!("removed {key} @{seq}");
                }
                // The initial sync's puts are summed up by the ready line.
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    println!("(skipped {n} changes; the cache itself is complete)");
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            },
            _ = progress.tick() => {
                let s = follower.status();
                println!(
                    "status: {:?}, {} keys, watermark {}, reopens {}, resyncs {}",
                    s.phase, s.keys, s.watermark, s.counters.reopens, s.counters.resyncs
                );
            }
        }
    }
    let status = follower.stop_within(Duration::from_secs(5)).await?;
    println!("stopped at watermark {}", status.watermark);
    Ok(())
}
