// The real transports and collectives inside one process: N threads, each a rank with its own
// Transport (connected through an in-memory rendezvous store over loopback TCP or shared
// memory) and Comm. Allreduce results are checked against sums computed here; the
// shared-memory ring is driven through wrap-around with messages larger than and not aligned
// with it.
#include "transport/transport.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/comm.h"
#include "collectives/hierarchy.h"
#include "compression/minmax_uint8.h"
#include "in_process_ranks.h"
#include "transport/control_channel.h"
#include "transport/shm.h"

namespace bagua_hvd {
namespace {
using testing_ranks::Kind;
using testing_ranks::run_ranks;

// Rank k's element i, exact in every type used here.
int64_t value(int k, size_t i) { return static_cast<int64_t>((k * 7 + i * 3) % 23) - 11; }

template <typename T>
std::vector<T> input(int k, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<T>(value(k, i));
  return v;
}

template <typename T>
std::vector<T> expected(int n, size_t count, ReduceOp op) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) {
    int64_t acc = value(0, i);
    for (int k = 1; k < n; ++k) {
      const int64_t x = value(k, i);
      if (op == ReduceOp::SUM) acc += x;
      if (op == ReduceOp::MAX) acc = std::max(acc, x);
      if (op == ReduceOp::MIN) acc = std::min(acc, x);
    }
    v[i] = static_cast<T>(acc);
  }
  return v;
}

enum class Algo { DIRECT, RING, AUTO };

template <typename T>
void check_allreduce(int n, Kind kind, Algo algo, size_t count, DataType dtype, ReduceOp op,
                     size_t chunk_bytes = kChunkBytes) {
  run_ranks(n, kind, [&](Comm& comm) {
    std::vector<T> buf = input<T>(comm.rank(), count);
    switch (algo) {
      case Algo::DIRECT: allreduce_direct(comm, buf.data(), count, dtype, op); break;
      case Algo::RING: allreduce_ring(comm, buf.data(), count, dtype, op, chunk_bytes); break;
      case Algo::AUTO: allreduce(comm, buf.data(), count, dtype, op); break;
    }
    EXPECT_EQ(buf, expected<T>(n, count, op)) << "rank " << comm.rank();
  });
}

// A rank waiting inside a collective keeps calling its transport's heartbeat: the runtime sends
// its keepalives from there (Runtime::send_keepalives), so that ranks outside a long collective
// of a process set do not take its members for stopped ones.
TEST(InProcessComm, AWaitInsideACollectiveCallsTheHeartbeat) {
  for (Kind kind : {Kind::SHM, Kind::TCP}) {
    run_ranks(2, kind, [](Comm& comm) {
      int beats = 0;
      comm.transport().set_heartbeat([&] { ++beats; });
      char byte = 0;
      if (comm.rank() == 0) {
        comm.recv(1, &byte, 1, "heartbeat test");  // 300 ms of waiting: ~30 checks of 10 ms
        EXPECT_EQ(byte, 7);
        EXPECT_GE(beats, 3);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        byte = 7;
        comm.send(0, &byte, 1, "heartbeat test");
      }
      comm.transport().set_heartbeat(nullptr);
    });
  }
}

// The end of a job (core/farewell.cc): rank 0 finishes its part of a collective and closes its
// connections while rank 2 still waits on rank 1. Rank 2, stalled, checks every member and finds
// rank 0 gone: that fails the collective unless rank 0 said bye on its control channel first.
// Over TCP, where an orderly close is seen at once (shared memory reports only a dead process).
std::string stalled_behind_a_closed_member(bool bye) {
  static int job = 0;
  testing_ranks::MemoryStore store;
  const std::string job_id = "bye" + std::to_string(getpid()) + "_" + std::to_string(++job);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto transport = testing_ranks::connect_rank(store, job_id, r, 3, Kind::TCP);
        ControlChannel ctrl(*transport, 60);
        transport->set_finished_probe(
            [&](int peer) { return ctrl.said_bye(peer) != ControlChannel::Bye::kNot; });
        Comm comm(*transport, {0, 1, 2});
        char byte = static_cast<char>(r + 1);
        if (r == 0) {
          comm.send(2, &byte, 1, "bye test");
          if (bye) ctrl.send(2, ControlChannel::bye());
          return;  // closes every connection
        }
        if (r == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          comm.send(2, &byte, 1, "bye test");
          return;
        }
        comm.recv(0, &byte, 1, "bye test");
        EXPECT_EQ(byte, 1);
        comm.recv(1, &byte, 1, "bye test");  // ~30 checks of every member while rank 1 sleeps
        EXPECT_EQ(byte, 2);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  return errors[2];
}

