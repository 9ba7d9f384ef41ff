#!/usr/bin/env bash
# A proving campaign in one command: simulation seeds on every core, the proptest model
# with many cases, and every cargo-fuzz target for its share of the time. Prints one
# summary table and exits non-zero on any failure (every failure with how to replay it).
#
#   bash scripts/campaign.sh --minutes 10
#
# Shares of the time: simulation 50%, proptest model 15%, fuzzing 35% split evenly between
# the targets. Installs cargo-fuzz (cargo install) when it is missing; the fuzz targets run
# on the stable toolchain with RUSTC_BOOTSTRAP=1.
#
#   bash scripts/campaign.sh --nats 30
#
# The fault campaign against real nats-server processes instead, for that many minutes
# (with --minutes too: the simulation campaign first, then this one): seeded rounds of
# kill -9, SIGSTOP and proxy faults under writers, with the cache and the tidemark mirror
# checked against what the writers were acknowledged (adapters/cli/tests/nats_campaign).
# Provisions a nats-server first; every failing round prints the command that replays it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

minutes=10
minutes_given=0
nats_minutes=""
nats_given=0
whole_number() {
  case "$2" in ''|*[!0-9]*) echo "campaign: $1 takes a whole number" >&2; exit 2 ;; esac
  [ "$2" -ge 1 ] || { echo "campaign: $1 must be at least 1" >&2; exit 2; }
}
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes="${2:-}"; minutes_given=1; shift; shift || true ;;
    --minutes=*) minutes="${1#*=}"; minutes_given=1; shift ;;
    --nats) nats_minutes="${2:-}"; nats_given=1; shift; shift || true ;;
    --nats=*) nats_minutes="${1#*=}"; nats_given=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "campaign: unknown argument $1 (try --minutes N or --nats N)" >&2; exit 2 ;;
  esac
done
whole_number --minutes "$minutes"
[ "$nats_given" -eq 0 ] || whole_number --nats "$nats_minutes"

# ---- the NATS fault campaign: its own summary and exit status ----
nats_campaign() {
  bash scripts/provision-nats.sh >/dev/null \
    || { echo "campaign: no nats-server (see scripts/provision-nats.sh)" >&2; return 1; }
  cargo test -q -p tidemark-cli --test nats_campaign --no-run 2>/dev/null \
    || { echo "campaign: the NATS campaign does not build" >&2; return 1; }
  local start=${CAMPAIGN_NATS_START:-$(( $(date +%s) % 1000000 ))}
  echo "campaign: NATS fault campaign for ${nats_minutes} min from seed $start (CAMPAIGN_NATS_START=$start repeats it)"
  cargo test -q -p tidemark-cli --test nats_campaign -- --minutes "$nats_minutes" --start-seed "$start"
}
if [ "$nats_given" -eq 1 ] && [ "$minutes_given" -eq 0 ]; then
  nats_campaign
  exit $?
fi

