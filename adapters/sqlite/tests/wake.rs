//! The commit backstop on a freshly opened file: a write right after `open` wakes a
//! listener (the watcher's baseline was read by its thread once it ran, so a commit made
//! before that became the baseline and woke nobody: about 1 run in 10 lost its wake).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::{Received, Source, Wake, WakeListener};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_right_after_open_wakes_a_listener() {
    for round in 0..40 {
        let (_dir, _path, db) = common::fresh().await;
        let mut listener = db.wake().listen("any").await.unwrap();
        db.source().put("x", b"1".to_vec()).await.unwrap();
        let got = listener.recv_timeout(Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            got,
            Received::Wake(Vec::new()),
            "round {round}: the commit must wake the listener"
        );
    }
}
