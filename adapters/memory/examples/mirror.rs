//! Mirrors a memory source into a cache with a worker-free follower, and prints when ready.
//!
//! `cargo run -p tidemark-memory --example mirror`

use tidemark::{FollowerConfig, Utf8};
use tidemark::{Source, spawn_cache};
use tidemark_memory::Memory;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let m = Memory::new();
    for i in 0..1000 {
        m.source
            .put(&format!("pkg/{i:04}"), format!("v{i}").into_bytes())
            .await?;
    }
    let config = FollowerConfig::builder("mirror").seed(7).build()?;
    let (cache, follower) = spawn_cache(config, Utf8, m.source.clone(), m.source.clone());
    let watermark = cache.wait_ready().await?;
    println!("ready: {} keys at watermark {watermark}", cache.len());
    m.source.remove("pkg/0000").await?;
    let reconciled = follower.reconcile().await?;
    println!(
        "reconciled: {reconciled:?}; pkg/0000 present: {}",
        cache.get("pkg/0000").is_some()
    );
    let status = follower
        .stop_within(std::time::Duration::from_secs(1))
        .await?;
    println!("stopped: {status:?}");
    Ok(())
}