TEST(InProcessComm, AMemberThatSaidByeMayCloseUnderAStalledCollective) {
  EXPECT_EQ(stalled_behind_a_closed_member(true), "");
}

TEST(InProcessComm, AMemberThatClosedWithoutByeFailsTheStalledCollective) {
  const std::string error = stalled_behind_a_closed_member(false);
  EXPECT_NE(error.find("connection to rank 0"), std::string::npos) << error;
  EXPECT_NE(error.find("closed"), std::string::npos) << error;
}

// said_bye looks through the frames without taking them: the ones before the bye are still
// delivered in order, and a channel that closed without one says no.
TEST(ControlChannelBye, FoundBehindOtherFramesWithoutTakingThem) {
  static int job = 0;
  testing_ranks::MemoryStore store;
  const std::string job_id = "byech" + std::to_string(getpid()) + "_" + std::to_string(++job);
  std::string error0, error1;
  std::mutex mu;
  std::condition_variable cv;
  int stage = 0;  // 1: rank 0 sent its frames; 2: rank 1 checked; rank 0 then closes
  auto wait_for = [&](int s) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return stage >= s; });
  };
  auto reach = [&](int s) {
    std::lock_guard<std::mutex> lock(mu);
    stage = s;
    cv.notify_all();
  };
  std::thread t0([&] {
    try {
      auto transport = testing_ranks::connect_rank(store, job_id, 0, 2, Kind::TCP);
      ControlChannel ctrl(*transport, 60);
      ctrl.send(1, "first");
      ctrl.send(1, std::string());  // a keepalive
      ctrl.send(1, ControlChannel::bye());
      reach(1);
      wait_for(2);
    } catch (const std::exception& e) {
      error0 = e.what();
      reach(2);
    }
  });
  std::thread t1([&] {
    try {
      auto transport = testing_ranks::connect_rank(store, job_id, 1, 2, Kind::TCP);
      ControlChannel ctrl(*transport, 60);
      wait_for(1);
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (ctrl.said_bye(0) != ControlChannel::Bye::kSaid &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_EQ(ctrl.said_bye(0), ControlChannel::Bye::kSaid);
      std::string msg;
      ASSERT_TRUE(ctrl.poll(0, &msg));
      EXPECT_EQ(msg, "first");
      ASSERT_TRUE(ctrl.poll(0, &msg));
      EXPECT_EQ(msg, "");
      ASSERT_TRUE(ctrl.poll(0, &msg));
      EXPECT_TRUE(ControlChannel::is_bye(msg));
      EXPECT_EQ(ctrl.said_bye(0), ControlChannel::Bye::kUnknown);  // taken; channel open
      reach(2);
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (ctrl.said_bye(0) != ControlChannel::Bye::kNot &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_EQ(ctrl.said_bye(0), ControlChannel::Bye::kNot);  // closed, no bye left
    } catch (const std::exception& e) {
      error1 = e.what();
      reach(2);
    }
  });
  t0.join();
  t1.join();
  EXPECT_EQ(error0, "");
  EXPECT_EQ(error1, "");
}

TEST(InProcessAllreduce, DirectOverTcp) {
  check_allreduce<float>(3, Kind::TCP, Algo::DIRECT, 1000, DataType::FLOAT32, ReduceOp::SUM);
}

TEST(InProcessAllreduce, DirectOverShm) {
  check_allreduce<int64_t>(4, Kind::SHM, Algo::DIRECT, 777, DataType::INT64, ReduceOp::SUM);
  check_allreduce<int32_t>(2, Kind::SHM, Algo::DIRECT, 5, DataType::INT32, ReduceOp::MAX);
}

TEST(InProcessAllreduce, RingOverTcpManyChunks) {
  // 10007 elements over 3 ranks: segments not a multiple of n, chunks of 4 KiB.
  check_allreduce<float>(3, Kind::TCP, Algo::RING, 10007, DataType::FLOAT32, ReduceOp::SUM, 4096);
}

TEST(InProcessAllreduce, RingOverShm) {
  check_allreduce<double>(4, Kind::SHM, Algo::RING, 65537, DataType::FLOAT64, ReduceOp::SUM,
                          8192);
  check_allreduce<int32_t>(3, Kind::SHM, Algo::RING, 4099, DataType::INT32, ReduceOp::MIN, 1024);
}

TEST(InProcessAllreduce, RingFewerElementsThanRanks) {
  check_allreduce<float>(4, Kind::TCP, Algo::RING, 3, DataType::FLOAT32, ReduceOp::SUM, 4096);
}

TEST(InProcessAllreduce, AutomaticChoiceAcrossSizes) {
  // Below and above the direct/ring switch (kAllreduceDirectMaxBytes), in one job.
  run_ranks(3, Kind::SHM, [&](Comm& comm) {
    for (size_t count : {size_t(0), size_t(1), size_t(16384), size_t(16385), size_t(300000)}) {
      std::vector<float> buf = input<float>(comm.rank(), count);
      allreduce(comm, buf.data(), count, DataType::FLOAT32, ReduceOp::SUM);
      EXPECT_EQ(buf, expected<float>(3, count, ReduceOp::SUM)) << count;
    }
  });
}

TEST(InProcessAllreduce, SmallShmRingWrapsAround) {
  // A 4 KiB data ring: a 1 MB ring allreduce wraps it hundreds of times.
  run_ranks(
      2, Kind::SHM,
      [&](Comm& comm) {
        const size_t count = 250001;
        std::vector<float> buf = input<float>(comm.rank(), count);
        allreduce_ring(comm, buf.data(), count, DataType::FLOAT32, ReduceOp::SUM, 3000 * 4);
        EXPECT_EQ(buf, expected<float>(2, count, ReduceOp::SUM));
      },
      4096);
}

// Hosts x ranks per host: the two-level pipeline against exact sums, every rank with the same
// bits (random floats, whose sum depends on the order), and the small-buffer path.
TEST(InProcessAllreduce, HierarchicalPipelineOverTwoLevels) {
  for (auto [hosts, per_host] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}}) {
    const int n = hosts * per_host;
    std::vector<std::vector<float>> results(n);
    run_ranks(
        n, Kind::SHM,
        [&](Comm& comm) {
          Hierarchy h = build_hierarchy(comm.transport(), comm, comm.global_rank(comm.rank()));
          ASSERT_TRUE(h.active && h.cross);
          ASSERT_EQ(h.intra->size(), per_host);
          ASSERT_EQ(h.cross->size(), hosts);
          // Parts of uneven lengths, chunks of 4 KiB: many blocks in flight at once.
          for (size_t count : {size_t(5), size_t(16384), size_t(100003)}) {
            std::vector<float> buf = input<float>(comm.rank(), count);
            allreduce_hierarchical(comm, *h.intra, *h.cross, buf.data(), count, DataType::FLOAT32,
                                   ReduceOp::SUM, 4096);
            EXPECT_EQ(buf, expected<float>(n, count, ReduceOp::SUM)) << count;
          }
          std::vector<int64_t> ints = input<int64_t>(comm.rank(), 50001);
          allreduce_hierarchical(comm, *h.intra, *h.cross, ints.data(), ints.size(),
                                 DataType::INT64, ReduceOp::MAX, 8192);
          EXPECT_EQ(ints, expected<int64_t>(n, ints.size(), ReduceOp::MAX));
          std::mt19937 rng(77 + comm.rank());
          std::uniform_real_distribution<float> dist(-1, 1);
          std::vector<float> noise(70001);
          for (auto& x : noise) x = dist(rng);
          allreduce_hierarchical(comm, *h.intra, *h.cross, noise.data(), noise.size(),
                                 DataType::FLOAT32, ReduceOp::SUM, 4096);
          results[comm.rank()] = noise;
        },
        0, hosts);
    for (int r = 1; r < n; ++r) EXPECT_TRUE(results[r] == results[0]) << "rank " << r;
    // Within float rounding of the sum in double.
    std::vector<double> sum(results[0].size());
    for (int r = 0; r < n; ++r) {
      std::mt19937 rng(77 + r);
      std::uniform_real_distribution<float> dist(-1, 1);
      for (auto& x : sum) x += dist(rng);
    }
    for (size_t i = 0; i < sum.size(); i += 997) EXPECT_NEAR(results[0][i], sum[i], 1e-5) << i;
  }
}

