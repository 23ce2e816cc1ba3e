// bagua_hvd's TensorFlow kernels (bagua_hvd/tensorflow/kernels.py builds this file on first use
// against the installed TensorFlow and links it to the package's core library):
//
//  BaguaHvdCollective  allreduce and broadcast (outputs shaped as the inputs),
//  BaguaHvdReducescatter, BaguaHvdAllgather, BaguaHvdAlltoall: one asynchronous kernel that
//                      hands the tensors' buffers to the core (bhvd_enqueue) and returns; the
//                      core's completion callback (bhvd_on_done) ends the op. No Python in the
//                      step. Allreduce/broadcast: an input TensorFlow no longer needs becomes the
//                      output in place; reducescatter: the output holds this rank's rows;
//                      allgather/alltoall: the core's result is copied into an output allocated
//                      once its size is known.
//  BAGUA's algorithms  BaguaHvdCounter, BaguaHvdBuckets, BaguaHvdLpInit/LpStep/LpFlush/
//                      LpReplicas, BaguaHvdAsyncStep/AsyncControl (the section "BAGUA's
//                      algorithms" below; bagua_hvd/tensorflow/algorithm_kernels.py drives them).
//  BaguaHvdRaise       fails with a status computed by a numpy_function path (every collective
//                      with the kernels off, the algorithms' numpy fallback), so that graph mode
//                      raises the same tf.errors classes as eager mode.
//
// The core stays framework-free: this library only calls its C API (c_api.h).
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

namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

// Core status -> TensorFlow error code (Horovod's ToTFStatus; mpi_ops._STATUS_ERRORS).
absl::StatusCode ToCode(int32_t status) {
  switch (status) {
    case BHVD_INVALID_ARGUMENT: return absl::StatusCode::kInvalidArgument;
    case BHVD_PRECONDITION_ERROR: return absl::StatusCode::kFailedPrecondition;
    case BHVD_ABORTED: return absl::StatusCode::kAborted;
    case BHVD_NOT_IMPLEMENTED: return absl::StatusCode::kUnimplemented;
    case BHVD_TIMED_OUT: return absl::StatusCode::kDeadlineExceeded;
    case BHVD_NOT_INITIALIZED: return absl::StatusCode::kFailedPrecondition;  // Horovod's class
    default: return absl::StatusCode::kUnknown;
  }
}

bool ToDtype(::tensorflow::DataType t, int32_t* out) {
  switch (t) {
    case ::tensorflow::DT_UINT8: *out = BHVD_UINT8; return true;
    case ::tensorflow::DT_INT8: *out = BHVD_INT8; return true;
    case ::tensorflow::DT_UINT16: *out = BHVD_UINT16; return true;
    case ::tensorflow::DT_INT16: *out = BHVD_INT16; return true;
    case ::tensorflow::DT_INT32: *out = BHVD_INT32; return true;
    case ::tensorflow::DT_INT64: *out = BHVD_INT64; return true;
    case ::tensorflow::DT_HALF: *out = BHVD_FLOAT16; return true;
    case ::tensorflow::DT_BFLOAT16: *out = BHVD_BFLOAT16; return true;
    case ::tensorflow::DT_FLOAT: *out = BHVD_FLOAT32; return true;
    case ::tensorflow::DT_DOUBLE: *out = BHVD_FLOAT64; return true;
    case ::tensorflow::DT_BOOL: *out = BHVD_BOOL; return true;
    default: return false;
  }
}

double EnvSeconds(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double d = std::strtod(v, &end);
  return end != v ? d : fallback;
}

using Clock = std::chrono::steady_clock;

// A rejected request's error: the core's status and message (BHVD_NOT_INITIALIZED: Horovod's
// class and text).
absl::Status EnqueueError(int rc) { return absl::Status(ToCode(rc), bhvd_last_error()); }

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

// One collective in flight. Owns references to its tensors, so their buffers outlive the core's
// use of them even when the step has already failed with a timeout.
struct InFlight : Watched {
  int32_t op_type = 0;
  int num_tensors = 0;
  std::vector<Tensor> tensors;  // inputs and outputs
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

// Allgather, alltoall: outputs the core allocated (their sizes come from the other ranks), copied
// into TensorFlow outputs allocated now; alltoall's second output is the received splits.
absl::Status CopyCoreOutputs(OpKernelContext* ctx, const InFlight& f) {
  for (int i = 0; i < f.num_tensors; ++i) {
    const int ndim = bhvd_output_ndim(f.handle, i);
    if (ndim < 0)
      return absl::InternalError("bagua_hvd: the core has no output " + std::to_string(i));
    std::vector<int64_t> dims(ndim);
    if (ndim > 0) bhvd_output_shape(f.handle, i, dims.data());
    ::tensorflow::TensorShape shape;
    for (int64_t d : dims) TF_RETURN_IF_ERROR(shape.AddDimWithStatus(d));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(i, shape, &out));
    if (out->NumElements() > 0) {
      bhvd_output_copy(f.handle, i, const_cast<char*>(out->tensor_data().data()), nullptr);
    }
  }
  if (f.op_type == BHVD_OP_ALLTOALL) {
    const int n = bhvd_received_splits(f.handle, nullptr, 0);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, ::tensorflow::TensorShape({n < 0 ? 0 : n}), &out));
    if (n > 0) bhvd_received_splits(f.handle, out->flat<int32_t>().data(), n);
  }
  return absl::OkStatus();
}

void OnDone(int64_t handle, int32_t status, void* arg) {
  std::unique_ptr<InFlight> f(static_cast<InFlight*>(arg));
  if (!Watchdog::Get().Remove(f.get())) {  // the step already failed with a timeout
    bhvd_release(handle);
    return;
  }
  if (status != BHVD_OK) {
    f->ctx->SetStatus(absl::Status(ToCode(status), bhvd_handle_error(handle)));
  } else if (f->op_type == BHVD_OP_ALLGATHER || f->op_type == BHVD_OP_ALLTOALL) {
    f->ctx->SetStatus(CopyCoreOutputs(f->ctx, *f));
  }
  bhvd_release(handle);
  auto done = std::move(f->done);
  f.reset();  // drops this kernel's references before the step goes on
  done();
}

