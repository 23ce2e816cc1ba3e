// Handles (what a frontend waits on), entries (one tensor of a handle, pending in the runtime's
// table until its response has run) and core-allocated outputs. Shared by the runtime, the op
// executors and the data engines (which allocate the outputs).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "base/common.h"
#include "requests/message.h"

namespace bagua_hvd {

// A core-allocated output (allgather, alltoall) that the frontend copies out (bhvd_output_copy):
// host memory, or memory of the CUDA device that wrote it (freed in the order of that device
// engine's stream, after the copy).
struct Output {
  std::shared_ptr<void> data;
  size_t bytes = 0;
  int device = -1;
};

struct Handle {
  int64_t id = 0;
  int remaining = 0;  // tensors not yet finished
  bool done = false;
  bool seen = false;  // its caller has seen it complete (poll, wait, callback) or released it
  bool urgent = false;
  Status status;
  std::vector<std::string> names;
  // Core-allocated outputs (allgather, alltoall) and their shapes.
  std::vector<Output> outputs;
  std::vector<std::vector<int64_t>> output_shapes;
  std::vector<int32_t> received_splits;
  int32_t result = -1;  // join: last joined rank; add process set: new id
  // CUDA tensors: this rank's device, and the event after the operation on the device engine's
  // stream (the caller's stream waits on it: bhvd_handle_stream_wait).
  int32_t device = -1;
  std::shared_ptr<void> done_event;
  std::condition_variable cv;
  // Set by on_done(): run once, outside the runtime's lock, when the handle completes.
  std::function<void(const Status&)> on_done;
};

// This rank's state buffers of BAGUA's primitives (c_api.h's bhvd_*_params), never negotiated.
struct Residuals {  // BHVD_OP_COMPRESSED_ALLREDUCE's error feedback; null without it
  void* worker = nullptr;
  void* server = nullptr;
  int group = 0;  // the ranks of the compressed exchange they are sized for (residual_sizes)
};
struct Replicas {  // the low-precision ring's replicas (INIT and STEP: self too; EXCHANGE: not)
  void* self = nullptr;
  void* left = nullptr;
  void* right = nullptr;
  size_t count = 0;  // elements of each
  DataType dtype = DataType::FLOAT32;
};
using StateBuffers = std::variant<std::monostate, Residuals, Replicas>;

// One tensor of a handle, waiting for its response.
struct Entry {
  std::shared_ptr<Handle> handle;
  int index = 0;
  Request request;
  const void* input = nullptr;
  void* output = nullptr;
  StateBuffers state;
  // CUDA tensors: the event recorded on the caller's stream at enqueue (the inputs are ready
  // once it has completed).
  std::shared_ptr<void> ready;
};

}  // namespace bagua_hvd
