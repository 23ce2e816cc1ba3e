#!/usr/bin/env bash
# Builds native/tests/minmax_uint8_cuda_check.cu with nvcc alone (no CMake, no OpenSSL: a bare
# GPU machine has neither need) and runs it. Usage: native/tests/run_cuda_check.sh [--quick]
# Flags match CMakeLists.txt: no FMA contraction in host or device code, IEEE float32 on the GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${BHVD_CUDA_CHECK_DIR:-build/cuda-check}
mkdir -p "$out"
archs=${BAGUA_HVD_CUDA_ARCHS_NVCC:--gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]}
# shellcheck disable=SC2086
nvcc -std=c++17 -O2 $archs --fmad=false --ftz=false --prec-div=true \
  -Xcompiler=-ffp-contract=off -Inative/include -Inative/src \
  native/tests/minmax_uint8_cuda_check.cu native/src/compression/minmax_uint8_cuda.cu \
  native/src/compression/minmax_uint8_cpu.cc native/src/common.cc native/src/config.cc \
  -o "$out/minmax_uint8_cuda_check"
"$out/minmax_uint8_cuda_check" "$@"
