//! What `changes_since` holds while it replays, against a real server: one entry per key,
//! not every message since (with the counting allocator, so in a binary of its own).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use tidemark::{Changes, Source};
use tidemark_nats::KvBucket;
use tidemark_tests::alloc::{live, peak_above, reset_peak};

use common::*;

#[global_allocator]
static GLOBAL: tidemark_tests::CountingAlloc = tidemark_tests::CountingAlloc;

/// 20 keys written 60 times each with 2 KiB values on a bucket keeping 64 revisions: the
/// changes since 0 are 1,200 messages (2.4 MB) for 20 keys. It used to keep every message
/// and reserve room from the first one's pending count; it now keeps the latest per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_since_holds_one_entry_per_key_while_it_replays() {
    const KEYS: usize = 20;
    const WRITES: usize = 60;
    const VALUE: usize = 2_048;
    let server = server().await;
    let client = client(&server).await;
    create_bucket(&client, "revisions", 64, 1).await;
    // A cap on the messages in flight keeps what the client buffers small, so the peak
    // is what the replay keeps.
    let bucket = KvBucket::new(client.clone(), "revisions")
        .unwrap()
        .with_max_in_flight(32);
    for round in 0..WRITES {
        for k in 0..KEYS {
            bucket
                .put(&format!("k{k}"), vec![u8::try_from(round).unwrap(); VALUE])
                .await
                .unwrap();
        }
    }
    let before = live();
    reset_peak();
    let changes = bucket.changes_since(0).await.unwrap();
    let peak = peak_above(before);
    let Changes::Since { entries, .. } = changes else {
        panic!("nothing was compacted");
    };
    assert_eq!(entries.len(), KEYS);
    let all = KEYS * WRITES * VALUE;
    assert!(
        peak < all / 4,
        "the replay kept {peak} bytes at its peak for {} bytes of latest values; every \
         message since is {all}",
        KEYS * VALUE
    );
}
