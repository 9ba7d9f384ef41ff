//! The port conformance suite, instantiated with the memory adapter.

use std::time::Duration;

use tidemark::conformance as c;
use tidemark::tidemark_core::Legs;
use tidemark_memory::{
    Memory, MemoryEvents, MemoryLock, MemoryQueue, MemorySchedules, MemorySource, MemoryWake,
};

macro_rules! conformance {
    ($($name:ident => $port:expr $(, $arg:expr)*;)*) => {$(
        #[tokio::test(start_paused = true)]
        async fn $name() {
            c::$name(&$port $(, $arg)*).await;
        }
    )*};
}

conformance! {
    source_puts_typed_values_as_json => MemorySource::default();
    source_seqs_increase => MemorySource::default();
    source_get_returns_value_and_seq => MemorySource::default();
    source_get_at_reads_the_watermark_with_the_value => MemorySource::default();
    source_update_is_compare_and_set => MemorySource::default();
    source_update_of_a_removed_key_expects_zero => MemorySource::default();
    source_remove_absent_is_none => MemorySource::default();
    source_changes_cover_removals => MemorySource::default();
    source_changes_since_watermark_is_empty => MemorySource::default();
    source_lists_its_present_keys => MemorySource::default();
    source_snapshot_is_current => MemorySource::default();
    source_snapshot_parts_are_one_point_in_time => MemorySource::default();
    source_reads_hold_keys_overwritten_meanwhile => MemorySource::default(), 200;
    source_refuses_invalid_keys => MemorySource::default();
    source_writes_refuse_what_followers_refuse => MemorySource::default();
    change_log_replays_then_follows => MemorySource::default();
    change_log_states_its_history_at_the_watermark_on_open => MemorySource::default();
    events_deliver_published_in_order => MemoryEvents::default();
    cursors_are_monotone => MemoryEvents::default();
    wake_reaches_listeners => MemoryWake::default();
    queue_round_trip => MemoryQueue::default();
    queue_lease_expiry_redelivers => MemoryQueue::default(), Duration::from_millis(100);
    queue_dead_letters_after_max_attempts => MemoryQueue::default().with_max_attempts(3), 3;
    queue_renew_extends_a_lease => MemoryQueue::default(), Duration::from_millis(100);
    queue_dead_letters_list_and_requeue => MemoryQueue::default();
    queue_stale_lease_cannot_act_after_requeue =>
        MemoryQueue::default().with_max_attempts(1), Duration::from_millis(100);
    queue_counts_by_state => MemoryQueue::default();
    queue_expired_lease_cannot_finish_its_job => MemoryQueue::default(), Duration::from_millis(100);
    queue_dead_lease_cannot_ack =>
        MemoryQueue::default().with_max_attempts(1), Duration::from_millis(100);
    queue_requeued_dead_letter_coalesces => MemoryQueue::default();
    queue_coalesces_pending_jobs_per_key => MemoryQueue::default();
    queue_leases_sweeps_first => MemoryQueue::default();
    runner_wakes_on_enqueue => MemoryQueue::default();
    events_publish_batch_in_order => MemoryEvents::default();
    queue_removes_finished_jobs_past_retention => MemoryQueue::default(), Duration::from_secs(60);
    runner_renews_a_slow_jobs_lease => MemoryQueue::default(), Duration::from_millis(300);
    runner_dead_letters_what_it_cannot_run => MemoryQueue::default();
    runner_crash_redelivers_its_job => MemoryQueue::default(), Duration::from_millis(300);
    lock_is_exclusive_and_expires => MemoryLock::default(), Duration::from_millis(100);
    lock_for_ever_is_held => MemoryLock::default();
    lock_taken_again_by_its_owner_is_a_new_lease => MemoryLock::default();
    queue_lease_for_ever_holds_the_job => MemoryQueue::default();
    schedule_mark_fired_is_compare_and_set => MemorySchedules::default();
    schedule_mark_fired_refuses_a_replaced_schedule => MemorySchedules::default();
    schedule_replace_and_remove => MemorySchedules::default();
    schedule_cron_fires_each_tick_once => MemorySchedules::default(), &MemoryQueue::default();
    schedule_claimed_tick_fires_once_across_crashes =>
        MemorySchedules::default(), &MemoryQueue::default();
}

