// Shared by bagua_hvd's TensorFlow kernels (kernels.cc: Horovod's collectives; bucket_kernels.cc
// and weight_kernels.cc: BAGUA's algorithms), which bagua_hvd/tensorflow/kernels.py compiles
// together into one library: the core's status and dtype codes in TensorFlow's terms, the
// watchdog of asynchronous kernels, buffers as the core sees them, and the algorithms' state that
// outlives a step.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "c_api.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace bagua_hvd_tf {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

// Core status -> TensorFlow error code (Horovod's ToTFStatus; mpi_ops._STATUS_ERRORS).
absl::StatusCode ToCode(int32_t status);
bool ToDtype(::tensorflow::DataType t, int32_t* out);
// The core's dtype of t, or InvalidArgument naming it.
absl::Status CoreDtype(::tensorflow::DataType t, int32_t* out);
double EnvSeconds(const char* name, double fallback);
// A rejected request's error: the core's status and message (BHVD_NOT_INITIALIZED: Horovod's
// class and text).
absl::Status EnqueueError(int rc);
// A C API call's status: OK, or the core's status and last error.
absl::Status CoreStatus(int rc);
absl::Status Enqueue(const bhvd_request& r, int64_t* handle);
// The failure of a completed handle (Python: failure_message()).
absl::Status HandleError(int64_t handle, int32_t status, const std::string& name);
// Blocks until handle completes (BAGUA_HVD_OP_TIMEOUT_SECONDS: DeadlineExceeded after that),
// releases it and returns its outcome. For the kernels that wait at once (the step counts'
// agreement).
absl::Status WaitAndRelease(int64_t handle, const std::string& name);
// Shape functions: outputs shaped as the first inputs; no outputs.
absl::Status SameShapes(::tensorflow::shape_inference::InferenceContext* c);
absl::Status NoOutputs(::tensorflow::shape_inference::InferenceContext*);

using Clock = std::chrono::steady_clock;

// What the watchdog sees of an asynchronous kernel waiting for the core: its context and
// completion, the name and handle it reports, its deadlines.
struct Watched {
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  std::string name;
  int64_t handle = 0;
  Clock::time_point start = Clock::now(), next_warning = Clock::time_point::max(),
                    deadline = Clock::time_point::max();
  bool finished = false;  // done() was called (by the completion or by the watchdog)
};

// Nothing waits forever (the numpy path's ops._wait_long, here for the asynchronous kernel): a
// thread warns every BAGUA_HVD_WAIT_WARNING_SECONDS (default 60) about collectives still in
// flight and fails the step of one older than BAGUA_HVD_OP_TIMEOUT_SECONDS (default 0: no
// limit) with DeadlineExceeded; the core may still complete it later, which then only frees it.
class Watchdog {
 public:
  static Watchdog& Get() {
    // Deliberately never destroyed: its detached thread may run until the process ends.
    static Watchdog* const instance = std::make_unique<Watchdog>().release();
    return *instance;
  }

  void Add(Watched* f) {
    std::lock_guard<std::mutex> lock(mu_);
    const double warn_s = EnvSeconds("BAGUA_HVD_WAIT_WARNING_SECONDS", 60.0);
    const double limit_s = EnvSeconds("BAGUA_HVD_OP_TIMEOUT_SECONDS", 0.0);
    auto after = [&](double s) {
      return f->start +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    };
    if (warn_s > 0) f->next_warning = after(warn_s);
    if (limit_s > 0) f->deadline = after(limit_s);
    pending_.insert(f);
    if (!started_) {  // one thread per process (a detached std::thread is no longer joinable)
      started_ = true;
      std::thread([this] { Run(); }).detach();
    }
  }

  // Removes f; true when the caller is to call done() (the watchdog has not).
  bool Remove(Watched* f) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(f);
    if (f->finished) return false;
    f->finished = true;
    return true;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(500));
      const auto now = Clock::now();
      for (Watched* f : pending_) {
        if (f->finished) continue;
        const double waited = std::chrono::duration<double>(now - f->start).count();
        if (now >= f->deadline) {
          f->finished = true;
          char limit[32];
          std::snprintf(limit, sizeof(limit), "%g", EnvSeconds("BAGUA_HVD_OP_TIMEOUT_SECONDS", 0));
          f->ctx->SetStatus(absl::DeadlineExceededError(
              f->name + " (handle " + std::to_string(f->handle) + ") did not complete within " +
              "BAGUA_HVD_OP_TIMEOUT_SECONDS=" + limit +
              " s: other ranks may not have submitted the same operation"));
          // done() may start other kernels inline: not under this lock.
          auto done = std::move(f->done);
          lock.unlock();
          done();
          lock.lock();
          break;  // pending_ may have changed
        }
        if (now >= f->next_warning) {
          std::fprintf(stderr,
                       "bagua_hvd: still waiting for %s (handle %lld) after %.0f s; other ranks "
                       "may not have submitted the same operation\n",
                       f->name.c_str(), static_cast<long long>(f->handle), waited);
          f->next_warning =
              now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                        EnvSeconds("BAGUA_HVD_WAIT_WARNING_SECONDS", 60.0)));
        }
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_set<Watched*> pending_;
  bool started_ = false;
};

