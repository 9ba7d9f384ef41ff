//! The port conformance suite: async test bodies generic over the ports, so every adapter
//! proves the same semantics with the same code. An adapter's tests instantiate each body
//! with a fresh port:
//!
//! ```
//! # use tidemark_memory::MemorySource;
//! #[tokio::test(start_paused = true)]
//! async fn source_changes_cover_removals() {
//!     tidemark::conformance::source_changes_cover_removals(&MemorySource::default()).await;
//! }
//! # fn main() {}
//! ```
//!
//! Bodies panic (with a message saying why the behaviour matters) on a violation. Bodies
//! that wait use tokio time and short durations, so they run under paused time and stay
//! quick against a real clock. Enabled by the `conformance` feature.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod prefix;

pub use prefix::{prefix_follower_holds_exactly_its_keys, prefix_view_carries_only_its_keys};

use std::time::Duration;

use tidemark_core::{
    AnnounceReport, Entry, Event, Job, JobId, MAX_KEY_BYTES, MAX_VALUE_BYTES, Op, Schedule,
};

use crate::jobs::{JobHandlers, JobRunner};
use crate::ports::{
    Changes, Cursors, Feed, FeedItem, FeedStream, JobCounts, JobRetention, JobState, Lock, Outbox,
    OutboxRow, OutboxUpdate, OutboxWatch, Publish, Queue, Received, ScheduleStore, Source, Wake,
    WakeListener,
};

/// The next entry or undecodable item (a raised head only tells the follower how far its
/// initial sync reads, and is passed over).
async fn next_item<S: FeedStream>(stream: &mut S) -> FeedItem {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Ok(FeedItem::Head(_)))) => {}
            Ok(Some(Ok(item))) => return item,
            Ok(other) => panic!("feed should deliver an item, got {other:?}"),
            Err(_) => panic!("feed delivered nothing within 5s"),
        }
    }
}

fn entry(item: FeedItem) -> Entry {
    match item {
        FeedItem::Entry(e) => e,
        other => panic!("expected an entry, got {other:?}"),
    }
}

/// Seqs are positive and strictly increasing across puts and removes, and the watermark is
/// the last one: followers order everything by them.
pub async fn source_seqs_increase<S: Source>(s: &S) {
    assert_eq!(
        s.watermark().await.unwrap(),
        0,
        "a fresh source has watermark 0"
    );
    let a = s.put("a", b"1".to_vec()).await.unwrap();
    let b = s.put("b", b"2".to_vec()).await.unwrap();
    let c = s.remove("a").await.unwrap().expect("a existed");
    assert!(
        a > 0 && a < b && b < c,
        "seqs must be positive and increase: {a} {b} {c}"
    );
    assert_eq!(
        s.watermark().await.unwrap(),
        c,
        "the watermark is the last seq"
    );
}

/// `get` returns a value with the seq that wrote it, and nothing for an absent key:
/// marker fetches rely on the seq to keep per-key order.
pub async fn source_get_returns_value_and_seq<S: Source>(s: &S) {
    let seq = s.put("k", b"v".to_vec()).await.unwrap();
    let got = s.get("k").await.unwrap().expect("k was written");
    assert_eq!((got.seq, got.value), (seq, b"v".to_vec()));
    assert!(
        s.get("absent").await.unwrap().is_none(),
        "absent keys read as None"
    );
}

/// `get_at` returns what `get` does, with a watermark at least the value's seq and at least
/// every write made before the read: a follower takes a key absent from a source whose
/// watermark is below a marker's seq for a read from before the marker's change.
pub async fn source_get_at_reads_the_watermark_with_the_value<S: Source>(s: &S) {
    let first = s.put("k", b"v".to_vec()).await.unwrap();
    let last = s.put("other", b"w".to_vec()).await.unwrap();
    let got = s.get_at("k").await.unwrap();
    let value = got.value.expect("k was written");
    assert_eq!((value.seq, value.value), (first, b"v".to_vec()));
    assert!(
        got.watermark >= last,
        "the watermark {} covers every write before the read (the last at {last})",
        got.watermark
    );
    let removed = s.remove("k").await.unwrap().expect("k was present");
    let got = s.get_at("k").await.unwrap();
    assert!(got.value.is_none(), "a removed key reads as None");
    assert!(
        got.watermark >= removed,
        "an absent key's watermark {} is at or past its removal at {removed}",
        got.watermark
    );
}

/// `update` is a compare-and-set on the current seq: writers never overwrite a change
/// they did not see.
pub async fn source_update_is_compare_and_set<S: Source>(s: &S) {
    let first = s.update("k", b"1".to_vec(), 0).await.unwrap();
    assert!(
        s.update("k", b"x".to_vec(), 0).await.is_err(),
        "expected 0 (absent) must conflict once the key exists"
    );
    let second = s.update("k", b"2".to_vec(), first).await.unwrap();
    assert!(second > first);
    match s.update("k", b"3".to_vec(), first).await {
        Err(crate::Error::Conflict { current, .. }) => assert_eq!(current, Some(second)),
        other => panic!("a stale expected seq must be a conflict, got {other:?}"),
    }
    assert_eq!(s.get("k").await.unwrap().unwrap().value, b"2".to_vec());
}

/// A removed key is absent: an update must expect 0 for it, not its removal's seq (a
/// writer holding the seq `remove` returned must not write as if the key were there).
pub async fn source_update_of_a_removed_key_expects_zero<S: Source>(s: &S) {
    s.put("k", b"1".to_vec()).await.unwrap();
    let removed = s.remove("k").await.unwrap().unwrap();
    match s.update("k", b"2".to_vec(), removed).await {
        Err(crate::Error::Conflict { current, .. }) => assert_eq!(current, None),
        other => panic!("the removal's seq must be a conflict for an absent key, got {other:?}"),
    }
    let again = s.update("k", b"2".to_vec(), 0).await.unwrap();
    assert!(again > removed);
    assert_eq!(s.get("k").await.unwrap().unwrap().value, b"2".to_vec());
}

/// Removing an absent key changes nothing and uses no seq.
pub async fn source_remove_absent_is_none<S: Source>(s: &S) {
    let w = s.put("k", b"v".to_vec()).await.unwrap();
    assert_eq!(s.remove("absent").await.unwrap(), None);
    assert_eq!(
        s.watermark().await.unwrap(),
        w,
        "no seq is used by a no-op removal"
    );
}

/// Changes since N include removals as tombstones with their seq, so a reader that missed
/// a removal drops the key after one reconcile.
pub async fn source_changes_cover_removals<S: Source>(s: &S) {
    s.put("keep", b"1".to_vec()).await.unwrap();
    let since = s.put("gone", b"2".to_vec()).await.unwrap();
    let put = s.put("keep", b"3".to_vec()).await.unwrap();
    let removed = s.remove("gone").await.unwrap().unwrap();
    let Changes::Since { entries, watermark } = s.changes_since(since).await.unwrap() else {
        panic!("nothing was compacted: changes must be available");
    };
    assert_eq!(watermark, removed);
    let summary: Vec<_> = entries
        .iter()
        .map(|e| (&*e.key, e.seq, e.op.clone()))
        .collect();
    assert_eq!(
        summary,
        [("keep", put, Op::Put), ("gone", removed, Op::Delete)],
        "changes must be in seq order and include the removal as a tombstone"
    );
    assert_eq!(
        entries[0].value,
        b"3".to_vec(),
        "a put change carries its value"
    );
}

