//! The `ScheduleStore` port: compare-and-set firing, replacement and removal.

use super::common::*;

/// `mark_fired` is a compare-and-set: exactly one of two racing runners wins a tick.
pub async fn schedule_mark_fired_is_compare_and_set<T: ScheduleStore>(t: &T) {
    let s = Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap();
    t.put_schedule(s.clone()).await.unwrap();
    let due = t.schedules().await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!((due[0].schedule.clone(), due[0].last_fired), (s, None));
    assert!(t.mark_fired(&due[0], 1).await.unwrap());
    assert!(
        !t.mark_fired(&due[0], 1).await.unwrap(),
        "the loser of the race sees false"
    );
    assert_eq!(t.schedules().await.unwrap()[0].last_fired, Some(1));
}

/// `mark_fired` refuses a schedule replaced since it was read: a runner that read it, then
/// lost the race to a process that put a new one of the same name (last fired reset, a new
/// anchor and job), must neither fire the old job nor set the new schedule's last tick to
/// one counted on the old schedule's clock (a cron tick, a unix second, would stop an
/// interval replacement from ever firing). The replacement as read afterwards still fires.
pub async fn schedule_mark_fired_refuses_a_replaced_schedule<T: ScheduleStore>(t: &T) {
    let old = Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap();
    t.put_schedule(old).await.unwrap();
    let read = t.schedules().await.unwrap().remove(0);
    let new = Schedule::new(
        "sweep",
        Duration::from_secs(3600),
        Job::PackHousekeeping { key: "new".into() },
    )
    .unwrap();
    t.put_schedule(new.clone()).await.unwrap();
    assert!(
        !t.mark_fired(&read, 1_767_225_600).await.unwrap(),
        "a schedule replaced since it was read is not fired with the old read's tick"
    );
    let now = t.schedules().await.unwrap().remove(0);
    assert_eq!(
        (now.schedule.clone(), now.last_fired),
        (new, None),
        "the replacement's clock is untouched by the stale compare-and-set"
    );
    assert!(
        t.mark_fired(&now, 1).await.unwrap(),
        "the replacement, as read, fires"
    );
}

/// Schedules can be replaced (ticks restart) and removed.
pub async fn schedule_replace_and_remove<T: ScheduleStore>(t: &T) {
    let s = Schedule::new("sweep", Duration::from_secs(60), Job::Sweep).unwrap();
    t.put_schedule(s).await.unwrap();
    let first = t.schedules().await.unwrap().remove(0);
    assert!(t.mark_fired(&first, 3).await.unwrap());
    let faster = Schedule::new("sweep", Duration::from_secs(5), Job::Sweep).unwrap();
    t.put_schedule(faster.clone()).await.unwrap();
    let due = t.schedules().await.unwrap();
    assert_eq!(
        (due[0].schedule.clone(), due[0].last_fired),
        (faster, None),
        "replaced"
    );
    assert!(t.remove_schedule("sweep").await.unwrap());
    assert!(!t.remove_schedule("sweep").await.unwrap());
    assert!(t.schedules().await.unwrap().is_empty());
    assert!(
        !t.mark_fired(&due[0], 1).await.unwrap(),
        "a removed schedule never fires"
    );
}

/// A cron schedule fires each due tick once across racing runners, and a stretch of
/// missed ticks fires once, for the latest of them: the same guarantees as an interval.
///
/// Runs a once-a-second expression on the store's clock, so it waits a few seconds of
/// store time (tokio's under paused time, the wall clock or a server's otherwise).
pub async fn schedule_cron_fires_each_tick_once<T: ScheduleStore, Q: Queue>(t: &T, q: &Q) {
    let s = Schedule::cron("every-second", "* * * * * *", Job::Sweep).unwrap();
    t.put_schedule(s).await.unwrap();
    let mut ticks = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (a, b, c) = tokio::join!(
            crate::fire_due(t, q),
            crate::fire_due(t, q),
            crate::fire_due(t, q)
        );
        for (fired, next) in [a.unwrap(), b.unwrap(), c.unwrap()] {
            ticks.extend(fired.into_iter().map(|f| f.tick));
            assert!(
                next.is_some_and(|n| n <= Duration::from_secs(1)),
                "the next tick of a once-a-second schedule is at most a second away: {next:?}"
            );
        }
    }
    let mut distinct = ticks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        ticks.len(),
        "no tick fires twice across racing runners: {ticks:?}"
    );
    assert!(ticks.len() >= 3, "every round had a due tick: {ticks:?}");
    let last = *distinct.last().unwrap();
    // Nobody runs for four ticks: the next pass fires once, for the latest one.
    tokio::time::sleep(Duration::from_millis(4200)).await;
    let (fired, _) = crate::fire_due(t, q).await.unwrap();
    assert_eq!(fired.len(), 1, "a missed stretch fires once: {fired:?}");
    assert!(
        fired[0].tick >= last + 4,
        "it fires the latest due tick, not the first missed one: {} after {last}",
        fired[0].tick
    );
    let due = t.schedules().await.unwrap();
    assert_eq!(due[0].last_fired, Some(fired[0].tick));
    assert_eq!(
        due[0].schedule.cron_expr(),
        Some("* * * * * *"),
        "the expression is kept"
    );
}