class BaguaHvdCollectiveOp : public AsyncOpKernel {
 public:
  explicit BaguaHvdCollectiveOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    const std::string& op = c->def().op();
    if (op == "BaguaHvdCollective") {
      OP_REQUIRES_OK(c, c->GetAttr("op_type", &op_type_));
      OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
    } else if (op == "BaguaHvdReducescatter") {
      op_type_ = BHVD_OP_REDUCESCATTER;
    } else {
      op_type_ = op == "BaguaHvdAllgather" ? BHVD_OP_ALLGATHER : BHVD_OP_ALLTOALL;
    }
    if (op == "BaguaHvdCollective" || op == "BaguaHvdReducescatter") {
      OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
      OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_));
      OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_));
    }
    OP_REQUIRES_OK(c, c->GetAttr("core_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_id_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    auto f = std::make_unique<InFlight>();
    const bool in_place_shape = op_type_ == BHVD_OP_ALLREDUCE || op_type_ == BHVD_OP_BROADCAST;
    // Allgather and alltoall: the core allocates the outputs (sizes from the other ranks).
    const bool caller_outputs = in_place_shape || op_type_ == BHVD_OP_REDUCESCATTER;
    // Alltoall's second input is its splits (empty: even).
    const int n = op_type_ == BHVD_OP_ALLTOALL ? 1 : ctx->num_inputs();
    std::vector<bhvd_tensor> ins(n), outs(n);
    std::vector<std::vector<int64_t>> shapes(n), out_shapes(n);
    f->tensors.reserve(2 * n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      if (in_place_shape) {
        // An input nothing else reads is reduced in place: no allocation, no copy.
        OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out),
                             done);
      } else if (op_type_ == BHVD_OP_REDUCESCATTER) {
        // This rank's rows of dim 0 (the core's split); for an unknown set or a non-member the
        // core fails the op: no rows.
        ::tensorflow::TensorShape shape = in.shape();
        if (in.dims() > 0) {
          const int64_t rows = bhvd_reducescatter_rows(process_set_id_, in.dim_size(0));
          shape.set_dim(0, rows < 0 ? 0 : rows);
        }
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, shape, &out), done);
      }
      int32_t dtype = 0;
      OP_REQUIRES_ASYNC(
          ctx, ToDtype(in.dtype(), &dtype),
          absl::InvalidArgumentError("Tensor type " + ::tensorflow::DataTypeString(in.dtype()) +
                                     " is not supported."),
          done);
      f->tensors.push_back(in);
      for (int d = 0; d < in.dims(); ++d) shapes[i].push_back(in.dim_size(d));
      const bool empty = in.NumElements() == 0;
      ins[i] = {empty ? nullptr : const_cast<char*>(in.tensor_data().data()), dtype, in.dims(),
                shapes[i].data()};
      if (out != nullptr) {
        f->tensors.push_back(*out);
        for (int d = 0; d < out->dims(); ++d) out_shapes[i].push_back(out->dim_size(d));
        outs[i] = {out->NumElements() == 0 ? nullptr : const_cast<char*>(out->tensor_data().data()),
                   dtype, out->dims(), out_shapes[i].data()};
      }
    }
    std::vector<int32_t> splits;
    if (op_type_ == BHVD_OP_ALLTOALL) {
      const Tensor& s = ctx->input(1);
      OP_REQUIRES_ASYNC(ctx, s.dims() == 1,
                        absl::InvalidArgumentError("alltoall expects a 1D splits tensor"), done);
      const auto v = s.flat<int32_t>();
      splits.assign(v.data(), v.data() + v.size());
    }
    bhvd_request r{};
    r.op_type = op_type_;
    r.name = name_.empty() ? nullptr : name_.c_str();
    r.process_set_id = process_set_id_;
    r.reduce_op = reduce_op_;
    r.root_rank = root_rank_;
    r.device = -1;
    r.prescale_factor = prescale_;
    r.postscale_factor = postscale_;
    r.num_tensors = n;
    r.inputs = ins.data();
    r.outputs = caller_outputs ? outs.data() : nullptr;
    if (!splits.empty()) {
      r.splits = splits.data();
      r.num_splits = static_cast<int32_t>(splits.size());
    }
    r.urgent = 1;  // the step waits for it: not held back for fusion
    int64_t handle = 0;
    const int rc = bhvd_enqueue(&r, &handle);
    if (rc != BHVD_OK) {
      ctx->SetStatus(EnqueueError(rc));
      done();
      return;
    }
    f->ctx = ctx;
    f->op_type = op_type_;
    f->num_tensors = n;
    f->done = std::move(done);
    f->name = name_.empty() ? "collective" : name_;
    f->handle = handle;
    InFlight* raw = f.release();  // owned by OnDone from here
    Watchdog::Get().Add(raw);
    if (bhvd_on_done(handle, &OnDone, raw) != BHVD_OK) {
      // Only for an unknown handle, which enqueue just returned: a core bug, not user input.
      std::unique_ptr<InFlight> back(raw);
      if (Watchdog::Get().Remove(raw)) {
        ctx->SetStatus(absl::InternalError(std::string("bhvd_on_done: ") + bhvd_last_error()));
        auto d = std::move(back->done);
        back.reset();
        d();
      }
    }
  }

 private:
  int op_type_ = 0, process_set_id_ = 0, reduce_op_ = 0, root_rank_ = 0;
  float prescale_ = 1.f, postscale_ = 1.f;
  std::string name_;
};

class BaguaHvdRaiseOp : public OpKernel {
 public:
  explicit BaguaHvdRaiseOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* c) override {
    const int32_t code = c->input(0).scalar<int32_t>()();
    if (code == 0) return;
    const std::string message(c->input(1).scalar<::tensorflow::tstring>()());
    c->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
  }
};


// ---- BAGUA's algorithms (docs/tensorflow.md, "How tensors reach the core") ----------------------
// The Python engine decides, at trace time, the buckets (how many of the op's inputs each one
// takes, in order), their names on the wire, the primitive and its parameters, and when each op
// runs (graph conditions); these kernels pack the buckets, call the core's primitive and unpack
// the results, and keep the state that must outlive a step (error-feedback residuals, the
// low-precision ring's replicas and its id in the core, which keeps its exchanges in flight, the
// asynchronous averager, the step counts), keyed by the implementation's unique names.

// Memory of empty buffers: the core wants a non-null pointer for them.
char kEmptyBuffer[1];

