//! Foreign and corrupt rows in a tidemark SQLite file, read back through every read path.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_sqlite::fuzzing::foreign_rows(data));