// ---- the shared-memory ring itself -----------------------------------------------------------

TEST(ShmRing, WrapAroundWithUnalignedMessages) {
  const std::string name = "/bhvd_unit_" + std::to_string(getpid()) + "_ring";
  auto seg = ShmSegment::create(name, 2, 4096, 4096);
  ShmPair a(1, getpid(), seg->ring(0, 1, false), seg->ring(1, 0, false), seg->doorbell(1));
  ShmPair b(0, getpid(), seg->ring(1, 0, false), seg->ring(0, 1, false), seg->doorbell(0));
  std::mt19937 rng(2024);
  size_t total = 0;
  for (int round = 0; round < 200; ++round) {
    // From 1 byte to 3x the ring, mostly not a multiple of anything.
    const size_t len = std::uniform_int_distribution<size_t>(1, 3 * 4096 + 17)(rng);
    std::vector<uint8_t> msg(len), got(len);
    for (auto& x : msg) x = static_cast<uint8_t>(rng());
    const bool a_to_b = round % 3 != 2;  // both directions
    ShmPair& tx = a_to_b ? a : b;
    ShmPair& rx = a_to_b ? b : a;
    size_t sent = 0, received = 0;
    int idle = 0;
    while (received < len) {
      size_t moved = 0;
      if (sent < len) {
        const size_t piece = std::min(len - sent, size_t(1) + rng() % 5000);
        const size_t n = tx.try_send(msg.data() + sent, piece);
        sent += n;
        moved += n;
      }
      if (round % 2 == 0) {  // the copy path
        const size_t want = std::min(len - received, size_t(1) + rng() % 3000);
        const size_t n = rx.try_recv(got.data() + received, want);
        received += n;
        moved += n;
      } else {  // the zero-copy path
        const void* p = nullptr;
        size_t n = rx.peek(&p);
        n = std::min(n, len - received);
        if (n) {
          std::memcpy(got.data() + received, p, n);
          rx.consume(n);
          received += n;
          moved += n;
        }
      }
      ASSERT_LT(idle = moved ? 0 : idle + 1, 1000) << "no progress in round " << round;
    }
    ASSERT_EQ(got, msg) << "round " << round << ", " << len << " bytes";
    total += len;
  }
  EXPECT_GT(total, 100u * 4096);  // the ring wrapped many times
  const void* p = nullptr;
  EXPECT_EQ(a.peek(&p), 0u);  // nothing left over
  EXPECT_EQ(b.peek(&p), 0u);
}

