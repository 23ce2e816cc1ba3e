#!/usr/bin/env bash
# The GPU check of issue 13 (docs/gpu.md): one command on a machine with one CUDA GPU, torch
# with CUDA and nvidia-nccl; its report goes to one file, $OUT/gpu-report.txt (OUT defaults to
# build/gpu-check). Runs tests/gpu/gpu_check.py at 1 rank (NCCL) and at 2 ranks sharing the GPU
# (NCCL refuses that: host staging), and the CUDA kernels' checks (MinMaxUInt8; BAGUA's phased
# primitives, whose N-rank NCCL form one GPU cannot run, with their exchanges between threads).
# Every step is bounded (11 min in all; a few when all passes); each step's output is appended
# to one file beside the report ($OUT/gpu-logs.txt), so two files come back.
#
# Python packages the machine lacks (cffi, pycparser) may come as wheels in .whl/; a core library
# built elsewhere with CUDA (BAGUA_HVD_WITH_CUDA=1, for this GPU's architecture) in .gpu/ and the
# kernels' checks in .gpu/cuda-check/ (native/tests/prepare_gpu_check.sh makes both), else they are
# built here with CMake and nvcc.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-build/gpu-check}
mkdir -p "$out"
report="$out/gpu-report.txt"
logs="$out/gpu-logs.txt"
: >"$report"
: >"$logs"
say() { echo "$*" | tee -a "$report"; }
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A stalled NCCL call is aborted after this long (docs/gpu.md): a defect costs a step, not the run.
export HOROVOD_GLOO_TIMEOUT_SECONDS=${HOROVOD_GLOO_TIMEOUT_SECONDS:-30}
if compgen -G '.whl/*.whl' >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi
# The commit prepare_gpu_check.sh recorded: the device tool's copy of the tree may carry an older .git.
say "# bagua_hvd GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(cat .gpu/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
say "$(nvidia-smi -L 2>&1 | head -n 2)"
say "$($py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())' 2>&1)"
say "$(df -h /dev/shm | tail -n 1)"

mkdir -p bagua_hvd/_lib
if [ -f .gpu/libbagua_hvd.so ]; then
  cp .gpu/libbagua_hvd.so bagua_hvd/_lib/ && cp native/include/bagua_hvd/c_api.h bagua_hvd/_lib/
  say "core: carried build (.gpu/libbagua_hvd.so)"
else
  arch=$($py -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}-real")')
  start=$(date +%s)
  if cmake -S . -B build/gpu-core -DCMAKE_BUILD_TYPE=Release -DBAGUA_HVD_WITH_CUDA=1 \
      -DBAGUA_HVD_CUDA_ARCHS="$arch" -DBAGUA_HVD_LIB_OUTPUT_DIR="$PWD/bagua_hvd/_lib" \
      >"$out/build.log" 2>&1 && cmake --build build/gpu-core -j "$(nproc)" >>"$out/build.log" 2>&1; then
    cp native/include/bagua_hvd/c_api.h bagua_hvd/_lib/
    say "core: built here with nvcc for sm_$arch in $(($(date +%s) - start)) s"
  else
    say "FAIL core build (tail of $out/build.log below)"; tail -n 30 "$out/build.log" | tee -a "$report"
    exit 1
  fi
fi
say "$($py -c 'import bagua_hvd.torch as hvd; print("cuda_built", hvd.cuda_built(), "nccl_built", hvd.nccl_built())' 2>&1)"

fails=0
step() {  # step NAME TIMEOUT COMMAND...: runs it, keeps CHECK/FIGURE lines, counts failures
  local name=$1 limit=$2 start rc
  shift 2
  # GPU_CHECK_ONLY (an extended regex on the step names) runs a part, when device time is short.
  [[ -z "${GPU_CHECK_ONLY:-}" || "$name" =~ $GPU_CHECK_ONLY ]] || return 0
  start=$(date +%s)
  local log="$out/$name.log"
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  { echo "==== $name (exit $rc): $*"; cat "$log"; } >>"$logs"
  # The launcher prefixes a rank's lines with "[rank]<stdout>:"; MinMaxUInt8's check counts cases.
  local ranked='^(\[[0-9]+\]<stdout>:)?'
  grep -E "${ranked}(CHECK|FIGURE) |^correctness: " "$log" | sed "s/^/[$name] /" >>"$report"
  local failed
  failed=$(grep -cE "${ranked}CHECK [0-9]+ FAIL" "$log")
  if [ "$rc" != 0 ] || [ "$failed" != 0 ]; then
    fails=$((fails + 1))
    say "FAIL $name: exit $rc, $failed failed checks, $(($(date +%s) - start)) s (its output: $logs)"
    grep -E 'Error|error|Traceback' "$log" | head -n 8 | sed 's/^/    /' | tee -a "$report"
  else
    say "PASS $name: $(grep -cE "${ranked}CHECK " "$log") checks, $(($(date +%s) - start)) s"
  fi
  rm -f "$log"
}
launch=("$py" -m bagua_hvd.runner.launch -np 2)
step collectives-1rank 60 "$py" tests/gpu/gpu_check.py collectives
if [ -x .gpu/cuda-check/phased_cuda_check ]; then
  kernels=(sh -c '.gpu/cuda-check/minmax_uint8_cuda_check --quick; a=$?; .gpu/cuda-check/phased_cuda_check --quick && exit $a')
else
  kernels=(native/tests/run_cuda_check.sh --quick)
fi
step cuda-kernels 120 "${kernels[@]}"
step collectives-2ranks 75 "${launch[@]}" "$py" tests/gpu/gpu_check.py collectives
step optimizer-2ranks 45 "${launch[@]}" "$py" tests/gpu/gpu_check.py optimizer
step algorithms-2ranks 75 "${launch[@]}" "$py" tests/gpu/gpu_check.py algorithms
# Horovod's GPU Adasum: one host (a sum), then two hosts as two launchers here (--num-nodes 2)
# with one and with two ranks each.
step adasum-1rank 45 "$py" tests/gpu/gpu_check.py adasum
step adasum-2ranks 60 "${launch[@]}" "$py" tests/gpu/gpu_check.py adasum
step adasum-2hosts 60 bash tests/gpu/two_nodes.sh 2 "$py" tests/gpu/gpu_check.py adasum
step adasum-2x2 75 bash tests/gpu/two_nodes.sh 4 "$py" tests/gpu/gpu_check.py adasum
# The host hierarchy on CUDA tensors (issue 39): two hosts of one rank (flat), then of two ranks
# sharing the GPU (the hierarchy, staged, with the kernels on the device).
export HOROVOD_HIERARCHICAL_ALLREDUCE=1
step hierarchy-2hosts 90 bash tests/gpu/two_nodes.sh 2 "$py" tests/gpu/gpu_check.py hierarchy
step hierarchy-2x2 120 bash tests/gpu/two_nodes.sh 4 "$py" tests/gpu/gpu_check.py hierarchy
unset HOROVOD_HIERARCHICAL_ALLREDUCE
step timing-1rank 45 "$py" tests/gpu/gpu_check.py timing
step timing-2ranks 60 "${launch[@]}" "$py" tests/gpu/gpu_check.py timing
say "# $fails failed step(s)"
[ "$fails" = 0 ]