total=$((minutes * 60))
sim_secs=$((total * 50 / 100))
model_secs=$((total * 15 / 100))
targets=(decode_event follower_inputs decode_value sqlite_rows nats_metadata)
fuzz_secs=$(((total - sim_secs - model_secs) / ${#targets[@]}))
jobs=$(nproc 2>/dev/null || echo 2)
log=$(mktemp -d "${TMPDIR:-/tmp}/tidemark-campaign.XXXXXX")
status=0
failures=()

echo "campaign: ${minutes} min on ${jobs} cores (sim ${sim_secs}s, model ${model_secs}s, fuzz ${fuzz_secs}s x ${#targets[@]}); logs in ${log}"

# ---- build first, so the shares are spent running, not compiling ----
cargo build -q --release -p tidemark-sim || { echo "campaign: the simulator does not build" >&2; exit 1; }
cargo test -q --release -p tidemark-core --test model --no-run 2>/dev/null || { echo "campaign: the model test does not build" >&2; exit 1; }
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "campaign: installing cargo-fuzz (once)"
  cargo install -q cargo-fuzz --locked || { echo "campaign: cargo install cargo-fuzz failed" >&2; exit 1; }
fi
(cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build -O >"$log/fuzz-build.txt" 2>&1) \
  || { echo "campaign: the fuzz targets do not build (see $log/fuzz-build.txt)" >&2; exit 1; }

echo "campaign: built; running"
# ---- simulation: chunks of seeds from a start drawn now (printed, so a rerun can repeat it) ----
sim_start=${CAMPAIGN_SIM_START:-$(( ($(date +%s) % 100000) * 1000 ))}
sim_seeds=0; sim_failed=0; next=$sim_start
deadline=$((SECONDS + sim_secs))
while [ $SECONDS -lt $deadline ]; do
  end=$((next + 200))
  out="$log/sim-$next.txt"
  "${CARGO_TARGET_DIR:-target}/release/tidemark-sim" --seeds "$next..$end" --jobs "$jobs" >"$out" 2>&1
  rc=$?
  line=$(grep -E '^failures: [0-9]+ of [0-9]+' "$out" | tail -n 1)
  ran=$(echo "$line" | sed -E 's/^failures: [0-9]+ of ([0-9]+).*/\1/')
  failed=$(echo "$line" | sed -E 's/^failures: ([0-9]+) of.*/\1/')
  [ -n "$ran" ] || { ran=0; failed=1; }
  sim_seeds=$((sim_seeds + ran)); sim_failed=$((sim_failed + failed))
  if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ]; then
    status=1
    while IFS= read -r replay; do failures+=("sim: ${replay#*replay: }"); done < <(grep 'replay:' "$out")
    [ "$failed" -gt 0 ] || failures+=("sim: seeds $next..$end exited $rc (see $out)")
  fi
  next=$end
done
echo "campaign: simulation done: $sim_seeds seeds, $sim_failed failed"

# ---- the proptest model: chunks of cases with a fresh seed each, until its share is spent ----
model_cases=0; model_failed=0
deadline=$((SECONDS + model_secs))
chunk=0
while [ $SECONDS -lt $deadline ]; do
  seed=$((sim_start + chunk)); chunk=$((chunk + 1))
  out="$log/model-$seed.txt"
  if PROPTEST_CASES=2000 PROPTEST_RNG_SEED=$seed cargo test -q --release -p tidemark-core --test model >"$out" 2>&1; then
    model_cases=$((model_cases + 2000))
  else
    model_failed=$((model_failed + 1)); status=1
    failures+=("model: PROPTEST_CASES=2000 PROPTEST_RNG_SEED=$seed cargo test --release -p tidemark-core --test model (see $out)")
    break
  fi
done
echo "campaign: model done: $model_cases cases, $model_failed failed"

# ---- fuzzing: each target for its share ----
declare -A execs crashes
for t in "${targets[@]}"; do
  out="$log/fuzz-$t.txt"
  # New inputs go to the run's own folder; the tracked corpus is only read (the first
  # corpus folder is where libFuzzer writes), so a campaign leaves the checkout clean.
  mkdir -p "$log/corpus-$t"
  (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -O "$t" "$log/corpus-$t" "corpus/$t" -- -max_total_time="$fuzz_secs" -print_final_stats=1) >"$out" 2>&1
  rc=$?
  execs[$t]=$(grep -E '^stat::number_of_executed_units:' "$out" | awk '{print $2}' | tail -n 1)
  [ -n "${execs[$t]}" ] || execs[$t]=$(grep -oE '^#[0-9]+' "$out" | tail -n 1 | tr -d '#')
  [ -n "${execs[$t]}" ] || execs[$t]=0
  if [ "$rc" -ne 0 ]; then
    crashes[$t]=1; status=1
    artifact=$(grep -oE 'Test unit written to [^ ]+' "$out" | head -n 1 | sed 's/^Test unit written to //')
    artifact=${artifact#"$PWD/fuzz/"}
    failures+=("fuzz $t: ${artifact:-exit $rc, see $out} (replay: cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -O $t ${artifact:-})")
  else
    crashes[$t]=0
  fi
  echo "campaign: fuzz $t done: ${execs[$t]} execs, ${crashes[$t]} crashes"
done

# ---- the summary ----
echo
printf '%-28s %14s %10s\n' "what" "ran" "failed"
printf '%-28s %14s %10s\n' "simulation seeds" "$sim_seeds" "$sim_failed"
printf '%-28s %14s %10s\n' "proptest model cases" "$model_cases" "$model_failed"
for t in "${targets[@]}"; do
  printf '%-28s %14s %10s\n' "fuzz $t (execs)" "${execs[$t]}" "${crashes[$t]}"
done
echo "simulation seeds started at $sim_start (CAMPAIGN_SIM_START=$sim_start repeats them)"
if [ ${#failures[@]} -gt 0 ]; then
  echo
  echo "failures:"
  for f in "${failures[@]}"; do echo "  $f"; done
fi
if [ "$nats_given" -eq 1 ]; then
  echo
  nats_campaign || status=1
fi
exit $status
