// CPU kernels of MinMaxUInt8 (minmax_uint8.h). Per chunk: one pass for min, max and finiteness,
// one pass quantizing. The AVX2 + F16C path computes exactly the scalar operations of
// minmax_uint8_math.h, 8 lanes at a time (IEEE mul/div/add, round-half-even, min/max whose
// operand order matches the scalar selects), so it is bit-identical to the scalar path, which
// also handles the tails and CPUs without AVX2.
#include "compression/minmax_uint8.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "compression/minmax_uint8_math.h"

// -DBHVD_MMU8_NO_SIMD builds the portable path alone (to test it on x86).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(BHVD_MMU8_NO_SIMD)
#include <immintrin.h>
#define BHVD_MMU8_X86 1
// Per-function target: the rest of the library stays baseline x86-64; picked at run time.
#define BHVD_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace bagua_hvd {
namespace {

using mmu8::BF16;
using mmu8::F16;
using mmu8::F32;
using mmu8::Params;
using mmu8::dispatch;

struct Scan {
  float mn, mx;
  bool finite;
};

// ---- scalar ---------------------------------------------------------------------------------
template <typename Ty>
Scan scan_scalar(const typename Ty::Storage* p, size_t c, Scan s) {
  for (size_t i = 0; i < c; ++i) {
    const float v = Ty::widen(p[i]);
    s.finite = s.finite && std::isfinite(v);
    s.mn = v < s.mn ? v : s.mn;
    s.mx = v > s.mx ? v : s.mx;
  }
  return s;
}

template <typename Ty>
void quantize_scalar(const typename Ty::Storage* p, size_t c, const Params& prm, uint8_t* q) {
  for (size_t i = 0; i < c; ++i) q[i] = mmu8::quantize(Ty::widen(p[i]), prm);
}

template <typename Ty>
void dequantize_scalar(const uint8_t* q, size_t c, const Params& prm, typename Ty::Storage* out) {
  for (size_t i = 0; i < c; ++i) out[i] = Ty::narrow(mmu8::dequantize<Ty>(q[i], prm));
}

template <typename Ty>
void dequantize_add_scalar(const uint8_t* q, size_t c, const Params& prm, float* acc) {
  for (size_t i = 0; i < c; ++i) {
    acc[i] = mmu8::accumulate(acc[i], Ty::widen(Ty::narrow(mmu8::dequantize<Ty>(q[i], prm))));
  }
}

// ---- AVX2 + F16C ----------------------------------------------------------------------------
#ifdef BHVD_MMU8_X86
bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}

// Loads 8 elements widened to float; stores 8 floats narrowed (round to nearest even).
// narrow() expects NaN lanes to be the canonical NaN (all dequantized values are).
template <typename Ty>
struct Vec;
template <>
struct Vec<F32> {
  BHVD_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  BHVD_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  BHVD_AVX2 static __m256 round_trip(__m256 v) { return v; }
};
template <>
struct Vec<F16> {
  BHVD_AVX2 static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  BHVD_AVX2 static __m128i narrow(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  }
  BHVD_AVX2 static void store(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v));
  }
  BHVD_AVX2 static __m256 round_trip(__m256 v) { return _mm256_cvtph_ps(narrow(v)); }
};
template <>
struct Vec<BF16> {
  BHVD_AVX2 static __m256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Round to nearest even into the low 16 bits of each lane: (u + 0x7fff + lsb) >> 16. The
  // canonical NaN (low bits zero) comes out as the quiet bfloat16 NaN 0x7fc0.
  BHVD_AVX2 static __m256i narrow32(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_srli_epi32(r, 16);
  }
  BHVD_AVX2 static void store(uint16_t* p, __m256 v) {
    const __m256i packed = _mm256_packus_epi32(narrow32(v), _mm256_setzero_si256());
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xd8);  // lanes 0, 2 first
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  BHVD_AVX2 static __m256 round_trip(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(narrow32(v), 16));
  }
};

