// The host hierarchy on a stream engine (engines/stream_engine.h): the op executors' decomposition
// (ops/), DataEngine's hierarchical allreduce and the phased BAGUA primitives over the hierarchy's
// sub-communicators, the code the CUDA engine runs on multi-GPU hosts, here with host memory and
// the CPU kernels (comm_exchanges.h) over the real transports, ranks as threads grouped into
// simulated hosts (shared memory within a host, TCP between). The CUDA engine's own part (NCCL or
// staging per group, its kernels) is not exercised here: that is the GPU check's. Checked bit for
// bit against the CPU engine's path, and, for the plain hierarchical allreduce (another order of
// addition than the CPU engine's pipeline), against exact sums computed here.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "comm_exchanges.h"
#include "core/validate.h"
#include "engines/stream_engine.h"
#include "in_process_ranks.h"
#include "ops/op.h"

namespace bagua_hvd {
namespace {
using testing_ranks::Kind;
using testing_ranks::run_ranks;
using Bytes = std::vector<unsigned char>;

// A stream engine of host memory: the CPU engine's Horovod collectives, DataEngine's hierarchical
// allreduce (the device engines'), and the phased primitives with the CPU kernels.
class HostStreamEngine final : public StreamEngine {
 public:
  const char* name() const override { return "host-stream"; }
  void copy(void* dst, const void* src, size_t bytes) override { cpu().copy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { cpu().zero(dst, bytes); }
  void scale(void* buf, size_t count, DataType dtype, double factor) override {
    cpu().scale(buf, count, dtype, factor);
  }
  void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) override {
    cpu().allreduce(comm, buf, count, dtype, op);
  }
  void allgatherv(Comm& comm, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    cpu().allgatherv(comm, in, out, bytes_per_rank);
  }
  void broadcast(Comm& comm, void* buf, size_t bytes, int root) override {
    cpu().broadcast(comm, buf, bytes, root);
  }
  void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
                 const std::vector<size_t>& recv_bytes) override {
    cpu().alltoallv(comm, in, send_bytes, out, recv_bytes);
  }
  void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op) override {
    cpu().reducescatterv(comm, buf, out, counts, dtype, op);
  }
  std::unique_ptr<StreamBackend> backend(Comm& comm) override {
    return std::make_unique<HostBackend>(comm);
  }

 private:
  static DataEngine& cpu() { return cpu_engine(); }
};

// One tensor op through its executor, as the runtime runs it.
void run_op(DataEngine& eng, Comm& comm, Hierarchy* h, const Response& r, Entry& e) {
  std::vector<Entry*> entries{&e};
  std::mutex mu;
  std::atomic<int64_t> stat{0};
  FusionBuffer fusion(stat);
  ExecContext ctx{r, comm, entries, eng, fusion, h, mu, nullptr, 0};
  op_executor(r.type)(ctx);
}

Response one_tensor(int32_t type, size_t count, DataType dtype, ReduceOp op, OpParams params) {
  Response r;
  r.type = type;
  r.dtype = dtype;
  r.reduce_op = op;
  r.params = params;
  r.names = {"t"};
  r.shapes = {{static_cast<int64_t>(count)}};
  return r;
}

struct Layout {
  int hosts, per_host;
};
const Layout kLayouts[] = {{2, 2}, {2, 3}, {3, 2}, {4, 2}};
const size_t kCounts[] = {1, 7, 1001, (1u << 16) + 3};
// A count past the pipelined ByteGrad's blocks and the allreduce's chunks, on two layouts (the
// sanitizer builds run every count on every layout slowly).
constexpr size_t kLarge = (1u << 20) + 3;
std::vector<size_t> counts_for(const Layout& l) {
  std::vector<size_t> out(std::begin(kCounts), std::end(kCounts));
  if ((l.hosts == 2 && l.per_host == 2) || (l.hosts == 4 && l.per_host == 2)) out.push_back(kLarge);
  return out;
}
const size_t kPeerCounts[] = {1, 7, 1001, (1u << 16) + 3};

std::string where(const Layout& l, size_t count, int rank) {
  return std::to_string(l.hosts) + " hosts x " + std::to_string(l.per_host) + ", count " +
         std::to_string(count) + ", rank " + std::to_string(rank);
}

// Runs body(comm, hierarchy) on every layout.
void on_layouts(const std::function<void(const Layout&, Comm&, Hierarchy&)>& body) {
  for (const Layout& l : kLayouts) {
    run_ranks(
        l.hosts * l.per_host, Kind::SHM,
        [&](Comm& comm) {
          Hierarchy h = build_hierarchy(comm.transport(), comm, comm.global_rank(comm.rank()));
          ASSERT_TRUE(h.active);
          ASSERT_EQ(h.leaders->size(), l.hosts);
          ASSERT_EQ(h.intra->size(), l.per_host);
          body(l, comm, h);
        },
        0, l.hosts);
  }
}

