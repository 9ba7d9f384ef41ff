//! The runtime's port conformance suite, instantiated for SQLite: the same test bodies the
//! memory adapter passes, each on a fresh database file. Real time, not paused: the commit
//! watcher is a thread, outside tokio's clock.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::Source;
use tidemark::conformance as c;
use tidemark::tidemark_core::Legs;
use tidemark_sqlite::SqliteDb;

/// Leases on the wall clock: every call is a synced commit, and a loaded machine must
/// finish the checks made under a lease inside it.
const REAL_LEASE: Duration = Duration::from_secs(1);

macro_rules! conformance {
    ($($name:ident => |$db:ident| $view:expr $(, $arg:expr)*;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let (_dir, _path, $db) = common::fresh().await;
            c::$name(&$view $(, $arg)*).await;
        }
    )*};
}

conformance! {
    source_puts_typed_values_as_json => |db| db.source();
    source_seqs_increase => |db| db.source();
    source_get_returns_value_and_seq => |db| db.source();
    source_get_at_reads_the_watermark_with_the_value => |db| db.source();
    source_update_is_compare_and_set => |db| db.source();
    source_update_of_a_removed_key_expects_zero => |db| db.source();
    source_remove_absent_is_none => |db| db.source();
    source_changes_cover_removals => |db| db.source();
    source_changes_since_watermark_is_empty => |db| db.source();
    source_lists_its_present_keys => |db| db.source();
    source_snapshot_is_current => |db| db.source();
    source_snapshot_parts_are_one_point_in_time => |db| db.source();
    source_reads_hold_keys_overwritten_meanwhile => |db| db.source(), 500;
    source_refuses_invalid_keys => |db| db.source();
    source_writes_refuse_what_followers_refuse => |db| db.source();
    change_log_replays_then_follows => |db| db.source();
    change_log_states_its_history_at_the_watermark_on_open => |db| db.source();
    events_deliver_published_in_order => |db| db.events();
    cursors_are_monotone => |db| db.events();
    wake_reaches_listeners => |db| db.wake();
    queue_round_trip => |db| db.queue();
    queue_lease_expiry_redelivers => |db| db.queue(), REAL_LEASE;
    queue_renew_extends_a_lease => |db| db.queue(), REAL_LEASE;
    queue_dead_letters_list_and_requeue => |db| db.queue();
    queue_counts_by_state => |db| db.queue();
    queue_expired_lease_cannot_finish_its_job => |db| db.queue(), REAL_LEASE;
    queue_requeued_dead_letter_coalesces => |db| db.queue();
    queue_coalesces_pending_jobs_per_key => |db| db.queue();
    queue_leases_sweeps_first => |db| db.queue();
    runner_wakes_on_enqueue => |db| db.queue();
    events_publish_batch_in_order => |db| db.events();
    queue_removes_finished_jobs_past_retention => |db| db.queue(), Duration::from_millis(300);
    runner_renews_a_slow_jobs_lease => |db| db.queue(), REAL_LEASE;
    runner_dead_letters_what_it_cannot_run => |db| db.queue();
    runner_crash_redelivers_its_job => |db| db.queue(), REAL_LEASE;
    lock_is_exclusive_and_expires => |db| db.lock(), REAL_LEASE;
    lock_for_ever_is_held => |db| db.lock();
    lock_taken_again_by_its_owner_is_a_new_lease => |db| db.lock();
    sweep_refuses_a_stale_fence => |db| db.lock(), &db.sweeper(), REAL_LEASE;
    queue_lease_for_ever_holds_the_job => |db| db.queue();
    schedule_mark_fired_is_compare_and_set => |db| db.schedules();
    schedule_mark_fired_refuses_a_replaced_schedule => |db| db.schedules();
    schedule_replace_and_remove => |db| db.schedules();
    schedule_cron_fires_each_tick_once => |db| db.schedules(), &db.queue();
    schedule_claimed_tick_fires_once_across_crashes => |db| db.schedules(), &db.queue();
    outbox_claims_are_exclusive_and_expire =>
        |db| db.outbox(), &db.announced_source(Legs::default()), REAL_LEASE;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_dead_letters_after_max_attempts() {
    let (_dir, _path, db) = common::fresh().await;
    let max = db.options().max_attempts;
    c::queue_dead_letters_after_max_attempts(&db.queue(), max).await;
}

/// On a queue that dead-letters after one attempt, so the lapsed lease's job is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_stale_lease_cannot_act_after_requeue() {
    let dir = tempfile::tempdir().unwrap();
    let opts = tidemark_sqlite::Options {
        max_attempts: 1,
        ..tidemark_sqlite::Options::default()
    };
    let db = tidemark_sqlite::SqliteDb::open_with(dir.path().join("tidemark.db"), opts)
        .await
        .unwrap();
    c::queue_stale_lease_cannot_act_after_requeue(&db.queue(), REAL_LEASE).await;
}

/// On a queue that dead-letters after one attempt, so the lapsed lease was the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_dead_lease_cannot_ack() {
    let dir = tempfile::tempdir().unwrap();
    let opts = tidemark_sqlite::Options {
        max_attempts: 1,
        ..tidemark_sqlite::Options::default()
    };
    let db = tidemark_sqlite::SqliteDb::open_with(dir.path().join("tidemark.db"), opts)
        .await
        .unwrap();
    c::queue_dead_lease_cannot_ack(&db.queue(), REAL_LEASE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_view_carries_only_its_keys() {
    let (_dir, _path, db) = common::fresh().await;
    let view = db.source().with_prefix("orders.").unwrap();
    c::prefix_view_carries_only_its_keys(&db.source(), &view).await;
}

/// The registry restored from a copy taken before the body wrote (a file copied back is
/// another file for the follower's new handle). A running follower cannot see a file
/// replaced under its open handle, so SQLite runs the restarted body only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_follower_takes_a_restored_history() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("early", b"e".to_vec()).await.unwrap();
    let backup = path.with_file_name("backup.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    c::a_restarted_follower_takes_a_new_history(db.source(), || async move {
        SqliteDb::open(&backup).await.unwrap().source()
    })
    .await;
}

/// As above, with the restored copy written far past the follower's watermark and its
/// change log compacted below its head before the follower restarts: no stamp at the
/// watermark is left to tell the copy's history from the replaced one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_follower_takes_a_restored_history_compacted_past_its_watermark() {
    let (_dir, path, db) = common::fresh().await;
    db.source().put("early", b"e".to_vec()).await.unwrap();
    let backup = path.with_file_name("backup.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    c::a_restarted_follower_takes_a_restored_history_compacted_past_its_watermark(
        db.source(),
        || async move { SqliteDb::open(&backup).await.unwrap().source() },
        |source: tidemark_sqlite::SqliteSource, below| async move {
            source.compact_below(below).await.unwrap();
        },
    )
    .await;
}

/// The registry deleted and made again: a new file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_follower_takes_a_recreated_history() {
    let (_dir, path, db) = common::fresh().await;
    c::a_restarted_follower_takes_a_new_history(db.source(), || async move {
        SqliteDb::open(path.with_file_name("remade.db"))
            .await
            .unwrap()
            .source()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_follower_holds_exactly_its_keys() {
    let (_dir, _path, db) = common::fresh().await;
    let view = db.source().with_prefix("orders.").unwrap();
    let compacted = db.source();
    c::prefix_follower_holds_exactly_its_keys(db.source(), view, |seq| async move {
        compacted.compact_below(seq).await.unwrap();
    })
    .await;
}
