//! The `tidemark` binary over a SQLite registry file: `watch` prints changes as another
//! process writes them, `mirror` keeps a cache file, `status` shows both files.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::Source;
use tidemark::tidemark_core::Legs;
use tidemark_sqlite::SqliteDb;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_mirror_and_status_over_a_sqlite_registry() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("reg.db");
    let cache = dir.path().join("cache.db");
    let db = SqliteDb::open(&reg).await.unwrap();
    let source = db.announced_source(Legs::default());
    source.put("a", b"1".to_vec()).await.unwrap();
    source.put("b", b"2".to_vec()).await.unwrap();
    let reg_arg = reg.to_str().unwrap();

    let mut watch = Running::start(bin().args(["watch", reg_arg]));
    watch.wait_line("ready   2 keys at revision 2", LIMIT);
    let mut mirror =
        Running::start(bin().args(["mirror", reg_arg, "--into", cache.to_str().unwrap()]));
    mirror.wait_line("mirror ready", LIMIT);

    // Written by this process; the others hear of it through the file.
    source.put("c", b"3".to_vec()).await.unwrap();
    source.remove("a").await.unwrap();
    watch.wait_line("put     c @3 = 3", LIMIT);
    watch.wait_line("removed a @4", LIMIT);
    assert!(
        !watch.seen.iter().any(|l| l.starts_with("put     a")),
        "the initial sync is summed up, not printed key by key: {:?}",
        watch.seen
    );
    eventually("the mirror caught up", LIMIT, || {
        follower(&status_json(&cache), "mirror-reg").and_then(|f| f["watermark"].as_u64())
            == Some(4)
    });

    let (exit, printed) = watch.terminate(LIMIT);
    assert!(exit.success(), "{printed}");
    let (exit, printed) = mirror.terminate(LIMIT);
    assert!(exit.success(), "{printed}");

    let text = run(&["status", cache.to_str().unwrap()]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains(
            "follower     mirror-reg: revision 4, 2 keys, 1 starts (0 warm), last start cold"
        ),
        "{text}"
    );
    assert!(
        text.contains("last start cold, history "),
        "the mirror shows the registry's history it follows: {text}"
    );
    let reg_status = status_json(&reg);
    assert_eq!(reg_status["registry"]["watermark"], 4);
    assert_eq!(reg_status["registry"]["keys"], 2);
    assert_eq!(reg_status["registry"]["tombstones"], 1);
    assert_eq!(
        reg_status["outbox"]["pending"], 4,
        "no relay ran: every announced write waits in the outbox"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_mirrors_and_watches_only_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("reg.db");
    let cache = dir.path().join("cache.db");
    let source = SqliteDb::open(&reg).await.unwrap().source();
    for key in ["pkg/a", "pkg/b", "doc/x"] {
        source.put(key, b"1".to_vec()).await.unwrap();
    }
    let reg_arg = reg.to_str().unwrap();
    let mut watch = Running::start(bin().args(["watch", reg_arg, "--prefix", "pkg/"]));
    watch.wait_line("ready   2 keys", LIMIT);
    let mut mirror = Running::start(bin().args([
        "mirror",
        reg_arg,
        "--into",
        cache.to_str().unwrap(),
        "--prefix",
        "pkg/",
    ]));
    mirror.wait_line("mirror ready", LIMIT);
    source.put("doc/y", b"2".to_vec()).await.unwrap();
    source.put("pkg/c", b"2".to_vec()).await.unwrap();
    watch.wait_line("put     pkg/c @5 = 2", LIMIT);
    eventually("the prefix mirror holds pkg/c", LIMIT, || {
        follower(&status_json(&cache), "mirror-reg[pkg/]").and_then(|f| f["keys"].as_u64())
            == Some(3)
    });
    let (_, printed) = watch.terminate(LIMIT);
    assert!(
        !printed.contains("doc/"),
        "only the prefix's keys: {printed}"
    );
    mirror.terminate(LIMIT);

    let out = run(&["watch", reg_arg, "--prefix", ""]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with("tidemark: "))
            .count(),
        1,
        "{stderr}"
    );
}