// ---- pipelined collectives: the bits of their phases run one after the other ------------------
// ByteGrad and the low-precision exchange compress, send and decode in blocks of 128 Ki elements
// interleaved with the transfers. The expected values below follow docs/algorithms.md with the
// whole-chunk kernels, rank by rank, so counts of several blocks per chunk check that the blocks
// change nothing.

namespace pipelined {

std::vector<float> rank_input(int k, size_t count, int step) {
  std::mt19937 gen(1000 + 17 * k + 7919 * step);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = dist(gen) * (1.0f + k);
  if (count > 3) v[count / 2] = -0.0f;  // a zero of either sign may be a chunk's min or max
  return v;
}

std::vector<float> decode(const std::vector<uint8_t>& q, size_t n, size_t chunks) {
  std::vector<float> out(n);
  minmax_uint8_decompress(q.data(), DataType::FLOAT32, n, chunks, out.data());
  return out;
}

std::vector<uint8_t> encode(const float* x, size_t n, size_t chunks) {
  std::vector<uint8_t> q(minmax_uint8_bytes(DataType::FLOAT32, n, chunks));
  minmax_uint8_compress(x, DataType::FLOAT32, n, chunks, q.data());
  return q;
}

// Every rank's ByteGrad state (docs/algorithms.md, steps 1-7), float32, averaging.
struct ByteGradModel {
  int n;
  size_t count, chunk;
  bool ef;
  std::vector<std::vector<float>> ew, es;  // per rank: worker (padded) and server residuals

