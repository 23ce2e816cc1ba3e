// Element-wise reduction and scaling kernels for every data type of base/common.h.
//
// The loops are plain element-wise loops over __restrict pointers so that g++ -O3 vectorizes them
// for the baseline x86-64 ISA (SSE2); target_clones adds an AVX2 variant picked at load time.
// float16 and bfloat16 are widened to float32 with branch-free bit tricks (which vectorize too),
// computed, and rounded back to nearest-even once per element and call.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BHVD_F16C 1
#endif

#include "base/float_bits.h"
#include "collectives/collectives.h"

namespace bagua_hvd {
namespace {

using fbits::bf16_to_float;
using fbits::bits_f32;
using fbits::f32_bits;
using fbits::float_to_bf16;
using fbits::float_to_half;
using fbits::half_to_float;
using fbits::mask;

// Not under ThreadSanitizer: the clones' resolvers are instrumented too, and an executable runs
// them before the sanitizer's runtime has started (a crash at load).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(__SANITIZE_THREAD__)
#define BHVD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BHVD_CLONES
#endif

// ---- binary ops -----------------------------------------------------------------------------
// Integer sum and product wrap around (computed unsigned: no signed-overflow UB, and no int
// promotion overflow for uint16 * uint16).
template <typename T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

struct OpSum {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
    } else {
      return a + b;
    }
  }
};
struct OpProd {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
    } else {
      return a * b;
    }
  }
};
// Min/max propagate NaN (like torch), whichever side it is on.
struct OpMin {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return (b < a || b != b) ? b : a;
    else return b < a ? b : a;
  }
};
struct OpMax {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return (b > a || b != b) ? b : a;
    else return b > a ? b : a;
  }
};
// bool: any non-zero byte is true; results are 0/1.
struct OpOr {
  static uint8_t apply(uint8_t a, uint8_t b) { return static_cast<uint8_t>((a | b) != 0); }
};
struct OpAnd {
  static uint8_t apply(uint8_t a, uint8_t b) {
    return static_cast<uint8_t>((a != 0) & (b != 0));
  }
};

template <typename T, typename Op>
BHVD_CLONES void reduce_loop(T* __restrict d, const T* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(d[i], s[i]);
}

template <typename Op>
BHVD_CLONES void reduce_loop_f16_sw(uint16_t* __restrict d, const uint16_t* __restrict s,
                                    size_t n) {
  for (size_t i = 0; i < n; ++i) {
    d[i] = float_to_half(Op::apply(half_to_float(d[i]), half_to_float(s[i])));
  }
}

#ifdef BHVD_F16C
// F16C converts 8 halves per instruction, several times faster than the bit tricks. The software
// conversions above reproduce its results bit for bit (nan included), so ranks on different CPUs
// still agree.
bool have_f16c() {
  static const bool ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return ok;
}

template <typename Op>
__attribute__((target("avx,f16c"))) inline __m256 vec_apply(__m256 a, __m256 b) {
  if constexpr (std::is_same_v<Op, OpSum>) {
    return _mm256_add_ps(a, b);
  } else if constexpr (std::is_same_v<Op, OpProd>) {
    return _mm256_mul_ps(a, b);
  } else if constexpr (std::is_same_v<Op, OpMin>) {
    __m256 take = _mm256_or_ps(_mm256_cmp_ps(b, a, _CMP_LT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(a, b, take);
  } else {
    __m256 take = _mm256_or_ps(_mm256_cmp_ps(b, a, _CMP_GT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(a, b, take);
  }
}

template <typename Op>
__attribute__((target("avx,f16c"))) void reduce_loop_f16_hw(uint16_t* __restrict d,
                                                            const uint16_t* __restrict s,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(vec_apply<Op>(a, b), _MM_FROUND_TO_NEAREST_INT));
  }
  reduce_loop_f16_sw<Op>(d + i, s + i, n - i);
}

__attribute__((target("avx,f16c"))) void scale_f16_hw(uint16_t* __restrict p, size_t n, float f) {
  const __m256 vf = _mm256_set1_ps(f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(a, vf), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) p[i] = float_to_half(half_to_float(p[i]) * f);
}
#endif

template <typename Op>
void reduce_loop_f16(uint16_t* d, const uint16_t* s, size_t n) {
#ifdef BHVD_F16C
  if (have_f16c()) return reduce_loop_f16_hw<Op>(d, s, n);
#endif
  reduce_loop_f16_sw<Op>(d, s, n);
}

template <typename Op>
BHVD_CLONES void reduce_loop_bf16(uint16_t* __restrict d, const uint16_t* __restrict s,
                                  size_t n) {
  for (size_t i = 0; i < n; ++i) {
    d[i] = float_to_bf16(Op::apply(bf16_to_float(d[i]), bf16_to_float(s[i])));
  }
}

template <typename Op>
void reduce_typed(void* dst, const void* src, size_t n, DataType dtype) {
  switch (dtype) {
    case DataType::UINT8:
      return reduce_loop<uint8_t, Op>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
                                      n);
    case DataType::INT8:
      return reduce_loop<int8_t, Op>(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n);
    case DataType::UINT16:
      return reduce_loop<uint16_t, Op>(static_cast<uint16_t*>(dst),
                                       static_cast<const uint16_t*>(src), n);
    case DataType::INT16:
      return reduce_loop<int16_t, Op>(static_cast<int16_t*>(dst),
                                      static_cast<const int16_t*>(src), n);
    case DataType::INT32:
      return reduce_loop<int32_t, Op>(static_cast<int32_t*>(dst),
                                      static_cast<const int32_t*>(src), n);
    case DataType::INT64:
      return reduce_loop<int64_t, Op>(static_cast<int64_t*>(dst),
                                      static_cast<const int64_t*>(src), n);
    case DataType::FLOAT32:
      return reduce_loop<float, Op>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DataType::FLOAT64:
      return reduce_loop<double, Op>(static_cast<double*>(dst), static_cast<const double*>(src),
                                     n);
    case DataType::FLOAT16:
      return reduce_loop_f16<Op>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
                                 n);
    case DataType::BFLOAT16:
      return reduce_loop_bf16<Op>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
                                  n);
    case DataType::BOOL:
      break;  // handled by the caller
  }
  throw std::invalid_argument("reduce: unsupported data type " +
                              std::to_string(static_cast<int>(dtype)));
}

