//! The `Outbox` port: exclusive, expiring claims and each row published once.

use super::common::*;

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
    assert_eq!(o.pending().await.unwrap(), 0, "a fresh outbox is empty");
    let none = o.claim("a", 0, 10, HOUR).await.unwrap();
    assert!(none.rows.is_empty() && none.held_by_others.is_none());
    let [s1, s2, s3] = three_announced_rows(o, announced).await;
    let a = claims_are_exclusive(o, [s1, s2, s3]).await;
    completes_release_claims(o, &a, [s2, s3]).await;
    expired_claims_are_taken_over(o, lease, [s2, s3]).await;
}

/// A claim's lease in the checks that wait out no lease.
const HOUR: Duration = Duration::from_secs(3600);

/// Every leg landed.
const ALL: AnnounceReport = AnnounceReport {
    published: true,
    notified: true,
    enqueued: Some(JobId(7)),
    as_marker: false,
};

/// A completion of `row` with `landed`, `done` or not.
fn update(row: &OutboxRow, landed: AnnounceReport, done: bool) -> OutboxUpdate {
    OutboxUpdate {
        id: row.id,
        landed,
        done,
    }
}

/// Three announced writes (two puts and a removal) make three rows and wake a waiting
/// relay; their seqs.
async fn three_announced_rows<O: Outbox, S: Source>(o: &O, announced: &S) -> [u64; 3] {
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

    [s1, s2, s3]
}

/// Claims go in outbox order to one owner at a time, and an owner's own claims are handed
/// back to it; the rows `a` claimed.
async fn claims_are_exclusive<O: Outbox>(o: &O, [s1, s2, s3]: [u64; 3]) -> Vec<OutboxRow> {
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

    a
}

/// Completing records the legs that landed and releases the claim, only for the owner
/// that holds it.
async fn completes_release_claims<O: Outbox>(o: &O, a: &[OutboxRow], [s2, s3]: [u64; 2]) {
    let only_published = AnnounceReport {
        published: true,
        ..AnnounceReport::default()
    };
    assert_eq!(
        o.complete("b", vec![update(&a[0], ALL, true)])
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
                update(&a[0], ALL, true),
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
}

/// An expired claim is taken over, and its old owner can no longer complete it.
async fn expired_claims_are_taken_over<O: Outbox>(o: &O, lease: Duration, [s2, s3]: [u64; 2]) {
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
        o.complete("b", vec![update(&c[1], ALL, true)])
            .await
            .unwrap(),
        0,
        "a relay whose claim was taken over changes nothing"
    );
    assert_eq!(
        o.complete(
            "c",
            vec![update(&c[0], ALL, true), update(&c[1], ALL, true)]
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