  ByteGradModel(int n_, size_t count_, bool ef_)
      : n(n_), count(count_), chunk((count_ + n_ - 1) / n_), ef(ef_),
        ew(n_, std::vector<float>(chunk * n_, 0.0f)), es(n_, std::vector<float>(chunk, 0.0f)) {}

  std::vector<float> step(int s) {
    const size_t padded = chunk * n;
    std::vector<std::vector<uint8_t>> q(n);
    for (int k = 0; k < n; ++k) {
      std::vector<float> g = rank_input(k, count, s);
      g.resize(padded, 0.0f);
      if (ef)
        for (size_t i = 0; i < padded; ++i) g[i] += ew[k][i];
      q[k] = encode(g.data(), padded, n);
      if (ef) {
        const auto dec = decode(q[k], padded, n);
        for (size_t i = 0; i < padded; ++i) ew[k][i] = g[i] - dec[i];
      }
    }
    const size_t cb = minmax_uint8_bytes(DataType::FLOAT32, chunk, 1);
    std::vector<float> out;
    for (int j = 0; j < n; ++j) {
      std::vector<float> acc(chunk, 0.0f);
      for (int k = 0; k < n; ++k) {
        minmax_uint8_decompress_add_f32(q[k].data() + j * cb, DataType::FLOAT32, chunk, 1,
                                        acc.data());
      }
      for (auto& a : acc) a /= static_cast<float>(n);
      if (ef)
        for (size_t i = 0; i < chunk; ++i) acc[i] += es[j][i];
      const auto qj = encode(acc.data(), chunk, 1);
      const auto dj = decode(qj, chunk, 1);
      if (ef)
        for (size_t i = 0; i < chunk; ++i) es[j][i] = acc[i] - dj[i];
      out.insert(out.end(), dj.begin(), dj.end());
    }
    out.resize(count);
    return out;
  }
};

void check_bytegrad(int n, Kind kind, size_t count, bool ef) {
  ByteGradModel model(n, count, ef);
  std::vector<std::vector<float>> want;
  for (int s = 0; s < 2; ++s) want.push_back(model.step(s));
  run_ranks(n, kind, [&](Comm& comm) {
    const int k = comm.rank();
    std::vector<float> ew(model.chunk * n, 0.0f), es(model.chunk, 0.0f);
    for (int s = 0; s < 2; ++s) {
      std::vector<float> buf = rank_input(k, count, s);
      allreduce_minmax_uint8(comm, buf.data(), count, DataType::FLOAT32, true,
                             ef ? ew.data() : nullptr, ef ? es.data() : nullptr);
      ASSERT_EQ(buf.size(), want[s].size());
      EXPECT_EQ(std::memcmp(buf.data(), want[s].data(), count * sizeof(float)), 0)
          << "rank " << k << " step " << s << " count " << count;
    }
    if (ef) {  // the model's residuals are those after both steps
      EXPECT_EQ(std::memcmp(ew.data(), model.ew[k].data(), ew.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(es.data(), model.es[k].data(), es.size() * sizeof(float)), 0);
    }
  });
}

}  // namespace pipelined

TEST(PipelinedByteGrad, BitIdenticalToThePhasesInTurn) {
  for (int n : {2, 3}) {
    for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{300001}}) {
      for (bool ef : {false, true}) {
        pipelined::check_bytegrad(n, Kind::TCP, count, ef);
        pipelined::check_bytegrad(n, Kind::SHM, count, ef);
      }
    }
  }
}