char* Data(const Tensor& t) {
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

// ---- one request builder per primitive (the core's C API) ----
bhvd_request BaseRequest(int32_t op_type, const char* name, int32_t process_set_id,
                         const bhvd_tensor* in, const bhvd_tensor* out) {
  bhvd_request r{};
  r.op_type = op_type;
  r.name = name;
  r.process_set_id = process_set_id;
  r.device = -1;
  r.prescale_factor = 1.0;
  r.postscale_factor = 1.0;
  r.num_tensors = 1;
  r.inputs = in;
  r.outputs = out;
  r.urgent = 1;  // the step waits for it: not held back for fusion
  return r;
}

// The allreduce of one bucket in place: MinMaxUInt8-compressed (ByteGrad; error feedback's
// residuals worker and server, or both null), or Horovod's allreduce, or the hierarchical one.
// `params` is the caller's storage (it must outlive the enqueue).
bhvd_request AllreduceRequest(const char* name, int32_t process_set_id, int32_t reduce_op,
                              bool compressed, bool hierarchical, const bhvd_tensor* buf,
                              const bhvd_tensor* residual_worker,
                              const bhvd_tensor* residual_server,
                              bhvd_compressed_allreduce_params* params) {
  int32_t op_type = hierarchical ? BHVD_OP_HIERARCHICAL_ALLREDUCE : BHVD_OP_ALLREDUCE;
  if (compressed) op_type = BHVD_OP_COMPRESSED_ALLREDUCE;
  bhvd_request r = BaseRequest(op_type, name, process_set_id, buf, buf);
  r.reduce_op = reduce_op;
  if (compressed) {
    *params = bhvd_compressed_allreduce_params{};
    params->op_type = op_type;
    params->compression = BHVD_COMPRESSION_MINMAX_UINT8;
    params->hierarchical = hierarchical ? 1 : 0;
    params->residual_worker = residual_worker;
    params->residual_server = residual_server;
    r.params = params;
  }
  return r;
}

// Decentralized SGD's average of buf with the peers of round `round` into out.
bhvd_request PeerAverageRequest(const char* name, int32_t process_set_id, int32_t peer_mode,
                                int64_t round, bool hierarchical, const bhvd_tensor* buf,
                                const bhvd_tensor* out, bhvd_peer_average_params* params) {
  bhvd_request r = BaseRequest(BHVD_OP_PEER_AVERAGE, name, process_set_id, buf, out);
  *params = bhvd_peer_average_params{};
  params->op_type = BHVD_OP_PEER_AVERAGE;
  params->peer_mode = peer_mode;
  params->step = round;
  params->hierarchical = hierarchical ? 1 : 0;
  r.params = params;
  return r;
}

absl::Status Enqueue(const bhvd_request& r, int64_t* handle) {
  const int rc = bhvd_enqueue(&r, handle);
  return rc == BHVD_OK ? absl::OkStatus() : EnqueueError(rc);
}

// The failure of a completed handle (Python: failure_message()).
absl::Status HandleError(int64_t handle, int32_t status, const std::string& name) {
  std::string message = bhvd_handle_error(handle);
  if (message.empty()) message = name + " failed";
  return absl::Status(ToCode(status), message);
}

// Blocks until handle completes (BAGUA_HVD_OP_TIMEOUT_SECONDS: DeadlineExceeded after that),
// releases it and returns its outcome. For the kernels that wait at once (the step counts'
// agreement).
absl::Status WaitAndRelease(int64_t handle, const std::string& name) {
  const double limit_s = EnvSeconds("BAGUA_HVD_OP_TIMEOUT_SECONDS", 0.0);
  const int64_t timeout_ms = limit_s > 0 ? static_cast<int64_t>(limit_s * 1000) : -1;
  const int status = bhvd_wait(handle, timeout_ms);
  absl::Status out = absl::OkStatus();
  if (status == BHVD_TIMED_OUT) {
    char limit[32];
    std::snprintf(limit, sizeof(limit), "%g", limit_s);
    out = absl::DeadlineExceededError(name + " (handle " + std::to_string(handle) +
                                      ") did not complete within BAGUA_HVD_OP_TIMEOUT_SECONDS=" +
                                      limit +
                                      " s: other ranks may not have submitted the same operation");
  } else if (status != BHVD_OK) {
    out = HandleError(handle, status, name);
  }
  bhvd_release(handle);
  return out;
}

// ---- buckets ----
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

absl::Status CoreDtype(::tensorflow::DataType t, int32_t* out) {
  if (ToDtype(t, out)) return absl::OkStatus();
  return absl::InvalidArgumentError("Tensor type " + ::tensorflow::DataTypeString(t) +
                                    " is not supported.");
}

// The bucket of inputs [first, first + count) of a list argument, copied into a flat tensor:
// *flat itself when it has the bucket's dtype and size (a buffer kept from the previous step:
// no allocation, no page faults), else a new one.
absl::Status Pack(const ::tensorflow::OpInputList& ins, int first, int count, Tensor* flat) {
  const ::tensorflow::DataType dtype = ins[first].dtype();
  int64_t n = 0;
  for (int i = first; i < first + count; ++i) {
    if (ins[i].dtype() != dtype) {
      return absl::InvalidArgumentError("bagua_hvd: a bucket holds tensors of one dtype");
    }
    n += ins[i].NumElements();
  }
  if (!flat->IsInitialized() || flat->dtype() != dtype || flat->NumElements() != n) {
    *flat = Tensor(dtype, ::tensorflow::TensorShape({n}));
  }
  char* dst = Data(*flat);
  for (int i = first; i < first + count; ++i) {
    const auto src = ins[i].tensor_data();
    std::memcpy(dst, src.data(), src.size());
    dst += src.size();
  }
  return absl::OkStatus();
}

// Outputs [first, first + count), shaped as the same inputs, read from a flat bucket. An input
// nothing else reads becomes its output (written in place: no allocation). Inputs and outputs
// are the op's first list argument and its list output.
absl::Status Unpack(OpKernelContext* ctx, const ::tensorflow::OpInputList& ins, int first,
                    int count, const Tensor& flat, ::tensorflow::OpOutputList* outs) {
  const char* src = Data(flat);
  for (int i = first; i < first + count; ++i) {
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({i}, i, ins[i].shape(), &out));
    const size_t bytes = ins[i].tensor_data().size();
    if (bytes > 0) std::memcpy(Data(*out), src, bytes);
    src += bytes;
  }
  return absl::OkStatus();
}

// ---- weights: the resource variables of a weight op's inputs ----
using Variables = std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>>;

absl::Status LookupVariables(OpKernelContext* ctx, int n, Variables* vars) {
  vars->clear();
  for (int i = 0; i < n; ++i) {
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> v;
    TF_RETURN_IF_ERROR(LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, i), &v));
    vars->push_back(std::move(v));
  }
  return absl::OkStatus();
}

// The bucket of variables [first, first + count), copied into *flat (kept when it fits).
absl::Status PackVariables(const Variables& vars, int first, int count, Tensor* flat) {
  ::tensorflow::DataType dtype = ::tensorflow::DT_INVALID;
  int64_t n = 0;
  for (int i = first; i < first + count; ++i) {
    ::tensorflow::tf_shared_lock lock(*vars[i]->mu());
    const Tensor& t = *vars[i]->tensor();
    if (!vars[i]->is_initialized) {
      return absl::FailedPreconditionError("bagua_hvd: an uninitialized variable");
    }
    if (i == first) dtype = t.dtype();
    if (t.dtype() != dtype) {
      return absl::InvalidArgumentError("bagua_hvd: a bucket holds tensors of one dtype");
    }
    n += t.NumElements();
  }
  if (!flat->IsInitialized() || flat->dtype() != dtype || flat->NumElements() != n) {
    *flat = Tensor(dtype, ::tensorflow::TensorShape({n}));
  }
  char* dst = Data(*flat);
  for (int i = first; i < first + count; ++i) {
    ::tensorflow::tf_shared_lock lock(*vars[i]->mu());
    const auto src = vars[i]->tensor()->tensor_data();
    std::memcpy(dst, src.data(), src.size());
    dst += src.size();
  }
  return absl::OkStatus();
}

// Writes a flat bucket into variables [first, first + count), in place where no read of the
// variable still holds its buffer (else into a new buffer, as TensorFlow's own updates do).
// The variable's tensor, with a buffer of its own (its mutex held): one another tensor still
// shares (a read in flight), or any of a copy-on-read variable, is replaced first by a new buffer,
// holding the old values where keep_values says so (TensorFlow's copy-on-write for updates).
Tensor* Writable(::tensorflow::Var* var, bool keep_values) {
  Tensor* t = var->tensor();
  if (var->copy_on_read_mode.load() || !t->RefCountIsOne()) {
    Tensor own(t->dtype(), t->shape());
    if (keep_values && t->NumElements() > 0) {
      std::memcpy(Data(own), t->tensor_data().data(), t->tensor_data().size());
    }
    *t = own;
  }
  return t;
}

