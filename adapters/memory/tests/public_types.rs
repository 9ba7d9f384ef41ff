//! Types a port's methods return must be reachable from outside the crate: an adapter
//! that overrides a method has to name its return type.
#![allow(clippy::unwrap_used)]

use futures::StreamExt;
use tidemark::{SnapshotParts, Source};
use tidemark_memory::MemorySource;

/// An adapter overriding `Source::snapshot_parts` writes this type in its signature; it
/// was public in a private module, so no adapter outside the crate could (and the
/// crate's docs linked to a private item).
async fn parts_of(source: &MemorySource, part_len: usize) -> SnapshotParts<'_> {
    source.snapshot_parts(part_len).await.unwrap()
}

#[tokio::test]
async fn an_adapter_can_name_the_snapshot_parts_a_source_returns() {
    let source = MemorySource::default();
    for key in ["a", "b", "c"] {
        source.put(key, b"v".to_vec()).await.unwrap();
    }
    let parts = parts_of(&source, 2).await;
    assert_eq!(parts.watermark, 3);
    let lens: Vec<usize> = parts.parts.map(|p| p.unwrap().len()).collect().await;
    assert_eq!(lens, [2, 1]);
}