TEST(PipelinedByteGrad, NonFiniteChunkDecodesToNaNEverywhere) {
  const size_t count = 400000;
  run_ranks(2, Kind::TCP, [&](Comm& comm) {
    std::vector<float> buf = pipelined::rank_input(comm.rank(), count, 0);
    if (comm.rank() == 1) buf[10] = INFINITY;  // chunk 0 of rank 1: chunk 0 of the mean is NaN
    allreduce_minmax_uint8(comm, buf.data(), count, DataType::FLOAT32, true, nullptr, nullptr);
    for (size_t i = 0; i < count / 2; ++i) ASSERT_TRUE(std::isnan(buf[i])) << i;
    for (size_t i = count / 2; i < count; ++i) ASSERT_TRUE(std::isfinite(buf[i])) << i;
  });
}

TEST(PipelinedLowPrecision, LocalHalfAndExchangeMatchTheSpec) {
  // docs/algorithms.md: d = ((x + L/3) + R/3) - 5/3 s; c = Compress(d); s += D(c); x = s; the
  // neighbours' replicas advance by their decoded differences. n = 3 (two neighbours) and 2.
  for (int n : {2, 3}) {
    const size_t count = 300001;
    auto weights = [&](int k, int which) { return pipelined::rank_input(k, count, 10 + which); };
    // Spec, per rank: its c, then its new L and R.
    std::vector<std::vector<uint8_t>> cs(n);
    std::vector<std::vector<float>> new_s(n);
    for (int k = 0; k < n; ++k) {
      auto x = weights(k, 0), l = weights(k, 1), r = weights(k, 2), s = weights(k, 3);
      std::vector<float> d(count);
      for (size_t i = 0; i < count; ++i)
        d[i] = ((x[i] + l[i] * (1.0f / 3.0f)) + r[i] * (1.0f / 3.0f)) - s[i] * (5.0f / 3.0f);
      cs[k] = pipelined::encode(d.data(), count, 1);
      const auto dec = pipelined::decode(cs[k], count, 1);
      for (size_t i = 0; i < count; ++i) s[i] += dec[i];
      new_s[k] = s;
    }
    run_ranks(n, Kind::TCP, [&](Comm& comm) {
      const int k = comm.rank();
      auto x = weights(k, 0), l = weights(k, 1), r = weights(k, 2), s = weights(k, 3);
      std::vector<uint8_t> c(minmax_uint8_bytes(DataType::FLOAT32, count, 1));
      lp_decentralized_local(x.data(), s.data(), l.data(), r.data(), count, DataType::FLOAT32,
                             c.data());
      EXPECT_EQ(c, cs[k]) << "rank " << k;
      EXPECT_EQ(std::memcmp(s.data(), new_s[k].data(), count * 4), 0) << "rank " << k;
      EXPECT_EQ(std::memcmp(x.data(), new_s[k].data(), count * 4), 0) << "rank " << k;
      const auto l0 = l, r0 = r;
      lp_decentralized_exchange(comm, c.data(), l.data(), r.data(), count, DataType::FLOAT32);
      const int left = (k + n - 1) % n, right = (k + 1) % n;
      const auto dl = pipelined::decode(cs[left], count, 1);
      const auto dr = pipelined::decode(cs[right], count, 1);
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(l[i], l0[i] + dl[i]) << "rank " << k << " left " << i;
        ASSERT_EQ(r[i], r0[i] + dr[i]) << "rank " << k << " right " << i;
      }
    });
  }
}