absl::Status WriteVariables(const Variables& vars, int first, int count, const Tensor& flat) {
  const char* src = Data(flat);
  for (int i = first; i < first + count; ++i) {
    ::tensorflow::mutex_lock lock(*vars[i]->mu());
    Tensor* t = Writable(vars[i].get(), false);
    const size_t bytes = t->tensor_data().size();
    if (bytes > 0) std::memcpy(Data(*t), src, bytes);
    src += bytes;
  }
  return absl::OkStatus();
}

// The buffers of variables [first, first + count), held exclusively (their mutexes) and of their
// own (Writable) for an update in place.
struct InPlace {
  std::vector<::tensorflow::mutex_lock> locks;
  std::vector<void*> data;
  std::vector<int64_t> counts;
  ::tensorflow::DataType dtype = ::tensorflow::DT_INVALID;
  int64_t count = 0;

  absl::Status Take(const Variables& vars, int first, int n) {
    for (int i = first; i < first + n; ++i) {
      locks.emplace_back(*vars[i]->mu());
      if (!vars[i]->is_initialized) {
        return absl::FailedPreconditionError("bagua_hvd: an uninitialized variable");
      }
      if (i == first) dtype = vars[i]->tensor()->dtype();
      if (vars[i]->tensor()->dtype() != dtype) {
        return absl::InvalidArgumentError("bagua_hvd: a bucket holds tensors of one dtype");
      }
      Tensor* t = Writable(vars[i].get(), true);
      data.push_back(Data(*t));
      counts.push_back(t->NumElements());
      count += t->NumElements();
    }
    return absl::OkStatus();
  }

  void Release() { locks.clear(); }
};

Tensor Zeros(::tensorflow::DataType dtype, int64_t n) {
  Tensor t(dtype, ::tensorflow::TensorShape({n}));
  if (n > 0) std::memset(Data(t), 0, t.tensor_data().size());
  return t;
}

// ---- the state that outlives a step ----
// State that belongs to one job carries the job it was made for (Store::job): an elastic reset
// forms a new job (BaguaHvdNewJob), after which residuals start from zero, the low-precision
// ring makes its replicas anew for its new neighbours, a new background averager starts, and
// the step counts are agreed with the other ranks (a worker that just joined starts from 0).
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

struct Averager {  // asynchronous model averaging, one implementation
  std::mutex mu;
  int64_t id = 0;  // the core's averager, 0: none runs
  int64_t job = -1;         // the job it runs in
  int64_t generation = 0;   // restarts (resume) within the job
  bool aborted = false;
  std::vector<Tensor> buffers;  // the core writes into them until it is released
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

// The ranks' agreement on an implementation's counts (an elastic job's first step in a job):
// the largest of every rank's (the survivors' are equal; a worker that just joined has 0).
absl::Status AgreeCounts(const std::string& name, int32_t process_set_id, Counters* c) {
  Tensor counts(::tensorflow::DT_INT64, ::tensorflow::TensorShape({2}));
  counts.flat<int64_t>()(0) = c->steps;
  counts.flat<int64_t>()(1) = c->applied;
  View v(counts, BHVD_INT64);
  bhvd_request r = BaseRequest(BHVD_OP_ALLREDUCE, name.c_str(), process_set_id, &v.desc, &v.desc);
  r.reduce_op = BHVD_MAX;
  int64_t handle = 0;
  TF_RETURN_IF_ERROR(Enqueue(r, &handle));
  TF_RETURN_IF_ERROR(WaitAndRelease(handle, name));
  c->steps = counts.flat<int64_t>()(0);
  c->applied = counts.flat<int64_t>()(1);
  return absl::OkStatus();
}

// BaguaHvdCounter: a step count of an implementation. mode 0: read; 1: add `value`; 2: set to
// `value`; 3: fail with `message` (InvalidArgument) when the last after_apply is older than the
// step count (an update not followed by after_apply). Returns the count before the change.
// agree_name (an elastic job's first read of a step): first, once per job, every rank takes the
// largest of the ranks' counts (an allreduce under that name).
class BaguaHvdCounterOp : public OpKernel {
 public:
  explicit BaguaHvdCounterOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("counter", &counter_));
    OP_REQUIRES_OK(c, c->GetAttr("mode", &mode_));
    OP_REQUIRES_OK(c, c->GetAttr("message", &message_));
    OP_REQUIRES_OK(c, c->GetAttr("agree_name", &agree_name_));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_id_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t value = ctx->input(0).scalar<int64_t>()();
    Store& store = Store::Get();
    int64_t before = 0;
    if (!agree_name_.empty()) {
      Counters mine;
      int64_t job = 0;
      {
        std::lock_guard<std::mutex> lock(store.mu);
        mine = store.counters[key_];
        job = store.job;
      }
      if (mine.job != job) {  // the collective runs without the store's lock
        OP_REQUIRES_OK(ctx, AgreeCounts(agree_name_, process_set_id_, &mine));
        std::lock_guard<std::mutex> lock(store.mu);
        Counters& c = store.counters[key_];
        c.steps = mine.steps;
        c.applied = mine.applied;
        c.job = job;
      }
    }
    {
      std::lock_guard<std::mutex> lock(store.mu);
      Counters& c = store.counters[key_];
      int64_t& x = counter_ == "applied" ? c.applied : c.steps;
      before = x;
      if (mode_ == 1) x += value;
      if (mode_ == 2) x = value;
      if (mode_ == 3 && c.applied < c.steps) {
        ctx->SetStatus(absl::InvalidArgumentError(message_));
        return;
      }
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));
    out->scalar<int64_t>()() = before;
  }

 private:
  std::string key_, counter_, message_, agree_name_;
  int mode_ = 0;
  int32_t process_set_id_ = 0;
};

// Buckets submitted by one asynchronous kernel; done() once the last completes.
struct BucketGroup : Watched {
  std::mutex mu;
  int remaining = 0;
  absl::Status status;
  std::vector<Tensor> flats, results;  // per bucket: what was sent, where the result lands
  std::vector<std::shared_ptr<Residuals>> residuals;
  std::vector<std::string> names;
  std::function<absl::Status()> unpack;
};

struct BucketDone {  // the callback's argument for one handle
  std::shared_ptr<BucketGroup> group;
  size_t bucket;
};

void OnBucketDone(int64_t handle, int32_t status, void* arg) {
  std::unique_ptr<BucketDone> d(static_cast<BucketDone*>(arg));
  BucketGroup* g = d->group.get();
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    if (status != BHVD_OK && g->status.ok()) {
      g->status = HandleError(handle, status, g->names[d->bucket]);
    }
    last = --g->remaining == 0;
  }
  bhvd_release(handle);
  if (!last || !Watchdog::Get().Remove(g)) return;  // or the step already failed (timeout)
  absl::Status s = g->status;
  if (s.ok()) s = g->unpack();
  if (!s.ok()) g->ctx->SetStatus(s);
  auto done = std::move(g->done);
  g->unpack = nullptr;  // holds the context
  d.reset();            // the group may go now (its buffers are no longer the core's)
  done();
}