void reduce_aligned(void* dst, const void* src, size_t n, DataType dtype, ReduceOp op) {
  if (dtype == DataType::BOOL) {
    auto* d = static_cast<uint8_t*>(dst);
    auto* s = static_cast<const uint8_t*>(src);
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVERAGE:
      case ReduceOp::MAX:
        return reduce_loop<uint8_t, OpOr>(d, s, n);
      case ReduceOp::MIN:
      case ReduceOp::PRODUCT:
        return reduce_loop<uint8_t, OpAnd>(d, s, n);
      default:
        break;
    }
  } else {
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVERAGE:
        return reduce_typed<OpSum>(dst, src, n, dtype);
      case ReduceOp::MIN:
        return reduce_typed<OpMin>(dst, src, n, dtype);
      case ReduceOp::MAX:
        return reduce_typed<OpMax>(dst, src, n, dtype);
      case ReduceOp::PRODUCT:
        return reduce_typed<OpProd>(dst, src, n, dtype);
      default:
        break;
    }
  }
  throw std::invalid_argument("reduce: unsupported reduce op " +
                              std::to_string(static_cast<int>(op)) +
                              " (only SUM, AVERAGE, MIN, MAX and PRODUCT are element-wise)");
}

// ---- scaling ----------------------------------------------------------------------------------
template <typename T>
BHVD_CLONES void scale_int(T* __restrict p, size_t n, double f) {
  // Horovod: computed in double, truncated toward zero. Out-of-range results saturate (a plain
  // cast would be undefined behaviour); NaN becomes 0.
  constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
  constexpr double hi = static_cast<double>(std::numeric_limits<T>::max());
  for (size_t i = 0; i < n; ++i) {
    double v = static_cast<double>(p[i]) * f;
    v = v != v ? 0.0 : v;
    if constexpr (sizeof(T) == 8) {
      // hi rounds up to 2^63, which does not fit: compare with >=.
      p[i] = v >= hi ? std::numeric_limits<T>::max()
                     : (v <= lo ? std::numeric_limits<T>::min() : static_cast<T>(v));
    } else {
      p[i] = static_cast<T>(v > hi ? hi : (v < lo ? lo : v));
    }
  }
}

// Horovod scales a float tensor in its own precision: the factor is rounded to float first,
// so the result is (float)f * x with one float rounding, not x * f rounded from double.
BHVD_CLONES void scale_f32(float* __restrict p, size_t n, float f) {
  for (size_t i = 0; i < n; ++i) p[i] *= f;
}
BHVD_CLONES void scale_f64(double* __restrict p, size_t n, double f) {
  for (size_t i = 0; i < n; ++i) p[i] *= f;
}
BHVD_CLONES void scale_f16_sw(uint16_t* __restrict p, size_t n, float f) {
  for (size_t i = 0; i < n; ++i) p[i] = float_to_half(half_to_float(p[i]) * f);
}
void scale_f16(uint16_t* p, size_t n, float f) {
#ifdef BHVD_F16C
  if (have_f16c()) return scale_f16_hw(p, n, f);
#endif
  scale_f16_sw(p, n, f);
}
// bfloat16 (which Horovod does not scale) follows Horovod's float16 on the CPU: in float32.
BHVD_CLONES void scale_bf16(uint16_t* __restrict p, size_t n, float f) {
  for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) * f);
}

