// float16 / bfloat16 <-> float32 conversions usable from host C++ and CUDA device code.
//
// Shared by the reduction kernels (collectives/reduce.cc), the compressors and the algorithms:
// branch-free bit tricks (loops over them vectorize), exact widening, round-to-nearest-even
// narrowing, NaN made quiet the way F16C's vcvtps2ph does.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define BHVD_HD __host__ __device__ __forceinline__
#else
#define BHVD_HD inline
#endif

namespace bagua_hvd {
namespace fbits {

BHVD_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

BHVD_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Float addition rounded to nearest even, never contracted or flushed (CUDA: explicit _rn).
BHVD_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
BHVD_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// All-ones when c holds: selects with masks keep conversion loops branch-free.
BHVD_HD uint32_t mask(bool c) { return 0u - static_cast<uint32_t>(c); }

// IEEE half -> float, exact.
BHVD_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t exp = em & 0x7c00u;
  const uint32_t shifted = em << 13;
  const uint32_t normal = shifted + (112u << 23);  // rebias 15 -> 127
  // inf / nan: exponent 255; nan is made quiet, like the F16C instructions do.
  const uint32_t special = (shifted + (224u << 23)) | (mask(em > 0x7c00u) & 0x00400000u);
  const uint32_t denorm =  // m * 2^-24, exact in float
      f32_bits(sub_rn(bits_f32(shifted + (113u << 23)), bits_f32(113u << 23)));
  const uint32_t is_special = mask(exp == 0x7c00u), is_denorm = mask(exp == 0);
  const uint32_t mag =
      (special & is_special) | (denorm & is_denorm) | (normal & ~(is_special | is_denorm));
  return bits_f32(mag | sign);
}

// float -> IEEE half, round to nearest even (after F. Giesen's float_to_half_fast3_rtne).
BHVD_HD uint16_t float_to_half(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // Subnormal results: adding 0.5 aligns the 10 mantissa bits at the bottom; the FPU rounds.
  const uint32_t magic = ((127 - 15) + (23 - 10) + 1) << 23;
  const uint32_t sub = f32_bits(add_rn(bits_f32(u), bits_f32(magic))) - magic;
  // Normal results: rebias and round to nearest even by adding 0xfff + the lowest kept bit.
  const uint32_t odd = (u >> 13) & 1u;
  const uint32_t norm = (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd) >> 13;
  // inf, or a quiet nan keeping the top payload bits (what F16C's vcvtps2ph produces)
  const uint32_t special = 0x7c00u | (mask(u > (255u << 23)) & (0x0200u | ((u >> 13) & 0x3ffu)));
  const uint32_t is_special = mask(u >= ((127u + 16u) << 23));
  const uint32_t is_sub = mask(u < (113u << 23)) & ~is_special;
  const uint32_t o = (special & is_special) | (sub & is_sub) | (norm & ~(is_special | is_sub));
  return static_cast<uint16_t>(o | (sign >> 16));
}

BHVD_HD float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// float -> bfloat16, round to nearest even; NaN keeps sign and payload, made quiet.
BHVD_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  const uint32_t is_nan = mask((u & 0x7fffffffu) > 0x7f800000u);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

}  // namespace fbits
}  // namespace bagua_hvd
