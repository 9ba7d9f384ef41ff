//! Arbitrary bytes through every built-in value decoder: no panic; UTF-8 and JSON agree.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzzing::decode_value(data));
