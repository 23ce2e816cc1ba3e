// MinMaxUInt8 per-element and per-chunk math (docs/algorithms.md, "MinMaxUInt8"), shared by the
// CPU kernels (minmax_uint8_cpu.cc) and the CUDA kernels (minmax_uint8_cuda.cu) so that both, and
// a numpy float32 reference, agree bit for bit.
//
// Every operation is one IEEE float32 operation rounded to nearest even. In device code they are
// spelled with the _rn intrinsics, which nvcc never fuses into FMA nor flushes; on the host the
// formula has no a*b+c shape to contract in the first place (and the .cc files are compiled with
// -ffp-contract=off besides).
//
// Conventions beyond the spec formula (docs/compression.md):
//  - (uint8) saturates: values below 0 (and NaN) become 0, values above 255 become 255. Only
//    chunks where |max * scale| >= 2^24 reach those cases: ub - 255 is then rounded, so
//    ub - lb may be 256. Constant chunks are among them (scale = 255 / eps; a chunk of 1.0s
//    gives 256), as are large offsets with tiny ranges and overflowing ranges. Saturating is
//    what a GPU's float -> u8 conversion does; C++'s cast would be undefined.
//  - A chunk holding NaN or +-Inf stores NaN as min and max and zero payload; decompress then
//    yields NaN for every element, by the formula itself (scale = NaN).
//  - Finite in, finite out. Where the formula overflows float32 (mx - mn, or mx * scale: only
//    when max(|mn|, |mx|) >= 2^96), the scale is computed on min and max multiplied by
//    s = 2^(1-k), k = floor(log2(max(|mn|, |mx|))) (so they lie in [-4, 4]), and multiplied by s
//    again: exact power-of-2 steps, so x * scale is what the scaled chunk would give. A chunk of
//    1e30s then decodes to ~1e30, not NaN. Every other chunk keeps the formula's bits.
//    Decompressed values are clamped to T's largest finite value (a value near FLT_MAX can
//    round past it); only results that were +-Inf change.
//  - A zero min or max is stored as +0 (the sign of a zero min/max changes no decoded value, and
//    SIMD min/max may return either zero).
//  - Decompressed NaN is the canonical quiet NaN (0x7fc00000, float16 0x7e00, bfloat16 0x7fc0),
//    whatever NaN the hardware produced. Decompress-accumulate makes a NaN sum canonical too:
//    x86 returns a NaN operand's bits, a GPU its own NaN (0x7fffffff), so without it a CPU rank
//    and a GPU rank would disagree (seen on an H200: native/tests/minmax_uint8_cuda_check.cu).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "base/common.h"
#include "base/float_bits.h"