/// Changes since the watermark are empty: that is what makes a second reconcile a no-op.
pub async fn source_changes_since_watermark_is_empty<S: Source>(s: &S) {
    s.put("a", b"1".to_vec()).await.unwrap();
    let w = s.watermark().await.unwrap();
    match s.changes_since(w).await.unwrap() {
        Changes::Since { entries, watermark } => {
            assert!(entries.is_empty(), "nothing changed since the watermark");
            assert_eq!(watermark, w);
        }
        Changes::Compacted { .. } => panic!("the watermark itself is always servable"),
    }
}

/// A snapshot holds every current key (not removed ones) and the watermark: the base of a
/// resync.
pub async fn source_snapshot_is_current<S: Source>(s: &S) {
    s.put("a", b"1".to_vec()).await.unwrap();
    s.put("b", b"2".to_vec()).await.unwrap();
    s.remove("a").await.unwrap();
    let b = s.put("b", b"3".to_vec()).await.unwrap();
    let snap = s.snapshot().await.unwrap();
    assert_eq!(snap.watermark, b);
    assert_eq!(snap.entries, vec![Entry::put(b, "b", b"3".to_vec())]);
    assert!(
        s.first_available().await.unwrap() <= 1,
        "nothing was compacted"
    );
}

/// A snapshot read in parts is the snapshot, in key order, in parts no longer than asked,
/// and all of it from the point in time its watermark was read at: writes made between
/// two parts show in none. A resync that kept a later part's keys from another moment
/// would hold a state the source never had, with a watermark that vouches for it.
pub async fn source_snapshot_parts_are_one_point_in_time<S: Source>(s: &S) {
    use futures::StreamExt;
    for (k, v) in [("a", "1"), ("b", "2"), ("c", "3"), ("d", "4"), ("e", "5")] {
        s.put(k, v.as_bytes().to_vec()).await.unwrap();
    }
    s.remove("c").await.unwrap();
    let before = s.snapshot().await.unwrap();
    assert_eq!(before.entries.len(), 4);
    let mut read = s.snapshot_parts(2).await.unwrap();
    assert_eq!(read.watermark, before.watermark);
    let mut got = Vec::new();
    let first = read.parts.next().await.expect("a part").unwrap();
    assert!(
        !first.is_empty() && first.len() <= 2,
        "a part holds 1..=2 entries: {first:?}"
    );
    got.extend(first);
    // Between parts: a key added past every other, one changed and one removed.
    s.put("zz", b"new".to_vec()).await.unwrap();
    s.put("d", b"changed".to_vec()).await.unwrap();
    s.remove("e").await.unwrap();
    while let Some(part) = read.parts.next().await {
        let part = part.unwrap();
        assert!(
            !part.is_empty() && part.len() <= 2,
            "a part holds 1..=2 entries: {part:?}"
        );
        got.extend(part);
    }
    assert_eq!(
        got, before.entries,
        "every part comes from the snapshot's point in time, in key order"
    );
    drop(read);
    let after = s.snapshot_parts(3).await.unwrap();
    let keys: Vec<String> = after
        .parts
        .flat_map(|p| futures::stream::iter(p.unwrap()))
        .map(|e| e.key.to_string())
        .collect()
        .await;
    assert_eq!(keys, ["a", "b", "d", "zz"], "a new read sees the writes");
}

/// Every read of the whole source — a snapshot, a snapshot read in parts, the changes since
/// 0 — holds every one of `keys` keys that exist throughout, while a writer keeps
/// overwriting the keys such a read reaches last. A read that pages through the source
/// and stops at the head it saw first (a history-1 NATS bucket replayed in stream order, a
/// table paged by seq) loses a key overwritten past that head before its old version was
/// read, and a resync built on it removes a key that was never removed.
pub async fn source_reads_hold_keys_overwritten_meanwhile<S: Source>(s: &S, keys: u32) {
    use futures::StreamExt;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    let keys = keys.max(10);
    let name = |i: u32| format!("k{i:06}");
    for i in 0..keys {
        s.put(&name(i), b"v".to_vec()).await.unwrap();
    }
    let done = AtomicBool::new(false);
    let writer = async {
        let (mut i, hot) = (0u32, keys / 10);
        while !done.load(Ordering::Relaxed) {
            // The last tenth of the keys, in key order and in seq order alike.
            s.put(&name(keys - 1 - i % hot), b"w".to_vec())
                .await
                .unwrap();
            i += 1;
            tokio::task::yield_now().await;
        }
        i
    };
    let reader = async {
        let mut short = Vec::new();
        for _ in 0..3 {
            let snap = s.snapshot().await.unwrap();
            if snap.entries.len() != keys as usize {
                let held: std::collections::BTreeSet<&str> =
                    snap.entries.iter().map(|e| &*e.key).collect();
                let missing = (0..keys).map(name).find(|k| !held.contains(k.as_str()));
                short.push(format!(
                    "a snapshot at {} holds {} (first missing: {missing:?})",
                    snap.watermark,
                    snap.entries.len()
                ));
            }
            let read = s.snapshot_parts((keys as usize / 7).max(1)).await.unwrap();
            let watermark = read.watermark;
            let parts: Vec<_> = read.parts.collect().await;
            let got: usize = parts.into_iter().map(|p| p.unwrap().len()).sum();
            if got != keys as usize {
                short.push(format!("a snapshot in parts at {watermark} holds {got}"));
            }
            if let Changes::Since { entries, watermark } = s.changes_since(0).await.unwrap() {
                // The latest change of each key decides whether it is there.
                let mut latest: BTreeMap<&str, (u64, Op)> = BTreeMap::new();
                for e in &entries {
                    let held = latest.entry(&*e.key).or_insert((0, Op::Put));
                    if e.seq >= held.0 {
                        *held = (e.seq, e.op.clone());
                    }
                }
                let puts = latest.values().filter(|(_, op)| *op == Op::Put).count();
                if puts != keys as usize {
                    short.push(format!("the changes since 0 at {watermark} hold {puts}"));
                }
            }
            tokio::task::yield_now().await;
        }
        done.store(true, Ordering::Relaxed);
        short
    };
    let (writes, short) = tokio::join!(writer, reader);
    assert!(writes > 0, "the writer overwrote keys while the reads ran");
    assert!(
        short.is_empty(),
        "reads missing keys that existed throughout, of {keys}: {short:?}"
    );
}

/// Empty keys and control characters are refused with a typed error, never stored.
pub async fn source_refuses_invalid_keys<S: Source>(s: &S) {
    assert!(matches!(
        s.put("", b"v".to_vec()).await,
        Err(crate::Error::InvalidKey { .. })
    ));
    assert!(matches!(
        s.put("a\nb", b"v".to_vec()).await,
        Err(crate::Error::InvalidKey { .. })
    ));
    assert_eq!(
        s.watermark().await.unwrap(),
        0,
        "a refused write uses no seq"
    );
}