TEST(PeerAverage, AveragedAsTheBytesArriveGivesTheOnePassBits) {
  // shift_one and ring average each piece once both the receives hold it and the send is past it
  // (the send reads the same buffer): the bits of one pass after the whole exchange, computed
  // here, for buckets of several pieces (and one of 3 elements), float32 and float64, n = 2-4,
  // over TCP and shared memory.
  for (Kind kind : {Kind::TCP, Kind::SHM}) {
    for (int n : {2, 3, 4}) {
      for (size_t count : {size_t{3}, size_t{200003}}) {
        for (PeerMode mode : {PeerMode::SHIFT_ONE, PeerMode::RING}) {
          const int64_t step = 5;
          run_ranks(n, kind, [&](Comm& comm) {
            const int k = comm.rank();
            auto x = [&](int r) { return pipelined::rank_input(r, count, 20); };
            std::vector<float> mine = x(k);
            std::vector<double> wide(mine.begin(), mine.end());
            decentralized_average(comm, mine.data(), mine.data(), count, DataType::FLOAT32, mode,
                                  step);
            decentralized_average(comm, wide.data(), wide.data(), count, DataType::FLOAT64, mode,
                                  step);
            std::vector<float> want(count);
            std::vector<double> want_wide(count);
            const auto me = x(k);
            if (mode == PeerMode::SHIFT_ONE) {
              const int peer = shift_one_peer(k, n, step);
              const auto theirs = peer < n ? x(peer) : me;
              for (size_t i = 0; i < count; ++i) {
                want[i] = peer < n ? (me[i] + theirs[i]) / 2.0f : me[i];
                want_wide[i] = peer < n ? (double{me[i]} + double{theirs[i]}) / 2.0 : me[i];
              }
            } else {
              const auto l = x((k + n - 1) % n), r = x((k + 1) % n);
              for (size_t i = 0; i < count; ++i) {
                want[i] = ((l[i] + me[i]) + r[i]) / 3.0f;
                want_wide[i] = ((double{l[i]} + double{me[i]}) + double{r[i]}) / 3.0;
              }
            }
            EXPECT_EQ(std::memcmp(mine.data(), want.data(), count * 4), 0)
                << "rank " << k << " of " << n << ", " << count << " elements, mode "
                << static_cast<int>(mode);
            EXPECT_EQ(std::memcmp(wide.data(), want_wide.data(), count * 8), 0)
                << "float64, rank " << k << " of " << n << ", " << count << " elements";
          });
        }
      }
    }
  }
}

