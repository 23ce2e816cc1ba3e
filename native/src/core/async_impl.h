// Asynchronous model averaging inside one frontend implementation (AsyncModelAverage in one
// optimizer): the state machine both frontends share through the C API (bhvd_async_impl_*). The
// first step past the warm-up starts an averager (core/async_average.h) over the caller's weight
// buffers under a name every rank gives it alike; later steps copy the caller's staged weights into
// those buffers and take a step boundary, which reports whether a round was merged into them.
// abort() stops the rounds on every rank; resume() lets the next step start a new averager under
// the next restart's name. The caller owns the buffers and keeps them alive while an averager runs
// over them. docs/algorithms.md.
//
// An averager belongs to its job: the runtime's shutdown stops it (AsyncRegistry::stop_all) and
// end_job() forgets it with the restarts, so that after an elastic reset every rank, a worker that
// just joined included, starts the next one under the same name. Whether the implementation is
// aborted outlives the job, as the frontend's optimizer does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/common.h"
#include "core/async_average.h"
#include "core/id_registry.h"

namespace bagua_hvd {

// An averager's name: "<prefix>.<elastic generation>.<restarts>", the elastic driver's generation
// (BAGUA_HVD_ELASTIC_GENERATION, read as Python's config.elastic_generation: digits, else 0) naming
// the job alike on every rank, whatever each process's own history of resets.
std::string averager_name(const std::string& prefix, int64_t restarts);

class AsyncImpl {
 public:
  // One step boundary of the training thread, after the update.
  struct Step {
    std::string prefix;  // averager_name's
    int32_t set_id = 0;
    int64_t interval_ms = 0;
    int device = -1;  // -1: host memory, else the CUDA device of every buffer
    void* stream = nullptr;
    // The buffers the averager runs over (those it was started over, while it runs) and the weights
    // now (null: the same), copied into them first where they are other buffers.
    const bhvd_tensor* weights = nullptr;
    const bhvd_tensor* staged = nullptr;
    int32_t num_tensors = 0;
  };
  // What an implementation needs from the runtime (the C API gives the runtime's; tests, a fake): a
  // new averager (bhvd_async_start's checks), a copy between device buffers queued on the caller's
  // stream.
  struct Ops {
    std::function<Status(const std::string& name, const Step& s, std::shared_ptr<AsyncAverager>*)>
        start;
    std::function<void(int device, void* dst, const void* src, size_t bytes, void* stream)>
        device_copy;
  };
  struct State {
    bool aborted = false;
    int64_t restarts = 0;  // resumes in this job
    int64_t averager = 0;  // the running averager's id in AsyncRegistry (0: none)
    int64_t rounds = 0;    // rounds it merged (0: none runs)
  };

  explicit AsyncImpl(Ops ops) : ops_(std::move(ops)) {}
  ~AsyncImpl();  // releases a running averager (stopped without the ranks' agreement)
  AsyncImpl(const AsyncImpl&) = delete;
  AsyncImpl& operator=(const AsyncImpl&) = delete;

  // Starts an averager (none runs) or copies the staged weights in; then a step boundary of the
  // averager. *merged: a round was merged into the weights. Nothing while aborted.
  Status step(const Step& s, bool* merged);
  // Stops the rounds on every rank (after the current one), waits for this rank's, releases the
  // averager; until resume() steps do nothing. A round ended by a shutdown is no failure.
  Status abort();
  void resume();
  State state();
  // The runtime's shutdown: the averager ended with the job; the next one is the new job's first.
  void end_job();

 private:
  Status copy_in(const Step& s);

  Ops ops_;
  std::mutex mu_;
  bool aborted_ = false;
  int64_t restarts_ = 0;
  int64_t averager_ = 0;
  std::vector<const void*> buffers_;  // the running averager's, in order
};

// The implementations of this process, by id (the C API's). They outlive jobs: end_job() at the
// runtime's shutdown forgets their averagers.
class AsyncImpls : public IdRegistry<AsyncImpl> {
 public:
  static AsyncImpls& get();
  void end_job();
};

}  // namespace bagua_hvd
