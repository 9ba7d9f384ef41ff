//! What goes wrong is one clear line on stderr and a non-zero exit — never a panic or a
//! backtrace: bad arguments, an unreachable server, refused credentials, a file that is
//! not a tidemark file. Secrets stay out of what it prints.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Output;
use std::time::Duration;

use tidemark_tests::{NatsServer, NatsServerOptions};

use common::*;

/// Asserts `out` failed with `code` and one line on stderr containing `what`.
fn one_line_failure(out: &Output, code: i32, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "exit code; stderr: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("tidemark: "))
        .collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    assert!(lines[0].contains(what), "{what:?} in {stderr}");
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "no {bad}: {stderr}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout");
    stderr
}

#[test]
fn bad_arguments_are_one_line_and_exit_2() {
    one_line_failure(&run(&["mirror"]), 2, "--into");
    one_line_failure(
        &run(&["mirror", "x.db", "--into", "y.db", "--bogus"]),
        2,
        "--bogus",
    );
    one_line_failure(&run(&["frobnicate"]), 2, "frobnicate");
    let dir = tempfile::tempdir().unwrap();
    let into = dir.path().join("c.db");
    let into = into.to_str().unwrap();
    one_line_failure(
        &run(&["mirror", "nats://127.0.0.1:4222", "--into", into]),
        2,
        "BUCKET",
    );
    one_line_failure(&run(&["mirror", "http://h/b", "--into", into]), 2, "scheme");
    one_line_failure(
        &run(&[
            "mirror",
            "nats://127.0.0.1:1/b",
            "--into",
            into,
            "--metrics",
            "nowhere",
        ]),
        1,
        "cannot serve metrics on nowhere",
    );
}

#[test]
fn an_unreachable_server_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let into = dir.path().join("c.db");
    // A port nothing listens on.
    let addr = free_addr();
    let out = run(&[
        "mirror",
        &format!("nats://{addr}/b"),
        "--into",
        into.to_str().unwrap(),
    ]);
    one_line_failure(&out, 1, "cannot connect to NATS server");
    let out = run(&["watch", &format!("nats://{addr}/b")]);
    one_line_failure(&out, 1, "cannot connect to NATS server");
}

