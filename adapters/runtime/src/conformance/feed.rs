//! Feeds, events, cursors and wake: a change log replays then follows, events arrive in
//! order, cursors are monotone, a wake reaches its listeners.

use super::common::*;

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

/// A change log says at open which history it serves at `from - 1` (the follower's
/// watermark), with that entry's stamp, in the same read as its first seq: a compaction
/// between the open and a second read could take the one entry whose stamp tells a
/// restored history from the one the follower read, and the feed would go on into the
/// restored history over the replaced one's changes (the simulator's seeds 63 and 139 of
/// `--restores-while-cut`). Only for a source that states its history.
pub async fn change_log_states_its_history_at_the_watermark_on_open<S: Source + Feed>(s: &S) {
    s.put("a", b"1".to_vec()).await.unwrap();
    let second = s.put("b", b"2".to_vec()).await.unwrap();
    let told = s.lineage_at(second).await.unwrap();
    assert!(
        told.history.is_some() && told.stamp.is_some(),
        "the source states its history and the stamp at its head: {told:?}"
    );
    let opened = s.open(second + 1, None).await.unwrap();
    assert_eq!(
        opened.info.lineage, told,
        "the feed states the history at the watermark it resumes from"
    );
    s.put("c", b"3".to_vec()).await.unwrap();
    let from_start = s.open(1, None).await.unwrap();
    assert_eq!(
        from_start.info.lineage.history, told.history,
        "a feed from the first seq names the history (no entry before it has a stamp)"
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