TEST(PeerAverage, ASendBehindItsReceiveKeepsTheBytesItHasNotSent) {
  // Rank 1 starts late, over a 4 KiB shared-memory ring: rank 0's send then stalls while its
  // receive races ahead once rank 1 sends, so averaging behind the receive alone would overwrite
  // bytes rank 0 has yet to send (rank 1 would average with averages).
  const size_t count = 3 * 65536 + 7;
  run_ranks(
      2, Kind::SHM,
      [&](Comm& comm) {
        const int k = comm.rank();
        std::vector<float> mine = pipelined::rank_input(k, count, 30);
        const auto me = mine, theirs = pipelined::rank_input(1 - k, count, 30);
        if (k == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        decentralized_average(comm, mine.data(), mine.data(), count, DataType::FLOAT32,
                              PeerMode::SHIFT_ONE, 0);
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(mine[i], (me[i] + theirs[i]) / 2.0f) << "rank " << k << " element " << i;
      },
      4096);
}

TEST(PipelinedLowPrecision, LocalHalfOverSegmentsGivesTheContiguousBits) {
  // x in pieces (a framework's variables updated in place) must change no bit: the same c, self
  // and x as one contiguous x, for splits at and off block boundaries and with an empty piece, in
  // float32 and in bfloat16 (the blockwise path). The contiguous form's float32 bits are checked
  // against the spec by the test above.
  const size_t count = 300001;
  const std::vector<std::vector<size_t>> splits = {
      {count}, {1, count - 1}, {1000, 0, 131072, count - 132072}, {131071, 131073, count - 262144}};
  for (DataType dtype : {DataType::FLOAT32, DataType::BFLOAT16}) {
    const size_t es = dtype_size(dtype);
    auto buffer = [&](int which) {
      const std::vector<float> f = pipelined::rank_input(1, count, 20 + which);
      std::vector<unsigned char> out(count * es);
      if (dtype == DataType::FLOAT32) {
        std::memcpy(out.data(), f.data(), out.size());
      } else {  // bfloat16: the upper half of each float32
        for (size_t i = 0; i < count; ++i) {
          uint32_t u;
          std::memcpy(&u, &f[i], 4);
          const uint16_t h = static_cast<uint16_t>(u >> 16);
          std::memcpy(out.data() + 2 * i, &h, 2);
        }
      }
      return out;
    };
    const auto l = buffer(1), r = buffer(2);
    auto x0 = buffer(0), s0 = buffer(3);
    std::vector<uint8_t> c0(minmax_uint8_bytes(dtype, count, 1));
    lp_decentralized_local(x0.data(), s0.data(), l.data(), r.data(), count, dtype, c0.data());
    for (const auto& split : splits) {
      auto x = buffer(0), s = buffer(3);
      std::vector<std::vector<unsigned char>> pieces;
      size_t at = 0;
      for (size_t m : split) {
        pieces.emplace_back(x.begin() + at * es, x.begin() + (at + m) * es);
        at += m;
      }
      std::vector<XSegment> segs;
      for (auto& p : pieces) segs.push_back({p.data(), p.size() / es});
      std::vector<uint8_t> c(c0.size(), 0xcd);
      lp_decentralized_local(segs.data(), segs.size(), s.data(), l.data(), r.data(), dtype,
                             c.data());
      std::vector<unsigned char> joined;
      for (auto& p : pieces) joined.insert(joined.end(), p.begin(), p.end());
      EXPECT_EQ(c, c0) << dtype_name(dtype) << ", " << split.size() << " pieces";
      EXPECT_EQ(s, s0) << dtype_name(dtype) << ", " << split.size() << " pieces";
      EXPECT_EQ(joined, x0) << dtype_name(dtype) << ", " << split.size() << " pieces";
    }
  }
}

TEST(MinMaxUInt8Pieces, RangesAndScansGiveTheWholeChunksBytes) {
  for (size_t c : {size_t{0}, size_t{1}, size_t{33}, size_t{1000}, size_t{70001}}) {
    std::vector<float> x = pipelined::rank_input(3, c, 0);
    const auto whole = pipelined::encode(x.data(), c, 1);
    for (size_t piece : {size_t{1}, size_t{8}, size_t{1000}, size_t{1} << 20}) {
      std::vector<uint8_t> out(whole.size(), 0xcd);
      MinMaxUint8Scan scan;
      for (size_t i = 0; i < c; i += piece)  // pieces scanned back to front
        minmax_uint8_scan_range(x.data() + (c - std::min(c, i + piece)),
                                DataType::FLOAT32, std::min(piece, c - i), &scan);
      minmax_uint8_write_header(scan, DataType::FLOAT32, c, out.data());
      for (size_t i = 0; i < c; i += piece)
        minmax_uint8_compress_range(x.data() + i, DataType::FLOAT32, i, std::min(piece, c - i),
                                    out.data());
      EXPECT_EQ(out, whole) << "c " << c << " piece " << piece;
      std::vector<float> dec(c), want = pipelined::decode(whole, c, 1);
      for (size_t i = 0; i < c; i += piece)
        minmax_uint8_decompress_range(out.data(), DataType::FLOAT32, i, std::min(piece, c - i),
                                      dec.data() + i);
      EXPECT_EQ(dec, want) << "c " << c << " piece " << piece;
    }
  }
}

}  // namespace
}  // namespace bagua_hvd