// BaguaHvdBuckets: the gradient path's allreduce of every bucket (primitive 0: compressed or
// not, with error feedback's residuals when error_feedback is set: sized for the job's
// compression group, zeros in a new job or layout) or
// Decentralized's peer average of the weight buckets (primitive 1, round `round`), submitted
// together; outputs shaped as the inputs.
class BaguaHvdBucketsOp : public AsyncOpKernel {
 public:
  explicit BaguaHvdBucketsOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, buckets_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("primitive", &primitive_));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    OP_REQUIRES_OK(c, c->GetAttr("compressed", &compressed_));
    OP_REQUIRES_OK(c, c->GetAttr("hierarchical", &hierarchical_));
    OP_REQUIRES_OK(c, c->GetAttr("error_feedback", &error_feedback_));
    OP_REQUIRES_OK(c, c->GetAttr("peer_mode", &peer_mode_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ::tensorflow::OpInputList ins;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("tensors", &ins), done);
    const int64_t round = ctx->input(ins.size()).scalar<int64_t>()();
    const size_t nb = buckets_.sizes.size();
    auto g = std::make_shared<BucketGroup>();
    g->flats.resize(nb);
    g->results.resize(nb);
    g->residuals.resize(nb);
    g->names = buckets_.names;
    Store& store = Store::Get();
    for (size_t b = 0; b < nb; ++b) {
      // A name is in flight once at a time: its buffers are free again when its op completed.
      auto kept = store.Find(store.buffers, buckets_.names[b]);
      OP_REQUIRES_OK_ASYNC(ctx, Pack(ins, buckets_.first(b), buckets_.sizes[b], &kept->flat),
                           done);
      g->flats[b] = kept->flat;
      if (primitive_ == 0) {
        g->results[b] = g->flats[b];
      } else {
        if (!kept->result.IsInitialized() || kept->result.dtype() != kept->flat.dtype() ||
            kept->result.NumElements() != kept->flat.NumElements()) {
          kept->result = Tensor(kept->flat.dtype(), kept->flat.shape());
        }
        g->results[b] = kept->result;
      }
      if (error_feedback_) {
        auto r = store.Find(store.residuals, buckets_.names[b]);
        // The worker's: the bucket padded to a multiple of the compression group; the server's:
        // one chunk (the engine's GradientPath.residuals). A new layout or job starts from zero.
        const int64_t n = bhvd_compression_group_size(buckets_.process_set_id, hierarchical_);
        OP_REQUIRES_ASYNC(ctx, n > 0,
                          absl::InternalError(std::string("bagua_hvd: compression group: ") +
                                              bhvd_last_error()),
                          done);
        const int64_t chunk = (g->flats[b].NumElements() + n - 1) / n;
        const auto dtype = g->flats[b].dtype();
        int64_t job = 0;
        {
          std::lock_guard<std::mutex> lock(store.mu);
          job = store.job;
        }
        if (r->job != job || r->worker.NumElements() != chunk * n || r->worker.dtype() != dtype ||
            r->server.NumElements() != chunk) {
          r->worker = Zeros(dtype, chunk * n);
          r->server = Zeros(dtype, chunk);
          r->job = job;
        }
        g->residuals[b] = r;
      }
    }
    ::tensorflow::OpOutputList outs;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->output_list("outputs", &outs), done);
    OpKernelContext* c = ctx;
    BucketGroup* raw = g.get();
    const BucketAttrs* bk = &buckets_;
    g->unpack = [c, ins, outs, raw, bk]() mutable {
      for (size_t b = 0; b < bk->sizes.size(); ++b) {
        TF_RETURN_IF_ERROR(Unpack(c, ins, bk->first(b), bk->sizes[b], raw->results[b], &outs));
      }
      return absl::OkStatus();
    };
    g->ctx = ctx;
    g->done = std::move(done);
    g->name = nb > 0 ? buckets_.names[0] : "buckets";
    g->remaining = 1;  // held until every bucket is submitted
    absl::Status failed = absl::OkStatus();
    for (size_t b = 0; b < nb && failed.ok(); ++b) {
      int32_t dtype = 0;
      failed = CoreDtype(g->flats[b].dtype(), &dtype);
      if (!failed.ok()) break;
      View buf(g->flats[b], dtype), out(g->results[b], dtype);
      std::unique_ptr<View> rw, rs;
      bhvd_compressed_allreduce_params compressed_params;
      bhvd_peer_average_params peer_params;
      bhvd_request r;
      if (primitive_ == 0) {
        if (g->residuals[b]) {
          rw = std::make_unique<View>(g->residuals[b]->worker, dtype);
          rs = std::make_unique<View>(g->residuals[b]->server, dtype);
        }
        r = AllreduceRequest(buckets_.names[b].c_str(), buckets_.process_set_id, reduce_op_,
                             compressed_, hierarchical_, &buf.desc, rw ? &rw->desc : nullptr,
                             rs ? &rs->desc : nullptr, &compressed_params);
      } else {
        r = PeerAverageRequest(buckets_.names[b].c_str(), buckets_.process_set_id, peer_mode_,
                               round, hierarchical_, &buf.desc, &out.desc, &peer_params);
      }
      int64_t handle = 0;
      failed = Enqueue(r, &handle);
      if (!failed.ok()) break;
      {
        std::lock_guard<std::mutex> lock(g->mu);
        ++g->remaining;
        if (b == 0) g->handle = handle;
      }
      if (bhvd_on_done(handle, &OnBucketDone, new BucketDone{g, b}) != BHVD_OK) {
        failed = absl::InternalError(std::string("bhvd_on_done: ") + bhvd_last_error());
      }
    }
    if (!failed.ok()) {
      std::lock_guard<std::mutex> lock(g->mu);
      g->status = failed;
    }
    Watchdog::Get().Add(raw);
    // Drops the submission's hold: completes now if every bucket already has (or none went).
    {
      std::lock_guard<std::mutex> lock(g->mu);
      if (--g->remaining > 0) return;
    }
    if (!Watchdog::Get().Remove(raw)) return;
    absl::Status s = g->status;
    if (s.ok()) s = g->unpack();
    if (!s.ok()) ctx->SetStatus(s);
    auto d = std::move(g->done);
    g->unpack = nullptr;
    g.reset();
    d();
  }

 private:
  BucketAttrs buckets_;
  int primitive_ = 0, reduce_op_ = 0, peer_mode_ = 0;
  bool compressed_ = false, hierarchical_ = false, error_feedback_ = false;
};

// ---- low-precision decentralized: the core's ring (bhvd_lp_ring_*) over the variables ----
// The variables of every bucket, held exclusively (their mutexes) with buffers of their own, as
// the core's weights: per bucket its variables' buffers as segments.
struct LpWeights {
  std::vector<InPlace> held;
  std::vector<bhvd_lp_weights> weights;

  absl::Status Take(const Variables& vars, const BucketAttrs& buckets) {
    const size_t nb = buckets.sizes.size();
    held = std::vector<InPlace>(nb);
    weights.assign(nb, bhvd_lp_weights{});
    for (size_t b = 0; b < nb; ++b) {
      TF_RETURN_IF_ERROR(held[b].Take(vars, buckets.first(b), buckets.sizes[b]));
      weights[b].data = held[b].data.data();
      weights[b].counts = held[b].counts.data();
      weights[b].num_segments = static_cast<int32_t>(held[b].data.size());
    }
    return absl::OkStatus();
  }
};

