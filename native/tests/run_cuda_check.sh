#!/usr/bin/env bash
# Builds the CUDA kernels' checks with nvcc alone (no CMake, no OpenSSL: a bare GPU machine has
# neither need) and runs them: native/tests/minmax_uint8_cuda_check.cu (the MinMaxUInt8 kernels
# against the CPU ones) and native/tests/phased_cuda_check.cu (BAGUA's phased primitives with the
# CUDA kernels against the same phases with the CPU kernels). Usage:
# native/tests/run_cuda_check.sh [--quick]   (BHVD_CUDA_CHECK_BUILD_ONLY=1: build only)
# Flags match CMakeLists.txt: no FMA contraction in host or device code, IEEE float32 on the GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${BHVD_CUDA_CHECK_DIR:-build/cuda-check}
mkdir -p "$out"
archs=${BAGUA_HVD_CUDA_ARCHS_NVCC:--gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]}
nv() {
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O2 $archs --fmad=false --ftz=false --prec-div=true \
    -Xcompiler=-ffp-contract=off -Inative/include -Inative/src "$@"
}
common=(native/src/compression/minmax_uint8_cuda.cu native/src/compression/minmax_uint8_cpu.cc
  native/src/base/common.cc native/src/base/env.cc)
nv native/tests/minmax_uint8_cuda_check.cu "${common[@]}" -o "$out/minmax_uint8_cuda_check"
nv native/tests/phased_cuda_check.cu "${common[@]}" native/src/engines/cuda_kernels.cu \
  native/src/collectives/allreduce_minmax_uint8_phased.cc \
  native/src/collectives/peer_average_phased.cc native/src/collectives/lp_decentralized_phased.cc \
  native/src/collectives/primitive_rules.cc \
  native/src/collectives/reduce.cc -o "$out/phased_cuda_check"
[ "${BHVD_CUDA_CHECK_BUILD_ONLY:-0}" = 1 ] && exit 0
status=0
"$out/minmax_uint8_cuda_check" "$@" || status=1
"$out/phased_cuda_check" "$@" || status=1
exit $status
