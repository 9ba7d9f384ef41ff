//! `tidemark mirror`: a NATS bucket or SQLite registry mirrored into a local SQLite cache
//! file, which restarts warm; stops gracefully on SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tidemark::{Feed, FollowerConfig, FollowerTask, Health, RawBytes, Source};
use tidemark_sqlite::{PersistedCache, SqliteDb};
use tracing::{info, warn};

use crate::endpoint::{Probe, Probes};
use crate::error::CliError;
use crate::output::{Screen, SyncProgress};
use crate::source::{FollowArgs, Opened, SourceSpec, open};
use crate::stop_signal;

/// How long a stopping mirror may take to commit its last batch.
const STOP_BUDGET: Duration = Duration::from_secs(10);

/// `tidemark mirror`'s arguments.
#[derive(Args, Debug)]
pub struct MirrorArgs {
    #[command(flatten)]
    pub follow: FollowArgs,
    /// The SQLite file that keeps the cache and its watermark (created if absent).
    #[arg(long, value_name = "FILE")]
    pub into: PathBuf,
    /// The follower's name in the file (default: mirror-BUCKET). One name, one cache.
    #[arg(long)]
    pub name: Option<String>,
}

/// Runs the mirror until a stop signal.
pub async fn run(args: MirrorArgs, screen: &Screen) -> Result<(), CliError> {
    let spec = SourceSpec::parse(&args.follow.source)?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| spec.default_name("mirror", args.follow.prefix.as_deref()));
    let config = FollowerConfig::new(name.as_str()).map_err(tidemark::Error::from)?;
    // The local file first: a file that is not ours is refused before any server is asked.
    let db = SqliteDb::open(&args.into).await?;
    let probes = args.follow.probes()?;
    let cache = db.follower_cache(name.as_str());
    let label = match &spec {
        SourceSpec::Nats { bucket, .. } => bucket.clone(),
        SourceSpec::Sqlite(path) => path.display().to_string(),
    };
    let prefix = args.follow.prefix.as_deref();
    let client_name = format!("tidemark-{name}");
    let opening = open(
        &spec,
        &args.follow.auth,
        &client_name,
        prefix,
        args.follow.missing(),
    );
    // With --wait-for-source the opening may wait for a registry file: a stop ends it.
    let opened = tokio::select! {
        biased;
        signal = stop_signal() => {
            info!(follower = %name, "{signal}: stopping");
            return Ok(());
        }
        opened = opening => opened?,
    };
    let mirror = Mirror {
        spec: &spec,
        label: &label,
        screen,
        probes,
        stall_after: args.follow.stall_after(),
    };
    match opened {
        Opened::Nats(bucket) => mirror.follow(config, bucket.clone(), bucket, cache).await,
        Opened::Sqlite(source) => mirror.follow(config, source.clone(), source, cache).await,
    }
}

/// A mirror about to follow its source: what it shows and tells the probes.
struct Mirror<'a> {
    spec: &'a SourceSpec,
    label: &'a str,
    screen: &'a Screen,
    probes: Probes,
    stall_after: Duration,
}

impl Mirror<'_> {
    async fn follow<S, F>(
        self,
        config: FollowerConfig,
        source: S,
        feed: F,
        cache: PersistedCache,
    ) -> Result<(), CliError>
    where
        S: Source + 'static,
        F: Feed + 'static,
    {
        let name = config.name().to_owned();
        let start = match cache.held().await? {
            Some(held) => format!(
                "warm start from revision {}, {} keys",
                held.watermark, held.keys
            ),
            None => "cold start".to_owned(),
        };
        info!(follower = %name, "mirroring {} ({start})", self.spec.shown());
        let follower = FollowerTask::new(config, RawBytes, source, feed, cache)
            .source_name(self.label)
            .spawn();
        let mut stop = Box::pin(stop_signal());
        let mut status = follower.watch_status();
        let mut progress = Some(SyncProgress::new(self.screen));
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                biased;
                signal = &mut stop => {
                    // The bar goes first, or its last frame stays above the log lines.
                    if let Some(p) = progress.take() {
                        p.finish();
                    }
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
            self.probes
                .set(Probe::Running(Health::of([&follower], self.stall_after)));
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
        self.probes
            .set(Probe::Ended("the mirror is stopping".into()));
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
}
