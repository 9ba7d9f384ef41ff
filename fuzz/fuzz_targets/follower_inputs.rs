//! Arbitrary input sequences through a follower: no panic; invariants hold.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzzing::follower_inputs(data));