TEST(DeviceHierarchy, ByteGradSameBitsAndResidualsAsTheCpuEngine) {
  HostStreamEngine stream;
  on_layouts([&](const Layout& l, Comm& comm, Hierarchy& h) {
    const int k = comm.rank();
    // The residuals as every frontend sizes them: for the group the validation names.
    const int group = hierarchical_group_size(comm.transport(), comm.global_ranks(), true);
    ASSERT_EQ(group, l.hosts);
    for (size_t count : counts_for(l)) {
      for (bool ef : {false, true}) {
        const ResidualSizes rs = residual_sizes(static_cast<int64_t>(count), group);
        std::vector<Bytes> outs[2], worker[2], server[2];
        int which = 0;
        for (DataEngine* eng : {&cpu_engine(), static_cast<DataEngine*>(&stream)}) {
          Bytes w(rs.worker * 4, 0), s(rs.server * 4, 0);
          for (int step = 0; step < 2; ++step) {
            Bytes x = phased_input(k, count, step, DataType::FLOAT32, 900);
            const Response r = one_tensor(
                BHVD_OP_COMPRESSED_ALLREDUCE, count, DataType::FLOAT32, ReduceOp::AVERAGE,
                CompressedAllreduceParams{BHVD_COMPRESSION_MINMAX_UINT8, true});
            Entry e;
            e.input = e.output = x.data();
            e.state = ef ? Residuals{w.data(), s.data(), group} : Residuals{};
            run_op(*eng, comm, &h, r, e);
            outs[which].push_back(x);
          }
          worker[which].push_back(w);
          server[which].push_back(s);
          ++which;
        }
        EXPECT_EQ(outs[0], outs[1]) << where(l, count, k) << (ef ? ", error feedback" : "");
        EXPECT_EQ(worker[0], worker[1]) << where(l, count, k);
        EXPECT_EQ(server[0], server[1]) << where(l, count, k);
      }
    }
  });
}

TEST(DeviceHierarchy, ResidualsForAnotherLayoutAreRefusedBeforeAnythingIsSent) {
  // What the device path did before it had the host hierarchy: the exchange flat over every rank,
  // the residuals sized for the hosts (count 1001 over 2 hosts of 3: 1002 elements, where the flat
  // exchange touches 1002 = 6 * 167; over 4 hosts of 2, 1004 against 1008).
  HostStreamEngine stream;
  on_layouts([&](const Layout& l, Comm& comm, Hierarchy&) {
    const size_t count = 1001;
    const ResidualSizes rs = residual_sizes(count, l.hosts);
    Bytes x(count * 4, 0), w(rs.worker * 4, 0), s(rs.server * 4, 0);
    const Response r =
        one_tensor(BHVD_OP_COMPRESSED_ALLREDUCE, count, DataType::FLOAT32, ReduceOp::AVERAGE,
                   CompressedAllreduceParams{BHVD_COMPRESSION_MINMAX_UINT8, true});
    Entry e;
    e.input = e.output = x.data();
    e.state = Residuals{w.data(), s.data(), l.hosts};
    try {
      run_op(stream, comm, nullptr, r, e);
      ADD_FAILURE() << "ran flat with residuals sized for " << l.hosts << " hosts";
    } catch (const std::logic_error& err) {
      EXPECT_NE(std::string(err.what()).find("sized for " + std::to_string(l.hosts) + " ranks"),
                std::string::npos)
          << err.what();
    }
  });
}

TEST(DeviceHierarchy, PeerAveragesSameBitsAsTheCpuEngine) {
  HostStreamEngine stream;
  on_layouts([&](const Layout& l, Comm& comm, Hierarchy& h) {
    const int k = comm.rank();
    for (size_t count : kCounts) {
      for (int mode : {BHVD_PEER_ALL, BHVD_PEER_SHIFT_ONE, BHVD_PEER_RING}) {
        Bytes results[2];
        int which = 0;
        for (DataEngine* eng : {&cpu_engine(), static_cast<DataEngine*>(&stream)}) {
          Bytes in = phased_input(k, count, mode, DataType::FLOAT32, 700), out(in.size());
          for (int64_t step = 0; step < 2; ++step) {
            const Response r = one_tensor(BHVD_OP_PEER_AVERAGE, count, DataType::FLOAT32,
                                          ReduceOp::SUM, PeerAverageParams{mode, step, true});
            Entry e;
            e.input = in.data();
            e.output = out.data();
            run_op(*eng, comm, &h, r, e);
            in = out;
          }
          results[which++] = out;
        }
        EXPECT_EQ(results[0], results[1]) << where(l, count, k) << ", peer mode " << mode;
      }
    }
  });
}