BHVD_AVX2 float hmin(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
BHVD_AVX2 float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Min and max over the finite values; NaN lanes are tracked apart (vminps drops or keeps them
// depending on operand order, so they must not decide anything) and +-Inf shows in min/max.
template <typename Ty>
BHVD_AVX2 Scan scan_avx2(const typename Ty::Storage* p, size_t c) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  __m256 mn[4], mx[4], nan[4];
  for (int k = 0; k < 4; ++k) {
    mn[k] = _mm256_set1_ps(kInf);
    mx[k] = _mm256_set1_ps(-kInf);
    nan[k] = _mm256_setzero_ps();
  }
  size_t i = 0;
  for (; i + 32 <= c; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = Vec<Ty>::load(p + i + 8 * k);
      mn[k] = _mm256_min_ps(mn[k], v);
      mx[k] = _mm256_max_ps(mx[k], v);
      nan[k] = _mm256_or_ps(nan[k], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  for (; i + 8 <= c; i += 8) {
    const __m256 v = Vec<Ty>::load(p + i);
    mn[0] = _mm256_min_ps(mn[0], v);
    mx[0] = _mm256_max_ps(mx[0], v);
    nan[0] = _mm256_or_ps(nan[0], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const __m256 vmn = _mm256_min_ps(_mm256_min_ps(mn[0], mn[1]), _mm256_min_ps(mn[2], mn[3]));
  const __m256 vmx = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
  const __m256 vnan = _mm256_or_ps(_mm256_or_ps(nan[0], nan[1]), _mm256_or_ps(nan[2], nan[3]));
  Scan s{hmin(vmn), hmax(vmx), _mm256_movemask_ps(vnan) == 0};
  s = scan_scalar<Ty>(p + i, c - i, s);
  s.finite = s.finite && std::isfinite(s.mn) && std::isfinite(s.mx);
  return s;
}

// Same steps as mmu8::quantize: vminps(r, ub) returns ub on ties, which differ from fminf only
// in the sign of a zero that the subtraction of lb erases; vmaxps(v, 0) maps NaN to 0.
template <typename Ty>
BHVD_AVX2 void quantize_avx2(const typename Ty::Storage* p, size_t c, const Params& prm,
                             uint8_t* q) {
  const __m256 scale = _mm256_set1_ps(prm.scale), ub = _mm256_set1_ps(prm.ub),
               lb = _mm256_set1_ps(prm.lb), zero = _mm256_setzero_ps(),
               top = _mm256_set1_ps(255.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  size_t i = 0;
  for (; i + 32 <= c; i += 32) {
    __m256i w[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 x = Vec<Ty>::load(p + i + 8 * k);
      __m256 v = _mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(x, scale), kRound), ub);
      v = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(v, lb), zero), top);
      w[k] = _mm256_cvttps_epi32(v);
    }
    // int32 -> int16 -> uint8 packs interleave the 128-bit lanes; the permute undoes it.
    const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(w[0], w[1]),
                                          _mm256_packs_epi32(w[2], w[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(b, order));
  }
  quantize_scalar<Ty>(p + i, c - i, prm, q + i);
}

// 8 dequantized values clamped to +-top, NaN lanes replaced by the canonical NaN. vminps and
// vmaxps return their second operand when one is NaN, so v goes second: NaN stays NaN.
BHVD_AVX2 inline __m256 dequantize8(const uint8_t* q, __m256 lb, __m256 scale, __m256 top,
                                    __m256 nan) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  __m256 v = _mm256_div_ps(_mm256_add_ps(_mm256_cvtepi32_ps(b), lb), scale);
  v = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), top), _mm256_min_ps(top, v));
  return _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

template <typename Ty>
BHVD_AVX2 void dequantize_avx2(const uint8_t* q, size_t c, const Params& prm,
                               typename Ty::Storage* out) {
  const __m256 scale = _mm256_set1_ps(prm.scale), lb = _mm256_set1_ps(prm.lb),
               top = _mm256_castsi256_ps(_mm256_set1_epi32(Ty::kTopBits)),
               nan = _mm256_castsi256_ps(_mm256_set1_epi32(mmu8::kCanonicalNanBits));
  size_t i = 0;
  for (; i + 8 <= c; i += 8) Vec<Ty>::store(out + i, dequantize8(q + i, lb, scale, top, nan));
  dequantize_scalar<Ty>(q + i, c - i, prm, out + i);
}

template <typename Ty>
BHVD_AVX2 void dequantize_add_avx2(const uint8_t* q, size_t c, const Params& prm, float* acc) {
  const __m256 scale = _mm256_set1_ps(prm.scale), lb = _mm256_set1_ps(prm.lb),
               top = _mm256_castsi256_ps(_mm256_set1_epi32(Ty::kTopBits)),
               nan = _mm256_castsi256_ps(_mm256_set1_epi32(mmu8::kCanonicalNanBits));
  size_t i = 0;
  for (; i + 8 <= c; i += 8) {
    const __m256 v = Vec<Ty>::round_trip(dequantize8(q + i, lb, scale, top, nan));
    const __m256 sum = _mm256_add_ps(_mm256_loadu_ps(acc + i), v);
    _mm256_storeu_ps(acc + i, _mm256_blendv_ps(sum, nan, _mm256_cmp_ps(sum, sum, _CMP_UNORD_Q)));
  }
  dequantize_add_scalar<Ty>(q + i, c - i, prm, acc + i);
}
#endif  // BHVD_MMU8_X86

