// Horovod's Adasum (collectives/allreduce_adasum.cc) over in-process ranks, against references
// written here from the definition: per tensor, a and b combine as
// (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b over the tree (0,1), (2,3), ... then pairs of
// subtrees. At 2 ranks the reference follows Horovod's arithmetic step by step (each rank's
// half, its partial sums in double, their sum, the scaled add, with the fused multiply-adds its
// compiler makes of them), so the result must be the same bits; at 4 and 8 ranks the partial sums
// are grouped differently from a whole-tensor reference, so the comparison allows a few units in
// the last place. Every rank must hold the same bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/hierarchy.h"
#include "in_process_ranks.h"
#include "ops/op.h"

namespace bagua_hvd {
namespace {
using testing_ranks::Kind;
using testing_ranks::run_ranks;

// Rank k's tensors (double values, rounded to the dtype by the caller).
std::vector<std::vector<double>> tensors_of(int k, const std::vector<size_t>& counts) {
  std::mt19937 gen(1000 + k);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<std::vector<double>> out;
  for (size_t t = 0; t < counts.size(); ++t) {
    std::vector<double> v(counts[t]);
    // Tensor 1 points the same way on every rank (Adasum averages it); the others are random.
    for (size_t i = 0; i < v.size(); ++i) v[i] = t == 1 ? (k + 1) * std::sin(i + 1.0) : d(gen);
    out.push_back(v);
  }
  return out;
}

double round_to(DataType dt, double x) {
  if (dt == DataType::FLOAT64) return x;
  if (dt == DataType::FLOAT32) return static_cast<float>(x);
  float f = static_cast<float>(x), back;
  uint16_t h;
  from_float(&f, DataType::FLOAT16, 1, &h);
  to_float(&h, DataType::FLOAT16, 1, &back);
  return back;
}

std::vector<unsigned char> pack(DataType dt, const std::vector<std::vector<double>>& ts) {
  const size_t es = dtype_size(dt);
  std::vector<unsigned char> out;
  for (const auto& t : ts)
    for (double x : t) {
      unsigned char b[8];
      if (dt == DataType::FLOAT64) std::memcpy(b, &x, 8);
      if (dt == DataType::FLOAT32) {
        float f = static_cast<float>(x);
        std::memcpy(b, &f, 4);
      }
      if (dt == DataType::FLOAT16) {
        float f = static_cast<float>(x);
        from_float(&f, DataType::FLOAT16, 1, b);
      }
      out.insert(out.end(), b, b + es);
    }
  return out;
}

// The coefficient of a vector with squared norm a2 against the other one (Horovod's formula).
double coeff(double dot, double a2) {
  return a2 >= std::sqrt(DBL_MIN) ? 1.0 - dot / a2 * 0.5 : 1.0;
}

// Whole-tensor tree reference (every combination rounded to the dtype, as a rank stores it).
std::vector<std::vector<double>> tree_reference(DataType dt, int n,
                                                const std::vector<size_t>& counts) {
  std::vector<std::vector<std::vector<double>>> v;
  for (int k = 0; k < n; ++k) {
    auto ts = tensors_of(k, counts);
    for (auto& t : ts)
      for (double& x : t) x = round_to(dt, x);
    v.push_back(ts);
  }
  for (int width = 1; width < n; width *= 2)
    for (int k = 0; k < n; k += 2 * width)
      for (size_t t = 0; t < counts.size(); ++t) {
        auto& a = v[k][t];
        const auto& b = v[k + width][t];
        double dot = 0, a2 = 0, b2 = 0;
        for (size_t i = 0; i < a.size(); ++i)
          dot += a[i] * b[i], a2 += a[i] * a[i], b2 += b[i] * b[i];
        const double ac = coeff(dot, a2), bc = coeff(dot, b2);
        for (size_t i = 0; i < a.size(); ++i) a[i] = round_to(dt, ac * a[i] + bc * b[i]);
      }
  return v[0];
}

// 2 ranks, Horovod's steps as its kernels compile (fused multiply-adds): rank 0 holds the first
// half of the packed tensors, rank 1 the rest; per tensor, each half's sums in double (float16:
// four lanes), added rank 0's first; the scaled add fma(own coefficient, own value, other
// coefficient * other value) in double (float16: in float32).
std::vector<double> two_rank_reference(DataType dt, const std::vector<size_t>& counts) {
  auto a = tensors_of(0, counts), b = tensors_of(1, counts);
  std::vector<double> x, y;
  for (size_t t = 0; t < counts.size(); ++t)
    for (size_t i = 0; i < counts[t]; ++i) {
      x.push_back(round_to(dt, a[t][i]));
      y.push_back(round_to(dt, b[t][i]));
    }
  const size_t first = x.size() / 2;
  std::vector<double> out(x.size());
  size_t begin = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    const size_t end = begin + counts[t];
    double sums[3] = {0, 0, 0};
    for (int half = 0; half < 2; ++half) {  // rank 0's share, then rank 1's
      const size_t lo = half == 0 ? begin : std::max(begin, first);
      const size_t hi = half == 0 ? std::min(end, first) : end;
      double d[4] = {}, p[4] = {}, q[4] = {};
      for (size_t i = lo; i < hi; ++i) {
        const size_t lane = dt == DataType::FLOAT16 ? (i - lo) & 3 : 0;
        d[lane] = std::fma(x[i], y[i], d[lane]);
        p[lane] = std::fma(x[i], x[i], p[lane]);
        q[lane] = std::fma(y[i], y[i], q[lane]);
      }
      sums[0] += (d[0] + d[2]) + (d[1] + d[3]);
      sums[1] += (p[0] + p[2]) + (p[1] + p[3]);
      sums[2] += (q[0] + q[2]) + (q[1] + q[3]);
    }
    const double ac = coeff(sums[0], sums[1]), bc = coeff(sums[0], sums[2]);
    for (size_t i = begin; i < end; ++i) {
      // The rank holding element i scales its own value first.
      const bool mine_is_x = i < first;
      const double own = mine_is_x ? x[i] : y[i], other = mine_is_x ? y[i] : x[i];
      const double c_own = mine_is_x ? ac : bc, c_other = mine_is_x ? bc : ac;
      if (dt == DataType::FLOAT16) {
        const float s = static_cast<float>(c_own) * static_cast<float>(own);
        out[i] = round_to(
            dt, static_cast<float>(static_cast<double>(static_cast<float>(c_other)) * other + s));
      } else {
        out[i] = round_to(dt, std::fma(c_own, own, c_other * other));
      }
    }
    begin = end;
  }
  return out;
}

std::vector<double> unpack(DataType dt, const unsigned char* p, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == DataType::FLOAT64) std::memcpy(&out[i], p + 8 * i, 8);
    if (dt == DataType::FLOAT32) {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      out[i] = f;
    }
    if (dt == DataType::FLOAT16) {
      float f;
      to_float(p + 2 * i, DataType::FLOAT16, 1, &f);
      out[i] = f;
    }
  }
  return out;
}