/// A source's change log replays from a seq, then follows live writes, gaplessly: what a
/// follower's resume from watermark+1 relies on.
pub async fn change_log_replays_then_follows<S: Source + Feed>(s: &S) {
    s.put("a", b"1".to_vec()).await.unwrap();
    let second = s.put("b", b"2".to_vec()).await.unwrap();
    let opened = s.open(second, None).await.unwrap();
    assert_eq!(
        opened.info.head, second,
        "head is the source's last seq at open"
    );
    let mut stream = opened.stream;
    assert_eq!(
        entry(next_item(&mut stream).await).seq,
        second,
        "replay starts at `from`"
    );
    let third = s.remove("a").await.unwrap().unwrap();
    let live = entry(next_item(&mut stream).await);
    assert_eq!(
        (live.seq, live.op),
        (third, Op::Delete),
        "live removals follow"
    );
}

/// The events stream delivers what was published, in order, at increasing positions, and
/// a foreign payload as undecodable, not as an error.
pub async fn events_deliver_published_in_order<P: Publish + Feed>(p: &P) {
    let e1 = Event::Put {
        seq: 10,
        key: "a".into(),
        value: b"v".to_vec(),
    };
    let e2 = Event::Removed {
        seq: 11,
        key: "a".into(),
    };
    let p1 = p.publish("a", e1.encode().unwrap()).await.unwrap();
    let p2 = p
        .publish("x", b"{\"foreign\":true}".to_vec())
        .await
        .unwrap();
    let p3 = p.publish("a", e2.encode().unwrap()).await.unwrap();
    assert!(p1 < p2 && p2 < p3, "positions increase");
    let mut stream = p.open(1, None).await.unwrap().stream;
    let first = entry(next_item(&mut stream).await);
    assert_eq!((first.position, first.seq, first.op), (p1, 10, Op::Put));
    assert!(
        matches!(next_item(&mut stream).await, FeedItem::Undecodable { position, .. } if position == p2),
        "a foreign payload is a counted skip, not an error"
    );
    let third = entry(next_item(&mut stream).await);
    assert_eq!((third.position, third.seq), (p3, 11));
    let mut after = p.open(1, Some(p2)).await.unwrap().stream;
    assert_eq!(
        entry(next_item(&mut after).await).position,
        p3,
        "open after a cursor"
    );
}

/// Cursor saves are monotone and a fresh name has no cursor: a consumer never goes back.
pub async fn cursors_are_monotone<C: Cursors>(c: &C) {
    assert_eq!(c.load("fresh").await.unwrap(), None);
    assert_eq!(c.save("c", 5).await.unwrap(), 5);
    assert_eq!(
        c.save("c", 3).await.unwrap(),
        5,
        "a lower save keeps the higher cursor"
    );
    assert_eq!(c.load("c").await.unwrap(), Some(5));
}

/// A notify reaches a listener with its payload; a quiet channel times out.
pub async fn wake_reaches_listeners<W: Wake>(w: &W) {
    let mut l = w.listen("ch").await.unwrap();
    assert_eq!(
        l.recv_timeout(Duration::from_millis(50)).await.unwrap(),
        Received::TimedOut,
        "no wake without a notify"
    );
    w.notify("ch", b"hello".to_vec()).await.unwrap();
    w.notify("other", b"no".to_vec()).await.unwrap();
    assert_eq!(
        l.recv_timeout(Duration::from_secs(5)).await.unwrap(),
        Received::Wake(b"hello".to_vec())
    );
    assert_eq!(
        l.recv_timeout(Duration::from_millis(50)).await.unwrap(),
        Received::TimedOut,
        "another channel's notify does not wake this one"
    );
}

/// Enqueue → get → lease → ack: a job is readable by id and done once acked.
pub async fn queue_round_trip<Q: Queue>(q: &Q) {
    let job = Job::PackHousekeeping { key: "k".into() };
    let id = q.enqueue(job.clone()).await.unwrap();
    let rec = q.get(id).await.unwrap().expect("a job reads back by id");
    assert_eq!((rec.job.clone(), rec.state), (job.clone(), JobState::Ready));
    let lease = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a ready job");
    assert_eq!((lease.id, lease.job.clone(), lease.attempt), (id, job, 1));
    assert!(
        q.lease(Duration::from_secs(30)).await.unwrap().is_none(),
        "leased jobs are hidden"
    );
    q.ack(&lease).await.unwrap();
    assert_eq!(q.get(id).await.unwrap().unwrap().state, JobState::Done);
}

/// A job whose lease expires is delivered again, and the old lease can no longer ack:
/// a crashed worker loses no job and cannot complete one it no longer holds.
///
/// `visibility` is the lease length the test uses: short under paused time, long enough
/// on a real clock that a loaded machine acks the second lease before it runs out.
pub async fn queue_lease_expiry_redelivers<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let first = q.lease(visibility).await.unwrap().unwrap();
    tokio::time::sleep(visibility * 3 / 2).await;
    // Redelivery is due now; a busy server may take a moment to make it.
    let deadline = tokio::time::Instant::now() + visibility * 50;
    let second = loop {
        if let Some(lease) = q.lease(visibility).await.unwrap() {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an expired lease's job is redelivered"
        );
        tokio::time::sleep(visibility / 20).await;
    };
    assert_eq!((second.id, second.attempt), (id, 2));
    assert!(
        q.ack(&first).await.is_err(),
        "an expired lease must not ack"
    );
    q.ack(&second).await.unwrap();
}

/// After `max_attempts` failures a job is dead-lettered with its last error kept.
pub async fn queue_dead_letters_after_max_attempts<Q: Queue>(q: &Q, max_attempts: u32) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    for attempt in 1..=max_attempts {
        let lease = q
            .lease(Duration::from_secs(30))
            .await
            .unwrap()
            .expect("ready again");
        assert_eq!(lease.attempt, attempt);
        let state = q
            .fail(&lease, &format!("boom {attempt}"), Duration::ZERO)
            .await
            .unwrap();
        let want = if attempt == max_attempts {
            JobState::DeadLettered
        } else {
            JobState::Ready
        };
        assert_eq!(state, want);
    }
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(rec.state, JobState::DeadLettered, "attempts are used up");
    assert_eq!(
        rec.last_error.as_deref(),
        Some(&*format!("boom {max_attempts}"))
    );
    assert!(
        q.lease(Duration::from_secs(30)).await.unwrap().is_none(),
        "dead letters stay out"
    );
}

