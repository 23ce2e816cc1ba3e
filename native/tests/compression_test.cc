// MinMaxUInt8 (compression/) against byte vectors written by hand from the wire layout of
// docs/compression.md: per chunk min and max as T at bytes 0 and sizeof(T), zeros to byte 32,
// the uint8 values from byte 32, zeros to 32 + align32(c); scale = 255 / (max - min + 1e-7),
// ub = rint(max * scale), lb = ub - 255, q = uint8(min(rint(x * scale), ub) - lb).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "bagua_hvd/c_api.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// One float32 chunk of 4 values as the documented layout: 64 bytes.
std::vector<uint8_t> chunk(uint32_t min_bits, uint32_t max_bits, std::vector<uint8_t> q) {
  std::vector<uint8_t> out(64, 0);
  std::memcpy(out.data(), &min_bits, 4);
  std::memcpy(out.data() + 4, &max_bits, 4);
  std::copy(q.begin(), q.end(), out.begin() + 32);
  return out;
}

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

std::vector<uint8_t> compress(const std::vector<float>& x, size_t n_chunks) {
  std::vector<uint8_t> out(minmax_uint8_bytes(DataType::FLOAT32, x.size(), n_chunks), 0xcd);
  minmax_uint8_compress(x.data(), DataType::FLOAT32, x.size(), n_chunks, out.data());
  return out;
}

std::vector<float> decompress(const std::vector<uint8_t>& c, size_t n, size_t n_chunks) {
  std::vector<float> out(n);
  minmax_uint8_decompress(c.data(), DataType::FLOAT32, n, n_chunks, out.data());
  return out;
}

TEST(MinMaxUInt8, ExactRange) {
  // min 0, max 3: 3 + 1e-7 rounds to 3 in float32, scale = 85, ub = 255, lb = 0.
  const std::vector<float> x = {0, 1, 2, 3};
  const auto want = chunk(0x00000000, 0x40400000, {0, 85, 170, 255});
  EXPECT_EQ(minmax_uint8_bytes(DataType::FLOAT32, 4, 1), 64u);
  EXPECT_EQ(compress(x, 1), want);
  EXPECT_EQ(decompress(want, 4, 1), x);
}

TEST(MinMaxUInt8, RoundHalfEvenAndSaturation) {
  // min -1, max 1: scale = 127.5, ub = rint(127.5) = 128 (half to even), lb = -127.
  // -1 -> rint(-127.5) = -128, -128 + 127 = -1 saturates to 0; 0 -> 127; 1 -> 128 + 127 = 255;
  // 0.5 -> rint(63.75) = 64 -> 191.
  const std::vector<float> x = {-1, 0, 1, 0.5f};
  const auto want = chunk(0xbf800000, 0x3f800000, {0, 127, 255, 191});
  EXPECT_EQ(compress(x, 1), want);
  const std::vector<float> back = {(0.f - 127.f) / 127.5f, 0.f, (255.f - 127.f) / 127.5f,
                                   (191.f - 127.f) / 127.5f};
  EXPECT_EQ(decompress(want, 4, 1), back);
}

TEST(MinMaxUInt8, ChunksBackToBack) {
  const std::vector<float> x = {0, 1, 2, 3, -1, 0, 1, 0.5f};
  auto want = chunk(0x00000000, 0x40400000, {0, 85, 170, 255});
  const auto second = chunk(0xbf800000, 0x3f800000, {0, 127, 255, 191});
  want.insert(want.end(), second.begin(), second.end());
  EXPECT_EQ(minmax_uint8_bytes(DataType::FLOAT32, 8, 2), 128u);
  EXPECT_EQ(compress(x, 2), want);
}

TEST(MinMaxUInt8, ConstantChunkDecodesExactly) {
  // scale = 255 / 1e-7: q = ub - lb = 256 saturates to 255, which decodes to exactly 1.0.
  const std::vector<float> x = {1, 1, 1, 1};
  const auto want = chunk(0x3f800000, 0x3f800000, {255, 255, 255, 255});
  EXPECT_EQ(compress(x, 1), want);
  EXPECT_EQ(decompress(want, 4, 1), x);
}

TEST(MinMaxUInt8, NonFiniteChunkIsCanonicalNaN) {
  const std::vector<float> x = {1, NAN, 2, 3, 0, 1, 2, 3};
  auto want = chunk(0x7fc00000, 0x7fc00000, {0, 0, 0, 0});
  const auto second = chunk(0x00000000, 0x40400000, {0, 85, 170, 255});
  want.insert(want.end(), second.begin(), second.end());
  EXPECT_EQ(compress(x, 2), want);
  const auto back = decompress(want, 8, 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bits(back[i]), 0x7fc00000u) << i;  // canonical NaN
  EXPECT_EQ(std::vector<float>(back.begin() + 4, back.end()), (std::vector<float>{0, 1, 2, 3}));
}

