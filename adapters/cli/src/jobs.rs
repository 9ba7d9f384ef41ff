//! `tidemark jobs list|dead|requeue`: a job queue's counts, its dead letters, and
//! dead letters put back to work — on a SQLite file or a NATS work-queue stream.

use clap::{Args, Subcommand};
use serde_json::{Value, json};
use tidemark::{JobId, JobRecord, Queue};
use tidemark_nats::NatsQueue;

use crate::error::CliError;
use crate::source::{NatsAuth, SourceSpec, connect, open_existing};

/// `tidemark jobs`'s subcommands.
#[derive(Subcommand, Debug)]
pub enum JobsCommand {
    /// How many jobs are ready, leased, done and dead-lettered.
    List(QueueArgs),
    /// The dead letters: id, kind, attempts, last error.
    Dead {
        #[command(flatten)]
        queue: QueueArgs,
        /// Show at most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Makes dead letters ready again, with fresh attempts.
    Requeue {
        #[command(flatten)]
        queue: QueueArgs,
        /// The dead letters to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<u64>,
        /// Requeue every dead letter.
        #[arg(long)]
        all: bool,
    },
}

/// Which queue.
#[derive(Args, Debug)]
pub struct QueueArgs {
    /// A tidemark SQLite file, or `nats://host:port/QUEUE` (the queue's stream name).
    pub queue: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// On NATS: leases per job before it is dead-lettered (as the queue's runners use).
    #[arg(long, default_value_t = 5)]
    pub max_attempts: u32,
    #[command(flatten)]
    pub auth: NatsAuth,
}

/// Runs a `jobs` subcommand.
pub async fn run(cmd: JobsCommand) -> Result<(), CliError> {
    let args = match &cmd {
        JobsCommand::List(q)
        | JobsCommand::Dead { queue: q, .. }
        | JobsCommand::Requeue { queue: q, .. } => q,
    };
    match SourceSpec::parse(&args.queue)? {
        SourceSpec::Sqlite(path) => {
            let queue = open_existing(&path).await?.queue();
            on(queue, &cmd).await
        }
        spec @ SourceSpec::Nats { .. } => {
            let (client, name) = connect(&spec, &args.auth, "tidemark-jobs").await?;
            // Opening creates a queue that is missing: a typo must not make one.
            let js = async_nats::jetstream::new(client.clone());
            if js.get_stream(&name).await.is_err() {
                return Err(CliError::Usage(format!(
                    "no job queue {name:?} on the server"
                )));
            }
            let queue = NatsQueue::open(client, &name, args.max_attempts).await?;
            on(queue, &cmd).await
        }
    }
}

fn record(r: &JobRecord) -> Value {
    let job: Value = r
        .job
        .encode()
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or(Value::Null);
    json!({
        "id": r.id.0,
        "kind": r.job.kind(),
        "attempts": r.attempts,
        "last_error": r.last_error,
        "job": job,
    })
}

async fn on<Q: Queue>(queue: Q, cmd: &JobsCommand) -> Result<(), CliError> {
    match cmd {
        JobsCommand::List(args) => {
            let c = queue.counts().await?;
            if args.json {
                let counts = json!({ "ready": c.ready, "leased": c.leased, "done": c.done, "dead_letters": c.dead });
                println!("{counts}");
            } else {
                println!(
                    "{} ready, {} leased, {} done, {} dead letters",
                    c.ready, c.leased, c.done, c.dead
                );
            }
        }
        JobsCommand::Dead { queue: args, limit } => {
            let dead = queue.dead_letters(None, *limit).await?;
            if args.json {
                println!("{}", Value::Array(dead.iter().map(record).collect()));
            } else if dead.is_empty() {
                println!("no dead letters");
            } else {
                for r in &dead {
                    let error = r.last_error.as_deref().unwrap_or("-");
                    println!(
                        "{:>8}  {:<20} {} attempts  {error}",
                        r.id.0,
                        r.job.kind(),
                        r.attempts
                    );
                }
            }
        }
        JobsCommand::Requeue { ids, all, .. } => {
            let ids: Vec<JobId> = if *all {
                let mut ids = Vec::new();
                let mut after = None;
                loop {
                    let page = queue.dead_letters(after, 1000).await?;
                    let Some(last) = page.last() else { break };
                    after = Some(last.id);
                    ids.extend(page.iter().map(|r| r.id));
                }
                ids
            } else {
                ids.iter().copied().map(JobId).collect()
            };
            for id in &ids {
                let now = queue.requeue(*id).await?;
                if now == *id {
                    println!("requeued {}", id.0);
                } else {
                    println!("requeued {} as {}", id.0, now.0);
                }
            }
            if ids.is_empty() {
                println!("no dead letters");
            }
        }
    }
    Ok(())
}
