// Element-wise CUDA kernels of the device engine (engines/cuda_engine.cu) and of BAGUA's phased
// primitives on it (collectives/stream_backend.h), with the CPU path's rounding bit for bit
// (collectives/reduce.cc, decentralized.cc): 16-bit floats computed in float32 and rounded once,
// float64 in double, every operation an explicit _rn intrinsic (no contraction).
//
// Defined only in builds with CUDA kernels (BHVD_CUDA_BUILT); this header needs no CUDA headers.
// Pointers are device pointers; stream is a cudaStream_t (nullptr: the legacy default stream).
// The functions enqueue and return; they throw std::invalid_argument for a dtype they have no
// kernel for and std::runtime_error when a launch fails.
#pragma once

#include <cstddef>

#include "base/common.h"

namespace bagua_hvd {

// buf *= factor, as scale_buffer (every dtype).
void cuda_scale(void* buf, size_t n, DataType dtype, double factor, void* stream);
// dst += src, as reduce_into's SUM (float32, float16, bfloat16).
void cuda_add(void* dst, const void* src, size_t n, DataType dtype, void* stream);
// dst = a - b in float32 (float32, float16, bfloat16).
void cuda_subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype, void* stream);
// out = dtype(acc / divisor); divisor 0: dtype(acc) (float32, float16, bfloat16).
void cuda_from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out,
                   void* stream);
// The peer averages into mine: right null, (mine + left) / 2; else ((left + mine) + right) / 3
// (float32, float16, bfloat16, float64).
void cuda_average(void* mine, const void* left, const void* right, size_t n, DataType dtype,
                  void* stream);

// The low-precision ring's difference d = ((x + left * (1/3)) + right * (1/3)) - self * (5/3) in
// float32, rounded once (float32, float16, bfloat16), as lp_decentralized_local.
void cuda_lp_difference(void* d, const void* x, const void* left, const void* right,
                        const void* self, size_t n, DataType dtype, void* stream);
// Asynchronous model averaging's merge: x = (x + sum * (1 / n)) - snapshot in float32 (16-bit
// floats rounded once), x = (x + sum / n) - snapshot in double for float64, as
// core/async_average.cc (float32, float16, bfloat16, float64).
void cuda_async_merge(void* x, const void* sum, const void* snapshot, size_t n, DataType dtype,
                      int set_size, void* stream);

}  // namespace bagua_hvd