/// A renewed lease outlives its first visibility timeout: a slow job is not delivered
/// again while its holder renews it, and a finished job's lease cannot be renewed.
///
/// `visibility` is the lease the test takes (on NATS: the queue's ack wait).
pub async fn queue_renew_extends_a_lease<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q.lease(visibility).await.unwrap().expect("a ready job");
    let start = tokio::time::Instant::now();
    while start.elapsed() < visibility * 2 {
        tokio::time::sleep(visibility / 4).await;
        q.renew(&lease, visibility)
            .await
            .expect("a held lease renews");
        assert!(
            q.lease(visibility).await.unwrap().is_none(),
            "a renewed lease keeps its job from being delivered again"
        );
    }
    q.ack(&lease).await.expect("a renewed lease still acks");
    let rec = q.get(id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempts),
        (JobState::Done, 1),
        "one attempt, done"
    );
    assert!(
        matches!(
            q.renew(&lease, visibility).await,
            Err(crate::Error::LeaseLost(_))
        ),
        "a finished job's lease cannot be renewed"
    );
    q.enqueue(Job::Sweep).await.unwrap();
    let lapsed = q.lease(visibility).await.unwrap().expect("a ready job");
    tokio::time::sleep(visibility * 3 / 2).await;
    assert!(
        matches!(
            q.renew(&lapsed, visibility).await,
            Err(crate::Error::LeaseLost(_))
        ),
        "an expired lease cannot be renewed: its job may be someone else's"
    );
}

/// Dead letters are listed in id order with their last error, page by page, and a
/// requeued one runs again with fresh attempts; only a dead letter can be requeued.
pub async fn queue_dead_letters_list_and_requeue<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    let jobs = [
        Job::PackHousekeeping { key: "a".into() },
        Job::PackHousekeeping { key: "b".into() },
        Job::PackHousekeeping { key: "c".into() },
    ];
    let mut ids = Vec::new();
    for job in &jobs {
        ids.push(q.enqueue(job.clone()).await.unwrap());
    }
    for (i, id) in ids.iter().enumerate() {
        let lease = q.lease(visibility).await.unwrap().expect("a ready job");
        assert_eq!(lease.id, *id, "oldest first");
        if i == 1 {
            q.ack(&lease).await.unwrap();
        } else {
            q.dead_letter(&lease, &format!("no hope for {i}"))
                .await
                .unwrap();
        }
    }
    let dead = q.dead_letters(None, 10).await.unwrap();
    let listed: Vec<_> = dead
        .iter()
        .map(|r| {
            (
                r.id,
                r.job.clone(),
                r.state,
                r.attempts,
                r.last_error.clone(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            (
                ids[0],
                jobs[0].clone(),
                JobState::DeadLettered,
                1,
                Some("no hope for 0".into())
            ),
            (
                ids[2],
                jobs[2].clone(),
                JobState::DeadLettered,
                1,
                Some("no hope for 2".into())
            ),
        ],
        "dead letters are listed with their job and last error, and only dead letters"
    );
    let page: Vec<_> = q
        .dead_letters(Some(ids[0]), 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(page, vec![ids[2]], "listing resumes after the id given");
    let first: Vec<_> = q
        .dead_letters(None, 1)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(first, vec![ids[0]], "listing stops at the limit");
    assert!(
        matches!(q.requeue(ids[1]).await, Err(crate::Error::NotFound(_))),
        "a done job is not a dead letter"
    );
    let again = q.requeue(ids[0]).await.expect("a dead letter requeues");
    let lease = q
        .lease(visibility)
        .await
        .unwrap()
        .expect("the requeued job is ready");
    assert_eq!(
        (lease.id, lease.job.clone(), lease.attempt),
        (again, jobs[0].clone(), 1),
        "a requeued job runs again with fresh attempts"
    );
    q.ack(&lease).await.unwrap();
    let left: Vec<_> = q
        .dead_letters(None, 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(left, vec![ids[2]], "a requeued job leaves the dead letters");
}

/// A lease that expired before its job was dead-lettered and requeued can do nothing to
/// the job's next lease: its renew, ack, fail and dead letter are all
/// [`Error::LeaseLost`](crate::Error::LeaseLost), and the new holder acks. Why: a runner
/// that stalls past its visibility (a pause, a partition) wakes holding a receipt for a
/// job someone else now runs; if that receipt still matched, its fail would put the job
/// back while it runs and its ack would mark it done under the new holder, whose own ack
/// would then be refused. A receipt must name one lease for ever, however often the job
/// is requeued and its attempts start over.
///
/// `q` must dead-letter after one attempt (`max_attempts` 1), so that the lapsed lease's
/// job is dead-lettered rather than delivered again. `visibility` is the first lease's
/// length: short under paused time, long enough on a real clock to be taken and let lapse.
pub async fn queue_stale_lease_cannot_act_after_requeue<Q: Queue>(q: &Q, visibility: Duration) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let stale = q.lease(visibility).await.unwrap().expect("a ready job");
    assert_eq!((stale.id, stale.attempt), (id, 1));
    tokio::time::sleep(visibility * 3 / 2).await;
    // The lease has lapsed with the only attempt used: the job is dead-lettered (at once
    // on some adapters, by the next lease on others; a busy server may take a moment).
    let deadline = tokio::time::Instant::now() + visibility * 50;
    loop {
        let state = q.get(id).await.unwrap().map(|r| r.state);
        if state == Some(JobState::DeadLettered) {
            break;
        }
        assert!(
            q.lease(visibility).await.unwrap().is_none(),
            "with one attempt allowed, a lapsed lease's job is dead-lettered, not redelivered"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "a lapsed lease's job with its attempts used up is dead-lettered (now {state:?})"
        );
        tokio::time::sleep(visibility / 20).await;
    }
    let again = q.requeue(id).await.expect("a dead letter requeues");
    let fresh = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the requeued job is ready");
    assert_eq!(
        (fresh.id, fresh.attempt),
        (again, 1),
        "a requeued job runs again with fresh attempts"
    );
    let lost = |what: &str, result: crate::Result<()>| {
        assert!(
            matches!(result, Err(crate::Error::LeaseLost(_))),
            "a lease from before the requeue must not {what} the job's new lease: {result:?}"
        );
    };
    lost("renew", q.renew(&stale, Duration::from_secs(30)).await);
    lost("ack", q.ack(&stale).await);
    lost(
        "fail",
        q.fail(&stale, "stale", Duration::ZERO).await.map(|_| ()),
    );
    lost("dead-letter", q.dead_letter(&stale, "stale").await);
    let rec = q.get(again).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempts),
        (JobState::Leased, 1),
        "the stale lease changed nothing"
    );
    q.ack(&fresh).await.expect("the new lease still acks");
    assert_eq!(q.get(again).await.unwrap().unwrap().state, JobState::Done);
}

/// Counts by state: what a status command and the queue-depth gauge read.
pub async fn queue_counts_by_state<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    assert_eq!(
        q.counts().await.unwrap(),
        JobCounts::default(),
        "an empty queue"
    );
    for key in ["a", "b", "c", "d"] {
        q.enqueue(Job::PackHousekeeping { key: key.into() })
            .await
            .unwrap();
    }
    let done = q.lease(visibility).await.unwrap().unwrap();
    q.ack(&done).await.unwrap();
    let dead = q.lease(visibility).await.unwrap().unwrap();
    q.dead_letter(&dead, "bad").await.unwrap();
    let _held = q.lease(visibility).await.unwrap().unwrap();
    assert_eq!(
        q.counts().await.unwrap(),
        JobCounts {
            ready: 1,
            leased: 1,
            done: 1,
            dead: 1
        },
        "each job is counted in the state it is in"
    );
}

