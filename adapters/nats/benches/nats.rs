//! Benchmarks of the NATS adapter (to come).
fn main() {}