TEST(DeviceHierarchy, LowPrecisionRingSameBitsAsTheCpuEngine) {
  HostStreamEngine stream;
  on_layouts([&](const Layout& l, Comm& comm, Hierarchy& h) {
    const int k = comm.rank();
    for (size_t count : kCounts) {
      std::vector<Bytes> results[2];
      int which = 0;
      for (DataEngine* eng : {&cpu_engine(), static_cast<DataEngine*>(&stream)}) {
        Bytes x = phased_input(k, count, 0, DataType::FLOAT32, 300);
        Bytes self(x.size()), left(x.size()), right(x.size());
        Entry e;
        e.input = e.output = x.data();
        e.state = Replicas{self.data(), left.data(), right.data(), count, DataType::FLOAT32};
        run_op(*eng, comm, &h,
               one_tensor(BHVD_OP_LP_DECENTRALIZED_INIT, count, DataType::FLOAT32, ReduceOp::SUM,
                          LpRingParams{true}),
               e);
        for (int step = 1; step <= 2; ++step) {
          // An optimizer step between the averages.
          Bytes g = phased_input(k, count, step, DataType::FLOAT32, 301);
          auto* xf = reinterpret_cast<float*>(x.data());
          const auto* gf = reinterpret_cast<const float*>(g.data());
          for (size_t i = 0; i < count; ++i) xf[i] -= 0.1f * gf[i];
          run_op(*eng, comm, &h,
                 one_tensor(BHVD_OP_LP_DECENTRALIZED_STEP, count, DataType::FLOAT32, ReduceOp::SUM,
                            LpRingParams{true}),
                 e);
        }
        results[which++] = {x, self, left, right};
      }
      EXPECT_EQ(results[0], results[1]) << where(l, count, k);
    }
  });
}

TEST(DeviceHierarchy, HierarchicalAllreduceIsExactAndTheSameOnEveryRank) {
  // DataEngine's decomposition (Horovod's NCCL hierarchical allreduce: equal shards reduce-
  // scattered within the host, allreduced across, allgathered; the remainder over the set).
  HostStreamEngine stream;
  for (const Layout& l : kLayouts) {
    const int n = l.hosts * l.per_host;
    for (size_t count : counts_for(l)) {
      std::vector<Bytes> got_int(n), got_float(n);
      run_ranks(
          n, Kind::SHM,
          [&](Comm& comm) {
            const int k = comm.rank();
            Hierarchy h = build_hierarchy(comm.transport(), comm, comm.global_rank(k));
            ASSERT_TRUE(h.cross);
            std::vector<int32_t> xi(count);
            for (size_t i = 0; i < count; ++i)
              xi[i] = static_cast<int32_t>((i * 7 + k * 13) % 1000);
            Entry e;
            e.input = e.output = xi.data();
            run_op(stream, comm, &h,
                   one_tensor(BHVD_OP_HIERARCHICAL_ALLREDUCE, count, DataType::INT32, ReduceOp::SUM,
                              std::monostate{}),
                   e);
            got_int[k].assign(reinterpret_cast<unsigned char*>(xi.data()),
                              reinterpret_cast<unsigned char*>(xi.data() + count));
            Bytes xf = phased_input(k, count, 0, DataType::FLOAT32, 100);
            e.input = e.output = xf.data();
            run_op(stream, comm, &h,
                   one_tensor(BHVD_OP_HIERARCHICAL_ALLREDUCE, count, DataType::FLOAT32,
                              ReduceOp::AVERAGE, std::monostate{}),
                   e);
            got_float[k] = xf;
          },
          0, l.hosts);
      for (int k = 0; k < n; ++k) {
        EXPECT_EQ(got_int[k], got_int[0]) << where(l, count, k);
        EXPECT_EQ(got_float[k], got_float[0]) << where(l, count, k);
      }
      const auto* gi = reinterpret_cast<const int32_t*>(got_int[0].data());
      const auto* gf = reinterpret_cast<const float*>(got_float[0].data());
      std::vector<Bytes> inputs(n);
      for (int k = 0; k < n; ++k) inputs[k] = phased_input(k, count, 0, DataType::FLOAT32, 100);
      size_t wrong = 0;
      double worst = 0;  // |error| / (the mean of |x|), in float32's epsilons
      for (size_t i = 0; i < count; ++i) {
        int64_t sum = 0;
        double mean = 0, magnitude = 0;
        for (int k = 0; k < n; ++k) {
          sum += static_cast<int64_t>((i * 7 + k * 13) % 1000);
          const double v = reinterpret_cast<const float*>(inputs[k].data())[i];
          mean += v / n;
          magnitude += std::fabs(v) / n;
        }
        if (gi[i] != sum) ++wrong;
        if (magnitude > 0) worst = std::max(worst, std::fabs(gf[i] - mean) / magnitude / 1.2e-7);
      }
      EXPECT_EQ(wrong, 0u) << l.hosts << " hosts x " << l.per_host << ", count " << count;
      EXPECT_LT(worst, 2.0 * n) << l.hosts << " hosts x " << l.per_host << ", count " << count;
    }
  }
}

}  // namespace
}  // namespace bagua_hvd
