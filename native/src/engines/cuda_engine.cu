// The data engine of a CUDA device (engines/device_engine.h). Built with nvcc only;
// builds without it have engines/device_engine_none.cc. The host code calls the
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
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "base/float_bits.h"
#include "base/wire_stats.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"
#include "compression/minmax_uint8_cuda.h"
#include "engines/cuda_kernels.h"
#include "engines/device_engine.h"
#include "engines/nccl_library.h"

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
    int pools = 0;
    memory_pools_ =
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess &&
        pools != 0;
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
  Output allocate_output(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaStream_t s = stream_;
    if (!memory_pools_) {  // no stream-ordered allocator: cudaFree waits for the device
      check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc (an output)");
      return Output{std::shared_ptr<void>(p, [](void* q) { cudaFree(q); }), bytes, device_};
    }
    check(cudaMallocAsync(&p, std::max<size_t>(bytes, 1), s), "cudaMallocAsync (an output)");
    // Freed in the engine stream's order: after the op that wrote it and the copies out, which
    // that stream waits for (copy_output).
    return Output{std::shared_ptr<void>(p, [s](void* q) { cudaFreeAsync(q, s); }), bytes, device_};
  }
  void copy_output(void* dst, const Output& out, void* stream) override {
    DeviceGuard g(device_);
    auto caller = static_cast<cudaStream_t>(stream);
    check(cudaMemcpyAsync(dst, out.data.get(), out.bytes, cudaMemcpyDeviceToDevice, caller),
          "cudaMemcpyAsync (an output)");
    DeviceEvent copied = record(caller);
    check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(copied.get()), 0),
          "cudaStreamWaitEvent");
  }
  std::shared_ptr<void> make_stream() override {
    DeviceGuard g(device_);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return std::shared_ptr<void>(static_cast<void*>(s), [](void* q) {
      cudaStreamDestroy(static_cast<cudaStream_t>(q));  // its queued work still completes
    });
  }
  std::shared_ptr<void> device_memory(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
    return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });  // waits for the device
  }
  void copy_on(void* dst, const void* src, size_t bytes, void* stream) override {
    if (!bytes) return;
    DeviceGuard g(device_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
          "cudaMemcpyAsync");
  }
  void async_merge(void* x, const void* sum, const void* snapshot, size_t n, DataType dtype,
                   int set_size, void* stream) override {
    DeviceGuard g(device_);
    cuda_async_merge(x, sum, snapshot, n, dtype, set_size, stream);
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
      BHVD_LOG(WARNING, "NCCL operations still running at shutdown were aborted");
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
    cuda_scale(buf, count, dtype, factor, stream_);
  }
  // Horovod's GPU kernel multiplies float16 by the factor rounded to half (ScaleBufferCudaImpl:
  // __float2half((float)f), then __hmul2), its CPU path by the float factor. A product of two
  // halves is exact in float, so scale()'s one rounding of it gives __hmul's bits.
  void scale_horovod(void* buf, size_t count, DataType dtype, double factor) override {
    if (dtype == DataType::FLOAT16)
      factor = fbits::half_to_float(fbits::float_to_half(static_cast<float>(factor)));
    scale(buf, count, dtype, factor);
  }

  // ---- Horovod's collectives ----
  void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) override {
    DeviceGuard g(device_);
    nccl::DataType t;
    nccl::RedOp o;
    SetComm& sc = set_comm(comm);
    if (sc.comm && nccl::data_type(dtype, &t) && nccl::red_op(op, &o)) {
      if (count) nccl_call(nccl_->all_reduce(buf, buf, count, t, o, sc.comm, stream_), sc.comm);
      count_ring(comm, 2 * ring_share(comm, count * dtype_size(dtype)));
      return;
    }
    const size_t es = dtype_size(dtype);
    if (op != ReduceOp::ADASUM && count * es > kStagePieceBytes) {
      staged_allreduce_in_pieces(comm, buf, count, dtype, op);
      return;
    }
    Staging s(*this, {{buf, count * es, true}});
    cpu_engine().allreduce(comm, s.host(0), count, dtype, op);
    s.to_device();
  }
  void allgatherv(Comm& comm, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    // `out`: device memory of this engine (allocate_output).
    DeviceGuard g(device_);
    const int n = comm.size(), me = comm.rank();
    size_t total = 0;
    std::vector<size_t> offset(n);
    for (int j = 0; j < n; ++j) {
      offset[j] = total;
      total += bytes_per_rank[j];
    }
    auto* o = static_cast<unsigned char*>(out);
    SetComm& sc = set_comm(comm);
    if (sc.comm) {
      const bool even = std::all_of(bytes_per_rank.begin(), bytes_per_rank.end(),
                                    [&](size_t b) { return b == bytes_per_rank[0]; });
      if (even) {
        if (bytes_per_rank[0])
          nccl_call(nccl_->all_gather(in, out, bytes_per_rank[0], nccl::kUint8, sc.comm, stream_),
                    sc.comm);
        count_ring(comm, (n - 1) * bytes_per_rank[0]);
        return;
      }
      // Unequal parts: one send of this rank's part to every peer and one receive from each.
      copy(o + offset[me], in, bytes_per_rank[me]);
      std::vector<const void*> to(n, in);
      std::vector<void*> from(n);
      for (int j = 0; j < n; ++j) from[j] = o + offset[j];
      std::vector<size_t> send(n, bytes_per_rank[me]);
      grouped_sendrecv(comm, sc.comm, me, to, send, from, bytes_per_rank);
      return;
    }
    Staging s(*this, {{in, bytes_per_rank[me], false}, {out, total, true, false}});
    cpu_engine().allgatherv(comm, s.host(0), s.host(1), bytes_per_rank);
    s.to_device();
  }
  void broadcast(Comm& comm, void* buf, size_t bytes, int root) override {
    DeviceGuard g(device_);
    SetComm& sc = set_comm(comm);
    if (sc.comm) {
      if (bytes)
        nccl_call(nccl_->broadcast(buf, buf, bytes, nccl::kUint8, root, sc.comm, stream_), sc.comm);
      // The ring's pipeline: every rank but the root's predecessor passes the bytes on.
      if ((comm.rank() + 1) % comm.size() != root) count_ring(comm, bytes);
      return;
    }
    Staging s(*this, {{buf, bytes, true}});
    cpu_engine().broadcast(comm, s.host(0), bytes, root);
    s.to_device();
  }
  void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
                 const std::vector<size_t>& recv_bytes) override {
    // `out`: device memory of this engine (allocate_output).
    DeviceGuard g(device_);
    const int n = comm.size(), me = comm.rank();
    size_t sent = 0, received = 0;
    std::vector<const void*> to(n);
    std::vector<void*> from(n);
    for (int j = 0; j < n; ++j) {
      to[j] = static_cast<const unsigned char*>(in) + sent;
      from[j] = static_cast<unsigned char*>(out) + received;
      sent += send_bytes[j];
      received += recv_bytes[j];
    }
    SetComm& sc = set_comm(comm);
    if (sc.comm) {
      copy(from[me], to[me], send_bytes[me]);
      grouped_sendrecv(comm, sc.comm, me, to, send_bytes, from, recv_bytes);
      return;
    }
    Staging s(*this, {{in, sent, false}, {out, received, true, false}});
    cpu_engine().alltoallv(comm, s.host(0), send_bytes, s.host(1), recv_bytes);
    s.to_device();
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
      count_ring(comm, (comm.size() - 1) * counts[0] * dtype_size(dtype));
      return;
    }
    size_t total = 0;
    for (size_t c : counts) total += c;
    const size_t es = dtype_size(dtype);
    Staging s(*this, {{buf, total * es, false}, {out, counts[comm.rank()] * es, true}});
    cpu_engine().reducescatterv(comm, s.host(0), s.host(1), counts, dtype, op);
    s.to_device();
  }
  // The Adasum across hosts of Horovod's GPU Adasum (ops/allreduce.cc), on the host as Horovod
  // runs it (its MPI Adasum over a host buffer): the CPU engine's arithmetic, bit for bit.
  void allreduce_adasum(Comm& comm, void* buf, const std::vector<size_t>& counts, DataType dtype,
                        Comm* dots_also) override {
    size_t total = 0;
    for (size_t c : counts) total += c;
    Staging s(*this, {{buf, total * dtype_size(dtype), true}});
    bagua_hvd::allreduce_adasum(comm, s.host(0), counts, dtype, dots_also);
    s.to_device();
  }
  // ---- BAGUA's primitives ----
  // ByteGrad (and QAdam's compressed allreduce), the full-precision peer averages and the
  // low-precision ring run on the device in phases (engines/stream_engine.h): the CUDA kernels
  // compress, decompress and average on this stream whatever moves the bytes; NCCL exchanges
  // them, or, where NCCL cannot serve, the host transports with only the exchanged (compressed)
  // bytes staged. The same bits as the CPU engine's (native/tests/phased_test.cc).
  std::unique_ptr<StreamBackend> backend(Comm& comm) override {
    DeviceGuard g(device_);
    return std::make_unique<Backend>(*this, &comm, set_comm(comm).comm);
  }
  void lp_local(void* x, void* self, const void* left, const void* right, size_t count,
                DataType dtype, uint8_t* c, void* work, void* stream) override {
    DeviceGuard g(device_);
    wait(record(stream));
    Backend kernels(*this, nullptr, nullptr);
    lp_decentralized_local_phased(kernels, x, self, left, right, count, dtype, c, work);
    stream_wait(stream, record(stream_));
  }

 private:
  // Buffers copied to pinned host memory for one staged call, and the ones
  // copied back. The engine's one pinned area is reused: every staged call
  // synchronises the stream before the host touches it, so the previous call's
  // copies back have completed by then.
  struct Part {
    const void* dev;  // null: none (its host pointer is null too)
    size_t bytes;
    bool back;          // copied back to the device after the call
    bool fetch = true;  // copied to the host before it (false: an output only)
  };
  class Staging {
   public:
    Staging(CudaEngine& e, std::initializer_list<Part> parts)
        : Staging(e, std::vector<Part>(parts)) {}
    Staging(CudaEngine& e, std::vector<Part> parts) : e_(e), parts_(std::move(parts)) {
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
        if (p.dev) device_stats().staged_bytes += (p.fetch ? p.bytes : 0) + (p.back ? p.bytes : 0);
        if (p.dev && p.bytes && p.fetch)
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

  // BAGUA's phased primitives on this engine: its kernels on its stream; the exchanges through
  // NCCL (nc_), or staged through the host transports where the set has no communicator.
  class Backend final : public StreamBackend {
   public:
    // comm null: the kernels only (lp_local), no exchange.
    Backend(CudaEngine& e, Comm* comm, nccl::Comm nc) : e_(e), comm_(comm), nc_(nc) {}
    int rank() const override { return comm_->rank(); }
    int size() const override { return comm_->size(); }
    void* scratch(int slot, size_t bytes) override { return e_.scratch(slot, bytes); }
    void copy(void* dst, const void* src, size_t bytes) override { e_.copy(dst, src, bytes); }
    void zero(void* dst, size_t bytes) override { e_.zero(dst, bytes); }
    void add(void* dst, const void* src, size_t n, DataType dtype) override {
      cuda_add(dst, src, n, dtype, e_.stream_);
    }
    void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) override {
      cuda_subtract(dst, a, b, n, dtype, e_.stream_);
    }
    void from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out) override {
      cuda_from_f32(acc, n, divisor, dtype, out, e_.stream_);
    }
    void average(void* mine, const void* left, const void* right, size_t n,
                 DataType dtype) override {
      cuda_average(mine, left, right, n, dtype, e_.stream_);
    }
    void scale(void* buf, size_t n, DataType dtype, double factor) override {
      cuda_scale(buf, n, dtype, factor, e_.stream_);
    }
    void lp_difference(void* d, const void* x, const void* left, const void* right,
                       const void* self, size_t n, DataType dtype) override {
      cuda_lp_difference(d, x, left, right, self, n, dtype, e_.stream_);
    }
    void compress(const void* in, DataType dtype, size_t n, size_t chunks, uint8_t* out) override {
      minmax_uint8_compress_cuda(in, dtype, n, chunks, out, e_.stream_);
    }
    void decompress(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                    void* out) override {
      minmax_uint8_decompress_cuda(in, dtype, n, chunks, out, e_.stream_);
    }
    void decompress_add(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                        float* acc) override {
      minmax_uint8_decompress_add_f32_cuda(in, dtype, n, chunks, acc, e_.stream_);
    }
    // The exchanges: NCCL on the stream, or (nc_ null) the host transports, with the exchanged
    // bytes staged through pinned memory.
    void alltoall(const void* in, void* out, size_t bytes) override {
      const int n = size(), me = rank();
      const std::vector<size_t> each(n, bytes);
      if (!nc_) {
        Staging s(e_, {{in, bytes * n, false}, {out, bytes * n, true, false}});
        cpu_engine().alltoallv(*comm_, s.host(0), each, s.host(1), each);
        s.to_device();
        return;
      }
      std::vector<const void*> to(n);
      std::vector<void*> from(n);
      for (int j = 0; j < n; ++j) {
        to[j] = static_cast<const unsigned char*>(in) + j * bytes;
        from[j] = static_cast<unsigned char*>(out) + j * bytes;
      }
      e_.copy(from[me], to[me], bytes);
      e_.grouped_sendrecv(*comm_, nc_, me, to, each, from, each);
    }
    void allgather(const void* in, void* out, size_t bytes) override {
      if (!nc_) {
        const std::vector<size_t> each(size(), bytes);
        Staging s(e_, {{in, bytes, false}, {out, bytes * size(), true, false}});
        cpu_engine().allgatherv(*comm_, s.host(0), s.host(1), each);
        s.to_device();
        return;
      }
      // In place when `in` is out's block rank(), as NCCL allows.
      if (bytes)
        e_.nccl_call(e_.nccl_->all_gather(in, out, bytes, nccl::kUint8, nc_, e_.stream_), nc_);
      e_.count_ring(*comm_, (size() - 1) * bytes);
    }
    void sendrecv(const std::vector<int>& to, const void* out, const std::vector<int>& from,
                  const std::vector<void*>& in, size_t bytes) override {
      if (!bytes) return;
      if (!nc_) {
        std::vector<Part> parts{{out, bytes, false}};
        for (void* p : in) parts.push_back({p, bytes, true, false});
        Staging s(e_, std::move(parts));
        std::vector<Comm::Xfer> xs;
        for (int p : to) xs.push_back({Comm::Xfer::SEND, p, s.host(0), bytes});
        for (size_t k = 0; k < from.size(); ++k)
          xs.push_back({Comm::Xfer::RECV, from[k], s.host(k + 1), bytes});
        comm_->run(xs, "peer exchange");
        s.to_device();
        return;
      }
      e_.nccl_group(nc_, [&] {
        for (int p : to)
          e_.nccl_call(e_.nccl_->send(out, bytes, nccl::kUint8, p, nc_, e_.stream_), nc_);
        for (int p : to) count_bytes_sent(comm_->remote(p), bytes);
        for (size_t k = 0; k < from.size(); ++k)
          e_.nccl_call(e_.nccl_->recv(in[k], bytes, nccl::kUint8, from[k], nc_, e_.stream_), nc_);
      });
    }
    void allreduce_sum(void* buf, size_t n, DataType dtype) override {
      nccl::DataType t;
      if (!nc_ || !nccl::data_type(dtype, &t)) {
        Staging s(e_, {{buf, n * dtype_size(dtype), true}});
        cpu_engine().allreduce(*comm_, s.host(0), n, dtype, ReduceOp::SUM);
        s.to_device();
        return;
      }
      if (n) e_.nccl_call(e_.nccl_->all_reduce(buf, buf, n, t, nccl::kSum, nc_, e_.stream_), nc_);
      e_.count_ring(*comm_, 2 * ring_share(*comm_, n * dtype_size(dtype)));
    }

   private:
    CudaEngine& e_;
    Comm* comm_;
    nccl::Comm nc_;
  };

  // The bytes NCCL sends for this rank (hvd.communication_stats(), base/wire_stats.h), by the
  // ring model NCCL's collectives follow: a collective's bytes go to the ring's next rank (the
  // set's next rank; between hosts when it is on another host); sends and receives exactly.
  static size_t ring_share(const Comm& comm, size_t bytes) {
    return bytes / comm.size() * (comm.size() - 1);
  }
  static void count_ring(const Comm& comm, size_t bytes) {
    if (comm.size() > 1 && bytes)
      count_bytes_sent(comm.remote((comm.rank() + 1) % comm.size()), bytes);
  }

  // One NCCL group: to[j] (send[j] bytes) to every other rank j and from[j] (recv[j] bytes) from
  // it; empty parts are skipped on both ends (both know the sizes).
  void grouped_sendrecv(const Comm& comm, nccl::Comm nc, int me, const std::vector<const void*>& to,
                        const std::vector<size_t>& send, const std::vector<void*>& from,
                        const std::vector<size_t>& recv) {
    nccl_group(nc, [&] {
      for (size_t j = 0; j < to.size(); ++j) {
        const int peer = static_cast<int>(j);
        if (peer == me) continue;
        if (send[j]) nccl_call(nccl_->send(to[j], send[j], nccl::kUint8, peer, nc, stream_), nc);
        if (send[j]) count_bytes_sent(comm.remote(peer), send[j]);
        if (recv[j]) nccl_call(nccl_->recv(from[j], recv[j], nccl::kUint8, peer, nc, stream_), nc);
      }
    });
  }

  // The NCCL calls `queue` makes, as one group; the group is closed even when one of them fails
  // (NCCL would keep this thread's group open otherwise).
  template <typename F>
  void nccl_group(nccl::Comm nc, F&& queue) {
    nccl_call(nccl_->group_start(), nc);
    try {
      queue();
    } catch (...) {
      nccl_->group_end();
      throw;
    }
    nccl_call(nccl_->group_end(), nc);
  }

  // Device memory kept between calls, one buffer per slot (the phased primitives' scratch).
  void* scratch(int slot, size_t bytes) {
    auto& b = scratch_[slot];
    if (bytes > b.second) {
      // Work queued on the stream may still use the old buffer.
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      if (b.first) cudaFree(b.first);
      b = {nullptr, 0};
      check(cudaMalloc(&b.first, bytes), "cudaMalloc (scratch)");
      b.second = bytes;
    }
    return b.first;
  }

  // A staged element-wise allreduce in pieces, so that the copies overlap the host transports:
  // every piece's copy to the host is queued at once, each piece is reduced as soon as it has
  // arrived and copied back while the next ones are reduced (the pieces are the same on every
  // rank). Integers, min and max, and two ranks give the whole buffer's bits; floating-point
  // sums over more ranks may differ from one whole-buffer CPU allreduce in the last bit (another
  // order of addition, as NCCL's).
  static constexpr size_t kStagePieceBytes = 4 << 20;
  void staged_allreduce_in_pieces(Comm& comm, void* buf, size_t count, DataType dtype,
                                  ReduceOp op) {
    device_stats().staged_calls++;
    const size_t es = dtype_size(dtype), per = kStagePieceBytes / es;
    device_stats().staged_bytes += 2 * count * es;
    unsigned char* host = pinned(count * es);  // after the previous staged call's copies back
    auto* dev = static_cast<unsigned char*>(buf);
    std::vector<DeviceEvent> arrived;
    for (size_t off = 0; off < count; off += per) {
      const size_t bytes = std::min(per, count - off) * es;
      check(
          cudaMemcpyAsync(host + off * es, dev + off * es, bytes, cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (to the host)");
      arrived.push_back(record(stream_));
    }
    for (size_t p = 0, off = 0; off < count; ++p, off += per) {
      const size_t m = std::min(per, count - off);
      check(cudaEventSynchronize(static_cast<cudaEvent_t>(arrived[p].get())),
            "cudaEventSynchronize");
      cpu_engine().allreduce(comm, host + off * es, m, dtype, op);
      check(
          cudaMemcpyAsync(dev + off * es, host + off * es, m * es, cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (to the device)");
    }
  }

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
      BHVD_LOG(WARNING, "CUDA tensors of a process set of " + std::to_string(comm.size()) +
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
  std::map<int, std::pair<void*, size_t>> scratch_;
  bool memory_pools_ = false;  // cudaMallocAsync available
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
  BHVD_LOG(DEBUG, "CUDA device " + std::to_string(device) + ": " + engine->path());
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
