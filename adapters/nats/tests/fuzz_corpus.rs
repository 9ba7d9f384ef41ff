//! Replays the `nats_metadata` fuzz target's body over its checked-in corpus, so CI runs
//! it on the stable toolchain without cargo-fuzz.
#![allow(clippy::unwrap_used)]

#[test]
fn message_metadata_corpus_replays_without_panics() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/nats_metadata");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} must be checked in: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the corpus is too small to mean anything"
    );
    for file in files {
        tidemark_nats::fuzzing::message_metadata(&std::fs::read(&file).unwrap());
    }
}