// ---- per chunk --------------------------------------------------------------------------------
template <typename Ty>
Scan scan(const typename Ty::Storage* p, size_t c) {
  if (c == 0) return {0.0f, 0.0f, true};
#ifdef BHVD_MMU8_X86
  if (have_avx2()) return scan_avx2<Ty>(p, c);
#endif
  constexpr float kInf = std::numeric_limits<float>::infinity();
  return scan_scalar<Ty>(p, c, {kInf, -kInf, true});
}

template <typename Ty>
void write_header(uint8_t* h, const mmu8::Header& hd) {
  using S = typename Ty::Storage;
  const S mn = Ty::narrow(hd.mn), mx = Ty::narrow(hd.mx);  // exact: both are T values or NaN
  std::memset(h, 0, mmu8::kHeaderBytes);
  std::memcpy(h, &mn, sizeof(S));
  std::memcpy(h + sizeof(S), &mx, sizeof(S));
}

template <typename Ty>
Params read_params(const uint8_t* h) {
  using S = typename Ty::Storage;
  S mn, mx;
  std::memcpy(&mn, h, sizeof(S));
  std::memcpy(&mx, h + sizeof(S), sizeof(S));
  return mmu8::params(Ty::widen(mn), Ty::widen(mx));
}

template <typename Ty>
void compress_chunk(const typename Ty::Storage* p, size_t c, uint8_t* out) {
  const Scan s = scan<Ty>(p, c);
  const mmu8::Header hd = mmu8::make_header(s.mn, s.mx, s.finite);
  write_header<Ty>(out, hd);
  uint8_t* q = out + mmu8::kHeaderBytes;
  if (!s.finite) {
    std::memset(q, 0, mmu8::align32(c));  // the NaN header alone decodes to NaN
    return;
  }
  const Params prm = mmu8::params(hd.mn, hd.mx);
#ifdef BHVD_MMU8_X86
  if (have_avx2()) {
    quantize_avx2<Ty>(p, c, prm, q);
  } else {
    quantize_scalar<Ty>(p, c, prm, q);
  }
#else
  quantize_scalar<Ty>(p, c, prm, q);
#endif
  std::memset(q + c, 0, mmu8::align32(c) - c);
}

template <typename Ty>
void decompress_chunk(const uint8_t* in, size_t c, typename Ty::Storage* out) {
  const Params prm = read_params<Ty>(in);
  const uint8_t* q = in + mmu8::kHeaderBytes;
#ifdef BHVD_MMU8_X86
  if (have_avx2()) return dequantize_avx2<Ty>(q, c, prm, out);
#endif
  dequantize_scalar<Ty>(q, c, prm, out);
}

template <typename Ty>
void decompress_add_chunk(const uint8_t* in, size_t c, float* acc) {
  const Params prm = read_params<Ty>(in);
  const uint8_t* q = in + mmu8::kHeaderBytes;
#ifdef BHVD_MMU8_X86
  if (have_avx2()) return dequantize_add_avx2<Ty>(q, c, prm, acc);
#endif
  dequantize_add_scalar<Ty>(q, c, prm, acc);
}

template <typename Ty>
void quantize(const typename Ty::Storage* p, size_t c, const Params& prm, uint8_t* q) {
#ifdef BHVD_MMU8_X86
  if (have_avx2()) return quantize_avx2<Ty>(p, c, prm, q);
#endif
  quantize_scalar<Ty>(p, c, prm, q);
}

}  // namespace

void minmax_uint8_check_args(DataType dtype, size_t n, size_t n_chunks) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16) {
    const char* name = dtype_valid(static_cast<int32_t>(dtype)) ? dtype_name(dtype) : "unknown";
    throw std::invalid_argument(
        "MinMaxUInt8 compression supports float32, float16 and bfloat16 only, got dtype " +
        std::to_string(static_cast<int32_t>(dtype)) + " (" + name + ")");
  }
  if (n_chunks < 1) throw std::invalid_argument("MinMaxUInt8 compression needs n_chunks >= 1");
  if (n % n_chunks != 0) {
    throw std::invalid_argument("MinMaxUInt8 compression: n = " + std::to_string(n) +
                                " elements is not a multiple of n_chunks = " +
                                std::to_string(n_chunks) + " (callers zero-pad)");
  }
}

size_t minmax_uint8_bytes(DataType dtype, size_t n, size_t n_chunks) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  return n_chunks * (mmu8::kHeaderBytes + mmu8::align32(n / n_chunks));
}

