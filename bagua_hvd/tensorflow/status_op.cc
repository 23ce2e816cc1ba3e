// BaguaHvdRaise(code, message): a TensorFlow op whose only job is to fail with the status the
// collectives computed (bagua_hvd/tensorflow/status_op.py). tf.numpy_function maps every Python
// exception other than ValueError/TypeError/NotImplementedError to UnknownError, so a
// collective inside tf.function hands its status to this op instead, and graph mode raises
// tf.errors.FailedPreconditionError & co. with Horovod's text, as eager mode does. Compiled on
// first use against the installed TensorFlow; no other kernel is needed (the collectives stay
// in the framework-free core).
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;

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

REGISTER_OP("BaguaHvdRaise")
    .Input("code: int32")
    .Input("message: string")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext*) {
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("BaguaHvdRaise").Device(::tensorflow::DEVICE_CPU), BaguaHvdRaiseOp);
