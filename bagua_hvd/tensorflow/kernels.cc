// bagua_hvd's TensorFlow kernels, Horovod's collectives (bagua_hvd/tensorflow/kernels.py builds
// this file with bucket_kernels.cc and weight_kernels.cc, BAGUA's algorithms, into one library on
// first use, against the installed TensorFlow, linked to the package's core library):
//
//  BaguaHvdCollective  allreduce and broadcast (outputs shaped as the inputs),
//  BaguaHvdReducescatter, BaguaHvdAllgather, BaguaHvdAlltoall: one asynchronous kernel that
//                      hands the tensors' buffers to the core (bhvd_enqueue) and returns; the
//                      core's completion callback (bhvd_on_done) ends the op. No Python in the
//                      step. Allreduce/broadcast: an input TensorFlow no longer needs becomes the
//                      output in place; reducescatter: the output holds this rank's rows;
//                      allgather/alltoall: the core's result is copied into an output allocated
//                      once its size is known.
//  BaguaHvdRaise       fails with a status computed by a numpy_function path (every collective
//                      with the kernels off), so that graph mode raises the same tf.errors
//                      classes as eager mode.
//
// The core stays framework-free: this library only calls its C API (c_api.h).
#include "kernels.h"

namespace bagua_hvd_tf {

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

absl::Status EnqueueError(int rc) { return absl::Status(ToCode(rc), bhvd_last_error()); }

absl::Status CoreDtype(::tensorflow::DataType t, int32_t* out) {
  if (ToDtype(t, out)) return absl::OkStatus();
  return absl::InvalidArgumentError("Tensor type " + ::tensorflow::DataTypeString(t) +
                                    " is not supported.");
}

absl::Status CoreStatus(int rc) {
  return rc == BHVD_OK ? absl::OkStatus() : absl::Status(ToCode(rc), bhvd_last_error());
}

absl::Status Enqueue(const bhvd_request& r, int64_t* handle) {
  const int rc = bhvd_enqueue(&r, handle);
  return rc == BHVD_OK ? absl::OkStatus() : EnqueueError(rc);
}

absl::Status HandleError(int64_t handle, int32_t status, const std::string& name) {
  std::string message = bhvd_handle_error(handle);
  if (message.empty()) message = name + " failed";
  return absl::Status(ToCode(status), message);
}

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

absl::Status SameShapes(::tensorflow::shape_inference::InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

absl::Status NoOutputs(::tensorflow::shape_inference::InferenceContext*) {
  return absl::OkStatus();
}

}  // namespace bagua_hvd_tf

namespace {

using namespace bagua_hvd_tf;  // NOLINT: this library's own vocabulary

// One collective in flight. Owns references to its tensors, so their buffers outlive the core's
// use of them even when the step has already failed with a timeout.
struct InFlight : Watched {
  int32_t op_type = 0;
  int num_tensors = 0;
  std::vector<Tensor> tensors;  // inputs and outputs
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
#undef BHVD_GPU_HOST_KERNEL
