//! `tidemark watch`: a source's changes as they arrive, one line each on stdout.

use std::io::Write as _;
use std::time::Duration;

use clap::Args;
use tidemark::{Cache, Change, Feed, FollowerConfig, FollowerTask, RawBytes, Source};
use tokio::sync::broadcast::error::RecvError;
use tracing::{info, warn};

use crate::error::CliError;
use crate::source::{NatsAuth, Opened, SourceSpec, open};
use crate::{serve_metrics, stop_signal};

/// `tidemark watch`'s arguments.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// `nats://host:port/BUCKET` (also `tls://`) or a tidemark SQLite registry file.
    pub source: String,
    /// Also print every key the initial sync loads (default: only a summary line).
    #[arg(long)]
    pub all: bool,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    #[command(flatten)]
    pub auth: NatsAuth,
}

/// Prints changes until a stop signal.
pub async fn run(args: WatchArgs) -> Result<(), CliError> {
    let spec = SourceSpec::parse(&args.source)?;
    let name = spec.default_name("watch");
    let config = FollowerConfig::new(name.as_str()).map_err(tidemark::Error::from)?;
    if let Some(addr) = &args.metrics {
        serve_metrics(addr)?;
    }
    match open(&spec, &args.auth, &format!("tidemark-{name}")).await? {
        Opened::Nats(b) => watch(config, b.clone(), b, &spec, args.all).await,
        Opened::Sqlite(s) => watch(config, s.clone(), s, &spec, args.all).await,
    }
}

fn line(cache: &Cache<Vec<u8>>, change: &Change) -> String {
    match change {
        Change::Put { key, seq } => {
            let value = cache.get(key).unwrap_or_default();
            format!("put     {key} @{seq} = {}", String::from_utf8_lossy(&value))
        }
        Change::Removed { key, seq } => format!("removed {key} @{seq}"),
        Change::Ready { watermark } => {
            format!("ready   {} keys at revision {watermark}", cache.len())
        }
        other => format!("{other:?}"),
    }
}

async fn watch<S, F>(
    config: FollowerConfig,
    source: S,
    feed: F,
    spec: &SourceSpec,
    all: bool,
) -> Result<(), CliError>
where
    S: Source + 'static,
    F: Feed + 'static,
{
    info!("watching {}", spec.shown());
    let (writer, cache) = tidemark::cache();
    // Subscribed before the follower runs: no change, and not the readiness, goes by first.
    let mut changes = cache.subscribe();
    let follower = FollowerTask::new(config, RawBytes, source, feed, writer).spawn();
    let mut stop = Box::pin(stop_signal());
    let mut out = std::io::stdout();
    // Readiness as the stream tells it: the cache itself is ready before this loop has
    // read the initial sync's changes.
    let mut synced = false;
    loop {
        let change = tokio::select! {
            biased;
            signal = &mut stop => {
                info!("{signal}: stopping");
                break;
            }
            change = changes.recv() => change,
        };
        match change {
            // The initial sync's puts are summed up by the ready line unless asked for.
            Ok(Change::Put { .. } | Change::Removed { .. }) if !all && !synced => {}
            Ok(c) => {
                synced |= matches!(c, Change::Ready { .. });
                // A closed pipe (`tidemark watch … | head`) ends the watch, quietly.
                if writeln!(out, "{}", line(&cache, &c)).is_err() {
                    break;
                }
            }
            Err(RecvError::Lagged(n)) => {
                warn!(
                    "{n} changes went by faster than they could be printed; the cache itself is complete"
                );
            }
            Err(RecvError::Closed) => break,
        }
    }
    follower.stop_within(Duration::from_secs(5)).await?;
    Ok(())
}