// Memory of empty buffers: the core wants a non-null pointer for them.
inline char kEmptyBuffer[1];

inline char* Data(const Tensor& t) {
  return t.NumElements() == 0 ? kEmptyBuffer : const_cast<char*>(t.tensor_data().data());
}

// A 1-D buffer as the core sees it. Not copyable: desc.shape points at n.
struct View {
  int64_t n;
  bhvd_tensor desc;
  View(const Tensor& t, int32_t dtype) : n(t.NumElements()), desc{Data(t), dtype, 1, &n} {}
  View(const View&) = delete;
  View& operator=(const View&) = delete;
};

// The buckets of an algorithm op: how many of its inputs each takes, in order, and their names.
struct BucketAttrs {
  std::vector<int32_t> sizes;  // inputs per bucket, in input order
  std::vector<std::string> names;
  int32_t process_set_id = 0;

  absl::Status Read(OpKernelConstruction* c) {
    TF_RETURN_IF_ERROR(c->GetAttr("bucket_sizes", &sizes));
    TF_RETURN_IF_ERROR(c->GetAttr("names", &names));
    TF_RETURN_IF_ERROR(c->GetAttr("process_set_id", &process_set_id));
    if (sizes.size() != names.size()) {
      return absl::InvalidArgumentError("bagua_hvd: one name per bucket");
    }
    return absl::OkStatus();
  }
  int first(size_t b) const {
    int i = 0;
    for (size_t k = 0; k < b; ++k) i += sizes[k];
    return i;
  }
};

// ---- the state that outlives a step ----
// State that belongs to one job carries the job it was made for (Store::job): an elastic reset
// forms a new job (BaguaHvdNewJob), after which residuals start from zero, the low-precision
// ring makes its replicas anew for its new neighbours, and the step counts are agreed with the
// other ranks (a worker that just joined starts from 0). The core's shutdown ends the background
// averager with the job: the next step starts the new job's.
struct Counters {
  int64_t steps = 0;    // steps whose gradients were handed over (reduce_gradients calls)
  int64_t applied = 0;  // the step of the last after_apply
  int64_t job = -1;     // the job whose ranks agreed on them (-1: none yet)
};

struct Residuals {  // error feedback of one bucket: the worker's and the server's
  Tensor worker, server;
  int64_t job = -1;
};

struct BucketBuffers {  // one bucket's buffers, kept from step to step
  Tensor flat, result;
};

// Low-precision decentralized, one implementation: the core's ring (bhvd_lp_ring_*), which
// orchestrates the steps and keeps the exchanges in flight, and the buffers it writes into: per
// bucket the replicas (self, left, right) and the compressed difference.
struct Ring {
  std::mutex mu;
  int64_t id = 0;    // the core's ring (0: none)
  int64_t job = -1;  // the job it was started in
  std::vector<std::array<Tensor, 3>> replicas;
  std::vector<Tensor> diffs;
};

// Asynchronous model averaging, one implementation: the core's (bhvd_async_impl_*: the averager,
// its names, abort and resume, the end of a job) and the flat buckets its averager runs over.
struct Averager {
  std::mutex mu;
  int64_t impl = 0;             // the core's implementation (0: not made yet)
  std::vector<Tensor> buffers;  // the core writes into them while its averager runs
};

class Store {
 public:
  static Store& Get() {
    // Never destroyed: the core may write into the buffers until the process ends.
    static Store* const instance = std::make_unique<Store>().release();
    return *instance;
  }

  template <typename T>
  std::shared_ptr<T> Find(std::unordered_map<std::string, std::shared_ptr<T>>& map,
                          const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = map[key];
    if (!slot) slot = std::make_shared<T>();
    return slot;
  }

  std::mutex mu;
  int64_t job = 0;  // jobs formed after the first (elastic resets): BaguaHvdNewJob
  std::unordered_map<std::string, Counters> counters;
  std::unordered_map<std::string, std::shared_ptr<Residuals>> residuals;
  std::unordered_map<std::string, std::shared_ptr<BucketBuffers>> buffers;
  std::unordered_map<std::string, std::shared_ptr<Ring>> rings;
  std::unordered_map<std::string, std::shared_ptr<Averager>> averagers;
};

}  // namespace bagua_hvd_tf
