//! Replays the `sqlite_rows` fuzz target's body over its checked-in corpus, so CI runs it
//! on the stable toolchain without cargo-fuzz.

#[test]
fn foreign_rows_corpus_reads_back_without_panics() {
    for (_, data) in tidemark_tests::fuzz_corpus("sqlite_rows") {
        tidemark_sqlite::fuzzing::foreign_rows(&data);
    }
}
