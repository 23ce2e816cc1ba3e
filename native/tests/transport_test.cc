// The real transports and collectives inside one process: N threads, each a rank with its own
// Transport (connected through an in-memory rendezvous store over loopback TCP or shared
// memory) and Comm. Allreduce results are checked against sums computed here; the
// shared-memory ring is driven through wrap-around with messages larger than and not aligned
// with it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "collectives/comm.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace bagua_hvd {
namespace {

// The launcher's store, in memory.
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[key] = value;
    cv_.notify_all();
  }
  std::string get(const std::string& key, double timeout_s) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                      [&] { return kv_.count(key) > 0; }))
      throw TransportError("timed out waiting for rendezvous key '" + key + "'");
    return kv_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

enum class Kind { SHM, TCP };

// Runs body(comm) on n in-process ranks over one kind of transport; fails the test with the
// first rank's exception, if any.
void run_ranks(int n, Kind kind, const std::function<void(Comm&)>& body,
               int64_t shm_ring_bytes = 0) {
  static int job = 0;
  MemoryStore store;
  const std::string job_id = "unit" + std::to_string(getpid()) + "_" + std::to_string(++job);
  std::vector<std::string> errors(n);
  // Every rank keeps its transport until all are done, as ranks of a job do until a negotiated
  // shutdown: one that closed its connections first would look like a failed peer to a rank
  // still stalled on another (TcpPair::check_alive sees the orderly close).
  std::mutex done_mu;
  std::condition_variable done_cv;
  int done = 0;
  auto arrive = [&] {
    std::unique_lock<std::mutex> lock(done_mu);
    ++done;
    done_cv.notify_all();
    done_cv.wait(lock, [&] { return done == n; });
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      bool arrived = false;
      try {
        BootstrapConfig cfg;
        cfg.rank = r;
        cfg.size = n;
        cfg.local_rank = r;
        cfg.local_size = n;
        cfg.hostname = "unit-test-host";
        cfg.secret = "unit-test-secret";
        cfg.job_id = job_id;
        cfg.epoch = 1;
        cfg.force_tcp = kind == Kind::TCP;
        cfg.timeout_s = 60;
        cfg.iface = "lo";
        cfg.shm_ring_bytes = shm_ring_bytes;
        auto transport = connect_transport(cfg, store);
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          EXPECT_STREQ(transport->kind_to(p), kind == Kind::TCP ? "tcp" : "shm");
        }
        std::vector<int> all(n);
        for (int k = 0; k < n; ++k) all[k] = k;
        Comm comm(*transport, all);
        body(comm);
        arrived = true;
        arrive();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      if (!arrived) arrive();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

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

}  // namespace
}  // namespace bagua_hvd
