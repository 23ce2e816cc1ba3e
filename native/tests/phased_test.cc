// The phased forms of BAGUA's primitives (collectives/stream_backend.h), which the CUDA engine
// runs with kernels and NCCL, against the pipelined CPU forms: here with a StreamBackend of host
// memory over the real transports, so the phases' schedule (buffers, offsets, order of the sum,
// residuals, peers) is checked on a machine without a GPU; the GPU check compares the CUDA
// backend's results with the CPU path's.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "base/float_bits.h"
#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"
#include "comm_exchanges.h"
#include "host_stream_kernels.h"
#include "in_process_ranks.h"

namespace bagua_hvd {
namespace {
using testing_ranks::Kind;
using testing_ranks::run_ranks;

using Bytes = std::vector<unsigned char>;

// Per rank: the results of two steps, then the residuals.
std::vector<std::vector<Bytes>> bytegrad(int n, size_t count, DataType dtype, bool average, bool ef,
                                         bool phased) {
  std::vector<std::vector<Bytes>> out(n);
  run_ranks(n, Kind::TCP, [&](Comm& comm) {
    const int k = comm.rank();
    const size_t es = dtype_size(dtype), chunk = (count + n - 1) / n;
    Bytes ew(chunk * n * es, 0), es_(chunk * es, 0);
    HostBackend be(comm);
    for (int s = 0; s < 2; ++s) {
      Bytes buf = phased_input(k, count, s, dtype, 500);
      void* w = ef ? ew.data() : nullptr;
      void* v = ef ? es_.data() : nullptr;
      if (phased)
        allreduce_minmax_uint8_phased(be, buf.data(), count, dtype, average, w, v);
      else
        allreduce_minmax_uint8(comm, buf.data(), count, dtype, average, w, v);
      out[k].push_back(buf);
    }
    out[k].push_back(ew);
    out[k].push_back(es_);
  });
  return out;
}

TEST(PhasedByteGrad, SameBitsAndResidualsAsThePipelinedForm) {
  for (int n : {2, 3}) {
    for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{300001}}) {
      for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16}) {
        if (dtype != DataType::FLOAT32 && count > 1000) continue;  // the same schedule
        for (bool ef : {false, true}) {
          const bool average = !(count == 7 && dtype == DataType::FLOAT32);  // a sum once
          const auto want = bytegrad(n, count, dtype, average, ef, false);
          const auto got = bytegrad(n, count, dtype, average, ef, true);
          for (int k = 0; k < n; ++k)
            for (size_t i = 0; i < want[k].size(); ++i)
              EXPECT_EQ(got[k][i], want[k][i])
                  << "rank " << k << " of " << n << ", " << count << " elements, dtype "
                  << dtype_name(dtype) << (ef ? ", error feedback" : "") << ", item " << i;
        }
      }
    }
  }
}

TEST(PhasedByteGrad, RefusesWhatThePipelinedFormRefuses) {
  run_ranks(1, Kind::TCP, [&](Comm& comm) {
    HostBackend be(comm);
    double x[4] = {};
    EXPECT_THROW(allreduce_minmax_uint8_phased(be, x, 4, DataType::FLOAT64, true, nullptr, nullptr),
                 std::invalid_argument);
  });
}

// Per rank: x, self, left, right after init and two steps (and one exchange of a given
// difference, the split form's second half).
std::vector<std::vector<Bytes>> lp_ring(int n, size_t count, DataType dtype, bool phased) {
  std::vector<std::vector<Bytes>> out(n);
  run_ranks(n, Kind::TCP, [&](Comm& comm) {
    const int k = comm.rank();
    const size_t bytes = count * dtype_size(dtype);
    HostBackend be(comm);
    Bytes x = phased_input(k, count, 0, dtype, 600), self(bytes), left(bytes), right(bytes);
    if (phased)
      lp_decentralized_init_phased(be, x.data(), self.data(), left.data(), right.data(), count,
                                   dtype);
    else
      lp_decentralized_init(comm, x.data(), self.data(), left.data(), right.data(), count, dtype);
    for (int s = 1; s <= 2; ++s) {
      // Local progress, different on every rank, between the steps.
      const Bytes g = phased_input(k, count, s, dtype, 700);
      reduce_into(x.data(), g.data(), count, dtype, ReduceOp::SUM);
      if (phased)
        lp_decentralized_phased(be, x.data(), self.data(), left.data(), right.data(), count, dtype);
      else
        lp_decentralized(comm, x.data(), self.data(), left.data(), right.data(), count, dtype);
    }
    std::vector<uint8_t> c(minmax_uint8_bytes(dtype, count, 1));
    const Bytes d = phased_input(k, count, 9, dtype, 800);
    minmax_uint8_compress(d.data(), dtype, count, 1, c.data());
    if (phased)
      lp_decentralized_exchange_phased(be, c.data(), left.data(), right.data(), count, dtype);
    else
      lp_decentralized_exchange(comm, c.data(), left.data(), right.data(), count, dtype);
    out[k] = {x, self, left, right};
  });
  return out;
}

