//! `tidemark watch`: a source's changes as they arrive, one line each on stdout.

use std::io::Write as _;
use std::time::Duration;

use clap::Args;
use tidemark::{Cache, Change, Feed, FollowerConfig, FollowerTask, Health, RawBytes, Source};
use tokio::sync::broadcast::error::RecvError;
use tracing::{info, warn};

use crate::endpoint::{Probe, Probes};
use crate::error::CliError;
use crate::source::{FollowArgs, Opened, SourceSpec, open};
use crate::stop_signal;

/// `tidemark watch`'s arguments.
#[derive(Args, Debug)]
pub struct WatchArgs {
    #[command(flatten)]
    pub follow: FollowArgs,
    /// Also print every key the initial sync loads (default: only a summary line).
    #[arg(long)]
    pub all: bool,
}

/// Prints changes until a stop signal.
pub async fn run(args: WatchArgs) -> Result<(), CliError> {
    let spec = SourceSpec::parse(&args.follow.source)?;
    let name = spec.default_name("watch", args.follow.prefix.as_deref());
    let config = FollowerConfig::new(name.as_str()).map_err(tidemark::Error::from)?;
    let probes = args.follow.probes()?;
    let prefix = args.follow.prefix.as_deref();
    let client_name = format!("tidemark-{name}");
    let opening = open(
        &spec,
        &args.follow.auth,
        &client_name,
        prefix,
        args.follow.missing(),
    );
    let opened = tokio::select! {
        biased;
        signal = stop_signal() => {
            info!("{signal}: stopping");
            return Ok(());
        }
        opened = opening => opened?,
    };
    let watch = Watch {
        spec: &spec,
        all: args.all,
        probes,
        stall_after: args.follow.stall_after(),
    };
    match opened {
        Opened::Nats(b) => watch.run(config, b.clone(), b).await,
        Opened::Sqlite(s) => watch.run(config, s.clone(), s).await,
    }
}

/// A watch about to follow its source.
struct Watch<'a> {
    spec: &'a SourceSpec,
    all: bool,
    probes: Probes,
    stall_after: Duration,
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

impl Watch<'_> {
    async fn run<S, F>(self, config: FollowerConfig, source: S, feed: F) -> Result<(), CliError>
    where
        S: Source + 'static,
        F: Feed + 'static,
    {
        let all = self.all;
        info!("watching {}", self.spec.shown());
        let (writer, cache) = tidemark::cache();
        // Subscribed before the follower runs: no change, and not the readiness, goes by first.
        let mut changes = cache.subscribe();
        let follower = FollowerTask::new(config, RawBytes, source, feed, writer).spawn();
        let mut stop = Box::pin(stop_signal());
        let mut out = std::io::stdout();
        // Readiness as the stream tells it: the cache itself is ready before this loop has
        // read the initial sync's changes.
        let mut synced = false;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            let change = tokio::select! {
                biased;
                signal = &mut stop => {
                    info!("{signal}: stopping");
                    break;
                }
                change = changes.recv() => change,
                _ = tick.tick() => {
                    self.probes.set(Probe::Running(Health::of([&follower], self.stall_after)));
                    continue;
                }
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
        self.probes
            .set(Probe::Ended("the watch is stopping".into()));
        follower.stop_within(Duration::from_secs(5)).await?;
        Ok(())
    }
}
