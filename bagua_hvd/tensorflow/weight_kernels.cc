// BAGUA's algorithms that act on the weights, through the core: the low-precision decentralized
// ring (BaguaHvdLpInit/LpStep/LpFlush/LpReplicas over bhvd_lp_ring_*) and asynchronous model
// averaging (BaguaHvdAsyncStep/AsyncControl over bhvd_async_impl_*). The inputs are the weights'
// resource variables. Compiled with kernels.cc (kernels.h); bagua_hvd/tensorflow/
// algorithm_kernels.py drives them.
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using namespace bagua_hvd_tf;  // NOLINT: this library's own vocabulary

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

// The core's implementation of `av` (made at first use); av->mu held.
absl::Status AsyncImpl(Averager* av) {
  return av->impl != 0 ? absl::OkStatus() : CoreStatus(bhvd_async_impl_create(&av->impl));
}

// BaguaHvdAsyncStep: asynchronous model averaging after an update (past the warm-up): the weight
// buckets are packed into the buffers the core's averager runs over (new ones where none runs:
// the core starts one over them, named after name_prefix), then the core's step boundary; a
// merged round is written into the weights' resource variables (the inputs).
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
    auto av = Store::Get().Find(Store::Get().averagers, key_);
    std::lock_guard<std::mutex> lock(av->mu);
    Variables vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, ctx->num_inputs(), &vars));
    bhvd_async_impl_info info{};
    OP_REQUIRES_OK(ctx, AsyncImpl(av.get()));
    OP_REQUIRES_OK(ctx, CoreStatus(bhvd_async_impl_state(av->impl, &info)));
    if (info.aborted) return;
    const size_t nb = buckets_.sizes.size();
    if (info.averager == 0) av->buffers.assign(nb, Tensor());
    const auto changed = absl::InternalError("bagua_hvd: asynchronous averaging layout changed");
    OP_REQUIRES(ctx, av->buffers.size() == nb, changed);
    std::vector<std::unique_ptr<View>> views;
    std::vector<bhvd_tensor> descs;
    for (size_t b = 0; b < nb; ++b) {
      const int64_t n = av->buffers[b].NumElements();
      OP_REQUIRES_OK(ctx,
                     PackVariables(vars, buckets_.first(b), buckets_.sizes[b], &av->buffers[b]));
      OP_REQUIRES(ctx, info.averager == 0 || av->buffers[b].NumElements() == n, changed);
      int32_t dtype = 0;
      OP_REQUIRES_OK(ctx, CoreDtype(av->buffers[b].dtype(), &dtype));
      views.push_back(std::make_unique<View>(av->buffers[b], dtype));
      descs.push_back(views.back()->desc);
    }
    bhvd_async_impl_step_args a{};
    a.name_prefix = prefix_.c_str();
    a.process_set_id = buckets_.process_set_id;
    a.interval_ms = interval_ms_;
    a.device = -1;
    a.num_tensors = static_cast<int32_t>(nb);
    a.weights = descs.data();
    int32_t merged = 0;
    OP_REQUIRES_OK(ctx, CoreStatus(bhvd_async_impl_step(av->impl, &a, &merged)));
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
// releases the averager); 1: resume (the next step starts a new averager, under the next
// restart's name); 2: rounds merged; 3: the core's averager id (0: none runs).
class BaguaHvdAsyncControlOp : public OpKernel {
 public:
  explicit BaguaHvdAsyncControlOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("mode", &mode_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto av = Store::Get().Find(Store::Get().averagers, key_);
    std::lock_guard<std::mutex> lock(av->mu);
    OP_REQUIRES_OK(ctx, AsyncImpl(av.get()));
    bhvd_async_impl_info info{};
    if (mode_ == 0) {
      OP_REQUIRES_OK(ctx, CoreStatus(bhvd_async_impl_abort(av->impl)));
      av->buffers.clear();  // the core no longer writes into them
    } else if (mode_ == 1) {
      OP_REQUIRES_OK(ctx, CoreStatus(bhvd_async_impl_resume(av->impl)));
    } else {
      OP_REQUIRES_OK(ctx, CoreStatus(bhvd_async_impl_state(av->impl, &info)));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));
    out->scalar<int64_t>()() = mode_ == 2 ? info.rounds : info.averager;
  }

 private:
  std::string key_;
  int mode_ = 0;
};

}  // namespace

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
BHVD_CPU_KERNEL("BaguaHvdLpInit", BaguaHvdLpInitOp);
BHVD_CPU_KERNEL("BaguaHvdLpStep", BaguaHvdLpStepOp);
BHVD_CPU_KERNEL("BaguaHvdLpFlush", BaguaHvdLpFlushOp);
BHVD_CPU_KERNEL("BaguaHvdLpReplicas", BaguaHvdLpReplicasOp);
BHVD_CPU_KERNEL("BaguaHvdAsyncStep", BaguaHvdAsyncStepOp);
BHVD_CPU_KERNEL("BaguaHvdAsyncControl", BaguaHvdAsyncControlOp);
#undef BHVD_CPU_KERNEL
