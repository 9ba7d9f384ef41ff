//! `tidemark jobs list|dead|requeue` on a SQLite file and on a NATS work-queue stream.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use serde_json::Value;
use tidemark::tidemark_core::Job;
use tidemark::{JobState, Queue};
use tidemark_nats::NatsQueue;
use tidemark_sqlite::{Options, SqliteDb};

use common::*;

/// Leases the next job and fails it: with one attempt allowed, it is dead-lettered.
async fn kill_next<Q: Queue>(q: &Q) {
    let lease = q.lease(Duration::from_secs(30)).await.unwrap().unwrap();
    let state = q.fail(&lease, "disk full", Duration::ZERO).await.unwrap();
    assert_eq!(state, JobState::DeadLettered);
}

fn json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn text(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The same commands, whichever queue `target` names.
fn list_dead_requeue(target: &str, extra: &[&str], dead_id: u64) {
    let with = |args: &[&str]| -> Vec<String> {
        args.iter().chain(extra).map(|s| (*s).to_owned()).collect()
    };
    let args = with(&["jobs", "list", target, "--json"]);
    let counts = json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(counts["dead_letters"], 1, "{counts}");
    assert_eq!(counts["ready"], 1, "{counts}");

    let args = with(&["jobs", "dead", target, "--json"]);
    let dead = json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(dead.as_array().map(Vec::len), Some(1), "{dead}");
    assert_eq!(dead[0]["id"], dead_id);
    assert_eq!(dead[0]["kind"], "pack_housekeeping");
    assert_eq!(dead[0]["last_error"], "disk full");
    assert_eq!(dead[0]["job"]["key"], "pkg/a");

    let args = with(&["jobs", "dead", target]);
    let shown = text(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        shown.contains("pack_housekeeping") && shown.contains("disk full"),
        "{shown}"
    );

    let args = with(&["jobs", "requeue", target, "--all"]);
    let requeued = text(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        requeued.starts_with(&format!("requeued {dead_id}")),
        "{requeued}"
    );
    let args = with(&["jobs", "list", target, "--json"]);
    let counts = json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(counts["dead_letters"], 0, "{counts}");
    assert_eq!(
        counts["ready"], 2,
        "a requeued dead letter is ready again: {counts}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_on_a_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reg.db");
    let options = Options {
        max_attempts: 1,
        ..Options::default()
    };
    let db = SqliteDb::open_with(&path, options).await.unwrap();
    let q = db.queue();
    let key = "pkg/a".to_owned();
    let id = q.enqueue(Job::PackHousekeeping { key }).await.unwrap();
    // A job of the user's beside it (a sweep would be leased first).
    q.enqueue(Job::decode(br#"{"kind":"reindex"}"#).unwrap())
        .await
        .unwrap();
    kill_next(&q).await;
    drop(db);
    list_dead_requeue(path.to_str().unwrap(), &[], id.0);

    let out = run(&["jobs", "requeue", path.to_str().unwrap(), "999"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a job that is not a dead letter"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("999"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_on_a_nats_queue() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    tidemark_tests::wait_jetstream_ready(&client).await.unwrap();
    let q = NatsQueue::open(client, "maintenance", 1).await.unwrap();
    let key = "pkg/a".to_owned();
    let id = q.enqueue(Job::PackHousekeeping { key }).await.unwrap();
    // A job of the user's beside it (a sweep would be leased first).
    q.enqueue(Job::decode(br#"{"kind":"reindex"}"#).unwrap())
        .await
        .unwrap();
    kill_next(&q).await;
    let target = format!("{}/maintenance", server.url());
    list_dead_requeue(&target, &["--max-attempts", "1"], id.0);

    let missing = format!("{}/nosuchqueue", server.url());
    let out = run(&["jobs", "list", &missing]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no job queue \"nosuchqueue\""), "{stderr}");
}