// Runs Adasum on n ranks; returns rank 0's result and checks that every rank has its bits.
std::vector<double> run_adasum(int n, Kind kind, DataType dt, const std::vector<size_t>& counts) {
  std::vector<std::vector<unsigned char>> results(n);
  run_ranks(n, kind, [&](Comm& comm) {
    auto buf = pack(dt, tensors_of(comm.rank(), counts));
    allreduce_adasum(comm, buf.data(), counts, dt);
    results[comm.rank()] = buf;
  });
  for (int k = 1; k < n; ++k) EXPECT_EQ(results[k], results[0]) << "rank " << k;
  size_t total = 0;
  for (size_t c : counts) total += c;
  return unpack(dt, results[0].data(), total);
}

const std::vector<size_t> kCounts = {5, 1000, 0, 1, 33, 4099, 100003};

TEST(Adasum, TwoRanksAreHorovodsArithmeticBitForBit) {
  for (DataType dt : {DataType::FLOAT64, DataType::FLOAT32, DataType::FLOAT16})
    for (Kind kind : {Kind::SHM, Kind::TCP})
      EXPECT_EQ(run_adasum(2, kind, dt, kCounts), two_rank_reference(dt, kCounts))
          << dtype_name(dt);
}

TEST(Adasum, FourAndEightRanksFollowTheTree) {
  for (int n : {4, 8})
    for (DataType dt : {DataType::FLOAT64, DataType::FLOAT32, DataType::FLOAT16}) {
      const auto got = run_adasum(n, n == 4 ? Kind::TCP : Kind::SHM, dt, kCounts);
      const auto ref_t = tree_reference(dt, n, kCounts);
      std::vector<double> ref;
      for (const auto& t : ref_t) ref.insert(ref.end(), t.begin(), t.end());
      ASSERT_EQ(got.size(), ref.size());
      // Rounding at each of the log2(n) levels may differ by one unit of the dtype.
      const double ulp = dt == DataType::FLOAT64 ? 1e-15 : dt == DataType::FLOAT32 ? 1.2e-7 : 1e-3;
      for (size_t i = 0; i < ref.size(); ++i)
        ASSERT_NEAR(got[i], ref[i], 8 * ulp * std::max(1.0, std::fabs(ref[i])))
            << dtype_name(dt) << " n=" << n << " element " << i;
    }
}

