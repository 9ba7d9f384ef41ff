//! `tidemark mirror`: a NATS bucket or SQLite registry mirrored into a local SQLite cache
//! file, which restarts warm; stops gracefully on SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tidemark::{Feed, FollowerConfig, FollowerTask, RawBytes, Source};
use tidemark_sqlite::{PersistedCache, SqliteDb};
use tracing::{info, warn};

use crate::error::CliError;
use crate::output::{Screen, SyncProgress};
use crate::source::{NatsAuth, Opened, SourceSpec, open};
use crate::{serve_metrics, stop_signal};

/// How long a stopping mirror may take to commit its last batch.
const STOP_BUDGET: Duration = Duration::from_secs(10);

/// `tidemark mirror`'s arguments.
#[derive(Args, Debug)]
pub struct MirrorArgs {
    /// `nats://host:port/BUCKET` (also `tls://`, several hosts comma-separated) or a
    /// tidemark SQLite registry file.
    pub source: String,
    /// The SQLite file that keeps the cache and its watermark (created if absent).
    #[arg(long, value_name = "FILE")]
    pub into: PathBuf,
    /// The follower's name in the file (default: mirror-BUCKET). One name, one cache.
    #[arg(long)]
    pub name: Option<String>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    #[command(flatten)]
    pub auth: NatsAuth,
}

/// Runs the mirror until a stop signal.
pub async fn run(args: MirrorArgs, screen: &Screen) -> Result<(), CliError> {
    let spec = SourceSpec::parse(&args.source)?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| spec.default_name("mirror"));
    let config = FollowerConfig::new(name.as_str()).map_err(tidemark::Error::from)?;
    // The local file first: a file that is not ours is refused before any server is asked.
    let db = SqliteDb::open(&args.into).await?;
    if let Some(addr) = &args.metrics {
        serve_metrics(addr)?;
    }
    let cache = db.follower_cache(name.as_str());
    let label = match &spec {
        SourceSpec::Nats { bucket, .. } => bucket.clone(),
        SourceSpec::Sqlite(path) => path.display().to_string(),
    };
    match open(&spec, &args.auth, &format!("tidemark-{name}")).await? {
        Opened::Nats(bucket) => {
            follow(config, bucket.clone(), bucket, cache, &spec, &label, screen).await
        }
        Opened::Sqlite(source) => {
            follow(config, source.clone(), source, cache, &spec, &label, screen).await
        }
    }
}

async fn follow<S, F>(
    config: FollowerConfig,
    source: S,
    feed: F,
    cache: PersistedCache,
    spec: &SourceSpec,
    label: &str,
    screen: &Screen,
) -> Result<(), CliError>
where
    S: Source + 'static,
    F: Feed + 'static,
{
    let name = config.name().to_owned();
    let start = match cache.held().await? {
        Some(held) => format!(
            "warm start from revision {} ({} keys)",
            held.watermark, held.keys
        ),
        None => "cold start".to_owned(),
    };
    info!(follower = %name, "mirroring {} ({start})", spec.shown());
    let follower = FollowerTask::new(config, RawBytes, source, feed, cache)
        .source_name(label)
        .spawn();
    let mut stop = Box::pin(stop_signal());
    let mut status = follower.watch_status();
    let mut progress = Some(SyncProgress::new(screen));
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            biased;
            signal = &mut stop => {
                info!(follower = %name, "{signal}: stopping");
                break;
            }
            changed = status.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = tick.tick() => {}
        }
        let s = status.borrow_and_update().clone();
        if s.ready {
            if let Some(p) = progress.take() {
                p.finish();
                info!(follower = %name, keys = s.keys, watermark = s.watermark, "mirror ready ({start})");
            }
        } else if let Some(p) = &mut progress {
            p.update(&s, follower.head());
        }
        if follower.is_finished() {
            break;
        }
    }
    if let Some(p) = progress.take() {
        p.finish();
    }
    if follower.is_finished() {
        let result = follower.join().await;
        return match result {
            Ok(s) => {
                warn!(follower = %name, watermark = s.watermark, "mirror ended");
                Ok(())
            }
            Err(e) => Err(e.into()),
        };
    }
    let s = follower.stop_within(STOP_BUDGET).await?;
    info!(follower = %name, watermark = s.watermark, keys = s.keys, "stopped");
    Ok(())
}
