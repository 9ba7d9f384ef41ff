//! Replays the fuzz targets' bodies over the checked-in corpus, so CI exercises them on the
//! stable toolchain without cargo-fuzz.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} must be checked in: {e}", dir.display()))
        .map(|e| e.expect("readable corpus entry").path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the {target} corpus is too small to mean anything"
    );
    files
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).expect("readable corpus file")))
        .collect()
}

#[test]
fn decode_event_corpus_replays_without_panics_and_valid_events_round_trip() {
    let mut valid = 0;
    for (path, data) in corpus("decode_event") {
        tidemark_core::fuzzing::decode_event(&data);
        if tidemark_core::Event::decode(&data).is_ok() {
            valid += 1;
        }
        let _ = path;
    }
    assert!(
        valid >= 3,
        "the corpus must hold valid events too, or round-trip goes unchecked"
    );
}

#[test]
fn follower_inputs_corpus_replays_with_invariants_holding() {
    for (path, data) in corpus("follower_inputs") {
        let result = std::panic::catch_unwind(|| tidemark_core::fuzzing::follower_inputs(&data));
        assert!(result.is_ok(), "{} broke an invariant", path.display());
    }
}

#[test]
fn decode_value_corpus_replays_with_the_decoders_agreeing() {
    for (_, data) in corpus("decode_value") {
        tidemark_core::fuzzing::decode_value(&data);
    }
}