/// Retention removes done jobs and dead letters once they are older than their limits, and
/// never a ready or leased job; `dead: None` keeps dead letters.
///
/// `age` is the retention the test uses: long enough that a call made right after the jobs
/// finished finds them younger than it.
pub async fn queue_removes_finished_jobs_past_retention<Q: Queue>(q: &Q, age: Duration) {
    let visibility = Duration::from_secs(30);
    let done = q
        .enqueue(Job::PackHousekeeping { key: "done".into() })
        .await
        .unwrap();
    let dead = q
        .enqueue(Job::PackHousekeeping { key: "dead".into() })
        .await
        .unwrap();
    let leased = q
        .enqueue(Job::PackHousekeeping {
            key: "leased".into(),
        })
        .await
        .unwrap();
    let ready = q
        .enqueue(Job::PackHousekeeping {
            key: "ready".into(),
        })
        .await
        .unwrap();
    let lease = q.lease(visibility).await.unwrap().unwrap();
    q.ack(&lease).await.unwrap();
    let lease = q.lease(visibility).await.unwrap().unwrap();
    q.dead_letter(&lease, "bad").await.unwrap();
    let _held = q.lease(visibility).await.unwrap().unwrap();
    let both = JobRetention {
        done: age,
        dead: Some(age),
    };
    assert_eq!(
        q.remove_finished(both).await.unwrap(),
        0,
        "jobs younger than the retention are kept"
    );
    tokio::time::sleep(age * 2).await;
    let keep_dead = JobRetention {
        done: age,
        dead: None,
    };
    assert_eq!(
        q.remove_finished(keep_dead).await.unwrap(),
        1,
        "the done job goes"
    );
    assert!(
        q.get(done).await.unwrap().is_none(),
        "a removed job reads as absent"
    );
    assert!(
        q.get(dead).await.unwrap().is_some(),
        "dead letters stay when their age is None"
    );
    assert_eq!(
        q.remove_finished(both).await.unwrap(),
        1,
        "then the dead letter goes"
    );
    assert!(q.get(dead).await.unwrap().is_none());
    for id in [leased, ready] {
        assert!(
            q.get(id).await.unwrap().is_some(),
            "retention never removes a job still to run"
        );
    }
}

/// Waits until job `id` is in `state`, or panics after `within`.
async fn wait_for_state<Q: Queue>(q: &Q, id: JobId, state: JobState, within: Duration) -> u32 {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(rec) = q.get(id).await.unwrap()
            && rec.state == state
        {
            return rec.attempts;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} did not reach {state:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job that runs for three visibility timeouts, with a second runner waiting for work,
/// runs once: the [`JobRunner`] renews its lease while the handler runs.
pub async fn runner_renews_a_slow_jobs_lease<Q: Queue + Clone + 'static>(
    q: &Q,
    visibility: Duration,
) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let runner = |name: &str| {
        let runs = std::sync::Arc::clone(&runs);
        let handlers = JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let runs = std::sync::Arc::clone(&runs);
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(visibility * 3).await;
                Ok::<(), String>(())
            }
        });
        JobRunner::new(name, q.clone(), handlers)
            .visibility(visibility)
            .idle_poll(visibility / 10)
            .spawn()
    };
    let (a, b) = (runner("a"), runner("b"));
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let attempts = wait_for_state(q, id, JobState::Done, visibility * 20).await;
    let renewals = a.counters().renewals + b.counters().renewals;
    a.stop_within(visibility * 5).await.unwrap();
    b.stop_within(visibility * 5).await.unwrap();
    assert_eq!(attempts, 1, "a renewed lease is never delivered again");
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the slow job ran once though another runner was idle"
    );
    assert!(
        renewals >= 2,
        "renewed every third of the visibility ({renewals} renewals)"
    );
}

/// A runner that dies mid-job (aborted, as a crash) loses nothing: once its lease
/// expires, a new runner gets the job and finishes it.
pub async fn runner_crash_redelivers_its_job<Q: Queue + Clone + 'static>(
    q: &Q,
    visibility: Duration,
) {
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let crashing = {
        let started = std::sync::Arc::clone(&started);
        JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let started = std::sync::Arc::clone(&started);
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<(), String>(())
            }
        })
    };
    let a = JobRunner::new("a", q.clone(), crashing)
        .visibility(visibility)
        .idle_poll(visibility / 10)
        .spawn();
    let id = q.enqueue(Job::Sweep).await.unwrap();
    tokio::time::timeout(visibility * 20, started.notified())
        .await
        .expect("the first runner starts the job");
    a.abort();
    let ok = JobHandlers::new().on(["sweep"], |_: Job, _| async { Ok::<(), String>(()) });
    let b = JobRunner::new("b", q.clone(), ok)
        .visibility(visibility)
        .idle_poll(visibility / 10)
        .spawn();
    let attempts = wait_for_state(q, id, JobState::Done, visibility * 20).await;
    let counters = b.stop_within(visibility * 5).await.unwrap();
    assert_eq!(
        attempts, 2,
        "the crashed attempt counts, and the job runs again"
    );
    assert_eq!(counters.acked, 1, "the new runner finished it");
}

/// A job of a kind no handler takes, or whose payload does not decode into its handler's
/// type, is dead-lettered at its first attempt with an error that says so; the runner
/// goes on with the next job.
pub async fn runner_dead_letters_what_it_cannot_run<Q: Queue + Clone + 'static>(q: &Q) {
    #[derive(serde::Serialize, serde::Deserialize)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    enum Mine {
        Resize { width: u32 },
    }
    let unknown = q
        .enqueue(Job::decode(br#"{"kind":"reboot"}"#).unwrap())
        .await
        .unwrap();
    let undecodable = q
        .enqueue(Job::decode(br#"{"kind":"resize","width":"wide"}"#).unwrap())
        .await
        .unwrap();
    let good = q
        .enqueue(Job::custom(&Mine::Resize { width: 640 }).unwrap())
        .await
        .unwrap();
    let handlers = JobHandlers::new().on(["resize"], |job: Mine, _| async move {
        let Mine::Resize { width } = job;
        if width == 640 {
            Ok(())
        } else {
            Err(format!("width {width}"))
        }
    });
    let runner = JobRunner::new("r", q.clone(), handlers)
        .idle_poll(Duration::from_millis(20))
        .spawn();
    let within = Duration::from_secs(30);
    assert_eq!(wait_for_state(q, good, JobState::Done, within).await, 1);
    for (id, says) in [(unknown, "no handler"), (undecodable, "does not decode")] {
        assert_eq!(
            wait_for_state(q, id, JobState::DeadLettered, within).await,
            1,
            "no retry can help a job nothing can run: dead-lettered at once"
        );
        let error = q
            .get(id)
            .await
            .unwrap()
            .unwrap()
            .last_error
            .unwrap_or_default();
        assert!(error.contains(says), "the dead letter says why: {error}");
    }
    let counters = runner.stop_within(within).await.unwrap();
    assert_eq!((counters.acked, counters.dead_lettered), (1, 2));
}

/// An owner taking a lock it holds gets a new lease with a greater fencing token, and
/// the earlier lease is lost: it cannot be renewed, and releasing it leaves the new one
/// held. Two sweeps of one process under one owner name then never both hold the lock,
/// and the first to finish cannot free it while the other still runs.
pub async fn lock_taken_again_by_its_owner_is_a_new_lease<L: Lock>(l: &L) {
    const TTL: Duration = Duration::from_secs(60);
    let first = l
        .try_lock("sweeper", "a", TTL)
        .await
        .unwrap()
        .expect("a free lock");
    let second = l
        .try_lock("sweeper", "a", TTL)
        .await
        .unwrap()
        .expect("its owner takes it again");
    assert!(
        second.fencing > first.fencing,
        "a token grows with every acquisition: {} then {}",
        first.fencing,
        second.fencing
    );
    assert!(
        matches!(l.renew(&first, TTL).await, Err(crate::Error::LeaseLost(_))),
        "the earlier lease is lost"
    );
    l.release(&first).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", TTL).await.unwrap().is_none(),
        "releasing the earlier lease leaves the new one held"
    );
    l.renew(&second, TTL).await.unwrap();
    l.release(&second).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", TTL).await.unwrap().is_some(),
        "released: free"
    );
}

/// A lock taken for [`Duration::MAX`] is held for ever: never a panic on the instant it
/// would expire at (an overflow), and no other owner takes it; renewing it for ever again
/// and releasing it work.
pub async fn lock_for_ever_is_held<L: Lock>(l: &L) {
    let a = l
        .try_lock("sweeper", "a", Duration::MAX)
        .await
        .unwrap()
        .expect("a free lock");
    assert!(
        l.try_lock("sweeper", "b", Duration::from_secs(1))
            .await
            .unwrap()
            .is_none(),
        "held for ever: no other owner takes it"
    );
    l.renew(&a, Duration::MAX).await.unwrap();
    l.release(&a).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", Duration::from_secs(1))
            .await
            .unwrap()
            .is_some(),
        "released: free"
    );
}

