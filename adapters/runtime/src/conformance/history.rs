//! Conformance bodies for one history across restarts: a source recreated, or restored
//! from a backup, and written past a follower's watermark is taken as the new history it
//! is — by a follower that was down meanwhile (it kept what it knew of the history with
//! its watermark) and by one that kept running.

use std::future::Future;
use std::time::Duration;

use tidemark_core::{FollowerConfig, Status, Utf8};

use super::prefix::{cached, converges, restart_warm, snapshot_of};
use crate::cache::{Cache, cache};
use crate::follower::FollowerTask;
use crate::follower::handle::FollowerHandle;
use crate::ports::{Feed, Source};

/// Writes `n` mutations to `source` (puts of `hist.k0`…`hist.k7` with `tag`, every third
/// a removal of a key it holds) and returns its watermark after them.
async fn write<S: Source>(source: &S, n: u64, tag: &str) -> u64 {
    let mut last = source.watermark().await.unwrap();
    for i in 0..n {
        let key = format!("hist.k{}", i % 8);
        if i % 3 == 2 && source.get(&key).await.unwrap().is_some() {
            last = source.remove(&key).await.unwrap().unwrap_or(last);
        } else {
            last = source
                .put(&key, format!("{tag}-{i}").into_bytes())
                .await
                .unwrap();
        }
    }
    last
}

fn config() -> FollowerConfig {
    FollowerConfig::builder("history").seed(11).build().unwrap()
}

/// Writes the first history (12 mutations, "old") and follows it until the cache equals
/// the source: the running follower, its cache, and the source's watermark.
async fn follow_the_first_history<S>(source: &S) -> (FollowerHandle, Cache<String>, u64)
where
    S: Source + Feed + Clone + 'static,
{
    let watermark = write(source, 12, "old").await;
    let (writer, reader) = cache::<String>();
    let handle = FollowerTask::new(config(), Utf8, source.clone(), source.clone(), writer).spawn();
    converges(
        &reader,
        &snapshot_of(source).await,
        "the first history is followed",
    )
    .await;
    (handle, reader, watermark)
}

/// Restarts the follower stopped at `before` warm over `source` from what a durable sink
/// gives back (its rows, watermark and lineage) and waits until its cache equals the
/// source (`why` says what that proves); the follower's last status and its cache.
async fn restart_and_converge<S>(
    source: &S,
    reader: &Cache<String>,
    before: &Status,
    why: &str,
) -> (Status, Cache<String>)
where
    S: Source + Feed + Clone + 'static,
{
    let (writer, reader, core) = restart_warm(config(), reader, before).await;
    let handle = FollowerTask::from_core(core, source.clone(), source.clone(), writer).spawn();
    converges(&reader, &snapshot_of(source).await, why).await;
    let after = handle.stop_within(Duration::from_secs(10)).await.unwrap();
    assert_eq!(cached(&reader), snapshot_of(source).await);
    (after, reader)
}

/// A persisted follower is stopped at watermark W; `replace` recreates the source, or
/// restores a backup taken before the body began (so below W), and returns a handle on
/// the new source; the new source is written past W; the follower restarts warm from what
/// it persisted — its cache, W and what it knew of the history there — and its cache
/// becomes the new source's exactly, with the reset counted. Without the history check it
/// would resume from W+1 and keep every key the old history left at or below W.
pub async fn a_restarted_follower_takes_a_new_history<S, R, Fut>(source: S, replace: R)
where
    S: Source + Feed + Clone + 'static,
    R: FnOnce() -> Fut,
    Fut: Future<Output = S>,
{
    let (handle, reader, _) = follow_the_first_history(&source).await;
    let before: Status = handle.stop_within(Duration::from_secs(10)).await.unwrap();

    let source = replace().await;
    // The new history passes the old watermark by a few seqs: the follower's next seq is
    // another history's.
    while source.watermark().await.unwrap() <= before.watermark + 4 {
        write(&source, 5, "new").await;
    }

    // The persisted cache's restart: its rows, watermark and lineage, as a durable sink
    // gives them back.
    let (after, _) = restart_and_converge(
        &source,
        &reader,
        &before,
        "a follower restarted over a new history holds the new history, not the old one's keys",
    )
    .await;
    assert!(
        after.counters.resets >= 1,
        "taking a new history is a reset, counted: {after:?}"
    );
}

/// As [`a_restarted_follower_takes_a_new_history`], with the follower running while
/// `replace` recreates or restores the source in place (the follower's handle on the
/// source reads the new history afterwards) and the new history passes its watermark.
pub async fn a_running_follower_takes_a_new_history<S, R, Fut>(source: S, replace: R)
where
    S: Source + Feed + Clone + 'static,
    R: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let (handle, reader, watermark) = follow_the_first_history(&source).await;
    replace().await;
    while source.watermark().await.unwrap() <= watermark + 4 {
        write(&source, 5, "new").await;
    }
    let want = snapshot_of(&source).await;
    converges(
        &reader,
        &want,
        "a running follower holds the new history, not the old one's keys",
    )
    .await;
    let after = handle.stop_within(Duration::from_secs(10)).await.unwrap();
    assert!(
        after.counters.resets >= 1,
        "taking a new history is a reset, counted: {after:?}"
    );
}

/// A persisted follower is stopped at watermark W over a source backed up before the
/// body began (so below W); `restore` puts the backup back and returns a handle on the
/// restored source, whose next writes take the replaced history's seqs with other values
/// — the same keys at the same seqs. The restored source is written past W and
/// `compact(seq)` compacts its change log below its head, so nothing at W is left to tell
/// the two histories apart by stamp. The follower restarts warm and its cache becomes the
/// restored source's exactly: its resync puts every entry again rather than passing over
/// a key it holds at the same seq (a value of the replaced history would stay for good).
pub async fn a_restarted_follower_takes_a_restored_history_compacted_past_its_watermark<
    S,
    R,
    RFut,
    C,
    CFut,
>(
    source: S,
    restore: R,
    compact: C,
) where
    S: Source + Feed + Clone + 'static,
    R: FnOnce() -> RFut,
    RFut: Future<Output = S>,
    C: FnOnce(S, u64) -> CFut,
    CFut: Future<Output = ()>,
{
    let (handle, reader, _) = follow_the_first_history(&source).await;
    let before: Status = handle.stop_within(Duration::from_secs(10)).await.unwrap();

    // The same writes again, with other values: each key at the seq the replaced history
    // held it at (the last, at W, a removal: no key's current value tells its stamp).
    // Then on past W on other keys only, so the follower's keys stay at those seqs, and
    // the log compacted below the head.
    let source = restore().await;
    assert_eq!(write(&source, 12, "new").await, before.watermark);
    let mut head = before.watermark;
    for i in 0..8 {
        head = source
            .put(&format!("hist.later{i}"), b"later".to_vec())
            .await
            .unwrap();
    }
    compact(source.clone(), head).await;

    restart_and_converge(
        &source,
        &reader,
        &before,
        "a follower restarted over a restored history compacted past its watermark holds \
         the restored history's values",
    )
    .await;
}
