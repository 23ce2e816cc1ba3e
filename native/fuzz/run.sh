#!/usr/bin/env bash
# Coverage-guided fuzzing of the wire protocol (docs/reliability.md, "Fuzzing").
#
#   native/fuzz/run.sh SECONDS
#
# 1. Builds the libFuzzer targets of native/fuzz with clang into build/fuzz (incremental).
# 2. Replays every committed crash input, native/fuzz/regressions/<target>/*: each must pass.
# 3. Fuzzes each target for SECONDS (FUZZ_JOBS at once, default 2), starting from its seeds
#    (make_seeds, store_server_fuzz.py --write-seeds) in a temporary corpus: nothing is written
#    into the repository.
# Exits non-zero on any crash, hang or failed check, naming the input that caused it (the
# temporary directory is then kept). CI: `native/fuzz/run.sh 12`; a longer run:
# `native/fuzz/run.sh 600`, with FUZZ_CORPUS_DIR=DIR to keep the corpus across runs.
#
# Environment: FUZZ_CXX (default clang++), FUZZ_BUILD_DIR (default build/fuzz), PYTHON (default
# python3, needs `pip install atheris`), FUZZ_SKIP_PYTHON=1 (C++ targets only), FUZZ_JOBS,
# FUZZ_MAX_LEN (default 4096 bytes), FUZZ_CORPUS_DIR, FUZZ_BUILD_ONLY=1 (step 1 only: CI builds
# the targets in the background beside the tests).
set -euo pipefail

if [ $# -ne 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 SECONDS  (fuzzing time per target)" >&2
  exit 2
fi
SECS=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FUZZ=$ROOT/native/fuzz
BUILD=${FUZZ_BUILD_DIR:-$ROOT/build/fuzz}
PYTHON=${PYTHON:-python3}
JOBS=${FUZZ_JOBS:-2}
MAX_LEN=${FUZZ_MAX_LEN:-4096}
CXX_TARGETS=(message coordinator control_channel auth_server auth_client store_client)
PY_TARGET=store_server
START=$(date +%s)
elapsed() { echo "$(($(date +%s) - START)) s"; }

TARGETS=("${CXX_TARGETS[@]}")
if [ "${FUZZ_SKIP_PYTHON:-0}" != 1 ]; then
  if ! "$PYTHON" -c 'import atheris' 2>/dev/null; then
    echo "$PYTHON cannot import atheris: pip install atheris (or FUZZ_SKIP_PYTHON=1)" >&2
    exit 2
  fi
  TARGETS+=("$PY_TARGET")
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's bagua_hvd
fi

# ---- build -------------------------------------------------------------------------------------
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$FUZZ" -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="${FUZZ_CXX:-clang++}" >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" >/dev/null
echo "== built the fuzz targets in $BUILD ($(elapsed))"
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0

# Sets CMD to the command running target $1 (libFuzzer's arguments follow it).
set_cmd() {
  if [ "$1" = "$PY_TARGET" ]; then
    CMD=("$PYTHON" "$FUZZ/store_server_fuzz.py")
  else
    CMD=("$BUILD/${1}_fuzz")
  fi
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bagua_hvd-fuzz.XXXXXX")
keep_work=0
trap '[ "$keep_work" = 1 ] || rm -rf "$WORK"' EXIT

# ---- replay the committed crash inputs ----------------------------------------------------------
for t in "${TARGETS[@]}"; do
  dir=$FUZZ/regressions/$t
  [ -d "$dir" ] || continue
  mapfile -t inputs < <(find "$dir" -type f | sort)
  [ ${#inputs[@]} -gt 0 ] || continue
  set_cmd "$t"
  if ! "${CMD[@]}" "${inputs[@]}" >"$WORK/replay-$t.log" 2>&1; then
    keep_work=1
    tail -n 40 "$WORK/replay-$t.log" >&2
    echo "FUZZ FAILED: a regression input of $t crashes again (log: $WORK/replay-$t.log)" >&2
    exit 1
  fi
  echo "== replayed ${#inputs[@]} regression input(s) of $t"
done
echo "== replays done ($(elapsed))"

# ---- seeds -----------------------------------------------------------------------------------
"$BUILD/make_seeds" "$WORK/seeds"
if [[ " ${TARGETS[*]} " == *" $PY_TARGET "* ]] &&
  ! "$PYTHON" "$FUZZ/store_server_fuzz.py" --write-seeds "$WORK/seeds/$PY_TARGET" \
    >"$WORK/seeds-$PY_TARGET.log" 2>&1; then
  cat "$WORK/seeds-$PY_TARGET.log" >&2
  exit 1
fi

# ---- fuzz ------------------------------------------------------------------------------------
fuzz_one() {  # target; writes $WORK/<target>.log and .rc
  local t=$1 corpus
  if [ -n "${FUZZ_CORPUS_DIR:-}" ]; then
    corpus=$FUZZ_CORPUS_DIR/$t
  else
    corpus=$WORK/corpus/$t
  fi
  mkdir -p "$corpus" "$WORK/artifacts/$t"
  cp -r "$WORK/seeds/$t"/. "$corpus"/
  local timeout=10 rc=0
  if [ "$t" = "$PY_TARGET" ]; then timeout=30; fi
  set_cmd "$t"
  "${CMD[@]}" -max_total_time="$SECS" -max_len="$MAX_LEN" -timeout="$timeout" \
    -print_final_stats=1 -artifact_prefix="$WORK/artifacts/$t/" "$corpus" \
    >"$WORK/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$WORK/$t.rc"
}

echo "== fuzzing ${TARGETS[*]}: ${SECS} s each, $JOBS at once"
for t in "${TARGETS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  fuzz_one "$t" &
done
wait

printf '%-16s %10s %8s %6s %6s %10s\n' target execs exec/s cov ft corpus
for t in "${TARGETS[@]}"; do
  log=$WORK/$t.log
  last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -n 1 || true)
  printf '%-16s %10s %8s %6s %6s %10s\n' "$t" \
    "$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")" \
    "$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")" \
    "$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")" \
    "$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")" \
    "$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$last")"
done
failed=0
for t in "${TARGETS[@]}"; do
  rc=$(cat "$WORK/$t.rc" 2>/dev/null || echo "unknown (it did not start)")
  [ "$rc" = 0 ] && continue
  failed=1
  echo "---- $t (last lines of $WORK/$t.log)" >&2
  tail -n 30 "$WORK/$t.log" >&2
  for a in "$WORK/artifacts/$t"/*; do
    [ -e "$a" ] && echo "FUZZ FAILED: $t: input $a" >&2
  done
  echo "FUZZ FAILED: $t exited with status $rc" >&2
done
if [ "$failed" = 1 ]; then
  keep_work=1
  echo "Fix it, then add the input to native/fuzz/regressions/<target>/ and a unit test." >&2
  exit 1
fi
echo "== fuzzing passed ($(elapsed))"