/// Each claimed tick's job is enqueued exactly once, whichever step a crash cuts. A
/// scheduler that claims a tick for its job and dies before the enqueue leaves the tick
/// pending; the next pass, even one that finds a newer tick due, enqueues it first (racing
/// passes make one job between them) and then fires the newer tick. A scheduler that dies
/// after the enqueue, before recording it, leaves a tick whose enqueue, replayed under the
/// tick's key, makes no second job. A tick claimed with `mark_fired` (whose claimer does
/// the work itself, as the retention driver does) gets no job.
///
/// Runs a once-a-second interval on the store's clock (tokio's under paused time, the wall
/// clock or a server's otherwise).
pub async fn schedule_claimed_tick_fires_once_across_crashes<T: ScheduleStore, Q: Queue>(
    t: &T,
    q: &Q,
) {
    let s = Schedule::new("crashy", Duration::from_secs(1), Job::Sweep).unwrap();
    t.put_schedule(s).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = t.schedules().await.unwrap().remove(0);
    let anchor = due.clock.anchor;
    died_before_its_enqueue(t, q, &due).await;
    died_after_its_enqueue(t, q, anchor).await;
    claimed_by_a_runner_that_runs_it(t, q).await;
    passed_over_by_a_runner_that_runs_its_own(t, q).await;
}

/// A scheduler claims a tick for its job and dies before the enqueue: the next passes,
/// racing, with a newer tick due, enqueue it once and then the newer tick.
async fn died_before_its_enqueue<T: ScheduleStore, Q: Queue>(
    t: &T,
    q: &Q,
    due: &crate::ports::DueSchedule,
) {
    let first = due
        .schedule
        .tick_to_fire(due.last_fired, due.clock)
        .expect("a tick is due after an interval");
    assert!(
        t.claim_for_job(due, first).await.unwrap(),
        "the scheduler claims the tick (and dies before its enqueue)"
    );
    assert_eq!(
        t.schedules().await.unwrap()[0].pending,
        Some(first),
        "a tick claimed for a job is pending until its job is known enqueued"
    );
    // The next tick comes due before any scheduler passes again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (a, b, c) = tokio::join!(
        crate::fire_due(t, q),
        crate::fire_due(t, q),
        crate::fire_due(t, q)
    );
    let mut fired: Vec<u64> = [a.unwrap().0, b.unwrap().0, c.unwrap().0]
        .into_iter()
        .flatten()
        .map(|f| f.tick)
        .collect();
    fired.sort_unstable();
    assert_eq!(
        fired.len(),
        2,
        "the dead scheduler's tick and the next: {fired:?}"
    );
    assert_eq!(
        fired[0], first,
        "a tick claimed by a scheduler that died before its enqueue fires once, though a newer tick is due: {fired:?}"
    );
    assert!(fired[1] > first, "then the newer tick fires: {fired:?}");
    assert_eq!(q.counts().await.unwrap().ready, 2, "one job per tick");
    let now = t.schedules().await.unwrap().remove(0);
    assert_eq!(
        (now.last_fired, now.pending),
        (Some(fired[1]), None),
        "both enqueues are recorded"
    );
}

/// A scheduler dies after the enqueue, before recording it: the enqueue replayed under
/// the tick's key makes no second job.
async fn died_after_its_enqueue<T: ScheduleStore, Q: Queue>(t: &T, q: &Q, anchor: Duration) {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = t.schedules().await.unwrap().remove(0);
    let third = due
        .schedule
        .tick_to_fire(due.last_fired, due.clock)
        .unwrap();
    let key = crate::ports::TickKey {
        schedule: "crashy".into(),
        anchor,
        tick: third,
    };
    assert!(t.claim_for_job(&due, third).await.unwrap());
    let job = q.enqueue_tick(&key, Job::Sweep).await.unwrap();
    assert!(
        job.is_some(),
        "the tick's job is enqueued (then its scheduler dies)"
    );
    let (again, _) = crate::fire_due(t, q).await.unwrap();
    assert!(
        again.is_empty(),
        "a tick whose job was enqueued is not enqueued again: {again:?}"
    );
    assert_eq!(q.counts().await.unwrap().ready, 3, "still one job per tick");
    assert_eq!(
        t.schedules().await.unwrap()[0].pending,
        None,
        "the next pass records the enqueue"
    );
}

/// A tick claimed by a runner that does the work itself (`mark_fired`) gets no job.
async fn claimed_by_a_runner_that_runs_it<T: ScheduleStore, Q: Queue>(t: &T, q: &Q) {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = t.schedules().await.unwrap().remove(0);
    let fourth = due
        .schedule
        .tick_to_fire(due.last_fired, due.clock)
        .unwrap();
    assert!(t.mark_fired(&due, fourth).await.unwrap());
    let (none, _) = crate::fire_due(t, q).await.unwrap();
    assert!(
        none.is_empty(),
        "a tick claimed with mark_fired is its claimer's to run: {none:?}"
    );
    assert_eq!(q.counts().await.unwrap().ready, 3);
}

/// A tick claimed for its job by a scheduler that died, then passed over by a runner that
/// does its ticks itself: the job is still enqueued.
async fn passed_over_by_a_runner_that_runs_its_own<T: ScheduleStore, Q: Queue>(t: &T, q: &Q) {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = t.schedules().await.unwrap().remove(0);
    let fifth = due
        .schedule
        .tick_to_fire(due.last_fired, due.clock)
        .unwrap();
    assert!(t.claim_for_job(&due, fifth).await.unwrap());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = t.schedules().await.unwrap().remove(0);
    let sixth = due
        .schedule
        .tick_to_fire(due.last_fired, due.clock)
        .unwrap();
    assert!(t.mark_fired(&due, sixth).await.unwrap());
    assert_eq!(
        t.schedules().await.unwrap()[0].pending,
        Some(fifth),
        "a claim that runs its tick itself leaves an older pending tick pending"
    );
    let (late, _) = crate::fire_due(t, q).await.unwrap();
    let late: Vec<u64> = late.iter().map(|f| f.tick).collect();
    assert_eq!(
        late,
        vec![fifth],
        "the passed-over tick's job is enqueued, once"
    );
    assert_eq!(q.counts().await.unwrap().ready, 4);
}
