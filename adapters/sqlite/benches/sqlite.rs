//! Benchmarks of the SQLite adapter (filled in below).
fn main() {}
