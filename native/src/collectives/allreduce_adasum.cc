// Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021),
// the reduction Horovod's op=hvd.Adasum runs on CPU tensors: per tensor, two gradients a and b
// combine as
//     (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
// (a coefficient is 1 where its norm is below sqrt(DBL_MIN)), over a binary tree of the ranks:
// 0 with 1, 2 with 3, ..., then {0,1} with {2,3}, and so on.
//
// Vector halving, distance doubling, as Horovod's AdasumMPI: at level L = 1, 2, 4, ... a rank
// keeps one half of its current segment (the upper rank of the pair rank ^ L the second half),
// sends the other half to rank ^ L and receives that rank's copy of its own half. The dot
// product and norms of each tensor's share are then summed over the 2L ranks whose segments
// together hold the tensor (the two subtrees being combined), so every rank scales its share
// with the same coefficients. After the last level every element has been combined by exactly
// one rank, and the halves are gathered back in reverse order.
//
// Arithmetic as Horovod's kernels compile: sums of products in double with fused multiply-adds,
// float16 in four lanes (its AVX kernel), the scaled add fused in double (float32, float64) or
// in float32 (float16). Compared bit for bit with Horovod 0.28.1 built here (docs/adasum.md).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"

namespace bagua_hvd {
namespace {

// float32 and float64 as Horovod's loops compile (x86 with -mfma, aarch64): every a * b + c fused
// (dot += a * b; a = fma(ac, a, bc * b)). For float32 inputs the products are exact in double,
// so only the scaled add's rounding depends on it; for float64 both do. Explicit fma calls are
// immune to -ffp-contract=off; the FMA-target copies make them instructions where the CPU has
// them (checked at run time), the plain ones call the C library's.
template <typename T>
inline __attribute__((always_inline)) void dot_and_norms_body(const T* a, const T* b, size_t n,
                                                              double* dot, double* aa, double* bb) {
  double d = 0, x = 0, y = 0;
  for (size_t i = 0; i < n; ++i) {
    const double ai = static_cast<double>(a[i]), bi = static_cast<double>(b[i]);
    d = std::fma(ai, bi, d);
    x = std::fma(ai, ai, x);
    y = std::fma(bi, bi, y);
  }
  *dot = d, *aa = x, *bb = y;
}

template <typename T>
inline __attribute__((always_inline)) void scaled_add_body(T* a, double ac, const T* b, double bc,
                                                           size_t n) {
  for (size_t i = 0; i < n; ++i)
    a[i] = static_cast<T>(std::fma(ac, static_cast<double>(a[i]), bc * static_cast<double>(b[i])));
}

#if defined(__x86_64__) && defined(__GNUC__)
#define BHVD_FMA_VARIANTS 1
template <typename T>
__attribute__((target("fma"))) void dot_and_norms_fma(const T* a, const T* b, size_t n, double* dot,
                                                      double* aa, double* bb) {
  dot_and_norms_body(a, b, n, dot, aa, bb);
}
template <typename T>
__attribute__((target("fma"))) void scaled_add_fma(T* a, double ac, const T* b, double bc,
                                                   size_t n) {
  scaled_add_body(a, ac, b, bc, n);
}
bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename T>
void dot_and_norms(const T* a, const T* b, size_t n, double* dot, double* aa, double* bb) {
#ifdef BHVD_FMA_VARIANTS
  if (cpu_has_fma()) return dot_and_norms_fma(a, b, n, dot, aa, bb);
#endif
  dot_and_norms_body(a, b, n, dot, aa, bb);
}

template <typename T>
void scaled_add(T* a, double ac, const T* b, double bc, size_t n) {
#ifdef BHVD_FMA_VARIANTS
  if (cpu_has_fma()) return scaled_add_fma(a, ac, b, bc, n);
#endif
  scaled_add_body(a, ac, b, bc, n);
}

// float16: lane k & 3 sums element k's products, lanes folded as (0 + 2) + (1 + 3). Products of
// halves are exact in double, so this is Horovod's fused multiply-add kernel bit for bit.
void dot_and_norms_f16(const void* a, const void* b, size_t n, double* dot, double* aa,
                       double* bb) {
  double d[4] = {}, x[4] = {}, y[4] = {};
  float fa[kFloatBlock], fb[kFloatBlock];
  for (size_t i0 = 0; i0 < n; i0 += kFloatBlock) {
    const size_t m = std::min(kFloatBlock, n - i0);
    to_float(static_cast<const uint16_t*>(a) + i0, DataType::FLOAT16, m, fa);
    to_float(static_cast<const uint16_t*>(b) + i0, DataType::FLOAT16, m, fb);
    for (size_t j = 0; j < m; ++j) {
      const size_t lane = (i0 + j) & 3;
      const double ai = fa[j], bi = fb[j];
      d[lane] += ai * bi;
      x[lane] += ai * ai;
      y[lane] += bi * bi;
    }
  }
  *dot = (d[0] + d[2]) + (d[1] + d[3]);
  *aa = (x[0] + x[2]) + (x[1] + x[3]);
  *bb = (y[0] + y[2]) + (y[1] + y[3]);
}

// float16: a = fma(bc, b, ac * a) in float32 (coefficients rounded to float), rounded to half.
// The product bc * b is exact in double, so the fused add is one rounding of a double sum.
void scaled_add_f16(void* a, double ac, const void* b, double bc, size_t n) {
  const float fac = static_cast<float>(ac), fbc = static_cast<float>(bc);
  float fa[kFloatBlock], fb[kFloatBlock];
  for (size_t i0 = 0; i0 < n; i0 += kFloatBlock) {
    const size_t m = std::min(kFloatBlock, n - i0);
    uint16_t* pa = static_cast<uint16_t*>(a) + i0;
    to_float(pa, DataType::FLOAT16, m, fa);
    to_float(static_cast<const uint16_t*>(b) + i0, DataType::FLOAT16, m, fb);
    for (size_t j = 0; j < m; ++j) {
      const float scaled = fac * fa[j];
      fa[j] = static_cast<float>(static_cast<double>(fbc) * fb[j] + static_cast<double>(scaled));
    }
    from_float(fa, DataType::FLOAT16, m, pa);
  }
}

void tensor_dot_and_norms(DataType t, const unsigned char* a, const unsigned char* b, size_t n,
                          double* dot, double* aa, double* bb) {
  switch (t) {
    case DataType::FLOAT16:
      return dot_and_norms_f16(a, b, n, dot, aa, bb);
    case DataType::FLOAT32:
      return dot_and_norms(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b), n,
                           dot, aa, bb);
    default:
      return dot_and_norms(reinterpret_cast<const double*>(a), reinterpret_cast<const double*>(b),
                           n, dot, aa, bb);
  }
}

void tensor_scaled_add(DataType t, unsigned char* a, double ac, const unsigned char* b, double bc,
                       size_t n) {
  switch (t) {
    case DataType::FLOAT16:
      return scaled_add_f16(a, ac, b, bc, n);
    case DataType::FLOAT32:
      return scaled_add(reinterpret_cast<float*>(a), ac, reinterpret_cast<const float*>(b), bc, n);
    default:
      return scaled_add(reinterpret_cast<double*>(a), ac, reinterpret_cast<const double*>(b), bc,
                        n);
  }
}

// The 2L set ranks whose segments hold the shares combined at level L (this rank's among them).
Comm subtree_comm(Comm& comm, int level) {
  const int width = 2 * level, first = comm.rank() / width * width;
  std::vector<int> members;
  for (int r = first; r < first + width; ++r) members.push_back(comm.global_rank(r));
  return Comm(comm.transport(), std::move(members));
}

}  // namespace

