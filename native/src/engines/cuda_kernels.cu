// The element-wise CUDA kernels (engines/cuda_kernels.h).
#include "engines/cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "base/float_bits.h"
#include "compression/minmax_uint8_math.h"

namespace bagua_hvd {

namespace {

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + "'s launch failed: " + cudaGetErrorString(e));
}

// ---- scaling, with the CPU engine's semantics bit for bit (collectives/reduce.cc) ----
// 8- to 32-bit integers (int64: below): in double, truncated, saturated; NaN becomes 0.
template <typename T>
__global__ void scale_int_kernel(T* p, size_t n, double f, double lo, double hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x) {
    double v = static_cast<double>(p[i]) * f;
    v = v != v ? 0.0 : v;
    p[i] = static_cast<T>(v > hi ? hi : (v < lo ? lo : v));
  }
}
// int64: hi (2^63) does not fit; saturate to the maximum explicitly.
__global__ void scale_i64_kernel(int64_t* p, size_t n, double f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x) {
    double v = static_cast<double>(p[i]) * f;
    v = v != v ? 0.0 : v;
    p[i] = v >= 9223372036854775808.0
               ? INT64_MAX
               : (v <= -9223372036854775808.0 ? INT64_MIN : static_cast<int64_t>(v));
  }
}
__global__ void scale_f32_kernel(float* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = __fmul_rn(p[i], f);
}
__global__ void scale_f64_kernel(double* p, size_t n, double f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = __dmul_rn(p[i], f);
}
__global__ void scale_f16_kernel(uint16_t* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = fbits::float_to_half(__fmul_rn(fbits::half_to_float(p[i]), f));
}
__global__ void scale_bf16_kernel(uint16_t* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = fbits::float_to_bf16(__fmul_rn(fbits::bf16_to_float(p[i]), f));
}
__global__ void scale_bool_kernel(uint8_t* p, size_t n, bool keep) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = static_cast<uint8_t>(p[i] != 0 && keep);
}

template <typename T>
void launch_scale_int(void* buf, size_t n, double f, cudaStream_t s, unsigned blocks) {
  scale_int_kernel<T><<<blocks, 256, 0, s>>>(static_cast<T*>(buf), n, f,
                                             static_cast<double>(std::numeric_limits<T>::min()),
                                             static_cast<double>(std::numeric_limits<T>::max()));
}

void launch_scale(void* buf, size_t n, DataType dtype, double f, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 4096));
  switch (dtype) {
    case DataType::UINT8:
      launch_scale_int<uint8_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT8:
      launch_scale_int<int8_t>(buf, n, f, s, blocks);
      break;
    case DataType::UINT16:
      launch_scale_int<uint16_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT16:
      launch_scale_int<int16_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT32:
      launch_scale_int<int32_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT64:
      scale_i64_kernel<<<blocks, 256, 0, s>>>(static_cast<int64_t*>(buf), n, f);
      break;
    // Horovod scales float tensors in their own precision, the factor rounded to
    // float.
    case DataType::FLOAT32:
      scale_f32_kernel<<<blocks, 256, 0, s>>>(static_cast<float*>(buf), n, static_cast<float>(f));
      break;
    case DataType::FLOAT64:
      scale_f64_kernel<<<blocks, 256, 0, s>>>(static_cast<double*>(buf), n, f);
      break;
    case DataType::FLOAT16:
      scale_f16_kernel<<<blocks, 256, 0, s>>>(static_cast<uint16_t*>(buf), n,
                                              static_cast<float>(f));
      break;
    case DataType::BFLOAT16:
      scale_bf16_kernel<<<blocks, 256, 0, s>>>(static_cast<uint16_t*>(buf), n,
                                               static_cast<float>(f));
      break;
    case DataType::BOOL:
      scale_bool_kernel<<<blocks, 256, 0, s>>>(static_cast<uint8_t*>(buf), n, f != 0.0);
      break;
  }
}