namespace bagua_hvd {
namespace mmu8 {

#if defined(__CUDA_ARCH__)
BHVD_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
BHVD_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
BHVD_HD float rint_even(float a) { return ::rintf(a); }
#else
BHVD_HD float mul_rn(float a, float b) { return a * b; }
BHVD_HD float div_rn(float a, float b) { return a / b; }
BHVD_HD float rint_even(float a) { return std::nearbyint(a); }  // round-half-even, no errno
#endif
using fbits::add_rn;
using fbits::sub_rn;

constexpr float kEps = 1e-7f;  // the float32 nearest to 1e-7
constexpr uint32_t kCanonicalNanBits = 0x7fc00000u;
// Header per chunk: min at byte 0, max at byte sizeof(T), zeros up to byte 32.
constexpr size_t kHeaderBytes = 32;

BHVD_HD constexpr size_t align32(size_t n) { return (n + 31) & ~static_cast<size_t>(31); }

struct Params {
  float scale;  // 255 / (max - min + eps)
  float ub;     // rint(max * scale)
  float lb;     // ub - 255
};

BHVD_HD bool finite(float v) { return v - v == 0.0f; }  // false for NaN and +-Inf

BHVD_HD Params params(float mn, float mx) {
  Params p;
  const float range = sub_rn(mx, mn);
  p.scale = div_rn(255.0f, add_rn(range, kEps));
  p.ub = rint_even(mul_rn(mx, p.scale));
  if (finite(mn) && finite(mx) && !(finite(range) && finite(p.ub))) {
    // Overflow (see above): biased exponent e of max(|mn|, |mx|) >= 223 here, so
    // s = 2^(128 - (e - 127)) has biased exponent 255 - e >= 1: normal, and so is scale.
    const uint32_t e = (fbits::f32_bits(fmaxf(fabsf(mn), fabsf(mx))) >> 23) & 0xffu;
    const float s = fbits::bits_f32((255u - e) << 23);
    const float scaled = div_rn(255.0f, add_rn(sub_rn(mul_rn(mx, s), mul_rn(mn, s)), kEps));
    p.scale = mul_rn(scaled, s);
    p.ub = rint_even(mul_rn(mx, p.scale));
  }
  p.lb = sub_rn(p.ub, 255.0f);
  return p;
}

// q = (uint8) saturate(min(rint(x * scale), ub) - lb). fminf's operands are never NaN here
// (x and the chunk's min/max are finite), so fminf and SIMD min agree.
BHVD_HD uint8_t quantize(float x, const Params& p) {
  float v = sub_rn(fminf(rint_even(mul_rn(x, p.scale)), p.ub), p.lb);
  v = v > 0.0f ? v : 0.0f;  // also NaN -> 0
  v = v < 255.0f ? v : 255.0f;
  return static_cast<uint8_t>(v);
}

// x' = (q + lb) / scale in float32, clamped to T's largest finite value, NaN made canonical.
template <typename Ty>
BHVD_HD float dequantize(uint8_t q, const Params& p) {
  const float top = fbits::bits_f32(Ty::kTopBits);
  float v = div_rn(add_rn(static_cast<float>(q), p.lb), p.scale);
  v = v > top ? top : v;  // NaN compares false: kept
  v = v < -top ? -top : v;
  return v != v ? fbits::bits_f32(kCanonicalNanBits) : v;
}

// acc + x rounded to nearest even, a NaN sum made canonical (see above).
BHVD_HD float accumulate(float acc, float x) {
  const float v = add_rn(acc, x);
  return v != v ? fbits::bits_f32(kCanonicalNanBits) : v;
}

// Zero min/max are stored as +0 (see above).
BHVD_HD float canonical_zero(float v) { return v == 0.0f ? 0.0f : v; }

// Element types: storage, exact widening to float32, round-to-nearest-even narrowing.
// kTop: the largest finite T, as float32 (decompress clamps to it).
struct F32 {
  using Storage = float;
  static constexpr uint32_t kTopBits = 0x7f7fffffu;
  static BHVD_HD float widen(float v) { return v; }
  static BHVD_HD float narrow(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  static constexpr uint32_t kTopBits = 0x477fe000u;  // 65504
  static BHVD_HD float widen(uint16_t v) { return fbits::half_to_float(v); }
  static BHVD_HD uint16_t narrow(float v) { return fbits::float_to_half(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static constexpr uint32_t kTopBits = 0x7f7f0000u;
  static BHVD_HD float widen(uint16_t v) { return fbits::bf16_to_float(v); }
  static BHVD_HD uint16_t narrow(float v) { return fbits::float_to_bf16(v); }
};

// Bytes of one compressed chunk of c elements of Ty.
template <typename Ty>
BHVD_HD constexpr size_t chunk_bytes(size_t c) {
  static_assert(align32(2 * sizeof(typename Ty::Storage)) == kHeaderBytes, "header is 32 bytes");
  return kHeaderBytes + align32(c);
}

// Header contents for a chunk with the given min, max and finiteness.
struct Header {
  float mn, mx;
};
BHVD_HD Header make_header(float mn, float mx, bool finite) {
  if (!finite) {
    const float nan = fbits::bits_f32(kCanonicalNanBits);
    return {nan, nan};
  }
  return {canonical_zero(mn), canonical_zero(mx)};
}

// Host side: calls f(Ty{}) for the element type of dtype (checked by minmax_uint8_check_args).
template <typename F>
void dispatch(DataType dtype, F&& f) {
  switch (dtype) {
    case DataType::FLOAT32:
      return f(F32{});
    case DataType::FLOAT16:
      return f(F16{});
    default:
      return f(BF16{});
  }
}

}  // namespace mmu8
}  // namespace bagua_hvd