#[tokio::test(start_paused = true)]
async fn sweep_refuses_a_stale_fence() {
    let m = Memory::new();
    let sweep = m.sweeper(tidemark::RetentionPolicy::default());
    c::sweep_refuses_a_stale_fence(&m.lock, &sweep, Duration::from_millis(100)).await;
}

#[tokio::test(start_paused = true)]
async fn outbox_claims_are_exclusive_and_expire() {
    let m = Memory::new();
    let announced = m.announced_source(Legs::default());
    c::outbox_claims_are_exclusive_and_expire(&m.outbox, &announced, Duration::from_millis(100))
        .await;
}

#[tokio::test(start_paused = true)]
async fn prefix_view_carries_only_its_keys() {
    let whole = MemorySource::default();
    let view = whole.with_prefix("orders.").unwrap();
    c::prefix_view_carries_only_its_keys(&whole, &view).await;
}

#[tokio::test(start_paused = true)]
async fn prefix_follower_holds_exactly_its_keys() {
    let whole = MemorySource::default();
    let view = whole.with_prefix("orders.").unwrap();
    let compacted = whole.clone();
    c::prefix_follower_holds_exactly_its_keys(whole, view, |seq| async move {
        compacted.compact_below(seq);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_restarted_follower_takes_a_restored_history() {
    let source = MemorySource::default();
    tidemark::Source::put(&source, "early", b"e".to_vec())
        .await
        .unwrap();
    let backup = source.backup();
    let restored = source.clone();
    c::a_restarted_follower_takes_a_new_history(source, || async move {
        restored.restore(&backup);
        restored
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_restarted_follower_takes_a_restored_history_compacted_past_its_watermark() {
    let source = MemorySource::default();
    tidemark::Source::put(&source, "early", b"e".to_vec())
        .await
        .unwrap();
    let backup = source.backup();
    let restored = source.clone();
    c::a_restarted_follower_takes_a_restored_history_compacted_past_its_watermark(
        source,
        || async move {
            restored.restore(&backup);
            restored
        },
        |source: MemorySource, below| async move {
            source.compact_below(below);
        },
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_restarted_follower_takes_a_recreated_history() {
    let source = MemorySource::default();
    let recreated = source.clone();
    c::a_restarted_follower_takes_a_new_history(source, || async move {
        recreated.recreate();
        recreated
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_running_follower_takes_a_restored_history() {
    let source = MemorySource::default();
    tidemark::Source::put(&source, "early", b"e".to_vec())
        .await
        .unwrap();
    let backup = source.backup();
    let restored = source.clone();
    c::a_running_follower_takes_a_new_history(source, || async move {
        restored.restore(&backup);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_running_follower_takes_a_recreated_history() {
    let source = MemorySource::default();
    let recreated = source.clone();
    c::a_running_follower_takes_a_new_history(source, || async move {
        recreated.recreate();
    })
    .await;
}

/// Reads `n` entries off `source`'s change log from `from`: (seq, pending) of each.
async fn pending_counts(source: &MemorySource, from: u64, n: usize) -> Vec<(u64, Option<u64>)> {
    use tidemark::{Feed, FeedItem, FeedStream};
    let mut stream = source
        .open(from, None)
        .await
        .expect("the feed opens")
        .stream;
    let mut read = Vec::new();
    while read.len() < n {
        match stream.next().await {
            Some(Ok(FeedItem::Entry(e))) => read.push((e.seq, e.pending)),
            other => panic!("expected an entry, got {other:?}"),
        }
    }
    read
}

#[tokio::test(start_paused = true)]
async fn the_change_log_says_how_many_entries_follow_each_and_a_view_does_not() {
    use tidemark::Source;
    let source = MemorySource::default();
    for key in ["a/1", "b/1", "a/2", "b/2", "a/3"] {
        source.put(key, b"v".to_vec()).await.unwrap();
    }
    // A follower's initial sync presizes its index and cache by this count.
    assert_eq!(
        pending_counts(&source, 1, 5).await,
        [
            (1, Some(4)),
            (2, Some(3)),
            (3, Some(2)),
            (4, Some(1)),
            (5, Some(0))
        ]
    );
    assert_eq!(
        pending_counts(&source, 4, 2).await,
        [(4, Some(1)), (5, Some(0))]
    );
    // A view over a prefix cannot tell how many of the entries after one are its own.
    let view = source.with_prefix("a/").unwrap();
    assert_eq!(
        pending_counts(&view, 1, 3).await,
        [(1, None), (3, None), (5, None)]
    );
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_shares_each_key_with_the_log_instead_of_copying_it() {
    use std::sync::Arc;
    use tidemark::{Feed, FeedItem, FeedStream, Source};
    let source = MemorySource::default();
    source.put("a", b"1".to_vec()).await.unwrap();
    source.put("a", b"2".to_vec()).await.unwrap();
    source.put("b", b"3".to_vec()).await.unwrap();
    // A resync holds the whole snapshot beside the cache: a key copied per entry would
    // be one more allocation per key at its peak (the memory bench).
    let snapshot = source.snapshot().await.unwrap().entries;
    let mut stream = source.open(1, None).await.unwrap().stream;
    let mut logged = Vec::new();
    for _ in 0..3 {
        match stream.next().await {
            Some(Ok(FeedItem::Entry(e))) => logged.push(e.key),
            other => panic!("expected an entry, got {other:?}"),
        }
    }
    assert!(
        Arc::ptr_eq(&logged[0], &logged[1]),
        "one key, one allocation"
    );
    assert!(Arc::ptr_eq(&snapshot[0].key, &logged[0]));
    assert!(Arc::ptr_eq(&snapshot[1].key, &logged[2]));
}

/// A naive source: it reads the whole source page by page in seq order, each page a read
/// of its own, up to the head it saw first, keeping only the latest change per key, as a
/// replay of a history-1 NATS bucket did before it read on to the catch-up. A key
/// overwritten past that head before its page came is in no page.
struct PagedToFirstHead(MemorySource);

impl PagedToFirstHead {
    async fn paged(
        &self,
        since: u64,
    ) -> tidemark::Result<(Vec<tidemark::tidemark_core::Entry>, u64)> {
        use tidemark::{Changes, Source};
        let head = self.0.watermark().await?;
        let (mut cursor, mut latest) = (since, std::collections::BTreeMap::new());
        loop {
            let Changes::Since { entries, .. } = self.0.changes_since(cursor).await? else {
                unreachable!("nothing is compacted in these tests");
            };
            let page: Vec<_> = entries
                .into_iter()
                .filter(|e| e.seq <= head)
                .take(10)
                .collect();
            let Some(last) = page.last() else { break };
            cursor = last.seq;
            for e in page {
                latest.insert(e.key.clone(), e);
            }
            tokio::task::yield_now().await;
        }
        Ok((latest.into_values().collect(), head))
    }
}

impl tidemark::Source for PagedToFirstHead {
    async fn put(&self, key: &str, value: Vec<u8>) -> tidemark::Result<u64> {
        self.0.put(key, value).await
    }
    async fn update(&self, key: &str, value: Vec<u8>, expected: u64) -> tidemark::Result<u64> {
        self.0.update(key, value, expected).await
    }
    async fn remove(&self, key: &str) -> tidemark::Result<Option<u64>> {
        self.0.remove(key).await
    }
    async fn watermark(&self) -> tidemark::Result<u64> {
        self.0.watermark().await
    }
    async fn changes_since(&self, since: u64) -> tidemark::Result<tidemark::Changes> {
        let (mut entries, watermark) = self.paged(since).await?;
        entries.sort_by_key(|e| e.seq);
        Ok(tidemark::Changes::Since { entries, watermark })
    }
    async fn snapshot(&self) -> tidemark::Result<tidemark::Snapshot> {
        use tidemark::tidemark_core::Op;
        let (entries, watermark) = self.paged(0).await?;
        let entries = entries.into_iter().filter(|e| e.op == Op::Put).collect();
        Ok(tidemark::Snapshot {
            entries,
            watermark,
            lineage: Default::default(),
        })
    }
    async fn get(&self, key: &str) -> tidemark::Result<Option<tidemark::Versioned>> {
        self.0.get(key).await
    }
    async fn first_available(&self) -> tidemark::Result<u64> {
        self.0.first_available().await
    }
}

/// The body has teeth: a source that reads page by page up to its first head, as the NATS
/// replay did, fails it.
#[tokio::test(start_paused = true)]
async fn reads_that_stop_at_their_first_head_fail_the_overwrite_body() {
    use futures::FutureExt;
    let naive = PagedToFirstHead(MemorySource::default());
    let result =
        std::panic::AssertUnwindSafe(c::source_reads_hold_keys_overwritten_meanwhile(&naive, 200))
            .catch_unwind()
            .await;
    let message = result
        .expect_err("a read that stops at its first head loses overwritten keys")
        .downcast::<String>()
        .map(|m| *m)
        .unwrap_or_default();
    assert!(
        message.contains("reads missing keys"),
        "it fails for the keys it lost: {message}"
    );
}

/// An outbox claim for `Duration::MAX` holds its rows for ever: no overflow panic on the
/// instant it would end at, and no other relay gets them.
#[tokio::test(start_paused = true)]
async fn an_outbox_claim_for_ever_holds_its_rows() {
    use tidemark::{Outbox, Source};
    let m = Memory::new();
    let announced = m.announced_source(Legs::default());
    announced.put("k", b"v".to_vec()).await.unwrap();
    let mine = m.outbox.claim("a", 0, 10, Duration::MAX).await.unwrap();
    assert_eq!(mine.rows.len(), 1, "the one row is claimed");
    tokio::time::sleep(Duration::from_secs(86_400 * 365)).await;
    let theirs = m
        .outbox
        .claim("b", 0, 10, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(theirs.rows.is_empty(), "a year on, still held: {theirs:?}");
}

/// Removes racing each other over one key commit one removal for each put: the change log
/// never holds a removal of a key that was already removed. (Four threads put and remove
/// one key as fast as they can; the old check-then-commit, under two locks, logged double
/// removals within a few thousand operations.)
#[test]
fn racing_removes_of_a_key_commit_one_removal() {
    use tidemark::tidemark_core::Op;
    use tidemark::{Feed, FeedItem, FeedStream, Source};
    const OPS: u32 = 100_000;
    let source = MemorySource::default();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let source = source.clone();
            std::thread::spawn(move || {
                for i in 0..OPS {
                    if (i + t) % 2 == 0 {
                        futures::executor::block_on(source.put("k", b"v".to_vec())).unwrap();
                    } else {
                        futures::executor::block_on(source.remove("k")).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let watermark = futures::executor::block_on(source.watermark()).unwrap();
    let ops: Vec<Op> = futures::executor::block_on(async {
        let mut stream = source.open(1, None).await.unwrap().stream;
        let mut ops = Vec::new();
        while (ops.len() as u64) < watermark {
            match stream.next().await {
                Some(Ok(FeedItem::Entry(e))) => ops.push(e.op),
                other => panic!("the log ended early: {other:?}"),
            }
        }
        ops
    });
    let doubles = ops
        .windows(2)
        .filter(|w| w[0] == Op::Delete && w[1] == Op::Delete)
        .count();
    assert_eq!(
        doubles, 0,
        "removals of a key already removed, in {watermark} logged changes"
    );
}
