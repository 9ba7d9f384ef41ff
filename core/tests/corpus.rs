//! Replays the fuzz targets' bodies over the checked-in corpus, so CI exercises them on the
//! stable toolchain without cargo-fuzz.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tidemark_tests::fuzz_corpus as corpus;

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
