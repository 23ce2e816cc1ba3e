// BAGUA's algorithms, their gradient path: BaguaHvdBuckets (every bucket's allreduce, compressed
// or not, or Decentralized's peer average of the weight buckets), BaguaHvdCounter (an
// implementation's step counts) and BaguaHvdNewJob (an elastic reset). Compiled with kernels.cc
// (kernels.h); bagua_hvd/tensorflow/algorithm_kernels.py drives them.
//
// The Python engine decides, at trace time, the buckets (how many of the op's inputs each one
// takes, in order), their names on the wire, the primitive and its parameters, and when each op
// runs (graph conditions); these kernels pack the buckets, call the core's primitive and unpack
// the results, and keep the state that must outlive a step (kernels.h), keyed by the
// implementation's unique names (docs/tensorflow.md, "How tensors reach the core").
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using namespace bagua_hvd_tf;  // NOLINT: this library's own vocabulary

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

Tensor Zeros(::tensorflow::DataType dtype, int64_t n) {
  Tensor t(dtype, ::tensorflow::TensorShape({n}));
  if (n > 0) std::memset(Data(t), 0, t.tensor_data().size());
  return t;
}

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
        // Sized by the core for the job's compression group. A new layout or job: zeros.
        int64_t worker = 0, server = 0;
        const int rc = bhvd_compression_residuals(buckets_.process_set_id, hierarchical_,
                                                  g->flats[b].NumElements(), &worker, &server);
        OP_REQUIRES_OK_ASYNC(ctx, CoreStatus(rc), done);  // the core's code and message
        const auto dtype = g->flats[b].dtype();
        int64_t job = 0;
        {
          std::lock_guard<std::mutex> lock(store.mu);
          job = store.job;
        }
        if (r->job != job || r->worker.NumElements() != worker || r->worker.dtype() != dtype ||
            r->server.NumElements() != server) {
          r->worker = Zeros(dtype, worker);
          r->server = Zeros(dtype, server);
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

}  // namespace

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

REGISTER_KERNEL_BUILDER(Name("BaguaHvdCounter").Device(::tensorflow::DEVICE_CPU), BaguaHvdCounterOp);
REGISTER_KERNEL_BUILDER(Name("BaguaHvdNewJob").Device(::tensorflow::DEVICE_CPU), BaguaHvdNewJobOp);
REGISTER_KERNEL_BUILDER(Name("BaguaHvdBuckets").Device(::tensorflow::DEVICE_CPU), BaguaHvdBucketsOp);

// GPU builds of TensorFlow: host-memory kernels, as kernels.cc says.
#define BHVD_GPU_HOST_KERNEL(name, cls, ...) \
  REGISTER_KERNEL_BUILDER(Name(name).Device(::tensorflow::DEVICE_GPU) __VA_ARGS__, cls)
BHVD_GPU_HOST_KERNEL("BaguaHvdCounter", BaguaHvdCounterOp,
                     .HostMemory("value").HostMemory("before"));
BHVD_GPU_HOST_KERNEL("BaguaHvdBuckets", BaguaHvdBucketsOp,
                     .HostMemory("tensors").HostMemory("round").HostMemory("outputs"));
#undef BHVD_GPU_HOST_KERNEL
