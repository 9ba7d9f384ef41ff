//! Arbitrary bytes as an event: no panic; valid events round-trip.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzzing::decode_event(data));
