#!/usr/bin/env bash
# Prepares, on a machine with nvcc and network, what native/tests/run_gpu_check.sh needs on a GPU
# machine that has neither pip access nor (perhaps) the OpenSSL headers: the core built with CUDA
# for sm_90 in .gpu/, the CUDA kernels' checks (native/tests/run_cuda_check.sh) in .gpu/cuda-check/,
# and the wheels of cffi and pycparser for CPython 3.12 in .whl/ (both
# ignored by git through .git/info/exclude). Then, there: native/tests/run_gpu_check.sh with
# .gpu and .whl carried along.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
for d in /.gpu/ /.whl/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
archs=${BAGUA_HVD_CUDA_ARCHS:-90-real}
cmake -S . -B build/gpu-carry -DCMAKE_BUILD_TYPE=Release -DBAGUA_HVD_WITH_CUDA=1 \
  -DBAGUA_HVD_CUDA_ARCHS="$archs" -DBAGUA_HVD_LIB_OUTPUT_DIR="$PWD/build/gpu-carry/out" >/dev/null
cmake --build build/gpu-carry -j "$(nproc)"
mkdir -p .gpu .whl
cp build/gpu-carry/out/libbagua_hvd.so .gpu/
git rev-parse --short HEAD >.gpu/commit
gencode=""
for a in ${archs//;/ }; do gencode+=" -gencode arch=compute_${a%%-*},code=sm_${a%%-*}"; done
BHVD_CUDA_CHECK_BUILD_ONLY=1 BHVD_CUDA_CHECK_DIR=.gpu/cuda-check BAGUA_HVD_CUDA_ARCHS_NVCC="$gencode" \
  native/tests/run_cuda_check.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl cffi pycparser
ls -la .gpu .whl
