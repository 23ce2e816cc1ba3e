// The host half of the phased primitives' checks (collectives/stream_backend.h): a StreamBackend's
// memory and kernels in host memory with the CPU kernels, layered on a Base that supplies rank(),
// size() and the exchanges (Comm transfers in native/tests/phased_test.cc, a hub of threads in
// native/tests/phased_cuda_check.cu).
#pragma once

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {

template <typename Base>
class HostKernels final : public Base {
 public:
  using Base::Base;
  void* scratch(int slot, size_t bytes) override {
    auto& v = slots_[slot];
    if (v.size() < bytes) v.resize(bytes);
    return v.data();
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void add(void* dst, const void* src, size_t n, DataType dtype) override {
    reduce_into(dst, src, n, dtype, ReduceOp::SUM);
  }
  void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) override {
    std::vector<float> fa(n), fb(n);
    to_float(a, dtype, n, fa.data());
    to_float(b, dtype, n, fb.data());
    for (size_t i = 0; i < n; ++i) fa[i] -= fb[i];
    from_float(fa.data(), dtype, n, dst);
  }
  void from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out) override {
    std::vector<float> v(acc, acc + n);
    if (divisor != 0.0f)
      for (auto& x : v) x /= divisor;
    from_float(v.data(), dtype, n, out);
  }
  void average(void* mine, const void* left, const void* right, size_t n, DataType dtype) override {
    if (dtype == DataType::FLOAT64) {
      auto* m = static_cast<double*>(mine);
      const auto* l = static_cast<const double*>(left);
      const auto* r = static_cast<const double*>(right);
      for (size_t i = 0; i < n; ++i) m[i] = r ? ((l[i] + m[i]) + r[i]) / 3 : (m[i] + l[i]) / 2;
      return;
    }
    std::vector<float> m(n), l(n), r(n);
    to_float(mine, dtype, n, m.data());
    to_float(left, dtype, n, l.data());
    if (right) to_float(right, dtype, n, r.data());
    for (size_t i = 0; i < n; ++i) m[i] = right ? ((l[i] + m[i]) + r[i]) / 3 : (m[i] + l[i]) / 2;
    from_float(m.data(), dtype, n, mine);
  }
  void lp_difference(void* d, const void* x, const void* left, const void* right, const void* self,
                     size_t n, DataType dtype) override {
    std::vector<float> xv(n), l(n), r(n), s(n);
    to_float(x, dtype, n, xv.data());
    to_float(left, dtype, n, l.data());
    to_float(right, dtype, n, r.data());
    to_float(self, dtype, n, s.data());
    const float third = 1.0f / 3.0f, five_thirds = 5.0f / 3.0f;
    for (size_t i = 0; i < n; ++i)
      xv[i] = ((xv[i] + l[i] * third) + r[i] * third) - s[i] * five_thirds;
    from_float(xv.data(), dtype, n, d);
  }
  void scale(void* buf, size_t n, DataType dtype, double factor) override {
    scale_buffer(buf, n, dtype, factor);
  }
  void compress(const void* in, DataType dtype, size_t n, size_t chunks, uint8_t* out) override {
    minmax_uint8_compress(in, dtype, n, chunks, out);
  }
  void decompress(const uint8_t* in, DataType dtype, size_t n, size_t chunks, void* out) override {
    minmax_uint8_decompress(in, dtype, n, chunks, out);
  }
  void decompress_add(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                      float* acc) override {
    minmax_uint8_decompress_add_f32(in, dtype, n, chunks, acc);
  }

 private:
  std::map<int, std::vector<unsigned char>> slots_;
};

// Rank k's values of step s as dtype's bytes: normal, scaled by 1 + k, one -0 (a zero of either
// sign may be a chunk's min or max).
inline std::vector<unsigned char> phased_input(int k, size_t count, int s, DataType dtype,
                                               int seed) {
  std::mt19937 gen(seed + 31 * k + 7 * s);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = dist(gen) * (1.0f + k);
  if (count > 3) v[count / 2] = -0.0f;
  std::vector<unsigned char> out(count * dtype_size(dtype));
  if (dtype == DataType::FLOAT64) {
    auto* d = reinterpret_cast<double*>(out.data());
    for (size_t i = 0; i < count; ++i) d[i] = v[i];
  } else {
    from_float(v.data(), dtype, count, out.data());
  }
  return out;
}

}  // namespace bagua_hvd
