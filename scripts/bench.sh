#!/usr/bin/env bash
# Runs every benchmark and prints their headline figures (each measured against a baseline
# in the same run) as one table; the README's Benchmarks table comes from it.
#
#   bash scripts/bench.sh                 # every bench, once
#   bash scripts/bench.sh --runs 3        # every bench three times (a row per run)
#   bash scripts/bench.sh core memory     # only those (core memory sqlite relay nats
#                                         #   nats-sync-200k nats-sync-1m nats-mirror-200k
#                                         #   nats-memory recovery pauses sim first-run)
#
# The soaks (`--bench soak` of tidemark-sqlite and tidemark-nats) are left out: they write
# for minutes at a paced rate (the README gives their own commands).
#
# The NATS benches provision nats-server first (scripts/provision-nats.sh). Full logs are
# kept in a temporary directory named at the end. The machine's load is printed beside
# each run: on a shared machine, figures move with it.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1
selected=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) selected+=("$1"); shift ;;
    esac
done
[ ${#selected[@]} -gt 0 ] || selected=(core memory sqlite relay nats nats-sync-200k nats-sync-1m nats-mirror-200k nats-memory recovery pauses sim first-run)

# name | command | the lines of its output that carry its headline figures (an ERE)
benches=(
    "core|cargo bench -q -p tidemark-core|^ratio core/bare|^follower \\(in"
    "memory|cargo bench -q -p tidemark-memory|^ratio task/core|^  the task over a sink keeping no map|^follower task:|^core alone:|^follower \\+ cache|^resync peak|^bare HashMap<"
    "sqlite|cargo bench -q -p tidemark-sqlite --bench sqlite --bench resync_memory|^writes \\(|^reconcile of|^persisted follower|wake latency|^snapshot of"
    "relay|cargo bench -q -p tidemark-sqlite --bench relay -- --rows 20000|^relay:|x$"
    "nats|cargo bench -q -p tidemark-nats --bench nats|^initial sync of|^  bare watch_with_history keeping|^  feed alone|^  CPU µs per key|^live follow|^write->applied|^  cold mirror|^persisted mirror"
    "nats-sync-200k|env TIDEMARK_BENCH_SYNC_KEYS=200000 TIDEMARK_BENCH_PARTS=sync cargo bench -q -p tidemark-nats --bench nats|^initial sync of|^  bare watch_with_history keeping|^  CPU µs per key"
    "nats-sync-1m|env TIDEMARK_BENCH_SYNC_KEYS=1000000 TIDEMARK_BENCH_PARTS=sync cargo bench -q -p tidemark-nats --bench nats|^initial sync of|^  bare watch_with_history keeping|^  CPU µs per key"
    "nats-mirror-200k|env TIDEMARK_BENCH_MIRROR_KEYS=200000 TIDEMARK_BENCH_PARTS=persisted cargo bench -q -p tidemark-nats --bench nats|^  cold mirror|^persisted mirror"
    "nats-memory|cargo bench -q -p tidemark-nats --bench snapshot_memory|^snapshot of|^cache of"
    "recovery|cargo bench -q -p tidemark-nats --bench recovery|catch-up p50|not caught up"
    "pauses|cargo bench -q -p tidemark-nats --bench pauses|^pause "
    "sim|cargo run -q -p tidemark-sim --release -- --seeds 0..300|seeds in"
    "first-run|bash scripts/first-run.sh|^first run:|^ratio first-run"
)

if printf '%s\n' "${selected[@]}" | grep -qE '^(nats|nats-sync-200k|nats-sync-1m|nats-mirror-200k|nats-memory|recovery|pauses)$'; then
    bash scripts/provision-nats.sh >/dev/null
    if [ -z "${NATS_SERVER_BIN:-}" ] && [ -x .tools/nats/bin/nats-server ]; then
        export NATS_SERVER_BIN="$PWD/.tools/nats/bin/nats-server"
    fi
fi

logs="$(mktemp -d "${TMPDIR:-/tmp}/tidemark-bench.XXXXXX")"
table="$logs/table.md"
echo "| Bench | Run | Load | Figure |" >"$table"
echo "|---|---|---|---|" >>"$table"
failed=0
for run in $(seq 1 "$runs"); do
    for entry in "${benches[@]}"; do
        IFS='|' read -r name cmd pattern <<<"$entry"
        printf '%s\n' "${selected[@]}" | grep -qx "$name" || continue
        log="$logs/$name.$run.log"
        load="$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')"
        echo "== run $run: $name ($cmd), load $load" >&2
        if ! $cmd >"$log" 2>&1; then
            echo "   FAILED: see $log" >&2
            echo "| $name | $run | $load | FAILED (log: $log) |" >>"$table"
            failed=1
            continue
        fi
        grep -E "$pattern" "$log" | sed -e 's/^ *//' -e 's/|/\//g' | while IFS= read -r line; do
            echo "| $name | $run | $load | $line |" >>"$table"
        done
        if [ "$name" = sim ]; then
            # The simulator prints its rate; its baseline is the goal of 40 seeds/s.
            sed -nE 's/.*\(([0-9.]+) seeds\/s\).*/\1/p' "$log" | head -1 | while read -r rate; do
                ratio="$(awk -v r="$rate" 'BEGIN { printf "%.2f", r / 40 }')"
                echo "| $name | $run | $load | ratio sim/goal: $ratio (goal 40 seeds/s) |" >>"$table"
            done
        fi
    done
done
echo
cat "$table"
echo
echo "logs: $logs"
exit "$failed"