void scale_aligned(void* buf, size_t n, DataType dtype, double f) {
  switch (dtype) {
    case DataType::UINT8: return scale_int(static_cast<uint8_t*>(buf), n, f);
    case DataType::INT8: return scale_int(static_cast<int8_t*>(buf), n, f);
    case DataType::UINT16: return scale_int(static_cast<uint16_t*>(buf), n, f);
    case DataType::INT16: return scale_int(static_cast<int16_t*>(buf), n, f);
    case DataType::INT32: return scale_int(static_cast<int32_t*>(buf), n, f);
    case DataType::INT64: return scale_int(static_cast<int64_t*>(buf), n, f);
    case DataType::FLOAT32: return scale_f32(static_cast<float*>(buf), n, static_cast<float>(f));
    case DataType::FLOAT64: return scale_f64(static_cast<double*>(buf), n, f);
    // Horovod scales 16-bit floats in float32 with the factor rounded to float.
    case DataType::FLOAT16: return scale_f16(static_cast<uint16_t*>(buf), n, static_cast<float>(f));
    case DataType::BFLOAT16:
      return scale_bf16(static_cast<uint16_t*>(buf), n, static_cast<float>(f));
    case DataType::BOOL: {
      auto* p = static_cast<uint8_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(p[i] != 0 && f != 0.0);
      return;
    }
  }
  throw std::invalid_argument("scale: unsupported data type " +
                              std::to_string(static_cast<int>(dtype)));
}

size_t checked_size(DataType dtype) {
  size_t es = dtype_size(dtype);
  if (es == 0) {
    throw std::invalid_argument("unsupported data type " +
                                std::to_string(static_cast<int>(dtype)));
  }
  return es;
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Misaligned buffers (zero-copy bytes from a ring at an odd offset, odd user views) go through
// small aligned bounce buffers so the vector kernels may assume natural alignment.
constexpr size_t kBounceBytes = 4096;

}  // namespace

void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = checked_size(dtype);
  if (count == 0) return;
  if (aligned(dst, es) && aligned(src, es)) return reduce_aligned(dst, src, count, dtype, op);
  alignas(16) unsigned char d[kBounceBytes], s[kBounceBytes];
  const size_t per = kBounceBytes / es;
  auto* dp = static_cast<unsigned char*>(dst);
  auto* sp = static_cast<const unsigned char*>(src);
  for (size_t i = 0; i < count; i += per) {
    const size_t m = std::min(per, count - i), bytes = m * es;
    std::memcpy(d, dp + i * es, bytes);
    std::memcpy(s, sp + i * es, bytes);
    reduce_aligned(d, s, m, dtype, op);
    std::memcpy(dp + i * es, d, bytes);
  }
}

void scale_buffer(void* buf, size_t count, DataType dtype, double factor) {
  const size_t es = checked_size(dtype);
  if (count == 0 || factor == 1.0) return;
  if (aligned(buf, es)) return scale_aligned(buf, count, dtype, factor);
  alignas(16) unsigned char d[kBounceBytes];
  const size_t per = kBounceBytes / es;
  auto* dp = static_cast<unsigned char*>(buf);
  for (size_t i = 0; i < count; i += per) {
    const size_t m = std::min(per, count - i), bytes = m * es;
    std::memcpy(d, dp + i * es, bytes);
    scale_aligned(d, m, dtype, factor);
    std::memcpy(dp + i * es, d, bytes);
  }
}

}  // namespace bagua_hvd

namespace bagua_hvd {

void to_float(const void* src, DataType dtype, size_t n, float* out) {
  switch (dtype) {
    case DataType::FLOAT32:
      std::memcpy(out, src, n * 4);
      return;
    case DataType::FLOAT16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) out[i] = half_to_float(s[i]);
      return;
    }
    case DataType::BFLOAT16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(s[i]);
      return;
    }
    case DataType::FLOAT64: {
      const auto* s = static_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
      return;
    }
    default:
      throw std::invalid_argument(std::string("not a floating-point type: ") + dtype_name(dtype));
  }
}

void from_float(const float* src, DataType dtype, size_t n, void* out) {
  switch (dtype) {
    case DataType::FLOAT32:
      std::memcpy(out, src, n * 4);
      return;
    case DataType::FLOAT16: {
      auto* d = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      return;
    }
    case DataType::BFLOAT16: {
      auto* d = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DataType::FLOAT64: {
      auto* d = static_cast<double*>(out);
      for (size_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    default:
      throw std::invalid_argument(std::string("not a floating-point type: ") + dtype_name(dtype));
  }
}

}  // namespace bagua_hvd
