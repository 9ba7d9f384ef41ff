//! The checked-in fuzz corpus, for the plain tests that replay each fuzz target's body
//! over it on the stable toolchain.

use std::path::PathBuf;

/// Every file of `fuzz/corpus/<target>`, in name order, with its bytes. Panics (failing
/// the test) if the corpus is missing or holds fewer than 10 inputs: a replay over a
/// handful of files proves nothing.
#[must_use]
pub fn fuzz_corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} must be checked in: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("unreadable entry in {}: {e}", dir.display()))
                .path()
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the {target} corpus is too small to mean anything"
    );
    files
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p)
                .unwrap_or_else(|e| panic!("unreadable corpus file {}: {e}", p.display()));
            (p, data)
        })
        .collect()
}
