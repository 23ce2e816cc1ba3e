// MinMaxUInt8 on CUDA device memory: the same wire format and the same bits as the CPU kernels
// (minmax_uint8.h), from the same per-element math (minmax_uint8_math.h).
//
// Defined only in builds with CUDA kernels (BHVD_CUDA_BUILT); this header needs no CUDA headers.
// All pointers are device pointers; stream is a cudaStream_t (nullptr: the legacy default
// stream). The functions enqueue kernels and return without synchronizing. Compressed buffers
// must be 4-byte aligned (any offset of a whole number of chunks into a cudaMalloc buffer is).
// Throw std::invalid_argument for bad arguments (as the CPU functions) and std::runtime_error
// when a launch fails.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/common.h"

namespace bagua_hvd {

// out: minmax_uint8_bytes(dtype, n, n_chunks) bytes, all written (the payload area doubles as
// scratch for the per-block partial min/max before the quantize kernel overwrites it).
void minmax_uint8_compress_cuda(const void* in, DataType dtype, size_t n, size_t n_chunks,
                                uint8_t* out, void* stream);

void minmax_uint8_decompress_cuda(const uint8_t* in, DataType dtype, size_t n, size_t n_chunks,
                                  void* out, void* stream);

// acc[i] += float(T(x'_i)).
void minmax_uint8_decompress_add_f32_cuda(const uint8_t* in, DataType dtype, size_t n,
                                          size_t n_chunks, float* acc, void* stream);

}  // namespace bagua_hvd