TEST(Adasum, ParallelVectorsAverageOrthogonalOnesAdd) {
  // Horovod's own properties (test_adasum_pytorch.py): the same direction on every rank gives
  // the mean, mutually orthogonal vectors give their sum.
  const int n = 4;
  const size_t m = 64;
  std::vector<std::vector<double>> parallel(n), orthogonal(n, std::vector<double>(m, 0.0));
  run_ranks(n, Kind::SHM, [&](Comm& comm) {
    const int k = comm.rank();
    std::vector<double> p(m), o(m, 0.0);
    for (size_t i = 0; i < m; ++i) p[i] = (k + 1) * std::cos(0.1 * i);
    for (size_t i = k; i < m; i += n) o[i] = 1.0 + k;
    allreduce_adasum(comm, p.data(), {m}, DataType::FLOAT64);
    allreduce_adasum(comm, o.data(), {m}, DataType::FLOAT64);
    parallel[k] = p;
    orthogonal[k] = o;
  });
  for (size_t i = 0; i < m; ++i) {
    EXPECT_NEAR(parallel[0][i], 2.5 * std::cos(0.1 * i), 1e-12);  // mean of 1..4
    EXPECT_NEAR(orthogonal[0][i], 1.0 + static_cast<double>(i % n), 1e-12);
  }
}

// Horovod's GPU Adasum across hosts (ops/allreduce.cc, adasum_across_hosts) on the CPU engine: 2
// hosts of 2 ranks (and 2 of 4). Reference: per tensor, the hosts' sums (each rounded to the
// dtype, as an allreduce of the host stores them) combined by the formula over the whole tensor.
// The slices' dot products are summed in another grouping than the whole tensor's, so a few
// units in the last place are allowed; every rank must hold the same bits.
TEST(Adasum, AcrossHostsEachRankOfAHostCombinesOneSlice) {
  const std::vector<std::vector<size_t>> cases = {kCounts, {1}, {0, 3}, {2, 0, 5}};
  for (int per_host : {2, 4})
    for (const auto& counts : cases)
      for (DataType dt : {DataType::FLOAT64, DataType::FLOAT32, DataType::FLOAT16}) {
        const int n = 2 * per_host;
        std::vector<std::vector<unsigned char>> results(n);
        run_ranks(
            n, Kind::SHM,
            [&](Comm& comm) {
              Hierarchy h = build_hierarchy(comm.transport(), comm, comm.global_rank(comm.rank()));
              ASSERT_TRUE(h.active && h.cross);
              auto buf = pack(dt, tensors_of(comm.rank(), counts));
              adasum_across_hosts(cpu_engine(), *h.intra, *h.cross, buf.data(), counts, dt);
              results[comm.rank()] = buf;
            },
            0, 2);
        for (int k = 1; k < n; ++k) ASSERT_EQ(results[k], results[0]) << "rank " << k;
        size_t total = 0;
        for (size_t c : counts) total += c;
        const auto got = unpack(dt, results[0].data(), total);
        // The hosts' sums, then one combination per tensor.
        std::vector<std::vector<std::vector<double>>> sums(2);
        for (int host = 0; host < 2; ++host) {
          sums[host] = std::vector<std::vector<double>>(counts.size());
          for (size_t t = 0; t < counts.size(); ++t) sums[host][t].assign(counts[t], 0.0);
          for (int k = host * per_host; k < (host + 1) * per_host; ++k) {
            const auto x = tensors_of(k, counts);
            for (size_t t = 0; t < counts.size(); ++t)
              for (size_t i = 0; i < counts[t]; ++i) sums[host][t][i] += round_to(dt, x[t][i]);
          }
        }
        std::vector<double> ref;
        for (size_t t = 0; t < counts.size(); ++t) {
          std::vector<double> a = sums[0][t], b = sums[1][t];
          for (double& v : a) v = round_to(dt, v);
          for (double& v : b) v = round_to(dt, v);
          double dot = 0, a2 = 0, b2 = 0;
          for (size_t i = 0; i < a.size(); ++i)
            dot += a[i] * b[i], a2 += a[i] * a[i], b2 += b[i] * b[i];
          for (size_t i = 0; i < a.size(); ++i)
            ref.push_back(round_to(dt, coeff(dot, a2) * a[i] + coeff(dot, b2) * b[i]));
        }
        ASSERT_EQ(got.size(), ref.size());
        const double ulp = dt == DataType::FLOAT64   ? 1e-15
                           : dt == DataType::FLOAT32 ? 1.2e-7
                                                     : 1e-3;
        for (size_t i = 0; i < ref.size(); ++i)
          ASSERT_NEAR(got[i], ref[i], 16 * ulp * std::max(1.0, std::fabs(ref[i])))
              << dtype_name(dt) << " " << per_host << " per host, element " << i;
      }
}

TEST(Adasum, RefusesWhatItCannotReduce) {
  EXPECT_THROW(check_adasum(DataType::INT32, 2), std::invalid_argument);
  EXPECT_THROW(check_adasum(DataType::BFLOAT16, 2), std::invalid_argument);
  EXPECT_THROW(check_adasum(DataType::FLOAT32, 3), std::invalid_argument);
  EXPECT_NO_THROW(check_adasum(DataType::FLOAT16, 8));
  try {
    check_adasum(DataType::FLOAT32, 6);
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "Running Adasum with non-power of 2 ranks is not supported yet.");
  }
}

}  // namespace
}  // namespace bagua_hvd
