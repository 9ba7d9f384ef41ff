//! `tidemark`: the command-line face of the tidemark library.
//!
//! - `tidemark mirror SOURCE --into cache.db` keeps a local SQLite cache of a NATS KV
//!   bucket (`nats://host:port/BUCKET`) or a tidemark SQLite registry converged, restarts
//!   warm, shows the initial sync's progress, serves Prometheus metrics and the
//!   `/healthz` and `/readyz` probes with `--metrics`, and stops gracefully on SIGTERM or
//!   Ctrl-C. A source that does not exist is an error at once, unless
//!   `--wait-for-source`.
//! - `tidemark status FILE [--json]` shows what a tidemark SQLite file holds.
//! - `tidemark watch SOURCE` prints changes as they arrive.
//! - `tidemark get FILE KEY`, `tidemark ls FILE`, `tidemark dump FILE [--json]` read the
//!   entries a tidemark file holds (a mirror's cache or the registry), read-only.
//! - `tidemark verify SOURCE FILE` compares a mirror with its source: exit 0 when equal,
//!   1 when not, 2 when they cannot be compared.
//! - `tidemark jobs list|dead|requeue QUEUE` shows a job queue's counts and dead letters
//!   and puts dead letters back to work, on a SQLite file or a NATS work-queue stream.
//!
//! Logs go to stderr, filtered by `RUST_LOG`. A failure is one line on stderr and a
//! non-zero exit: 2 for bad arguments, 1 for anything else.
#![forbid(unsafe_code)]

mod endpoint;
mod error;
mod jobs;
mod mirror;
mod output;
mod read;
mod source;
mod status;
mod verify;
mod watch;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::CliError;
use crate::output::Screen;

/// Keep local caches converged with a NATS bucket or a SQLite registry, and look inside
/// tidemark files.
#[derive(Parser, Debug)]
#[command(name = "tidemark", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Mirror a NATS bucket or SQLite registry into a local SQLite cache file (restarts
    /// warm; stops on SIGTERM or Ctrl-C).
    Mirror(mirror::MirrorArgs),
    /// Show what a tidemark SQLite file holds: followers and their watermarks, outbox,
    /// queue and dead letters, schedules, locks.
    Status(status::StatusArgs),
    /// Print a source's changes as they arrive.
    Watch(watch::WatchArgs),
    /// A job queue (SQLite file or NATS): counts, dead letters, requeue.
    #[command(subcommand)]
    Jobs(jobs::JobsCommand),
    /// Print one key's value from a tidemark file (a mirror's cache or the registry).
    Get(read::GetArgs),
    /// List the keys a tidemark file holds (a mirror's cache or the registry).
    Ls(read::LsArgs),
    /// Print every entry a tidemark file holds: key, revision, value.
    Dump(read::DumpArgs),
    /// Compare a mirror with its source: exit 0 when equal, 1 when not, 2 when they
    /// cannot be compared.
    Verify(verify::VerifyArgs),
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT) with the signal's name.
pub(crate) async fn stop_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                biased;
                _ = tokio::signal::ctrl_c() => "interrupted",
                _ = term.recv() => "terminated",
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                "interrupted"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "interrupted"
    }
}

async fn run(cli: Cli, screen: &Screen) -> Result<(), CliError> {
    match cli.command {
        Command::Mirror(args) => mirror::run(args, screen).await,
        Command::Status(args) => status::run(&args).await,
        Command::Watch(args) => watch::run(args).await,
        Command::Jobs(cmd) => jobs::run(cmd).await,
        Command::Get(args) => read::get(args).await,
        Command::Ls(args) => read::ls(args).await,
        Command::Dump(args) => read::dump(args).await,
        Command::Verify(args) => verify::run(args).await,
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // `tidemark` alone: the help is the answer, but the command did nothing.
            let _ = e.print();
            return ExitCode::from(2);
        }
        Err(e) => {
            // clap's first paragraph says what is wrong; the usage it adds is one --help
            // away.
            let text = e.to_string();
            let what: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let what = what.join(" ");
            let what = what.strip_prefix("error: ").unwrap_or(&what);
            eprintln!("tidemark: {what} (see tidemark --help)");
            return ExitCode::from(2);
        }
    };
    let screen = Screen::default();
    output::init_logging(&screen);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tidemark: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli, &screen)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tidemark: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