absl::Status CoreStatus(int rc) {
  return rc == BHVD_OK ? absl::OkStatus() : absl::Status(ToCode(rc), bhvd_last_error());
}

// BaguaHvdLpInit: low-precision decentralized, before the first update: starts the core's ring,
// whose replicas of every bucket (self, left, right) start from the weights as they are on every
// rank; nothing when the ring of `key` runs already in this job (a new job has new neighbours;
// a shutdown ends the rings).
// The inputs are the weights' resource variables; names: the initialisations', step_names: the
// whole (hierarchical) steps', exchange_names: the split steps' exchanges.
class BaguaHvdLpInitOp : public OpKernel {
 public:
  explicit BaguaHvdLpInitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, buckets_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("hierarchical", &hierarchical_));
    OP_REQUIRES_OK(c, c->GetAttr("step_names", &step_names_));
    OP_REQUIRES_OK(c, c->GetAttr("exchange_names", &exchange_names_));
    OP_REQUIRES(c,
                step_names_.size() == buckets_.names.size() &&
                    exchange_names_.size() == buckets_.names.size(),
                absl::InvalidArgumentError("bagua_hvd: one step and exchange name per bucket"));
  }

  void Compute(OpKernelContext* ctx) override {
    Store& store = Store::Get();
    auto ring = store.Find(store.rings, key_);
    int64_t job = 0;
    {
      std::lock_guard<std::mutex> lock(store.mu);
      job = store.job;
    }
    std::lock_guard<std::mutex> lock(ring->mu);
    // Running in this job (a ring the core no longer knows ended with an earlier job's shutdown).
    if (ring->id != 0 && ring->job == job && bhvd_lp_ring_pending(ring->id) >= 0) return;
    if (ring->id != 0) bhvd_lp_ring_release(ring->id);  // an old job's (ended with it)
    ring->id = 0;
    Variables vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, ctx->num_inputs(), &vars));
    LpWeights x;
    OP_REQUIRES_OK(ctx, x.Take(vars, buckets_));
    const size_t nb = buckets_.sizes.size();
    std::vector<std::array<Tensor, 3>> replicas(nb);
    std::vector<Tensor> diffs(nb);
    std::vector<bhvd_lp_bucket> specs(nb);
    for (size_t b = 0; b < nb; ++b) {
      int32_t dtype = 0;
      OP_REQUIRES_OK(ctx, CoreDtype(x.held[b].dtype, &dtype));
      const int64_t n = x.held[b].count;
      for (auto& rep : replicas[b]) rep = Tensor(x.held[b].dtype, ::tensorflow::TensorShape({n}));
      // The split step's difference (an unsupported dtype: the core's initialisation says so).
      const int64_t bytes = bhvd_minmax_uint8_size(dtype, n, 1);
      if (bytes > 0) diffs[b] = Tensor(::tensorflow::DT_UINT8, ::tensorflow::TensorShape({bytes}));
      bhvd_lp_bucket& k = specs[b];
      k.init_name = buckets_.names[b].c_str();
      k.step_name = step_names_[b].c_str();
      k.exchange_name = exchange_names_[b].c_str();
      k.dtype = dtype;
      k.count = n;
      k.self = Data(replicas[b][0]);
      k.left = Data(replicas[b][1]);
      k.right = Data(replicas[b][2]);
      k.diff = bytes > 0 ? reinterpret_cast<uint8_t*>(Data(diffs[b])) : nullptr;
    }
    bhvd_lp_ring_params p{};
    p.process_set_id = buckets_.process_set_id;
    p.hierarchical = hierarchical_ ? 1 : 0;
    p.device = -1;
    p.num_buckets = static_cast<int32_t>(nb);
    p.buckets = specs.data();
    p.weights = x.weights.data();
    p.op_timeout_s = EnvSeconds("BAGUA_HVD_OP_TIMEOUT_SECONDS", 0.0);
    p.wait_warning_s = EnvSeconds("BAGUA_HVD_WAIT_WARNING_SECONDS", 60.0);
    int64_t id = 0;
    OP_REQUIRES_OK(ctx, CoreStatus(bhvd_lp_ring_start(&p, &id)));
    ring->id = id;
    ring->job = job;
    ring->replicas = std::move(replicas);  // the core writes into them until it is released
    ring->diffs = std::move(diffs);
  }

 private:
  BucketAttrs buckets_;  // names: the initialisations'
  std::vector<std::string> step_names_, exchange_names_;
  std::string key_;
  bool hierarchical_ = false;
};

// BaguaHvdLpStep: low-precision decentralized, after a communicating step's update: the core's
// ring step (split, its exchange left in flight, or whole, as the core decides for the job) on
// the variables' buffers in place, held exclusively for the call. The inputs are the weights'
// resource variables: read, and written with the new weights.
class BaguaHvdLpStepOp : public OpKernel {
 public:
  explicit BaguaHvdLpStepOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("bucket_sizes", &buckets_.sizes));
  }

  void Compute(OpKernelContext* ctx) override {
    auto ring = Store::Get().Find(Store::Get().rings, key_);
    std::lock_guard<std::mutex> lock(ring->mu);
    if (ring->id == 0) return;  // nothing to average with yet (the engine's replicas: None)
    OP_REQUIRES(ctx, ring->replicas.size() == buckets_.sizes.size(),
                absl::InvalidArgumentError("bagua_hvd: the low-precision layout changed"));
    Variables vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, ctx->num_inputs(), &vars));
    LpWeights x;
    OP_REQUIRES_OK(ctx, x.Take(vars, buckets_));
    const int32_t nb = static_cast<int32_t>(x.weights.size());
    OP_REQUIRES_OK(ctx, CoreStatus(bhvd_lp_ring_step(ring->id, x.weights.data(), nb, nullptr)));
  }

 private:
  BucketAttrs buckets_;  // sizes only
  std::string key_;
};

// BaguaHvdLpFlush: waits for the exchanges of the ring of `key` still in flight (their failure
// fails the op) and every other ring's.
class BaguaHvdLpFlushOp : public OpKernel {
 public:
  explicit BaguaHvdLpFlushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto ring = Store::Get().Find(Store::Get().rings, key_);
    std::lock_guard<std::mutex> lock(ring->mu);
    OP_REQUIRES_OK(ctx, CoreStatus(bhvd_lp_ring_flush(ring->id)));
  }

 private:
  std::string key_;
};

