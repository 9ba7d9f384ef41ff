//! Retention in memory under paused time: the sweep schedule fires each tick once across
//! several drivers, under the lock; history a durable cursor needs stays until the maximum
//! age; relayed outbox rows go.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tidemark::tidemark_core::{Legs, RetentionPolicy};
use tidemark::{
    Announcer, Cursors, Publish, Relay, Retention, Shutdown, Source, Sweep, Swept, run_retention,
};
use tidemark_memory::{Memory, MemorySweep};

/// The fence of a sweep run by hand, outside the sweeper lock (never taken here).
fn fence() -> tidemark::LockLease {
    tidemark::LockLease {
        name: tidemark::SWEEP_LOCK.into(),
        owner: "test".into(),
        fencing: 0,
    }
}

/// Counts the sweeps that ran, and how many at once.
#[derive(Clone)]
struct Counted {
    inner: MemorySweep,
    runs: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Sweep for Counted {
    async fn sweep(&self, fence: &tidemark::LockLease) -> tidemark::Result<Swept> {
        let n = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        // A slow sweep: a second driver would overlap it without the lock.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let out = self.inner.sweep(fence).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        self.runs.fetch_add(1, Ordering::SeqCst);
        out
    }
}

#[tokio::test(start_paused = true)]
async fn the_sweep_schedule_fires_each_tick_once_across_drivers() {
    let m = Memory::new();
    for i in 0..100 {
        m.source
            .put(&format!("k{}", i % 10), b"v".to_vec())
            .await
            .unwrap();
    }
    let counted = Counted {
        inner: m.sweeper(RetentionPolicy::new(Duration::ZERO, None).unwrap()),
        runs: Arc::default(),
        running: Arc::default(),
        most: Arc::default(),
    };
    let shutdown = Shutdown::new();
    let mut drivers = Vec::new();
    for owner in ["a", "b", "c"] {
        let (m, counted, stop) = (m.clone(), counted.clone(), shutdown.signal());
        let retention = Retention::new(owner)
            .unwrap()
            .every(Duration::from_secs(1))
            .unwrap();
        drivers.push(tokio::spawn(async move {
            run_retention(&m.schedules, &m.lock, &counted, retention, stop).await;
        }));
    }
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    shutdown.trigger();
    for d in drivers {
        d.await.unwrap();
    }
    assert_eq!(
        counted.runs.load(Ordering::SeqCst),
        10,
        "ten ticks in 10.5 s, each swept once by one of three drivers"
    );
    assert_eq!(counted.most.load(Ordering::SeqCst), 1, "never two at once");
    assert_eq!(
        m.source.first_available().await.unwrap(),
        101,
        "with no known reader and nothing kept, the whole log went"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cursor_holds_events_and_history_until_the_maximum_age() {
    let m = Memory::new();
    for i in 0..10 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
        m.events
            .publish(&format!("k{i}"), b"x".to_vec())
            .await
            .unwrap();
    }
    m.events.save("slow", 3).await.unwrap();
    let policy = RetentionPolicy::new(Duration::ZERO, Some(Duration::from_secs(60))).unwrap();
    let sweep = m.sweeper(policy);
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        (swept.first_event, swept.events, swept.first_available),
        (4, 3, 4),
        "everything below the cursor goes, nothing it still needs"
    );
    tokio::time::sleep(Duration::from_secs(61)).await;
    m.source.put("late", b"v".to_vec()).await.unwrap();
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        (swept.first_event, swept.first_available),
        (11, 11),
        "older than the maximum age: gone though the cursor still needs it"
    );
    let positions: Vec<u64> = m.events.records().iter().map(|r| r.position).collect();
    assert!(positions.is_empty(), "{positions:?}");
    m.events.publish("after", b"x".to_vec()).await.unwrap();
    assert_eq!(
        m.events.records()[0].position,
        11,
        "positions keep counting after a truncation"
    );
}

