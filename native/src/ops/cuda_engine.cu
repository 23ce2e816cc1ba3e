// The data engine of a CUDA device (ops/device_engine.h). Built with nvcc only;
// builds without it have ops/device_engine_none.cc. The host code calls the
// CUDA runtime (linked statically, as the compression kernels are) and NCCL
// through its loaded function table.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "compression/minmax_uint8.h"
#include "device/nccl_library.h"
#include "float_bits.h"
#include "ops/device_engine.h"

namespace bagua_hvd {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Makes `device` current for a scope and restores the caller's device: the
// frontend thread's current device belongs to the framework.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    device_ = device;
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int device_ = -1;
};

// ---- scaling, with the CPU engine's semantics bit for bit (collectives/reduce.cc) ----
// 8- to 32-bit integers (int64: below): in double, truncated, saturated; NaN becomes 0.
template <typename T>
__global__ void scale_int_kernel(T* p, size_t n, double f, double lo, double hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x) {
    double v = static_cast<double>(p[i]) * f;
    v = v != v ? 0.0 : v;
    p[i] = static_cast<T>(v > hi ? hi : (v < lo ? lo : v));
  }
}
// int64: hi (2^63) does not fit; saturate to the maximum explicitly.
__global__ void scale_i64_kernel(int64_t* p, size_t n, double f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x) {
    double v = static_cast<double>(p[i]) * f;
    v = v != v ? 0.0 : v;
    p[i] = v >= 9223372036854775808.0
               ? INT64_MAX
               : (v <= -9223372036854775808.0 ? INT64_MIN : static_cast<int64_t>(v));
  }
}
__global__ void scale_f32_kernel(float* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = __fmul_rn(p[i], f);
}
__global__ void scale_f64_kernel(double* p, size_t n, double f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = __dmul_rn(p[i], f);
}
__global__ void scale_f16_kernel(uint16_t* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = fbits::float_to_half(__fmul_rn(fbits::half_to_float(p[i]), f));
}
__global__ void scale_bf16_kernel(uint16_t* p, size_t n, float f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = fbits::float_to_bf16(__fmul_rn(fbits::bf16_to_float(p[i]), f));
}
__global__ void scale_bool_kernel(uint8_t* p, size_t n, bool keep) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    p[i] = static_cast<uint8_t>(p[i] != 0 && keep);
}

template <typename T>
void launch_scale_int(void* buf, size_t n, double f, cudaStream_t s, unsigned blocks) {
  scale_int_kernel<T><<<blocks, 256, 0, s>>>(static_cast<T*>(buf), n, f,
                                             static_cast<double>(std::numeric_limits<T>::min()),
                                             static_cast<double>(std::numeric_limits<T>::max()));
}

void launch_scale(void* buf, size_t n, DataType dtype, double f, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 4096));
  switch (dtype) {
    case DataType::UINT8:
      launch_scale_int<uint8_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT8:
      launch_scale_int<int8_t>(buf, n, f, s, blocks);
      break;
    case DataType::UINT16:
      launch_scale_int<uint16_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT16:
      launch_scale_int<int16_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT32:
      launch_scale_int<int32_t>(buf, n, f, s, blocks);
      break;
    case DataType::INT64:
      scale_i64_kernel<<<blocks, 256, 0, s>>>(static_cast<int64_t*>(buf), n, f);
      break;
    // Horovod scales float tensors in their own precision, the factor rounded to
    // float.
    case DataType::FLOAT32:
      scale_f32_kernel<<<blocks, 256, 0, s>>>(static_cast<float*>(buf), n, static_cast<float>(f));
      break;
    case DataType::FLOAT64:
      scale_f64_kernel<<<blocks, 256, 0, s>>>(static_cast<double*>(buf), n, f);
      break;
    case DataType::FLOAT16:
      scale_f16_kernel<<<blocks, 256, 0, s>>>(static_cast<uint16_t*>(buf), n,
                                              static_cast<float>(f));
      break;
    case DataType::BFLOAT16:
      scale_bf16_kernel<<<blocks, 256, 0, s>>>(static_cast<uint16_t*>(buf), n,
                                               static_cast<float>(f));
      break;
    case DataType::BOOL:
      scale_bool_kernel<<<blocks, 256, 0, s>>>(static_cast<uint8_t*>(buf), n, f != 0.0);
      break;
  }
  check(cudaGetLastError(), "the scale kernel's launch");
}