// BaguaHvdLpReplicas: copies of bucket `bucket`'s replicas (self, left, right) of the ring of
// `key` (tests, impl.replicas).
class BaguaHvdLpReplicasOp : public OpKernel {
 public:
  explicit BaguaHvdLpReplicasOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto ring = Store::Get().Find(Store::Get().rings, key_);
    std::lock_guard<std::mutex> lock(ring->mu);
    OP_REQUIRES(ctx, ring->id != 0 && bucket_ >= 0 && bucket_ < int(ring->replicas.size()),
                absl::InvalidArgumentError("bagua_hvd: no such low-precision replica"));
    for (int k = 0; k < 3; ++k) {
      const Tensor& rep = ring->replicas[bucket_][k];
      OP_REQUIRES(ctx, rep.dtype() == ctx->expected_output_dtype(k),
                  absl::InvalidArgumentError("bagua_hvd: replica dtype mismatch"));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(k, rep.shape(), &out));
      if (rep.NumElements() > 0) {
        std::memcpy(Data(*out), rep.tensor_data().data(), rep.tensor_data().size());
      }
    }
  }

 private:
  std::string key_;
  int bucket_ = 0;
};

// BaguaHvdAsyncStep: asynchronous model averaging after an update (past the warm-up): starts the
// core's averager over copies of the weight buckets (name: name_prefix + "." + generation), or
// copies the weights into its buffers; then a step boundary (bhvd_async_step); a merged round
// is written into the weights' resource variables (the inputs). Nothing runs while aborted.
class BaguaHvdAsyncStepOp : public OpKernel {
 public:
  explicit BaguaHvdAsyncStepOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("bucket_sizes", &buckets_.sizes));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &buckets_.process_set_id));
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("name_prefix", &prefix_));
    OP_REQUIRES_OK(c, c->GetAttr("interval_ms", &interval_ms_));
  }

  void Compute(OpKernelContext* ctx) override {
    Store& store = Store::Get();
    auto av = store.Find(store.averagers, key_);
    int64_t job = 0;
    {
      std::lock_guard<std::mutex> lock(store.mu);
      job = store.job;
    }
    std::lock_guard<std::mutex> lock(av->mu);
    if (av->job != job) {  // the old job's averager ended with it (the core's shutdown)
      av->id = 0;
      av->buffers.clear();
      av->generation = 0;
      av->job = job;
    }
    Variables vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, ctx->num_inputs(), &vars));
    const size_t nb = buckets_.sizes.size();
    bool merged = false;
    if (!av->aborted) {
      if (av->id == 0) {
        std::vector<Tensor> flats(nb);
        for (size_t b = 0; b < nb; ++b) {
          OP_REQUIRES_OK(ctx,
                         PackVariables(vars, buckets_.first(b), buckets_.sizes[b], &flats[b]));
        }
        std::vector<std::unique_ptr<View>> views;
        std::vector<bhvd_tensor> descs;
        for (size_t b = 0; b < nb; ++b) {
          int32_t dtype = 0;
          OP_REQUIRES_OK(ctx, CoreDtype(flats[b].dtype(), &dtype));
          views.push_back(std::make_unique<View>(flats[b], dtype));
          descs.push_back(views.back()->desc);
        }
        // The same name on every rank, a worker that just joined included: the elastic
        // generation (BAGUA_HVD_ELASTIC_GENERATION, 0 outside elastic jobs) and the restarts
        // within it (the engine's AsyncAveraging names its averagers alike).
        const char* elastic = std::getenv("BAGUA_HVD_ELASTIC_GENERATION");
        const std::string name = prefix_ + "." + (elastic && *elastic ? elastic : "0") + "." +
                                 std::to_string(av->generation);
        int64_t id = 0;
        const int rc = bhvd_async_start(name.c_str(), descs.data(), static_cast<int32_t>(nb),
                                        /*device=*/-1, buckets_.process_set_id, interval_ms_, &id);
        OP_REQUIRES(ctx, rc == BHVD_OK, absl::Status(ToCode(rc), bhvd_last_error()));
        av->id = id;
        av->buffers = std::move(flats);
      } else {
        OP_REQUIRES(ctx, av->buffers.size() == nb,
                    absl::InternalError("bagua_hvd: asynchronous averaging layout changed"));
        for (size_t b = 0; b < nb; ++b) {  // staged weights: copied in (the same buffers)
          const int64_t n = av->buffers[b].NumElements();
          OP_REQUIRES_OK(
              ctx, PackVariables(vars, buckets_.first(b), buckets_.sizes[b], &av->buffers[b]));
          OP_REQUIRES(ctx, av->buffers[b].NumElements() == n,
                      absl::InternalError("bagua_hvd: asynchronous averaging layout changed"));
        }
      }
      const int64_t before = bhvd_async_rounds(av->id);
      const int rc = bhvd_async_step(av->id, /*stream=*/nullptr);
      OP_REQUIRES(ctx, rc == BHVD_OK, absl::Status(ToCode(rc), bhvd_last_error()));
      merged = bhvd_async_rounds(av->id) != before;
    }
    for (size_t b = 0; b < nb && merged; ++b) {  // the merged round, into the variables
      OP_REQUIRES_OK(ctx,
                     WriteVariables(vars, buckets_.first(b), buckets_.sizes[b], av->buffers[b]));
    }
  }

 private:
  BucketAttrs buckets_;
  std::string key_, prefix_;
  int64_t interval_ms_ = 0;
};

// BaguaHvdAsyncControl: mode 0: abort (stops the rounds on every rank, waits for this rank's,
// releases the averager); 1: resume (the next step starts a new generation); 2: rounds merged;
// 3: the core's averager id (0: none runs).
class BaguaHvdAsyncControlOp : public OpKernel {
 public:
  explicit BaguaHvdAsyncControlOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("mode", &mode_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto av = Store::Get().Find(Store::Get().averagers, key_);
    std::lock_guard<std::mutex> lock(av->mu);
    int64_t result = 0;
    if (mode_ == 0) {
      av->aborted = true;
      if (av->id != 0) {
        const int status = bhvd_async_abort(av->id, -1);
        const std::string message = bhvd_last_error();
        bhvd_async_release(av->id);
        av->id = 0;
        av->buffers.clear();
        OP_REQUIRES(ctx, status == BHVD_OK || status == BHVD_ABORTED,
                    absl::Status(ToCode(status), message));
      }
    } else if (mode_ == 1) {
      if (av->aborted) {
        av->aborted = false;
        ++av->generation;
      }
    } else if (mode_ == 2) {
      result = av->id != 0 ? bhvd_async_rounds(av->id) : 0;
    } else {
      result = av->id;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));
    out->scalar<int64_t>()() = result;
  }

 private:
  std::string key_;
  int mode_ = 0;
};

// BaguaHvdNewJob: an elastic reset formed a new job (called eagerly after the frontend's init):
// the implementations' state made for the old one is renewed at its next use.
class BaguaHvdNewJobOp : public OpKernel {
 public:
  explicit BaguaHvdNewJobOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext*) override {
    Store& store = Store::Get();
    std::lock_guard<std::mutex> lock(store.mu);
    ++store.job;
  }
};