TEST(MinMaxUInt8, EmptyInputIsAZeroHeader) {
  EXPECT_EQ(minmax_uint8_bytes(DataType::FLOAT32, 0, 1), 32u);
  EXPECT_EQ(compress({}, 1), std::vector<uint8_t>(32, 0));
}

TEST(MinMaxUInt8, CApiRefusesBadArguments) {
  float x[4] = {0, 1, 2, 3};
  uint8_t out[64];
  EXPECT_EQ(bhvd_minmax_uint8_compress(x, BHVD_FLOAT32, 4, 0, out), BHVD_INVALID_ARGUMENT);
  EXPECT_STREQ(bhvd_last_error(), "MinMaxUInt8 compression needs n_chunks >= 1, got 0");
  EXPECT_EQ(bhvd_minmax_uint8_compress(nullptr, BHVD_FLOAT32, 4, 1, out), BHVD_INVALID_ARGUMENT);
  EXPECT_EQ(bhvd_minmax_uint8_size(BHVD_FLOAT32, -1, 1), -1);
  EXPECT_EQ(bhvd_minmax_uint8_compress(x, BHVD_FLOAT32, 4, 1, out), BHVD_OK);
  EXPECT_EQ(out[33], 85);
}

// Finite in, finite out (docs/algorithms.md): where mx - mn or mx * scale overflows float32, the
// scale is computed on min and max brought to [-4, 4] by a power of 2, and decompress clamps to
// T's largest finite value. The chunks below gave +-Inf or NaN before. 12 values: 8 through the
// AVX2 path where there is one, 4 through the scalar tail.
float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(MinMaxUInt8, LargeConstantChunkStaysFinite) {
  for (const float v : {1e30f, -1e30f, 3e38f, from_bits(0x7f7fffff)}) {
    const std::vector<float> x(12, v);
    const auto wire = compress(x, 1);
    EXPECT_EQ(bits(from_bits(wire[0] | wire[1] << 8 | wire[2] << 16 | uint32_t{wire[3]} << 24)),
              bits(v));
    for (const float y : decompress(wire, 12, 1)) {
      ASSERT_TRUE(std::isfinite(y)) << v;
      EXPECT_LE(std::fabs(y - v), std::fabs(v) * 1e-6f) << v << " decoded as " << y;
    }
  }
}

TEST(MinMaxUInt8, OverflowingRangeStaysFinite) {
  // mx - mn = 6e38 overflows: the formula gave scale 0 and NaN everywhere.
  const std::vector<float> x = {3e38f, -3e38f, 0, 1e38f, -1e38f, 2e38f, 3e38f, 0, 1, -1, 0, 3e38f};
  const auto back = decompress(compress(x, 1), 12, 1);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(std::isfinite(back[i])) << i;
    EXPECT_LE(std::fabs(back[i] - x[i]), 2.4e36f) << i;  // one step: (mx - mn) / 255
  }
}

TEST(MinMaxUInt8, DecompressClampsToLargestFinite) {
  // +-a, a = 0x7f7fde48: ub / scale rounds past FLT_MAX (to +Inf before the clamp).
  const float a = from_bits(0x7f7fde48);
  const std::vector<float> x = {-a, a, a, -a, -a, a, a, -a, -a, a, a, -a};
  const auto back = decompress(compress(x, 1), 12, 1);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(std::isfinite(back[i])) << i;
    if (x[i] > 0) {
      EXPECT_EQ(bits(back[i]), 0x7f7fffffu) << i;  // FLT_MAX, T's largest
    }
  }
}

TEST(MinMaxUInt8, Bfloat16ClampsToItsLargestFinite) {
  // bfloat16's largest finite value, 0x7f7f, and its negative: FLT_MAX would round to +Inf.
  const std::vector<uint16_t> x = {0xff7f, 0x7f7f, 0x7f7f, 0xff7f, 0xff7f, 0x7f7f,
                                   0x7f7f, 0xff7f, 0xff7f, 0x7f7f, 0x7f7f, 0xff7f};
  std::vector<uint8_t> wire(minmax_uint8_bytes(DataType::BFLOAT16, 12, 1));
  minmax_uint8_compress(x.data(), DataType::BFLOAT16, 12, 1, wire.data());
  std::vector<uint16_t> back(12);
  minmax_uint8_decompress(wire.data(), DataType::BFLOAT16, 12, 1, back.data());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NE(back[i] & 0x7f80, 0x7f80) << i << ": " << back[i];  // not Inf, not NaN
  }
}

}  // namespace
}  // namespace bagua_hvd