void check_adasum(DataType dtype, int ranks) {
  if (dtype != DataType::FLOAT16 && dtype != DataType::FLOAT32 && dtype != DataType::FLOAT64)
    throw std::invalid_argument(std::string("Adasum reduces float16, float32 and float64 tensors, "
                                            "not ") +
                                dtype_name(dtype));
  if (ranks < 1 || (ranks & (ranks - 1)) != 0)
    throw std::invalid_argument("Running Adasum with non-power of 2 ranks is not supported yet.");
}

void allreduce_adasum(Comm& comm, void* buf, const std::vector<size_t>& counts, DataType dtype,
                      Comm* dots_also) {
  const int n = comm.size(), me = comm.rank();
  check_adasum(dtype, n);
  size_t total = 0;
  for (size_t c : counts) total += c;
  if (n == 1 || (total == 0 && !dots_also)) return;
  TraceSpan span(TraceOp::kAllreduce, static_cast<int64_t>(total));
  const size_t es = dtype_size(dtype);
  thread_local std::vector<unsigned char> recv_mem;  // grows, never shrinks (as Horovod's)
  if (recv_mem.size() < total * es) recv_mem.resize(total * es);

  std::vector<size_t> mine = counts;       // per tensor: elements of this rank's segment
  std::vector<std::vector<size_t>> given;  // per level: elements handed to the neighbour
  unsigned char* seg = static_cast<unsigned char*>(buf);  // this rank's segment
  unsigned char* theirs = recv_mem.data();  // the neighbour's copy, at the same offsets
  size_t held = total;
  std::vector<double> sums(3 * counts.size());
  auto exchange = [&](int peer, const unsigned char* send, size_t send_n, unsigned char* recv,
                      size_t recv_n) {
    std::vector<Comm::Xfer> xs;
    if (send_n)
      xs.push_back({Comm::Xfer::SEND, peer, const_cast<unsigned char*>(send), send_n * es});
    if (recv_n) xs.push_back({Comm::Xfer::RECV, peer, recv, recv_n * es});
    comm.run(xs, "allreduce (Adasum)");
  };

  for (int level = 1; level < n; level <<= 1) {
    const int peer = me ^ level;
    const bool upper = (me & level) != 0;  // keeps the second half of the segment
    const size_t first = held / 2;
    std::vector<size_t>& gave = given.emplace_back(mine.size());
    size_t pos = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const size_t in_first = pos >= first ? 0 : std::min(mine[i], first - pos);
      pos += mine[i];
      gave[i] = upper ? in_first : mine[i] - in_first;
      mine[i] -= gave[i];
    }
    const size_t keep = upper ? held - first : first, give = held - keep;
    if (upper) {
      exchange(peer, seg, give, theirs + first * es, keep);
      seg += first * es;
      theirs += first * es;
    } else {
      exchange(peer, seg + first * es, give, theirs, keep);
    }
    held = keep;

    // Dot product and norms of each tensor's share; index 1 the lower subtree's norm.
    size_t off = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      double dot, a2, b2;
      tensor_dot_and_norms(dtype, seg + off * es, theirs + off * es, mine[i], &dot, &a2, &b2);
      sums[3 * i] = dot;
      sums[3 * i + 1] = upper ? b2 : a2;
      sums[3 * i + 2] = upper ? a2 : b2;
      off += mine[i];
    }
    Comm subtree = subtree_comm(comm, level);
    allreduce(subtree, sums.data(), sums.size(), DataType::FLOAT64, ReduceOp::SUM);
    if (dots_also)
      allreduce(*dots_also, sums.data(), sums.size(), DataType::FLOAT64, ReduceOp::SUM);

    static const double kTiny = std::sqrt(DBL_MIN);
    off = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const double dot = sums[3 * i];
      const double a2 = sums[3 * i + (upper ? 2 : 1)], b2 = sums[3 * i + (upper ? 1 : 2)];
      const double ac = a2 >= kTiny ? 1.0 - dot / a2 * 0.5 : 1.0;
      const double bc = b2 >= kTiny ? 1.0 - dot / b2 * 0.5 : 1.0;
      tensor_scaled_add(dtype, seg + off * es, ac, theirs + off * es, bc, mine[i]);
      off += mine[i];
    }
  }

  // Gather the combined halves back, the last level first.
  for (int level = n >> 1; level > 0; level >>= 1) {
    const int peer = me ^ level;
    const bool upper = (me & level) != 0;
    const std::vector<size_t>& gave = given.back();
    size_t back = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      back += gave[i];
      mine[i] += gave[i];
    }
    if (upper) {
      exchange(peer, seg, held, seg - back * es, back);
      seg -= back * es;
    } else {
      exchange(peer, seg, held, seg + held * es, back);
    }
    held += back;
    given.pop_back();
  }
}

}  // namespace bagua_hvd
