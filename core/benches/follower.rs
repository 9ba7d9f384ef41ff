//! Placeholder, replaced by the follower benchmark.
fn main() {}
