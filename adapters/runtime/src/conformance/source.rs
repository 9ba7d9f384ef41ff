//! The `Source` port: seqs, reads, compare-and-set, changes and snapshots, and what a
//! write refuses.

use super::common::*;

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