DeviceEvent wrap(cudaEvent_t ev) {
  return DeviceEvent(static_cast<void*>(ev),
                     [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

// Device memory, grown on demand (the fused responses' buffer).
class DeviceFusion final : public FusionBuffer {
 public:
  DeviceFusion(std::atomic<int64_t>& stat, int device, cudaStream_t stream)
      : FusionBuffer(stat), device_(device), stream_(stream) {}
  ~DeviceFusion() override { DeviceFusion::release(); }
  unsigned char* get(size_t bytes) override {
    if (bytes > cap_) {
      DeviceGuard g(device_);
      // Work queued on the stream may still read the old buffer.
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      if (buf_) cudaFree(buf_);
      buf_ = nullptr;
      cap_ = 0;
      check(cudaMalloc(&buf_, bytes), "cudaMalloc (the fusion buffer)");
      cap_ = bytes;
    }
    return static_cast<unsigned char*>(buf_);
  }
  void release() override {
    if (!buf_) return;
    DeviceGuard g(device_);
    cudaStreamSynchronize(stream_);
    cudaFree(buf_);
    buf_ = nullptr;
    cap_ = 0;
  }

 private:
  int device_;
  cudaStream_t stream_;
  void* buf_ = nullptr;
  size_t cap_ = 0;
};

// What a communicator of one process set is.
struct SetComm {
  nccl::Comm comm = nullptr;  // null: staged through the host
  std::string why;            // why it is staged
};

class CudaEngine final : public DeviceEngine {
 public:
  explicit CudaEngine(int device) : device_(device) {
    DeviceGuard g(device);
    // Non-blocking: the engine's stream does not wait for the legacy default
    // stream; ordering with the frontends' streams is by events only.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    fusion_ = std::make_unique<DeviceFusion>(fusion_stat_, device, stream_);
    nccl_ = loaded_nccl();
    if (!nccl_) nccl_ = load_nccl("", "", &nccl_why_);
  }
  ~CudaEngine() override {
    // Process exit: the driver may be gone already; free nothing it owns.
  }

  const char* name() const override { return nccl_ ? "NCCL" : "CUDA host staging"; }
  int device() const override { return device_; }
  std::string path() const override {
    return nccl_ ? "NCCL " + nccl_version_text(nccl_->version) : "host staging (" + nccl_why_ + ")";
  }

  // ---- events ----
  DeviceEvent record(void* stream) override {
    DeviceGuard g(device_);
    cudaEvent_t ev;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    DeviceEvent out = wrap(ev);
    check(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
    return out;
  }
  void wait(const DeviceEvent& ready) override {
    if (!ready) return;
    check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ready.get()), 0),
          "cudaStreamWaitEvent");
  }
  DeviceEvent done(std::vector<DeviceEvent> inputs) override {
    DeviceEvent ev = record(stream_);
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.push_back({ev, std::move(inputs)});
    return ev;
  }
  bool stalled(double timeout_s) override {
    std::lock_guard<std::mutex> lock(pending_mu_);
    while (!pending_.empty() && completed(pending_.front().done)) {
      pending_.pop_front();
      ready_since_ = Clock::time_point{};
    }
    if (pending_.empty()) return false;
    if (ready_since_ == Clock::time_point{}) {
      const auto& in = pending_.front().inputs;
      if (!std::all_of(in.begin(), in.end(), [&](const DeviceEvent& e) { return completed(e); }))
        return false;
      ready_since_ = Clock::now();  // the head's inputs are ready: its own time starts
    }
    return seconds_since(ready_since_) > timeout_s;
  }
  void stream_wait(void* stream, const DeviceEvent& ev) override {
    if (!ev) return;
    DeviceGuard g(device_);
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ev.get()),
                              0),
          "cudaStreamWaitEvent");
  }
  bool completed(const DeviceEvent& ev) override {
    return !ev || cudaEventQuery(static_cast<cudaEvent_t>(ev.get())) != cudaErrorNotReady;
  }
  FusionBuffer& fusion() override { return *fusion_; }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    DeviceGuard g(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }
  void release_communicators(double wait_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (comms_.empty()) return;
    DeviceGuard g(device_);
    const auto deadline = Clock::now() + std::chrono::duration<double>(wait_s);
    cudaError_t e;
    while ((e = cudaStreamQuery(stream_)) == cudaErrorNotReady && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const bool drained = e == cudaSuccess;
    for (auto& kv : comms_) {
      if (!kv.second.comm) continue;
      if (drained)
        nccl_->comm_destroy(kv.second.comm);
      else
        nccl_->comm_abort(kv.second.comm);
    }
    if (!drained)
      log_message(LogLevel::WARNING, "NCCL operations still running at shutdown were aborted");
    comms_.clear();
  }

  // ---- local memory ----
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return;
    DeviceGuard g(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }
  void zero(void* dst, size_t bytes) override {
    if (!bytes) return;
    DeviceGuard g(device_);
    check(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync");
  }
  void scale(void* buf, size_t count, DataType dtype, double factor) override {
    if (!count || factor == 1.0) return;
    DeviceGuard g(device_);
    launch_scale(buf, count, dtype, factor, stream_);
  }

  // ---- Horovod's collectives ----
  void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) override {
    DeviceGuard g(device_);
    nccl::DataType t;
    nccl::RedOp o;
    SetComm& sc = set_comm(comm);
    if (sc.comm && nccl::data_type(dtype, &t) && nccl::red_op(op, &o)) {
      if (count) nccl_call(nccl_->all_reduce(buf, buf, count, t, o, sc.comm, stream_), sc.comm);
      return;
    }
    Staging s(*this, {{buf, count * dtype_size(dtype), true}});
    cpu_engine().allreduce(comm, s.host(0), count, dtype, op);
    s.to_device();
  }
  void allgatherv(Comm& comm, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    // `out` is host memory (the core allocates allgather's outputs): the input
    // is staged.
    DeviceGuard g(device_);
    const size_t mine = comm.rank() >= 0 ? bytes_per_rank[comm.rank()] : 0;
    Staging s(*this, {{in, mine, false}});
    cpu_engine().allgatherv(comm, s.host(0), out, bytes_per_rank);
  }
  void broadcast(Comm& comm, void* buf, size_t bytes, int root) override {
    DeviceGuard g(device_);
    SetComm& sc = set_comm(comm);
    if (sc.comm) {
      if (bytes)
        nccl_call(nccl_->broadcast(buf, buf, bytes, nccl::kUint8, root, sc.comm, stream_), sc.comm);
      return;
    }
    Staging s(*this, {{buf, bytes, true}});
    cpu_engine().broadcast(comm, s.host(0), bytes, root);
    s.to_device();
  }
  void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
                 const std::vector<size_t>& recv_bytes) override {
    // `out` is host memory (core-allocated): the input is staged.
    DeviceGuard g(device_);
    size_t total = 0;
    for (size_t b : send_bytes) total += b;
    Staging s(*this, {{in, total, false}});
    cpu_engine().alltoallv(comm, s.host(0), send_bytes, out, recv_bytes);
  }
  void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op) override {
    DeviceGuard g(device_);
    nccl::DataType t;
    nccl::RedOp o;
    SetComm& sc = set_comm(comm);
    const bool even =
        std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; });
    if (sc.comm && even && nccl::data_type(dtype, &t) && nccl::red_op(op, &o)) {
      if (counts[0])
        nccl_call(nccl_->reduce_scatter(buf, out, counts[0], t, o, sc.comm, stream_), sc.comm);
      return;
    }
    size_t total = 0;
    for (size_t c : counts) total += c;
    const size_t es = dtype_size(dtype);
    Staging s(*this, {{buf, total * es, false}, {out, counts[comm.rank()] * es, true}});
    cpu_engine().reducescatterv(comm, s.host(0), s.host(1), counts, dtype, op);
    s.to_device();
  }
  void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                              DataType dtype, ReduceOp op) override {
    // NCCL finds the topology itself (NVLink within a host, the network
    // across).
    allreduce(comm, buf, count, dtype, op);
  }

  // ---- BAGUA's primitives: through the host for now (the CPU engine's results, bit for bit) ----
  void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                              void* ef_worker, void* ef_server) override {
    DeviceGuard g(device_);
    const size_t es = dtype_size(dtype), n = static_cast<size_t>(comm.size());
    const size_t chunk = (count + n - 1) / n;
    Staging s(*this, {{buf, count * es, true},
                      {ef_worker, chunk * n * es, true},
                      {ef_server, chunk * es, true}});
    cpu_engine().allreduce_minmax_uint8(comm, s.host(0), count, dtype, average, s.host(1),
                                        s.host(2));
    s.to_device();
  }
  void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                             PeerMode mode, int64_t step) override {
    DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    const bool same = in == out;
    Staging s(*this, {{in, bytes, same}, {same ? nullptr : out, bytes, true}});
    cpu_engine().decentralized_average(comm, s.host(0), same ? s.host(0) : s.host(1), count, dtype,
                                       mode, step);
    s.to_device();
  }
  void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                        DataType dtype) override {
    DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    Staging s(*this,
              {{x, bytes, true}, {self, bytes, true}, {left, bytes, true}, {right, bytes, true}});
    cpu_engine().lp_decentralized(comm, s.host(0), s.host(1), s.host(2), s.host(3), count, dtype);
    s.to_device();
  }
  void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype) override {
    DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    Staging s(*this,
              {{x, bytes, false}, {self, bytes, true}, {left, bytes, true}, {right, bytes, true}});
    cpu_engine().lp_decentralized_init(comm, s.host(0), s.host(1), s.host(2), s.host(3), count,
                                       dtype);
    s.to_device();
  }
  void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                 size_t count, DataType dtype) override {
    DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    Staging s(*this, {{c, minmax_uint8_bytes(dtype, count, 1), false},
                      {left, bytes, true},
                      {right, bytes, true}});
    cpu_engine().lp_decentralized_exchange(comm, static_cast<const uint8_t*>(s.host(0)), s.host(1),
                                           s.host(2), count, dtype);
    s.to_device();
  }

 private:
  // Buffers copied to pinned host memory for one staged call, and the ones
  // copied back. The engine's one pinned area is reused: every staged call
  // synchronises the stream before the host touches it, so the previous call's
  // copies back have completed by then.
  struct Part {
    const void* dev;  // null: none (its host pointer is null too)
    size_t bytes;
    bool back;  // copied back to the device after the call
  };
  class Staging {
   public:
    Staging(CudaEngine& e, std::initializer_list<Part> parts) : e_(e), parts_(parts) {
      device_stats().staged_calls++;
      std::vector<size_t> offsets;
      size_t size = 0;
      for (const auto& p : parts_) {
        offsets.push_back(size);
        size += (p.bytes + 255) / 256 * 256;
      }
      unsigned char* area = e_.pinned(size);
      for (size_t i = 0; i < parts_.size(); ++i) {
        const Part& p = parts_[i];
        host_.push_back(p.dev ? area + offsets[i] : nullptr);
        if (p.dev && p.bytes)
          check(cudaMemcpyAsync(host_[i], p.dev, p.bytes, cudaMemcpyDefault, e_.stream_),
                "cudaMemcpyAsync (to the host)");
      }
      check(cudaStreamSynchronize(e_.stream_), "cudaStreamSynchronize");
    }
    void* host(size_t i) const { return host_[i]; }
    // Queues the copies back (after the host call; the stream orders later work
    // after them).
    void to_device() {
      for (size_t i = 0; i < parts_.size(); ++i) {
        const Part& p = parts_[i];
        if (p.dev && p.back && p.bytes)
          check(cudaMemcpyAsync(const_cast<void*>(p.dev), host_[i], p.bytes, cudaMemcpyDefault,
                                e_.stream_),
                "cudaMemcpyAsync (to the device)");
      }
    }

   private:
    CudaEngine& e_;
    std::vector<Part> parts_;
    std::vector<void*> host_;
  };

  unsigned char* pinned(size_t bytes) {
    if (bytes > pinned_cap_) {
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      if (pinned_) cudaFreeHost(pinned_);
      pinned_ = nullptr;
      pinned_cap_ = 0;
      check(cudaHostAlloc(reinterpret_cast<void**>(&pinned_), std::max<size_t>(bytes, 1),
                          cudaHostAllocPortable),
            "cudaHostAlloc (the staging buffer)");
      pinned_cap_ = bytes;
    }
    return pinned_;
  }

  void nccl_call(nccl::Result r, nccl::Comm comm) {
    device_stats().nccl_calls++;
    if (r != nccl::kSuccess && r != nccl::kInProgress)
      throw std::runtime_error(nccl_->error(r, comm));
  }

  // The set's communicator, created the first time the set runs an op on this
  // device: rank 0 of the set makes NCCL's unique id, the set's host Comm
  // carries it, and every member agrees whether all of them got a communicator
  // (else all stage: NCCL refuses two ranks on one device, and a set cannot run
  // half on NCCL).
  SetComm& set_comm(Comm& comm) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(comm.global_ranks());
    if (it != comms_.end()) return it->second;
    SetComm sc;
    struct Hello {
      int32_t ok;
      nccl::UniqueId id;
    } hello{};
    // Devices by UUID: NCCL refuses a communicator with two ranks on one
    // device.
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    std::vector<unsigned char> uuids(16 * comm.size());
    std::memcpy(uuids.data() + 16 * comm.rank(), prop.uuid.bytes, 16);
    cpu_engine().allgatherv(comm, uuids.data() + 16 * comm.rank(), uuids.data(),
                            std::vector<size_t>(comm.size(), 16));
    bool shared = false;
    for (int a = 0; a < comm.size(); ++a)
      for (int b = a + 1; b < comm.size(); ++b)
        shared = shared || std::memcmp(&uuids[16 * a], &uuids[16 * b], 16) == 0;
    if (!nccl_) {
      sc.why = nccl_why_;
    } else if (shared) {
      sc.why = "ranks of this process set share a GPU, which NCCL does not allow";
    } else {
      if (comm.rank() == 0) hello.ok = nccl_->get_unique_id(&hello.id) == nccl::kSuccess;
      cpu_engine().broadcast(comm, &hello, sizeof hello, 0);
      nccl::Result r = hello.ok
                           ? nccl_->comm_init_rank(&sc.comm, comm.size(), hello.id, comm.rank())
                           : nccl::Result(1);
      int32_t all_ok = r == nccl::kSuccess ? 1 : 0;
      cpu_engine().allreduce(comm, &all_ok, 1, DataType::INT32, ReduceOp::MIN);
      if (!all_ok) {
        sc.why = r == nccl::kSuccess ? "NCCL failed to create the communicator on another rank"
                                     : nccl_->error(r);
        if (sc.comm) nccl_->comm_destroy(sc.comm);
        sc.comm = nullptr;
      }
    }
    if (!sc.comm)
      log_message(LogLevel::WARNING, "CUDA tensors of a process set of " +
                                         std::to_string(comm.size()) +
                                         " ranks go through host memory, not NCCL: " + sc.why);
    return comms_.emplace(comm.global_ranks(), sc).first->second;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::atomic<int64_t> fusion_stat_{0};
  std::unique_ptr<DeviceFusion> fusion_;
  const NcclLibrary* nccl_ = nullptr;
  std::string nccl_why_;
  std::mutex mu_;
  std::map<std::vector<int>, SetComm> comms_;
  unsigned char* pinned_ = nullptr;
  size_t pinned_cap_ = 0;
  // Operations queued on the stream and not yet seen complete (the stall
  // check).
  std::mutex pending_mu_;
  struct Pending {
    DeviceEvent done;
    std::vector<DeviceEvent> inputs;
  };
  std::deque<Pending> pending_;
  Clock::time_point ready_since_{};  // when the oldest one's inputs were seen ready (or unset)
};