TEST(PhasedLowPrecisionRing, SameBitsAsThePipelinedForm) {
  for (int n : {2, 3, 4}) {
    for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16}) {
      for (size_t count : {size_t{5}, size_t{300001}}) {
        if (dtype != DataType::FLOAT32 && count > 5 && n > 2) continue;  // the same schedule
        const auto want = lp_ring(n, count, dtype, false);
        const auto got = lp_ring(n, count, dtype, true);
        for (int k = 0; k < n; ++k)
          for (size_t i = 0; i < want[k].size(); ++i)
            EXPECT_EQ(got[k][i], want[k][i])
                << "rank " << k << " of " << n << ", " << count << " elements, "
                << dtype_name(dtype) << ", buffer " << i << " (x, self, left, right)";
      }
    }
  }
}

TEST(PhasedLowPrecisionRing, LocalHalfAloneSameBitsAsTheCpuLocalHalf) {
  // The split step's local half on a device (DeviceEngine::lp_local): kernels only, into the
  // caller's compressed-difference and work buffers, against lp_decentralized_local.
  for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16}) {
    for (size_t count : {size_t{1}, size_t{5}, size_t{300001}}) {
      const size_t bytes = count * dtype_size(dtype), cbytes = minmax_uint8_bytes(dtype, count, 1);
      const Bytes left = phased_input(1, count, 0, dtype, 610);
      const Bytes right = phased_input(2, count, 0, dtype, 620);
      std::vector<Bytes> out[2];
      for (int phased = 0; phased < 2; ++phased) {
        Bytes x = phased_input(0, count, 0, dtype, 630),
              self = phased_input(3, count, 0, dtype, 640);
        std::vector<uint8_t> c(cbytes);
        if (phased) {
          // No exchange: the kernels of a backend whose exchanges are never called.
          run_ranks(1, Kind::TCP, [&](Comm& comm) {
            HostBackend be(comm);
            Bytes work(bytes);
            lp_decentralized_local_phased(be, x.data(), self.data(), left.data(), right.data(),
                                          count, dtype, c.data(), work.data());
          });
        } else {
          lp_decentralized_local(x.data(), self.data(), left.data(), right.data(), count, dtype,
                                 c.data());
        }
        out[phased] = {x, self, Bytes(c.begin(), c.end())};
      }
      for (size_t i = 0; i < 3; ++i)
        EXPECT_EQ(out[1][i], out[0][i])
            << count << " elements, " << dtype_name(dtype) << ", buffer " << i << " (x, self, c)";
    }
  }
}

TEST(PhasedPeerAverage, SameBitsAsTheCombiningForm) {
  for (int n : {2, 3, 4}) {
    for (PeerMode mode : {PeerMode::ALL, PeerMode::SHIFT_ONE, PeerMode::RING}) {
      for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT64, DataType::FLOAT16}) {
        for (bool in_place : {true, false}) {
          if (!in_place && dtype != DataType::FLOAT32) continue;
          const size_t count = 70001;
          std::vector<Bytes> want(n), got(n);
          for (bool phased : {false, true}) {
            run_ranks(n, Kind::TCP, [&](Comm& comm) {
              const int k = comm.rank();
              HostBackend be(comm);
              const Bytes x = phased_input(k, count, 3, dtype, 500);
              Bytes out = in_place ? x : Bytes(x.size(), 0xab);
              const void* in = in_place ? static_cast<const void*>(out.data()) : x.data();
              if (phased)
                decentralized_average_phased(be, in, out.data(), count, dtype, mode, 5);
              else
                decentralized_average(comm, in, out.data(), count, dtype, mode, 5);
              (phased ? got : want)[k] = out;
            });
          }
          for (int k = 0; k < n; ++k)
            EXPECT_EQ(got[k], want[k]) << "rank " << k << " of " << n << ", mode "
                                       << static_cast<int>(mode) << ", " << dtype_name(dtype);
        }
      }
    }
  }
}

}  // namespace
}  // namespace bagua_hvd
