// Asynchronous model averaging (BAGUA's DecentralizedFullPrecisionAsynchronous): a thread of the
// core averages registered weight buffers across a process set in the background, round after
// round, while training goes on. The training thread only calls step() at step boundaries, where
// a finished round is merged or a snapshot for the next round is taken: forward and backward
// never see half-merged weights and no lock is held while Python runs. docs/algorithms.md.
//
// Weights on a CUDA device stay there: snapshot and sum buffers on the device, the snapshot and
// the merge queued on the training thread's stream at its step boundaries, the rounds' allreduces
// ordered after the snapshot through a stream of the averager's own; the host never waits for
// the GPU.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "core/id_registry.h"
#include "engines/device_engine.h"

namespace bagua_hvd {

class AsyncAverager {
 public:
  struct Weights {
    void* data;
    DataType dtype;
    std::vector<int64_t> shape;
  };
  // What an averager needs from the runtime: run one request through negotiation (enqueue, wait
  // for it, release it) and return its status. Keeps this file independent of the runtime, which
  // stops the averagers at shutdown.
  using RunRequest = std::function<Status(const bhvd_request& req)>;
  // set_size: the number of ranks of process set set_id. device: the weights' CUDA device, whose
  // engine is `engine` (-1 and null: host memory).
  AsyncAverager(RunRequest run_request, std::string name, std::vector<Weights> weights,
                int32_t set_id, int set_size, int64_t interval_ms, int device = -1,
                DeviceEngine* engine = nullptr);
  ~AsyncAverager();  // stops (without the collective agreement if it must) and joins
  AsyncAverager(const AsyncAverager&) = delete;
  AsyncAverager& operator=(const AsyncAverager&) = delete;

  // Training thread, at the end of an optimizer step: merge a finished round
  // (x += sum / n - snapshot) or take the snapshot of the next round. Never waits for peers.
  // stream: for device weights, the caller's CUDA stream, which produced them (null: the legacy
  // default stream).
  void step(void* stream = nullptr);
  // Asks every rank to stop after the current round and waits for this rank's rounds to end.
  Status abort(int64_t timeout_ms);
  int64_t rounds() const;
  bool stopped() const;

 private:
  enum class Phase { IDLE, WANT_SNAPSHOT, REDUCING, WANT_MERGE, STOPPED };
  struct Buffer {
    Weights w;
    size_t count = 0, bytes = 0;
    std::shared_ptr<void> snapshot, sum;  // host or device memory, as the weights
  };
  void run();
  // stream: where device work is queued (the caller's at a step boundary; the averager's own
  // when it stops without one).
  void snapshot_locked(void* stream);
  void merge_locked(void* stream);
  // Runs one allreduce of the core (through negotiation, like a frontend) and waits for it.
  Status allreduce(const std::string& name, void* in, void* out, DataType dtype,
                   const std::vector<int64_t>& shape, int32_t reduce_op);

  RunRequest run_;
  const std::string name_;
  const int32_t set_id_;
  const std::chrono::milliseconds interval_;
  int set_size_ = 1;
  const int device_;
  DeviceEngine* const engine_;
  std::shared_ptr<void> stream_;  // device weights: the averager's stream (its allreduces')
  std::vector<Buffer> buffers_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Phase phase_ = Phase::IDLE;
  bool abort_ = false;
  int64_t rounds_ = 0;
  Status error_;
  std::thread thread_;
};

// The averagers of this process, by id (the C API's handles).
class AsyncRegistry : public IdRegistry<AsyncAverager> {
 public:
  static AsyncRegistry& get();
  void release(int64_t id);
  // At shutdown: asks every averager to stop (each waits for its peers up to timeout_ms) and
  // hands them over; the caller destroys them once the runtime has stopped, which ends any
  // collective they still wait for.
  std::map<int64_t, std::shared_ptr<AsyncAverager>> stop_all(int64_t timeout_ms);
};

}  // namespace bagua_hvd