#[test]
fn a_file_that_is_not_a_tidemark_file_is_one_line_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(
        &text,
        "not a database at all, just some text that is long enough",
    )
    .unwrap();
    one_line_failure(
        &run(&["status", text.to_str().unwrap()]),
        1,
        "not an SQLite database",
    );

    let foreign = dir.path().join("other.db");
    let c = rusqlite::Connection::open(&foreign).unwrap();
    c.execute_batch(
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY); INSERT INTO accounts VALUES (1);",
    )
    .unwrap();
    drop(c);
    let before = std::fs::read(&foreign).unwrap();
    for args in [
        vec!["status", foreign.to_str().unwrap()],
        vec!["watch", foreign.to_str().unwrap()],
        vec![
            "mirror",
            "nats://127.0.0.1:1/b",
            "--into",
            foreign.to_str().unwrap(),
        ],
    ] {
        one_line_failure(&run(&args), 1, "not a tidemark database");
    }
    assert_eq!(
        std::fs::read(&foreign).unwrap(),
        before,
        "a foreign file is never changed"
    );

    let empty = dir.path().join("empty.db");
    std::fs::write(&empty, "").unwrap();
    one_line_failure(
        &run(&["status", empty.to_str().unwrap()]),
        1,
        "not a tidemark database",
    );
    let missing = dir.path().join("missing.db");
    one_line_failure(
        &run(&["status", missing.to_str().unwrap()]),
        1,
        "missing.db",
    );
    assert!(!missing.exists(), "status never creates a file");
    one_line_failure(&run(&["watch", missing.to_str().unwrap()]), 1, "missing.db");
    assert!(!missing.exists(), "a missing registry is not made up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_only_reads_and_refuses_an_older_schema_without_migrating_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("reg.db");
    let db = tidemark_sqlite::SqliteDb::open(&file).await.unwrap();
    tidemark::Source::put(&db.source(), "a", b"1".to_vec())
        .await
        .unwrap();
    drop(db);
    // The last connection's close moves the WAL into the file; wait for it, so what is
    // compared below is the file at rest.
    let wal = dir.path().join("reg.db-wal");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!wal.exists(), "the closed file still has a WAL");
    let arg = file.to_str().unwrap().to_owned();
    let status = || {
        let arg = arg.clone();
        std::thread::spawn(move || run(&["status", &arg]))
            .join()
            .unwrap()
    };

    let before = std::fs::read(&file).unwrap();
    let out = status();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("revision 1"));
    assert!(
        std::fs::read(&file).unwrap() == before,
        "a look changes no byte"
    );
    let wal_len = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    assert_eq!(wal_len, 0, "a look writes nothing to the WAL either");

    // A file an older tidemark wrote (its process may still be running): status says so
    // and leaves it as it is; migrating is for the processes that use it.
    let older = tidemark_sqlite::SCHEMA_VERSION - 1;
    let c = rusqlite::Connection::open(&file).unwrap();
    c.pragma_update(None, "user_version", older).unwrap();
    drop(c);
    let before = std::fs::read(&file).unwrap();
    one_line_failure(&status(), 1, "older than this build");
    assert!(std::fs::read(&file).unwrap() == before, "not migrated");
    let c = rusqlite::Connection::open(&file).unwrap();
    let version: i64 = c
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, older);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_are_one_line_and_secrets_never_show() {
    let options = NatsServerOptions::new().user_password("mirror", "right-horse-battery");
    let server = match NatsServer::start_with(options).await {
        Ok(s) => s,
        Err(e) => panic!("a real nats-server is required for these tests: {e}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let into = dir.path().join("c.db");
    let into = into.to_str().unwrap();
    let source = format!("{}/packages", server.url());

    let out = bin()
        .args(["mirror", &source, "--into", into, "--user", "mirror"])
        .env("TIDEMARK_NATS_PASSWORD", "wrong-staple-secret")
        .output()
        .unwrap();
    let stderr = one_line_failure(&out, 1, "rejected the credentials");
    assert!(!stderr.contains("wrong-staple-secret"), "{stderr}");

    let with_url = source.replace("nats://", "nats://mirror:wrong-in-url@");
    let out = run(&["watch", &with_url]);
    let stderr = one_line_failure(&out, 1, "rejected the credentials");
    assert!(!stderr.contains("wrong-in-url"), "{stderr}");

    // The right password, from the environment: asked to wait, it connects and keeps
    // trying for the bucket (which does not exist yet) until stopped.
    let running = Running::start(
        bin()
            .args(["mirror", &source, "--into", into, "--user", "mirror"])
            .arg("--wait-for-source")
            .env("TIDEMARK_NATS_PASSWORD", "right-horse-battery"),
    );
    let mut running = running;
    running.wait_line("mirroring bucket packages", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(500));
    let (exit, printed) = running.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{exit:?}: {printed}");
    assert!(!printed.contains("right-horse-battery"), "{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_does_not_exist_is_one_line_naming_it_within_seconds() {
    let server = server().await;
    let client = server.connect().await.unwrap();
    // The bucket an operator meant; the command names one letter off.
    kv_bucket(&client, "packages").await;
    let dir = tempfile::tempdir().unwrap();
    let into = dir.path().join("c.db");
    let into = into.to_str().unwrap();
    let typo = format!("{}/pakages", server.url());
    for args in [
        vec!["mirror", &typo, "--into", into],
        vec!["watch", &typo],
        vec!["mirror", &typo, "--into", into, "--prefix", "pkg"],
    ] {
        let started = std::time::Instant::now();
        let out = run(&args);
        let took = started.elapsed();
        let stderr = one_line_failure(&out, 1, "bucket pakages does not exist");
        assert!(
            stderr.contains("--wait-for-source"),
            "says how to wait: {stderr}"
        );
        assert!(
            took < Duration::from_secs(10),
            "a typo is told within seconds, not waited for: {took:?}"
        );
    }

    let missing = dir.path().join("registry.db");
    let out = run(&["mirror", missing.to_str().unwrap(), "--into", into]);
    one_line_failure(&out, 1, "registry.db does not exist");
    assert!(!missing.exists(), "a missing registry is not made up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asked_to_wait_a_mirror_waits_for_its_registry_file() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("later.db");
    let into = dir.path().join("c.db");
    let mut mirror = Running::start(bin().args([
        "mirror",
        reg.to_str().unwrap(),
        "--into",
        into.to_str().unwrap(),
        "--wait-for-source",
    ]));
    mirror.wait_line(
        "does not exist (yet): waiting for it",
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(!reg.exists(), "waiting never creates the registry");
    let db = tidemark_sqlite::SqliteDb::open(&reg).await.unwrap();
    tidemark::Source::put(&db.source(), "a", b"1".to_vec())
        .await
        .unwrap();
    mirror.wait_line("mirror ready", Duration::from_secs(30));
    eventually(
        "the mirror holds the registry's key",
        Duration::from_secs(30),
        || {
            follower(&status_json(&into), "mirror-later").and_then(|f| f["keys"].as_u64())
                == Some(1)
        },
    );
    let (exit, printed) = mirror.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{printed}");
}