std::mutex g_engines_mu;
std::map<int, std::unique_ptr<CudaEngine>>& engines() {
  // Never destroyed: CUDA may already be torn down when static destructors run.
  static auto* m = new std::map<int, std::unique_ptr<CudaEngine>>();
  return *m;
}

}  // namespace

DeviceEngine* device_engine(int device, std::string* why) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  auto it = engines().find(device);
  if (it != engines().end()) return it->second.get();
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (why) *why = std::string("CUDA is not usable: ") + cudaGetErrorString(e);
    return nullptr;
  }
  if (device < 0 || device >= count) {
    if (why)
      *why =
          "no CUDA device " + std::to_string(device) + " (" + std::to_string(count) + " visible)";
    return nullptr;
  }
  auto engine = std::make_unique<CudaEngine>(device);
  log_message(LogLevel::DEBUG, "CUDA device " + std::to_string(device) + ": " + engine->path());
  return engines().emplace(device, std::move(engine)).first->second.get();
}

void release_device_communicators(double wait_s) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  for (auto& kv : engines()) kv.second->release_communicators(wait_s);
}

bool device_engines_stalled(double timeout_s) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  for (auto& kv : engines())
    if (kv.second->stalled(timeout_s)) return true;
  return false;
}

bool device_engines_built() { return true; }

}  // namespace bagua_hvd