/// A job leased for [`Duration::MAX`] is held for ever: never a panic on the instant its
/// lease would end at, never delivered to another runner, and renewable and ackable by
/// its holder. Retrying it after [`Duration::MAX`] keeps it out of sight, not a panic.
pub async fn queue_lease_for_ever_holds_the_job<Q: Queue>(q: &Q) {
    let id = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q.lease(Duration::MAX).await.unwrap().expect("a ready job");
    assert_eq!(lease.id, id);
    assert!(
        q.lease(Duration::from_secs(1)).await.unwrap().is_none(),
        "held for ever: nobody else gets it"
    );
    q.renew(&lease, Duration::MAX).await.unwrap();
    q.ack(&lease).await.unwrap();
    let other = q.enqueue(Job::Sweep).await.unwrap();
    let lease = q
        .lease(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a ready job");
    assert_eq!(lease.id, other);
    let state = q
        .fail(&lease, "try again in an eternity", Duration::MAX)
        .await
        .unwrap();
    assert_eq!(state, JobState::Ready, "one failure: retried, not dead");
    assert!(
        q.lease(Duration::from_secs(1)).await.unwrap().is_none(),
        "retried after an eternity: out of sight"
    );
}

/// One holder at a time; an expired lease frees the lock with a higher fencing token, and
/// the old holder can no longer renew.
///
/// `ttl` is the lease the test takes: short under paused time, long enough on a real clock
/// that the checks made while a lease is held finish inside it on a loaded machine.
pub async fn lock_is_exclusive_and_expires<L: Lock>(l: &L, ttl: Duration) {
    let a = l
        .try_lock("sweeper", "a", ttl)
        .await
        .unwrap()
        .expect("a free lock");
    assert!(
        l.try_lock("sweeper", "b", ttl).await.unwrap().is_none(),
        "exclusive while held"
    );
    l.renew(&a, ttl).await.unwrap();
    tokio::time::sleep(ttl * 3 / 2).await;
    let b = l
        .try_lock("sweeper", "b", ttl)
        .await
        .unwrap()
        .expect("expired: free again");
    assert!(b.fencing > a.fencing, "fencing tokens grow");
    assert!(
        l.renew(&a, ttl).await.is_err(),
        "the expired holder lost the lock"
    );
    l.release(&a).await.unwrap();
    assert!(
        l.try_lock("sweeper", "c", ttl).await.unwrap().is_none(),
        "a stale release is a no-op"
    );
    l.release(&b).await.unwrap();
    assert!(
        l.try_lock("sweeper", "c", ttl).await.unwrap().is_some(),
        "released: free"
    );
}

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

fn ids(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.id).collect()
}

fn seqs(rows: &[OutboxRow]) -> Vec<u64> {
    rows.iter().map(|r| r.seq).collect()
}

/// Outbox rows are claimed by one owner at a time and handed out in id order with the
/// legs that already landed; completing records those legs and releases the claim, but
/// only for the owner that still holds it; an expired claim is taken over. This is what
/// lets relays in several processes publish each row once, and a crashed relay's rows
/// still go out.
///
/// `announced` is a source whose writes append rows to `o` (an announcing source on the
/// same store). `lease` is the short lease the expiry check waits out: short under paused
/// time, long enough on a real clock that a loaded machine makes the checks inside it.
pub async fn outbox_claims_are_exclusive_and_expire<O: Outbox, S: Source>(
    o: &O,
    announced: &S,
    lease: Duration,
) {
    const HOUR: Duration = Duration::from_secs(3600);
    assert_eq!(o.pending().await.unwrap(), 0, "a fresh outbox is empty");
    let none = o.claim("a", 0, 10, HOUR).await.unwrap();
    assert!(none.rows.is_empty() && none.held_by_others.is_none());

    let mut watch = o.watch();
    let s1 = announced.put("k1", b"v".to_vec()).await.unwrap();
    let s2 = announced.put("k2", b"v".to_vec()).await.unwrap();
    let s3 = announced.remove("k1").await.unwrap().unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(5), watch.changed())
            .await
            .is_ok(),
        "an announced write must wake a waiting relay"
    );
    assert_eq!(o.pending().await.unwrap(), 3, "one row per announced write");

    let a = o.claim("a", 0, 2, HOUR).await.unwrap().rows;
    assert_eq!(
        seqs(&a),
        vec![s1, s2],
        "claims go in outbox order, at most max"
    );
    assert!(a[0].id < a[1].id);
    assert_eq!(a[0].plan.key, "k1");
    assert_eq!(Event::decode(&a[0].plan.payload).unwrap().seq(), s1);
    assert_eq!(a[0].landed, AnnounceReport::default(), "nothing landed yet");

    let b = o.claim("b", 0, 10, HOUR).await.unwrap();
    assert_eq!(
        seqs(&b.rows),
        vec![s3],
        "rows another owner holds are not handed out: each row has one relay"
    );
    let held = b
        .held_by_others
        .expect("a's rows are held by another owner");
    assert!(
        held > Duration::ZERO && held <= HOUR,
        "held_by_others is the time left on a's lease: {held:?}"
    );
    assert_eq!(
        ids(&o.claim("a", 0, 10, HOUR).await.unwrap().rows),
        ids(&a),
        "an owner's own claims are handed back to it (a restarted relay resumes its rows)"
    );

    let all = AnnounceReport {
        published: true,
        notified: true,
        enqueued: Some(JobId(7)),
        as_marker: false,
    };
    let only_published = AnnounceReport {
        published: true,
        ..AnnounceReport::default()
    };
    let update = |row: &OutboxRow, landed, done| OutboxUpdate {
        id: row.id,
        landed,
        done,
    };
    assert_eq!(
        o.complete("b", vec![update(&a[0], all, true)])
            .await
            .unwrap(),
        0,
        "a relay cannot complete a row it does not hold"
    );
    assert_eq!(o.pending().await.unwrap(), 3);
    assert_eq!(
        o.complete(
            "a",
            vec![
                update(&a[0], all, true),
                update(&a[1], only_published, false)
            ]
        )
        .await
        .unwrap(),
        2
    );
    assert_eq!(
        o.pending().await.unwrap(),
        2,
        "a done row is no longer pending"
    );

    let b = o.claim("b", 0, 10, HOUR).await.unwrap().rows;
    assert_eq!(
        seqs(&b),
        vec![s2, s3],
        "a completed claim is released; a done row is never handed out again"
    );
    assert_eq!(
        b[0].landed, only_published,
        "a row remembers which legs landed, so a retry redoes only the others"
    );
    assert_eq!(
        seqs(&o.claim("b", b[0].id, 10, HOUR).await.unwrap().rows),
        vec![s3],
        "only rows after `after` are claimed"
    );

    // b renews its claim with the short lease, then "crashes".
    assert_eq!(
        seqs(&o.claim("b", 0, 10, lease).await.unwrap().rows),
        vec![s2, s3]
    );
    let c = o.claim("c", 0, 10, HOUR).await.unwrap();
    assert!(c.rows.is_empty(), "b's live lease keeps its rows from c");
    assert!(
        c.held_by_others.is_some_and(|left| left <= lease),
        "c learns when b's lease runs out: {:?}",
        c.held_by_others
    );
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let c = o.claim("c", 0, 10, HOUR).await.unwrap().rows;
    assert_eq!(
        seqs(&c),
        vec![s2, s3],
        "an expired claim is taken over: a crashed relay's rows still go out"
    );
    assert_eq!(
        o.complete("b", vec![update(&c[1], all, true)])
            .await
            .unwrap(),
        0,
        "a relay whose claim was taken over changes nothing"
    );
    assert_eq!(
        o.complete(
            "c",
            vec![update(&c[0], all, true), update(&c[1], all, true)]
        )
        .await
        .unwrap(),
        2
    );
    assert_eq!(o.pending().await.unwrap(), 0);
    let after = o.claim("a", 0, 10, HOUR).await.unwrap();
    assert!(
        after.rows.is_empty() && after.held_by_others.is_none(),
        "a drained outbox hands out nothing: {after:?}"
    );
}

