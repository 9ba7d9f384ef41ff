//! `FeedStream::next_ready`: a turn's items handed over at once must be exactly what
//! `next` would have given at once, call after call — for the memory log (which hands over
//! what it read in batches) and for a stream on the trait's default (the events stream).
#![allow(clippy::unwrap_used)]

use futures::FutureExt;
use tidemark::tidemark_core::Event;
use tidemark::{Feed, FeedItem, FeedStream, Publish, Result, Source};
use tidemark_memory::{MemoryEvents, MemorySource, Port};

type Item = Option<Result<FeedItem>>;

/// What `next` gives without waiting, call after call, up to the first end or error.
fn by_next<S: FeedStream>(stream: &mut S) -> Vec<Item> {
    let mut items = Vec::new();
    while let Some(item) = stream.next().now_or_never() {
        let last = !matches!(item, Some(Ok(_)));
        items.push(item);
        if last {
            break;
        }
    }
    items
}

/// What `next_ready` gives, `max` at a time, until it gives nothing or an end or error.
fn by_next_ready<S: FeedStream>(stream: &mut S, max: usize) -> Vec<Item> {
    let mut items = Vec::new();
    loop {
        let before = items.len();
        let taken = stream.next_ready(max, &mut items);
        assert_eq!(taken, items.len() - before, "it counts what it appended");
        assert!(taken <= max, "never more than asked for");
        if taken == 0 || !matches!(items.last(), Some(Some(Ok(_)))) {
            return items;
        }
    }
}

/// The items, comparable (errors by their message).
fn shown(items: &[Item]) -> Vec<String> {
    items
        .iter()
        .map(|i| match i {
            Some(Ok(item)) => format!("{item:?}"),
            Some(Err(e)) => format!("error: {e}"),
            None => "end".to_owned(),
        })
        .collect()
}

async fn log_with(entries: usize) -> MemorySource {
    let source = MemorySource::default();
    for i in 0..entries {
        source
            .put(&format!("k{:05}", i % 1_700), vec![b'v'; i % 7])
            .await
            .unwrap();
    }
    source.remove("k00003").await.unwrap();
    source
}

#[tokio::test]
async fn the_memory_log_hands_over_at_once_what_next_would_give_at_once() {
    // More than two of the log's reads of 1,024 entries, taken in turns that end inside
    // them, and one that ends exactly on the last entry.
    let source = log_with(2_500).await;
    for max in [1, 700, 1_024, 2_501, 16_384] {
        let mut a = source.open(1, None).await.unwrap().stream;
        let mut b = source.open(1, None).await.unwrap().stream;
        let expected = by_next(&mut a);
        assert_eq!(expected.len(), 2_501);
        assert_eq!(
            shown(&by_next_ready(&mut b, max)),
            shown(&expected),
            "max {max}"
        );
        // Caught up: nothing now, and nothing appended; a new write is there at once.
        let mut none = Vec::new();
        assert_eq!(b.next_ready(max, &mut none), 0);
        assert!(none.is_empty());
    }
    let mut b = source.open(2_400, None).await.unwrap().stream;
    assert_eq!(by_next_ready(&mut b, 64).len(), 102);
    let seq = source.put("late", b"x".to_vec()).await.unwrap();
    let mut late = Vec::new();
    assert_eq!(b.next_ready(64, &mut late), 1);
    assert!(matches!(&late[0], Some(Ok(FeedItem::Entry(e))) if e.seq == seq));
}

#[tokio::test]
async fn the_memory_log_hands_over_its_end_and_stops_there() {
    // A feed ended under it (a restore, a server restart) ends the turn with `None`, even
    // with entries read and not yet handed over: `next` would not give them either.
    let source = log_with(1_500).await;
    let mut a = source.open(1, None).await.unwrap().stream;
    let mut b = source.open(1, None).await.unwrap().stream;
    let (mut first_a, mut first_b) = (Vec::new(), Vec::new());
    assert_eq!(a.next_ready(10, &mut first_a), 10);
    assert_eq!(b.next_ready(10, &mut first_b), 10);
    source.end_feeds();
    let expected = by_next(&mut a);
    let mut got = Vec::new();
    assert_eq!(b.next_ready(100, &mut got), 1, "only the end");
    assert_eq!(shown(&got), shown(&expected));
    assert_eq!(shown(&got), ["end"]);
}

#[tokio::test]
async fn the_memory_log_hands_over_a_failure_and_then_goes_on_as_next_would() {
    let source = log_with(300).await;
    let mut a = source.open(1, None).await.unwrap().stream;
    let mut b = source.open(1, None).await.unwrap().stream;
    // One injected failure for each stream's read, in the middle of the log.
    let (mut head_a, mut head_b) = (Vec::new(), Vec::new());
    a.next_ready(50, &mut head_a);
    b.next_ready(50, &mut head_b);
    source.faults().fail_next(Port::Feed, 1);
    let failed_a = by_next(&mut a);
    source.faults().fail_next(Port::Feed, 1);
    let failed_b = by_next_ready(&mut b, 100);
    assert_eq!(shown(&failed_b), shown(&failed_a));
    assert_eq!(failed_b.len(), 1, "the failure ends the turn");
    assert!(matches!(failed_b[0], Some(Err(_))));
    // The entries after it are still there, as they are for `next`.
    assert_eq!(shown(&by_next_ready(&mut b, 100)), shown(&by_next(&mut a)));

    // A log compacted under an open feed fails it, as `next` does.
    let mut c = source.open(1, None).await.unwrap().stream;
    source.compact_below(200);
    let got = by_next_ready(&mut c, 100);
    assert_eq!(got.len(), 1);
    assert!(matches!(&got[0], Some(Err(e)) if e.to_string().contains("compacted")));
}

#[tokio::test]
async fn a_stream_on_the_default_hands_over_what_next_would_give_at_once() {
    // The events stream keeps the trait's default (one `next` polled per item).
    let events = MemoryEvents::default();
    for i in 0..40u64 {
        let key = format!("k{i}");
        let payload = if i == 17 {
            // Not an event: handed over as undecodable, like the rest.
            b"{\"foreign\":true}".to_vec()
        } else {
            let value = vec![b'v'; 3];
            let seq = i + 1;
            Event::Put {
                seq,
                key: key.clone(),
                value,
            }
            .encode()
            .unwrap()
        };
        events.publish(&key, payload).await.unwrap();
    }
    let mut a = events.open(1, None).await.unwrap().stream;
    let mut b = events.open(1, None).await.unwrap().stream;
    let expected = by_next(&mut a);
    assert_eq!(expected.len(), 40);
    assert_eq!(shown(&by_next_ready(&mut b, 7)), shown(&expected));
    let mut none = Vec::new();
    assert_eq!(b.next_ready(7, &mut none), 0);
}
