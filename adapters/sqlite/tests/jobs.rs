//! Queue, lock and schedules shared by several handles on one file (as several processes
//! would share it).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use tidemark::tidemark_core::{Job, JobId, Schedule};
use tidemark::{
    JobCounts, JobHandlers, JobRunner, JobState, Lock, Queue, ScheduleStore, UNDECODABLE_KIND,
};
use tidemark_sqlite::SqliteDb;

/// Time since the schedule's anchor, by the store's clock.
async fn since_anchor(db: &SqliteDb) -> Duration {
    db.schedules().schedules().await.unwrap()[0]
        .clock
        .since_anchor()
}

/// How many schedule ticks have begun since the schedule's anchor.
async fn ticks_begun(db: &SqliteDb, every: Duration) -> u128 {
    since_anchor(db).await.as_nanos() / every.as_nanos()
}

/// Sleeps until halfway through the schedule's next interval: a new tick is due and the
/// one after it is half an interval away.
async fn to_mid_tick(db: &SqliteDb, every: Duration) {
    let since = since_anchor(db).await;
    let ticks = since.as_nanos() / every.as_nanos();
    let target = every * u32::try_from(ticks + 1).unwrap() + every / 2;
    tokio::time::sleep(target - since).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_due_tick_enqueues_exactly_one_job_across_racing_schedulers() {
    let (_dir, path, db) = common::fresh().await;
    let others: Vec<SqliteDb> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(SqliteDb::open(&path).await.unwrap());
        }
        v
    };
    // Ticks come from the wall clock: every round starts halfway between two boundaries.
    // A round that a loaded machine stretches past the next boundary has a second due tick,
    // which rightly fires once more: the bound is one job per tick begun, never two.
    let every = Duration::from_millis(400);
    db.schedules()
        .put_schedule(Schedule::new("sweep", every, Job::Sweep).unwrap())
        .await
        .unwrap();
    let mut fired = 0;
    for round in 0..3 {
        to_mid_tick(&db, every).await;
        let first = ticks_begun(&db, every).await;
        let mut tasks = Vec::new();
        for h in others.iter().chain(std::iter::once(&db)) {
            let s = h.schedules();
            tasks.push(tokio::spawn(
                async move { s.fire_due().await.unwrap().len() },
            ));
        }
        let mut this_round = 0;
        for t in tasks {
            this_round += t.await.unwrap();
        }
        let crossed = usize::try_from(ticks_begun(&db, every).await - first).unwrap();
        // Ticks that begin while the round runs fire only if a scheduler looks after they
        // began; several that begin before the last look fire once, as missed ticks do.
        assert!(
            (1..=1 + crossed).contains(&this_round),
            "round {round}: {this_round} jobs; one for the due tick and at most one per \
             tick that began while it ran ({crossed}), whoever races"
        );
        fired += this_round;
    }
    // A long outage: many intervals missed, one job.
    tokio::time::sleep(every * 6).await;
    to_mid_tick(&db, every).await;
    let first = ticks_begun(&db, every).await;
    let late: usize = db.schedules().fire_due().await.unwrap().len()
        + others[0].schedules().fire_due().await.unwrap().len();
    let crossed = usize::try_from(ticks_begun(&db, every).await - first).unwrap();
    // Two looks: the first fires the missed ticks once; the second fires again only if a
    // tick began after the first looked (a loaded machine can stretch the two past several
    // boundaries, but two looks never fire more than twice).
    assert!(
        (1..=1 + crossed.min(1)).contains(&late),
        "missed ticks fire once, not once per missed interval: {late} jobs, {crossed} ticks \
         began while the two schedulers looked"
    );
    fired += late;
    let ready = db.queue().counts().await.unwrap().ready;
    assert_eq!(
        ready, fired as u64,
        "every fired tick's job is in the queue"
    );
}

/// A retry delay long enough that the "not yet" check right after the failure holds even
/// when a commit stalls on a loaded machine.
const RETRY: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_waits_its_retry_delay_and_a_dead_letter_keeps_its_error() {
    let (_dir, path, db) = common::fresh().await;
    let other = SqliteDb::open(&path).await.unwrap();
    let id = db.queue().enqueue(Job::Sweep).await.unwrap();
    let lease = other
        .queue()
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert!(
        db.queue()
            .lease(Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "a job leased by one process is hidden from another"
    );
    let failed_at = std::time::Instant::now();
    let state = other
        .queue()
        .fail(&lease, "disk full", RETRY)
        .await
        .unwrap();
    assert_eq!(state, JobState::Ready);
    assert!(
        db.queue()
            .lease(Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "not before its retry delay"
    );
    // Whenever it reappears, it is not before its delay (wall clock, so no upper bound
    // is asserted: a loaded machine may be late).
    let mut again = None;
    while again.is_none() {
        assert!(failed_at.elapsed() < RETRY * 15, "the job never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
        again = db.queue().lease(Duration::from_secs(30)).await.unwrap();
    }
    let again = again.unwrap();
    assert!(
        failed_at.elapsed() >= RETRY,
        "redelivered after {:?}, before its retry delay",
        failed_at.elapsed()
    );
    assert_eq!((again.id, again.attempt), (id, 2));
    let rec = db.queue().get(id).await.unwrap().unwrap();
    assert_eq!(rec.last_error.as_deref(), Some("disk full"));
    assert!(
        other.queue().ack(&lease).await.is_err(),
        "the first attempt's receipt is stale"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sweeper_at_a_time_across_handles() {
    let (_dir, path, db) = common::fresh().await;
    let other = SqliteDb::open(&path).await.unwrap();
    let ttl = Duration::from_secs(30);
    let a = db
        .lock()
        .try_lock("sweeper", "proc-a", ttl)
        .await
        .unwrap()
        .unwrap();
    assert!(
        other
            .lock()
            .try_lock("sweeper", "proc-b", ttl)
            .await
            .unwrap()
            .is_none()
    );
    db.lock().release(&a).await.unwrap();
    let b = other
        .lock()
        .try_lock("sweeper", "proc-b", ttl)
        .await
        .unwrap()
        .unwrap();
    assert!(b.fencing > a.fencing, "fencing survives release");
}

/// Rows written before user job kinds existed still run; a row that is no job at all is
/// dead-lettered at its first lease and listed for an operator, with why; a runner goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_rows_run_and_rows_that_are_no_job_are_listed_as_dead_letters() {
    let (_dir, path, db) = common::fresh().await;
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        for bytes in [&br#"{"kind":"sweep"}"#[..], b"\xff not json"] {
            conn.execute("INSERT INTO jobs (job) VALUES (?1)", [bytes])
                .unwrap();
        }
    }
    let q = db.queue();
    let handlers = JobHandlers::new().on(["sweep"], |_: Job, _| async { Ok::<(), String>(()) });
    let runner = JobRunner::new("old", q.clone(), handlers)
        .idle_poll(Duration::from_millis(20))
        .spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while q.counts().await.unwrap()
        != (JobCounts {
            done: 1,
            dead: 1,
            ..JobCounts::default()
        })
    {
        assert!(tokio::time::Instant::now() < deadline, "both rows settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    runner.stop_within(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        q.get(JobId(1)).await.unwrap().unwrap().state,
        JobState::Done,
        "an old {{\"kind\":\"sweep\"}} row runs"
    );
    let dead = q.dead_letters(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].job.kind(), UNDECODABLE_KIND, "listed, not hidden");
    let why = dead[0].last_error.as_deref().unwrap_or_default();
    assert!(
        why.contains("unreadable job"),
        "the dead letter says why: {why}"
    );
}