/// Writes refuse, with a typed error and before anything is stored, every key and value a
/// follower refuses: an empty key, one longer than [`MAX_KEY_BYTES`], one with a control
/// character, a value over [`MAX_VALUE_BYTES`]. A write the source commits but no follower
/// applies is a committed write missing from every converged cache. A key of exactly the
/// limit is stored: refusing more than followers do would be a bug too.
pub async fn source_writes_refuse_what_followers_refuse<S: Source>(s: &S) {
    let too_long = "k".repeat(MAX_KEY_BYTES + 1);
    for key in ["", "a\tb", "a\u{7f}b", too_long.as_str()] {
        let shown = tidemark_core::shorten(key, 16);
        let put = s.put(key, b"v".to_vec()).await;
        let create = s.update(key, b"v".to_vec(), 0).await;
        let remove = s.remove(key).await;
        for (write, result) in [
            ("put", put.map(Some)),
            ("create", create.map(Some)),
            ("remove", remove),
        ] {
            assert!(
                matches!(result, Err(crate::Error::InvalidKey { .. })),
                "a {write} of {shown:?} ({} bytes) must be refused as followers refuse it: {result:?}",
                key.len()
            );
        }
    }
    let too_big = vec![b'x'; MAX_VALUE_BYTES + 1];
    let refused_value = |result: crate::Result<u64>| match result {
        Err(crate::Error::ValueTooLarge { len, max }) => {
            assert_eq!(len, too_big.len());
            assert!(
                max <= MAX_VALUE_BYTES,
                "the limit reported ({max}) is not one followers apply"
            );
        }
        other => {
            panic!("a value over MAX_VALUE_BYTES must be refused as followers refuse it: {other:?}")
        }
    };
    refused_value(s.put("big", too_big.clone()).await);
    refused_value(s.update("big", too_big.clone(), 0).await);
    assert_eq!(
        s.watermark().await.unwrap(),
        0,
        "a refused write uses no seq"
    );

    let at_limit = "k".repeat(MAX_KEY_BYTES);
    let seq = s.put(&at_limit, b"v".to_vec()).await.unwrap();
    refused_value(s.update(&at_limit, too_big.clone(), seq).await);
    let stored = s.get(&at_limit).await.unwrap().map(|v| (v.seq, v.value));
    assert_eq!(
        stored,
        Some((seq, b"v".to_vec())),
        "a key at the limit is one followers accept"
    );
}

/// A listing of the source's keys names every key that holds a value and none that was
/// never written (a removed key may still be named: a listed key need not hold a value),
/// and its watermark is read before the listing, so it is at least the last write's seq.
pub async fn source_lists_its_present_keys<S: Source>(s: &S) {
    s.put("a", b"1".to_vec()).await.unwrap();
    s.put("b", b"2".to_vec()).await.unwrap();
    let last = s.put("c", b"3".to_vec()).await.unwrap();
    s.remove("b").await.unwrap();
    let present = s
        .present_keys()
        .await
        .unwrap()
        .expect("this source lists its keys");
    let mut keys = present.keys.clone();
    keys.sort();
    assert!(
        keys.contains(&"a".to_owned()) && keys.contains(&"c".to_owned()),
        "every key holding a value is listed: {keys:?}"
    );
    assert!(
        keys.iter().all(|k| ["a", "b", "c"].contains(&k.as_str())),
        "no key that was never written: {keys:?}"
    );
    assert!(present.watermark >= last, "{present:?}");
}