// Shape functions: outputs shaped as the first inputs; no outputs.
absl::Status SameShapes(::tensorflow::shape_inference::InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

absl::Status NoOutputs(::tensorflow::shape_inference::InferenceContext*) {
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("BaguaHvdCollective")
    .Attr("T: list(type)")
    .Input("tensors: T")
    .Output("outputs: T")
    .Attr("op_type: int")
    .Attr("core_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 1")
    .Attr("root_rank: int = 0")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("BaguaHvdReducescatter")
    .Attr("T: list(type)")
    .Input("tensors: T")
    .Output("outputs: T")
    .Attr("core_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnknownShape);

// Output sizes come from the other ranks: unknown here (the Python side sets what it knows).
REGISTER_OP("BaguaHvdAllgather")
    .Attr("T: list(type)")
    .Input("tensors: T")
    .Output("outputs: T")
    .Attr("core_name: string = ''")
    .Attr("process_set_id: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnknownShape);

REGISTER_OP("BaguaHvdAlltoall")
    .Attr("T: type")
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("output: T")
    .Output("received_splits: int32")
    .Attr("core_name: string = ''")
    .Attr("process_set_id: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("BaguaHvdCollective").Device(::tensorflow::DEVICE_CPU),
                        BaguaHvdCollectiveOp);
REGISTER_KERNEL_BUILDER(Name("BaguaHvdReducescatter").Device(::tensorflow::DEVICE_CPU),
                        BaguaHvdCollectiveOp);
REGISTER_KERNEL_BUILDER(Name("BaguaHvdAllgather").Device(::tensorflow::DEVICE_CPU),
                        BaguaHvdCollectiveOp);
REGISTER_KERNEL_BUILDER(Name("BaguaHvdAlltoall").Device(::tensorflow::DEVICE_CPU),
                        BaguaHvdCollectiveOp);

REGISTER_OP("BaguaHvdRaise")
    .Input("code: int32")
    .Input("message: string")
    .SetIsStateful()
    .SetShapeFn(NoOutputs);

REGISTER_KERNEL_BUILDER(Name("BaguaHvdRaise").Device(::tensorflow::DEVICE_CPU), BaguaHvdRaiseOp);

// ---- BAGUA's algorithms ----
REGISTER_OP("BaguaHvdCounter")
    .Input("value: int64")
    .Output("before: int64")
    .Attr("key: string")
    .Attr("counter: string = 'steps'")
    .Attr("mode: int = 0")
    .Attr("message: string = ''")
    .Attr("agree_name: string = ''")
    .Attr("process_set_id: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

REGISTER_OP("BaguaHvdNewJob").SetIsStateful().SetShapeFn(NoOutputs);

REGISTER_OP("BaguaHvdBuckets")
    .Attr("T: list(type)")
    .Input("tensors: T")
    .Input("round: int64")
    .Output("outputs: T")
    .Attr("primitive: int = 0")
    .Attr("bucket_sizes: list(int)")
    .Attr("names: list(string)")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("compressed: bool = false")
    .Attr("hierarchical: bool = false")
    .Attr("error_feedback: bool = false")
    .Attr("peer_mode: int = 0")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("BaguaHvdLpInit")
    .Attr("N: int >= 1")
    .Input("variables: N * resource")
    .Attr("key: string")
    .Attr("bucket_sizes: list(int)")
    .Attr("names: list(string)")
    .Attr("step_names: list(string)")
    .Attr("exchange_names: list(string)")
    .Attr("process_set_id: int = 0")
    .Attr("hierarchical: bool = false")
    .SetIsStateful()
    .SetShapeFn(NoOutputs);

REGISTER_OP("BaguaHvdLpStep")
    .Attr("N: int >= 1")
    .Input("variables: N * resource")
    .Attr("key: string")
    .Attr("bucket_sizes: list(int)")
    .SetIsStateful()
    .SetShapeFn(NoOutputs);

REGISTER_OP("BaguaHvdLpFlush").Attr("key: string").SetIsStateful().SetShapeFn(NoOutputs);

REGISTER_OP("BaguaHvdLpReplicas")
    .Output("own: T")
    .Output("left: T")
    .Output("right: T")
    .Attr("T: type")
    .Attr("key: string")
    .Attr("bucket: int")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnknownShape);

REGISTER_OP("BaguaHvdAsyncStep")
    .Attr("N: int >= 1")
    .Input("variables: N * resource")
    .Attr("key: string")
    .Attr("name_prefix: string")
    .Attr("bucket_sizes: list(int)")
    .Attr("process_set_id: int = 0")
    .Attr("interval_ms: int = 0")
    .SetIsStateful()
    .SetShapeFn(NoOutputs);

REGISTER_OP("BaguaHvdAsyncControl")
    .Output("result: int64")
    .Attr("key: string")
    .Attr("mode: int")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

#define BHVD_CPU_KERNEL(name, cls) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(::tensorflow::DEVICE_CPU), cls)
BHVD_CPU_KERNEL("BaguaHvdCounter", BaguaHvdCounterOp);
BHVD_CPU_KERNEL("BaguaHvdNewJob", BaguaHvdNewJobOp);
BHVD_CPU_KERNEL("BaguaHvdBuckets", BaguaHvdBucketsOp);
BHVD_CPU_KERNEL("BaguaHvdLpInit", BaguaHvdLpInitOp);
BHVD_CPU_KERNEL("BaguaHvdLpStep", BaguaHvdLpStepOp);
BHVD_CPU_KERNEL("BaguaHvdLpFlush", BaguaHvdLpFlushOp);
BHVD_CPU_KERNEL("BaguaHvdLpReplicas", BaguaHvdLpReplicasOp);
BHVD_CPU_KERNEL("BaguaHvdAsyncStep", BaguaHvdAsyncStepOp);
BHVD_CPU_KERNEL("BaguaHvdAsyncControl", BaguaHvdAsyncControlOp);
#undef BHVD_CPU_KERNEL

// GPU builds of TensorFlow: the same kernels for GPU placement, every argument in host memory, so
// TensorFlow stages GPU tensors through the host around them (docs/tensorflow.md) and a graph
// pinned to a GPU needs no soft placement. The algorithms' variable kernels stay on the CPU: they
// read the variables' buffers from the host.
#define BHVD_GPU_HOST_KERNEL(name, cls, ...) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(::tensorflow::DEVICE_GPU) __VA_ARGS__, cls)
BHVD_GPU_HOST_KERNEL("BaguaHvdCollective", BaguaHvdCollectiveOp,
                     .HostMemory("tensors").HostMemory("outputs"));
BHVD_GPU_HOST_KERNEL("BaguaHvdReducescatter", BaguaHvdCollectiveOp,
                     .HostMemory("tensors").HostMemory("outputs"));
BHVD_GPU_HOST_KERNEL("BaguaHvdAllgather", BaguaHvdCollectiveOp,
                     .HostMemory("tensors").HostMemory("outputs"));
BHVD_GPU_HOST_KERNEL("BaguaHvdAlltoall", BaguaHvdCollectiveOp,
                     .HostMemory("tensor").HostMemory("splits").HostMemory("output")
                         .HostMemory("received_splits"));
BHVD_GPU_HOST_KERNEL("BaguaHvdRaise", BaguaHvdRaiseOp, .HostMemory("code").HostMemory("message"));
BHVD_GPU_HOST_KERNEL("BaguaHvdCounter", BaguaHvdCounterOp,
                     .HostMemory("value").HostMemory("before"));
BHVD_GPU_HOST_KERNEL("BaguaHvdBuckets", BaguaHvdBucketsOp,
                     .HostMemory("tensors").HostMemory("round").HostMemory("outputs"));
#undef BHVD_GPU_HOST_KERNEL