// ---- BAGUA's phased primitives: 16-bit floats through mmu8's widen/narrow ----
#define BHVD_GRID_LOOP(i, n)                                              \
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (n); \
       i += size_t(blockDim.x) * gridDim.x)

template <typename Ty>
__global__ void add_kernel(typename Ty::Storage* d, const typename Ty::Storage* s, size_t n) {
  BHVD_GRID_LOOP(i, n) d[i] = Ty::narrow(__fadd_rn(Ty::widen(d[i]), Ty::widen(s[i])));
}
template <typename Ty>
__global__ void sub_kernel(typename Ty::Storage* d, const typename Ty::Storage* a,
                           const typename Ty::Storage* b, size_t n) {
  BHVD_GRID_LOOP(i, n) d[i] = Ty::narrow(__fsub_rn(Ty::widen(a[i]), Ty::widen(b[i])));
}
template <typename Ty>
__global__ void from_f32_kernel(const float* acc, size_t n, float divisor,
                                typename Ty::Storage* out) {
  BHVD_GRID_LOOP(i, n) out[i] = Ty::narrow(divisor != 0.0f ? __fdiv_rn(acc[i], divisor) : acc[i]);
}
// right null: (mine + left) / 2; else ((left + mine) + right) / 3, as decentralized.cc.
template <typename Ty>
__global__ void average_kernel(typename Ty::Storage* m, const typename Ty::Storage* l,
                               const typename Ty::Storage* r, size_t n) {
  BHVD_GRID_LOOP(i, n) {
    const float v = Ty::widen(m[i]), a = Ty::widen(l[i]);
    m[i] = Ty::narrow(r ? __fdiv_rn(__fadd_rn(__fadd_rn(a, v), Ty::widen(r[i])), 3.0f)
                        : __fdiv_rn(__fadd_rn(v, a), 2.0f));
  }
}
__global__ void average_f64_kernel(double* m, const double* l, const double* r, size_t n) {
  BHVD_GRID_LOOP(i, n) {
    m[i] = r ? __ddiv_rn(__dadd_rn(__dadd_rn(l[i], m[i]), r[i]), 3.0)
             : __ddiv_rn(__dadd_rn(m[i], l[i]), 2.0);
  }
}
template <typename Ty>
__global__ void lp_difference_kernel(typename Ty::Storage* d, const typename Ty::Storage* x,
                                     const typename Ty::Storage* l, const typename Ty::Storage* r,
                                     const typename Ty::Storage* s, size_t n) {
  const float third = 1.0f / 3.0f, five_thirds = 5.0f / 3.0f;
  BHVD_GRID_LOOP(i, n) {
    const float a = __fadd_rn(__fadd_rn(Ty::widen(x[i]), __fmul_rn(Ty::widen(l[i]), third)),
                              __fmul_rn(Ty::widen(r[i]), third));
    d[i] = Ty::narrow(__fsub_rn(a, __fmul_rn(Ty::widen(s[i]), five_thirds)));
  }
}
template <typename Ty>
__global__ void async_merge_kernel(typename Ty::Storage* x, const typename Ty::Storage* s,
                                   const typename Ty::Storage* p, size_t n, float inv) {
  BHVD_GRID_LOOP(i, n) {
    x[i] = Ty::narrow(
        __fsub_rn(__fadd_rn(Ty::widen(x[i]), __fmul_rn(Ty::widen(s[i]), inv)), Ty::widen(p[i])));
  }
}
__global__ void async_merge_f64_kernel(double* x, const double* s, const double* p, size_t n,
                                       double dn) {
  BHVD_GRID_LOOP(i, n) x[i] = __dsub_rn(__dadd_rn(x[i], __ddiv_rn(s[i], dn)), p[i]);
}
#undef BHVD_GRID_LOOP

unsigned grid_for(size_t n) {
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>((n + 255) / 256, 4096)));
}