#[tokio::test(start_paused = true)]
async fn relayed_outbox_rows_go_and_pending_ones_stay() {
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..4 {
        src.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let sweep = m.sweeper(RetentionPolicy::default());
    assert_eq!(
        sweep.sweep(&fence()).await.unwrap().outbox_rows,
        0,
        "nothing relayed yet"
    );
    let relay = Relay::new(
        m.outbox.clone(),
        Announcer::new(m.events.clone(), m.wake.clone(), m.queue.clone(), "reg"),
        "relay",
    );
    relay.drain().await.unwrap();
    src.put("late", b"v".to_vec()).await.unwrap();
    assert_eq!(sweep.sweep(&fence()).await.unwrap().outbox_rows, 4);
    let rows = m.outbox.rows();
    assert_eq!(rows.len(), 1, "the pending row stays");
    assert!(!rows[0].1);
}

/// The job path: the sweep schedule enqueues `sweep` jobs, a runner executes them under
/// the lock, and each sweep also removes the queue's finished jobs.
#[tokio::test(start_paused = true)]
async fn the_runner_executes_scheduled_sweeps_and_they_remove_finished_jobs() {
    use tidemark::{
        Job, JobHandlers, JobRetention, JobRunner, Queue, SweepWithJobs, run_scheduler,
        with_sweep_job,
    };
    let m = Memory::new();
    let src = m.announced_source(Legs::default());
    for i in 0..50 {
        src.put(&format!("k{}", i % 5), b"v".to_vec())
            .await
            .unwrap();
    }
    let relay = Relay::new(
        m.outbox.clone(),
        Announcer::new(m.events.clone(), m.wake.clone(), m.queue.clone(), "reg"),
        "relay",
    );
    relay.drain().await.unwrap();
    assert_eq!(
        m.queue.counts().await.unwrap().ready,
        5,
        "one pending job per key: a key's later writes coalesce into it"
    );

    let retention = Retention::new("me")
        .unwrap()
        .every(Duration::from_secs(5))
        .unwrap();
    retention.install(&m.schedules).await.unwrap();
    let sweep = SweepWithJobs::new(
        m.sweeper(RetentionPolicy::new(Duration::ZERO, None).unwrap()),
        m.queue.clone(),
        JobRetention {
            done: Duration::ZERO,
            dead: None,
        },
    );
    let handlers = with_sweep_job(
        JobHandlers::new().on(["pack_housekeeping"], |_: Job, _| async {
            Ok::<(), std::io::Error>(())
        }),
        m.lock.clone(),
        sweep,
        retention.owner(),
        retention.lease_time(),
    );
    let runner = JobRunner::new("jobs", m.queue.clone(), handlers).spawn();
    let shutdown = Shutdown::new();
    let scheduler = {
        let (m, stop) = (m.clone(), shutdown.signal());
        tokio::spawn(async move {
            run_scheduler(&m.schedules, &m.queue, Duration::from_secs(1), stop).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(11_000)).await;
    shutdown.trigger();
    scheduler.await.unwrap();
    let counters = runner.stop_within(Duration::from_secs(5)).await.unwrap();
    assert_eq!(counters.acked, 7, "5 housekeeping jobs and two sweeps ran");
    let counts = m.queue.counts().await.unwrap();
    assert!(
        counts.done <= 1,
        "the sweeps removed the finished jobs (at most the last sweep's own is left): {counts:?}"
    );
    assert_eq!(
        m.source.first_available().await.unwrap(),
        51,
        "and compacted the change log"
    );
    assert!(m.outbox.rows().is_empty(), "and removed the relayed rows");
}

/// A restore takes the seqs back to the backup's and the next writes reuse them: a mark a
/// sweep took before the restore must not make those younger changes look old (sim seeds
/// 685, 777, 1500, 2059 and 2132 cut history a second old after a restore-backup).
#[tokio::test(start_paused = true)]
async fn a_restore_makes_marks_forget_the_seqs_it_took_back() {
    let m = Memory::new();
    for i in 0..3 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let backup = m.source.backup();
    for i in 3..10 {
        m.source.put(&format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let policy = RetentionPolicy::new(Duration::from_secs(2), None).unwrap();
    let sweep = m.sweeper(policy);
    assert_eq!(
        sweep.sweep(&fence()).await.unwrap().first_available,
        1,
        "all young"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    m.source.restore(&backup);
    m.source.put("new-a", b"v".to_vec()).await.unwrap();
    m.source.put("new-b", b"v".to_vec()).await.unwrap();
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(
        swept.first_available, 4,
        "only what the backup held is as old as the mark; seqs 4 and 5 are new"
    );
    let tidemark::Changes::Since { entries, .. } = m.source.changes_since(3).await.unwrap() else {
        panic!("a follower at the backup's watermark must still read the new seqs");
    };
    let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [4, 5]);
}
