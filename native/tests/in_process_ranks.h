// N ranks inside one test process: threads, each with its own Transport (connected through an
// in-memory rendezvous store over loopback TCP or shared memory) and Comm. Shared by the C++
// tests of collectives.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/comm.h"
#include "transport/transport.h"

namespace bagua_hvd {
namespace testing_ranks {

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

// Rank r's transport in the in-process job job_id of n ranks (see run_ranks).
inline std::unique_ptr<Transport> connect_rank(Store& store, const std::string& job_id, int r,
                                               int n, Kind kind, int64_t shm_ring_bytes = 0,
                                               int hosts = 1) {
  BootstrapConfig cfg;
  cfg.rank = r;
  cfg.size = n;
  const int per_host = n / hosts;
  cfg.local_rank = r % per_host;
  cfg.local_size = per_host;
  cfg.hostname = "unit-test-host" + std::to_string(r / per_host);
  cfg.secret = "unit-test-secret";
  cfg.job_id = job_id;
  cfg.epoch = 1;
  cfg.force_tcp = kind == Kind::TCP;
  cfg.timeout_s = 60;
  cfg.iface = "lo";
  cfg.shm_ring_bytes = shm_ring_bytes;
  return connect_transport(cfg, store);
}

// Runs body(comm) on n in-process ranks over one kind of transport; fails the test with the
// first rank's exception, if any.
// hosts > 1: the ranks are spread over that many host names in consecutive blocks (shared memory
// within a host, TCP between hosts).
inline void run_ranks(int n, Kind kind, const std::function<void(Comm&)>& body,
                      int64_t shm_ring_bytes = 0, int hosts = 1) {
  static int job = 0;  // one job id per call, within this process
  MemoryStore store;
  const std::string job_id = "unit" + std::to_string(getpid()) + "_" + std::to_string(++job);
  std::vector<std::string> errors(n);
  // Every rank keeps its transport until all are done, as ranks of a job do at a negotiated
  // shutdown (core/farewell.cc): one that closed its connections first, without a bye, would
  // look like a failed peer to a rank still stalled on another (TcpPair::check_alive sees the
  // orderly close).
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
        auto transport = connect_rank(store, job_id, r, n, kind, shm_ring_bytes, hosts);
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          const bool local = p / (n / hosts) == r / (n / hosts);
          EXPECT_STREQ(transport->kind_to(p), kind == Kind::SHM && local ? "shm" : "tcp");
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

}  // namespace testing_ranks
}  // namespace bagua_hvd
