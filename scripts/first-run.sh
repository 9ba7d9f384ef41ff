#!/usr/bin/env bash
# The first run a newcomer meets: the README's main job from a clean target dir, build
# included, timed. Clones this checkout's HEAD into a temporary directory (so nothing of
# this checkout's target dir is reused), runs
#
#   cargo run -p tidemark-sim --release -- --seeds 0..300
#
# there, and prints the build's and the run's seconds beside the whole, and the whole as a
# ratio of the 120 s goal. Crates already downloaded into cargo's registry are reused, as
# on a machine that built any Rust project before; nothing is fetched when they are.
#
#   bash scripts/first-run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d "${TMPDIR:-/tmp}/tidemark-first-run.XXXXXX")"
trap 'rm -rf "$work"' EXIT
git clone -q . "$work/tidemark"
cd "$work/tidemark"
export CARGO_TARGET_DIR="$work/target"

start=$(date +%s.%N)
cargo build -q -p tidemark-sim --release
built=$(date +%s.%N)
cargo run -q -p tidemark-sim --release -- --seeds 0..300 >"$work/run.log" 2>&1 || {
    tail -5 "$work/run.log" >&2
    echo "first run: the simulation failed" >&2
    exit 1
}
done_at=$(date +%s.%N)
crates=$(find "$CARGO_TARGET_DIR/release/.fingerprint" -maxdepth 1 -mindepth 1 -type d | sed 's/-[0-9a-f]*$//' | sort -u | wc -l)

awk -v s="$start" -v b="$built" -v d="$done_at" -v c="$crates" 'BEGIN {
    build = b - s; run = d - b; all = d - s;
    printf "first run: %.0f s (build %.0f s of %d units, run of 300 seeds %.0f s)\n", all, build, c, run;
    printf "ratio first-run/goal: %.2f (goal 120 s)\n", all / 120;
}'
grep -E "^failures:" "$work/run.log"