/// Typed writes: a serde value is stored as its JSON (what [`Json`](tidemark_core::Json)
/// reads back), a compare-and-set of one is one; a value that does not serialize is an
/// [`Error::Encode`](crate::Error::Encode) and one whose JSON is over [`MAX_VALUE_BYTES`]
/// an [`Error::ValueTooLarge`](crate::Error::ValueTooLarge), both before anything is
/// written.
pub async fn source_puts_typed_values_as_json<S: Source>(s: &S) {
    use crate::PutJson as _;
    use tidemark_core::Decode as _;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Package {
        version: String,
        yanked: bool,
    }
    let v1 = Package {
        version: "1.0.0".into(),
        yanked: false,
    };
    let seq = s.put_json("pkg.a", &v1).await.unwrap();
    let stored = s.get("pkg.a").await.unwrap().unwrap();
    assert_eq!(stored.seq, seq);
    let read: Package = tidemark_core::Json::new()
        .decode("pkg.a", stored.value)
        .unwrap();
    assert_eq!(read, v1, "what a Json decoder reads back is what was put");
    let v2 = Package {
        version: "1.0.1".into(),
        yanked: true,
    };
    let conflict = s.update_json("pkg.a", &v2, seq + 1_000).await;
    assert!(
        matches!(conflict, Err(crate::Error::Conflict { .. })),
        "{conflict:?}"
    );
    let seq2 = s.update_json("pkg.a", &v2, seq).await.unwrap();
    assert!(seq2 > seq);

    let watermark = s.watermark().await.unwrap();
    // A map with keys that are not strings has no JSON form.
    let unencodable = std::collections::BTreeMap::from([((1u8, 2u8), 3u8)]);
    let refused = s.put_json("pkg.b", &unencodable).await;
    assert!(
        matches!(&refused, Err(crate::Error::Encode { key, .. }) if key == "pkg.b"),
        "a value with no JSON form is a typed error naming the key: {refused:?}"
    );
    let huge = "x".repeat(MAX_VALUE_BYTES);
    let refused = s.put_json("pkg.c", &huge).await;
    assert!(
        matches!(refused, Err(crate::Error::ValueTooLarge { len, .. }) if len == MAX_VALUE_BYTES + 2),
        "JSON over the followers' limit is refused before it is sent: {refused:?}"
    );
    assert_eq!(
        s.watermark().await.unwrap(),
        watermark,
        "a refused typed write uses no seq"
    );
    assert_eq!(s.get("pkg.b").await.unwrap(), None);
}

/// A ready, never-leased `pack_housekeeping` job absorbs later enqueues for its key (the
/// enqueue returns its id), so pending housekeeping is bounded by the keys written, not by
/// the writes; once it is leased, the next enqueue makes a new job (the running one may
/// have read the key already). Other keys, sweeps and a user's kinds never coalesce.
pub async fn queue_coalesces_pending_jobs_per_key<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    let pack = |key: &str| Job::PackHousekeeping { key: key.into() };
    let a = q.enqueue(pack("a")).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            q.enqueue(pack("a")).await.unwrap(),
            a,
            "a pending job for the key absorbs the enqueue and says which job holds it"
        );
    }
    let b = q.enqueue(pack("b")).await.unwrap();
    assert_ne!(a, b, "another key is another job");
    let batch = q.enqueue_batch(vec![pack("a"), pack("b"), pack("c")]).await;
    let batch: Vec<JobId> = batch.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        &batch[..2],
        &[a, b],
        "a batch enqueue coalesces like a single one"
    );
    let c = batch[2];
    assert!(c != a && c != b);
    let custom = Job::decode(br#"{"kind":"reindex","key":"a"}"#).unwrap();
    let c1 = q.enqueue(custom.clone()).await.unwrap();
    let c2 = q.enqueue(custom).await.unwrap();
    assert_ne!(c1, c2, "a user's jobs never coalesce");
    let counts = q.counts().await.unwrap();
    assert_eq!(
        counts.ready, 5,
        "three pending housekeeping jobs and two user jobs, whatever the enqueues: {counts:?}"
    );

    let lease = q.lease(visibility).await.unwrap().expect("a ready job");
    assert_eq!(lease.id, a, "oldest first");
    let again = q.enqueue(pack("a")).await.unwrap();
    assert_ne!(
        again, a,
        "a leased job absorbs nothing: a write after its handler read the key needs a new run"
    );
    assert_eq!(
        q.enqueue(pack("a")).await.unwrap(),
        again,
        "the new job is the pending one now"
    );
    q.ack(&lease).await.unwrap();
    assert_eq!(q.get(a).await.unwrap().unwrap().state, JobState::Done);
    assert_eq!(
        q.get(again).await.unwrap().unwrap().job,
        pack("a"),
        "the absorbing job reads back by the id the enqueue returned"
    );
}

/// Sweeps are leased before every other ready job, however many were enqueued first, so a
/// backlog of housekeeping never delays retention.
pub async fn queue_leases_sweeps_first<Q: Queue>(q: &Q) {
    let visibility = Duration::from_secs(30);
    for key in ["a", "b", "c"] {
        q.enqueue(Job::PackHousekeeping { key: key.into() })
            .await
            .unwrap();
    }
    let sweep = q.enqueue(Job::Sweep).await.unwrap();
    let first = q.lease(visibility).await.unwrap().expect("ready jobs");
    assert_eq!(
        (first.id, first.job.clone()),
        (sweep, Job::Sweep),
        "the sweep goes before the housekeeping enqueued ahead of it"
    );
    q.ack(&first).await.unwrap();
    let next = q.lease(visibility).await.unwrap().expect("ready jobs");
    assert_eq!(
        next.job,
        Job::PackHousekeeping { key: "a".into() },
        "then the oldest"
    );
    q.ack(&next).await.unwrap();
}

/// A batch publish appends every item in order, as single publishes would, and reports
/// each item's position: what the relay's batched publish leg relies on.
pub async fn events_publish_batch_in_order<P: Publish + Feed>(events: &P) {
    let items: Vec<(String, Vec<u8>)> = (1..=5u64)
        .map(|seq| {
            let event = Event::Put {
                seq,
                key: format!("k{seq}"),
                value: vec![b'v'],
            };
            (format!("k{seq}"), event.encode().unwrap())
        })
        .collect();
    let positions: Vec<u64> = events
        .publish_batch(items)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions increase in batch order: {positions:?}"
    );
    let mut stream = events.open(1, None).await.unwrap().stream;
    for (seq, position) in (1..=5u64).zip(positions) {
        let got = entry(next_item(&mut stream).await);
        assert_eq!(
            (got.position, got.seq, &*got.key),
            (position, seq, format!("k{seq}").as_str()),
            "every item of the batch arrives, in order, where its result said"
        );
    }
}

/// A runner waiting on an empty queue that signals readiness
/// ([`Queue::ready_signal`]) runs a job enqueued meanwhile at once, not after its idle
/// poll, which here is an hour: the poll is only the backstop.
pub async fn runner_wakes_on_enqueue<Q: Queue + Clone + 'static>(q: &Q) {
    const POLL: Duration = Duration::from_secs(3600);
    assert!(
        q.ready_signal().is_some(),
        "this queue says it can tell a runner when jobs are ready"
    );
    let ran = std::sync::Arc::new(tokio::sync::Notify::new());
    let handlers = {
        let ran = std::sync::Arc::clone(&ran);
        JobHandlers::new().on(["sweep"], move |_: Job, _| {
            let ran = std::sync::Arc::clone(&ran);
            async move {
                ran.notify_one();
                Ok::<(), String>(())
            }
        })
    };
    let runner = JobRunner::new("woken", q.clone(), handlers)
        .idle_poll(POLL)
        .spawn();
    // Long enough for the runner to find the queue empty and wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let enqueued = tokio::time::Instant::now();
    q.enqueue(Job::Sweep).await.unwrap();
    tokio::time::timeout(POLL / 2, ran.notified())
        .await
        .expect("the enqueue wakes the waiting runner before its idle poll");
    assert!(
        enqueued.elapsed() < Duration::from_secs(30),
        "woken by the enqueue, not by the poll: {:?}",
        enqueued.elapsed()
    );
    runner.stop_within(Duration::from_secs(10)).await.unwrap();
}