// Calls f(Ty{}) for float32, float16 and bfloat16 (mmu8's element types); throws for others.
template <typename F>
void float_types(DataType dtype, const char* what, F&& f) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16)
    throw std::invalid_argument(std::string(what) + ": no CUDA kernel for " + dtype_name(dtype));
  mmu8::dispatch(dtype, f);
}

}  // namespace

void cuda_lp_difference(void* d, const void* x, const void* left, const void* right,
                        const void* self, size_t n, DataType dtype, void* stream) {
  if (!n) return;
  float_types(dtype, "lp_difference", [&](auto ty) {
    using Ty = decltype(ty);
    using S = typename Ty::Storage;
    lp_difference_kernel<Ty><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<S*>(d), static_cast<const S*>(x), static_cast<const S*>(left),
        static_cast<const S*>(right), static_cast<const S*>(self), n);
  });
  check_launch("the low-precision difference kernel");
}

void cuda_async_merge(void* x, const void* sum, const void* snapshot, size_t n, DataType dtype,
                      int set_size, void* stream) {
  if (!n) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DataType::FLOAT64) {
    async_merge_f64_kernel<<<grid_for(n), 256, 0, s>>>(
        static_cast<double*>(x), static_cast<const double*>(sum),
        static_cast<const double*>(snapshot), n, static_cast<double>(set_size));
  } else {
    float_types(dtype, "async_merge", [&](auto ty) {
      using Ty = decltype(ty);
      using S = typename Ty::Storage;
      async_merge_kernel<Ty><<<grid_for(n), 256, 0, s>>>(
          static_cast<S*>(x), static_cast<const S*>(sum), static_cast<const S*>(snapshot), n,
          1.0f / static_cast<float>(set_size));
    });
  }
  check_launch("the merge kernel");
}

void cuda_scale(void* buf, size_t n, DataType dtype, double factor, void* stream) {
  if (!n || factor == 1.0) return;  // as scale_buffer
  launch_scale(buf, n, dtype, factor, static_cast<cudaStream_t>(stream));
  check_launch("the scale kernel");
}

void cuda_add(void* dst, const void* src, size_t n, DataType dtype, void* stream) {
  if (!n) return;
  float_types(dtype, "add", [&](auto ty) {
    using Ty = decltype(ty);
    using S = typename Ty::Storage;
    add_kernel<Ty><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<S*>(dst), static_cast<const S*>(src), n);
  });
  check_launch("the add kernel");
}

void cuda_subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype,
                   void* stream) {
  if (!n) return;
  float_types(dtype, "subtract", [&](auto ty) {
    using Ty = decltype(ty);
    using S = typename Ty::Storage;
    sub_kernel<Ty><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<S*>(dst), static_cast<const S*>(a), static_cast<const S*>(b), n);
  });
  check_launch("the subtract kernel");
}

void cuda_from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out,
                   void* stream) {
  if (!n) return;
  float_types(dtype, "from_f32", [&](auto ty) {
    using Ty = decltype(ty);
    from_f32_kernel<Ty><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        acc, n, divisor, static_cast<typename Ty::Storage*>(out));
  });
  check_launch("the from_f32 kernel");
}

void cuda_average(void* mine, const void* left, const void* right, size_t n, DataType dtype,
                  void* stream) {
  if (!n) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DataType::FLOAT64) {
    average_f64_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<double*>(mine),
                                                   static_cast<const double*>(left),
                                                   static_cast<const double*>(right), n);
  } else {
    float_types(dtype, "average", [&](auto ty) {
      using Ty = decltype(ty);
      using S = typename Ty::Storage;
      average_kernel<Ty><<<grid_for(n), 256, 0, s>>>(
          static_cast<S*>(mine), static_cast<const S*>(left), static_cast<const S*>(right), n);
    });
  }
  check_launch("the average kernel");
}

}  // namespace bagua_hvd
