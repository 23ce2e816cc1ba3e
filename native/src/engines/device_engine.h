// The data engine of a CUDA device (engines/cuda_engine.cu): CUDA tensors stay on the device.
// Horovod's collectives run through NCCL (engines/nccl_library.h) on the engine's own stream, and
// so do ByteGrad's compressed allreduce and the peer averages (the CUDA kernels between NCCL
// exchanges, collectives/stream_backend.h), and the low-precision ring; what NCCL cannot serve
// (NCCL missing, ranks sharing a device, which NCCL refuses, dtypes NCCL has no type for, unequal
// reducescatter shares) is staged through pinned host memory and the CPU engine, on the same stream
// order. Ordering with the frontend's streams is by events: the engine's stream waits for the event
// recorded on the caller's stream at enqueue, and at synchronize the caller's stream waits for the
// event recorded after the op (as Horovod and DDP do), so no host thread blocks on a GPU in the
// NCCL path.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engines/fusion_buffer.h"
#include "engines/stream_engine.h"

namespace bagua_hvd {

// A recorded CUDA event (null: nothing to wait for). Shared by the entries of a
// request and the handle that waits for it.
using DeviceEvent = std::shared_ptr<void>;

class DeviceEngine : public StreamEngine {
 public:
  virtual int device() const = 0;
  // "NCCL 2.27.3" or "host staging (<why NCCL is not used>)", for the log and
  // the tests.
  virtual std::string path() const = 0;

  // Frontend thread: an event on the caller's stream (null: the legacy default
  // stream).
  virtual DeviceEvent record(void* stream) = 0;
  // Background thread: the engine's stream waits for `ready` before the op
  // reads its inputs.
  virtual void wait(const DeviceEvent& ready) = 0;
  // Background thread: an event after everything enqueued so far on the
  // engine's stream, which ends the operation that waited for `inputs` (their
  // events).
  virtual DeviceEvent done(std::vector<DeviceEvent> inputs) = 0;
  // Frontend thread: `stream` (the caller's) waits for `ev`.
  virtual void stream_wait(void* stream, const DeviceEvent& ev) = 0;
  // Whether `ev` has completed (no blocking).
  virtual bool completed(const DeviceEvent& ev) = 0;
  // The stall check (background thread): true when the oldest operation still
  // running on the device has had its inputs ready for timeout_s without
  // completing (a peer that never joined an NCCL call; time spent waiting for
  // the callers' streams does not count); the caller then aborts the
  // communicators and fails the job, so nothing waits forever.
  virtual bool stalled(double timeout_s) = 0;
  // The fused responses' buffer, on the device.
  virtual FusionBuffer& fusion() = 0;
  // Synchronous copies between host memory and this device (core-allocated
  // outputs).
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  // Frontend thread: queues the copy of a device output of this engine into
  // dst on `stream` (the caller's, which already waits for the operation);
  // the output's memory is freed only after that copy.
  virtual void copy_output(void* dst, const Output& out, void* stream) = 0;
  // Asynchronous model averaging of weights on this device
  // (core/async_average.cc): a stream of the caller's own (destroyed with the
  // pointer), device memory (cudaMalloc'd), a copy and the merge
  // x = (x + sum / n) - snapshot (the host path's rounding) queued on `stream`.
  virtual std::shared_ptr<void> make_stream() = 0;
  virtual std::shared_ptr<void> device_memory(size_t bytes) = 0;
  virtual void copy_on(void* dst, const void* src, size_t bytes, void* stream) = 0;
  virtual void async_merge(void* x, const void* sum, const void* snapshot, size_t n,
                           DataType dtype, int set_size, void* stream) = 0;
  // Frontend thread: the low-precision ring's local half (lp_decentralized_local_phased) queued
  // on the engine's stream after the work `stream` (the caller's) has queued so far, and
  // `stream` waiting for it; work: count elements of device memory of the caller's. The split
  // step's exchange, enqueued next with the same stream, follows it.
  virtual void lp_local(void* x, void* self, const void* left, const void* right, size_t count,
                        DataType dtype, uint8_t* c, void* work, void* stream) = 0;
  // Destroys the NCCL communicators once the engine's stream has drained, or
  // aborts them when it has not within wait_s (a peer gone mid-operation); the
  // next op of a set creates anew.
  virtual void release_communicators(double wait_s) = 0;
};

// The engine of CUDA device `device`, created on first use and kept for the
// process's life; null with *why in a build without CUDA or where the device
// cannot be used. Thread-safe. NCCL is the one load_nccl() loaded (the
// frontends load it at hvd.init()), else none.
DeviceEngine* device_engine(int device, std::string* why);
// release_communicators(wait_s) of every engine created so far (hvd.shutdown();
// 0 after a stall: abort at once).
void release_device_communicators(double wait_s);
// Whether some engine's device stalled (DeviceEngine::stalled); cheap when none
// exists.
bool device_engines_stalled(double timeout_s);
// Whether this build runs collectives on CUDA memory (compiled with nvcc).
bool device_engines_built();

// Calls of the device engines so far (bhvd_stat "nccl_calls",
// "device_staged_calls"), and the bytes staged calls copied between the device and host memory,
// both ways ("device_staged_bytes").
struct DeviceStats {
  std::atomic<int64_t> nccl_calls{0};
  std::atomic<int64_t> staged_calls{0};
  std::atomic<int64_t> staged_bytes{0};
};
DeviceStats& device_stats();

}  // namespace bagua_hvd
