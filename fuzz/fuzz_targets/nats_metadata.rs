//! Arbitrary ack subjects and headers: what the NATS adapter reads of every message.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_nats::fuzzing::message_metadata(data));
