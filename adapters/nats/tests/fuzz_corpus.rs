//! Replays the `nats_metadata` fuzz target's body over its checked-in corpus, so CI runs
//! it on the stable toolchain without cargo-fuzz.

#[test]
fn message_metadata_corpus_replays_without_panics() {
    for (_, data) in tidemark_tests::fuzz_corpus("nats_metadata") {
        tidemark_nats::fuzzing::message_metadata(&data);
    }
}