void minmax_uint8_compress(const void* in, DataType dtype, size_t n, size_t n_chunks,
                           uint8_t* out) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  const size_t c = n / n_chunks;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const auto* p = static_cast<const typename Ty::Storage*>(in);
    for (size_t k = 0; k < n_chunks; ++k) {
      compress_chunk<Ty>(p + k * c, c, out + k * mmu8::chunk_bytes<Ty>(c));
    }
  });
}

void minmax_uint8_decompress(const uint8_t* in, DataType dtype, size_t n, size_t n_chunks,
                             void* out) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  const size_t c = n / n_chunks;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    auto* p = static_cast<typename Ty::Storage*>(out);
    for (size_t k = 0; k < n_chunks; ++k) {
      decompress_chunk<Ty>(in + k * mmu8::chunk_bytes<Ty>(c), c, p + k * c);
    }
  });
}

void minmax_uint8_decompress_add_f32(const uint8_t* in, DataType dtype, size_t n,
                                     size_t n_chunks, float* acc) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  const size_t c = n / n_chunks;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    for (size_t k = 0; k < n_chunks; ++k) {
      decompress_add_chunk<Ty>(in + k * mmu8::chunk_bytes<Ty>(c), c, acc + k * c);
    }
  });
}

// ---- one chunk in pieces ------------------------------------------------------------------
void minmax_uint8_scan_range(const void* in, DataType dtype, size_t m, MinMaxUint8Scan* acc) {
  minmax_uint8_check_args(dtype, m, 1);
  if (m == 0) return;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const Scan s = scan<Ty>(static_cast<const typename Ty::Storage*>(in), m);
    if (!acc->any) {
      *acc = MinMaxUint8Scan{s.mn, s.mx, s.finite, true};
      return;
    }
    acc->finite = acc->finite && s.finite;
    acc->mn = s.mn < acc->mn ? s.mn : acc->mn;
    acc->mx = s.mx > acc->mx ? s.mx : acc->mx;
  });
}

void minmax_uint8_write_header(const MinMaxUint8Scan& s, DataType dtype, size_t c,
                               uint8_t* chunk) {
  minmax_uint8_check_args(dtype, c, 1);
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    write_header<Ty>(chunk, mmu8::make_header(s.mn, s.mx, s.finite));
    uint8_t* q = chunk + mmu8::kHeaderBytes;
    if (!s.finite) {
      std::memset(q, 0, mmu8::align32(c));  // the NaN header alone decodes to NaN
    } else {
      std::memset(q + c, 0, mmu8::align32(c) - c);
    }
  });
}

void minmax_uint8_compress_header(const void* in, DataType dtype, size_t c, uint8_t* chunk) {
  MinMaxUint8Scan s;
  minmax_uint8_scan_range(in, dtype, c, &s);
  minmax_uint8_write_header(s, dtype, c, chunk);
}

void minmax_uint8_compress_range(const void* in, DataType dtype, size_t i0, size_t m,
                                 uint8_t* chunk) {
  minmax_uint8_check_args(dtype, m, 1);
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const Params prm = read_params<Ty>(chunk);
    if (prm.scale != prm.scale) return;  // non-finite chunk: the payload stays zero
    quantize<Ty>(static_cast<const typename Ty::Storage*>(in), m, prm,
                 chunk + mmu8::kHeaderBytes + i0);
  });
}

void minmax_uint8_decompress_range(const uint8_t* chunk, DataType dtype, size_t i0, size_t m,
                                   void* out) {
  minmax_uint8_check_args(dtype, m, 1);
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const Params prm = read_params<Ty>(chunk);
    const uint8_t* q = chunk + mmu8::kHeaderBytes + i0;
    auto* o = static_cast<typename Ty::Storage*>(out);
#ifdef BHVD_MMU8_X86
    if (have_avx2()) return dequantize_avx2<Ty>(q, m, prm, o);
#endif
    dequantize_scalar<Ty>(q, m, prm, o);
  });
}

void minmax_uint8_decompress_add_range(const uint8_t* chunk, DataType dtype, size_t i0, size_t m,
                                       float* acc) {
  minmax_uint8_check_args(dtype, m, 1);
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const Params prm = read_params<Ty>(chunk);
    const uint8_t* q = chunk + mmu8::kHeaderBytes + i0;
#ifdef BHVD_MMU8_X86
    if (have_avx2()) return dequantize_add_avx2<Ty>(q, m, prm, acc);
#endif
    dequantize_add_scalar<Ty>(q, m, prm, acc);
  });
}

}  // namespace bagua_hvd
