// The GPU check of BAGUA's phased primitives (collectives/stream_backend.h) with the CUDA kernels
// (engines/cuda_kernels.cu and the MinMaxUInt8 CUDA kernels), against the same phases with the CPU
// kernels. NCCL refuses two ranks on one device, so the ranks here are threads of this process,
// each with its own stream, and their exchanges go through a hub (copies between the ranks'
// buffers) instead of NCCL; CTest shows that the phases with CPU kernels give the pipelined CPU
// primitives' bits (native/tests/phased_test.cc), so equality here carries to the CPU path.
// Prints "CHECK 0 PASS|FAIL <name>" lines (run_gpu_check.sh counts them). Built and run by
// native/tests/run_cuda_check.sh. Usage: phased_cuda_check [--quick]
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"
#include "compression/minmax_uint8_cuda.h"
#include "engines/cuda_kernels.h"
#include "host_stream_kernels.h"

namespace bagua_hvd {
namespace {

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// n threads meeting in rounds: each posts a pointer, all read every rank's, then leave together.
class Hub {
 public:
  explicit Hub(int n) : n_(n), posted_(n) {}
  void round(int rank, const void* mine,
             const std::function<void(const std::vector<const void*>&)>& f) {
    posted_[rank] = mine;
    barrier();
    f(posted_);
    barrier();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }
  int n_;
  std::vector<const void*> posted_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t gen_ = 0;
};

// The exchanges over the hub, written once for both kinds of memory.
class HubBackend : public StreamBackend {
 public:
  HubBackend(Hub& hub, int rank, int size) : hub_(hub), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void alltoall(const void* in, void* out, size_t bytes) override {
    sync();
    hub_.round(rank_, in, [&](const std::vector<const void*>& p) {
      for (int j = 0; j < size_; ++j)
        xcopy(static_cast<unsigned char*>(out) + j * bytes,
              static_cast<const unsigned char*>(p[j]) + rank_ * bytes, bytes);
      sync();
    });
  }
  void allgather(const void* in, void* out, size_t bytes) override {
    sync();
    hub_.round(rank_, in, [&](const std::vector<const void*>& p) {
      for (int j = 0; j < size_; ++j) {
        void* dst = static_cast<unsigned char*>(out) + j * bytes;
        if (dst != p[j]) xcopy(dst, p[j], bytes);
      }
      sync();
    });
  }
  void sendrecv(const std::vector<int>&, const void* out, const std::vector<int>& from,
                const std::vector<void*>& in, size_t bytes) override {
    sync();
    hub_.round(rank_, out, [&](const std::vector<const void*>& p) {
      for (size_t k = 0; k < from.size(); ++k) xcopy(in[k], p[from[k]], bytes);
      sync();
    });
  }
  void allreduce_sum(void* buf, size_t n, DataType dtype) override {
    // In host memory, in rank order, for both kinds (NCCL sums in production).
    const size_t bytes = n * dtype_size(dtype);
    std::vector<unsigned char> sum(bytes), part(bytes);
    sync();
    hub_.round(rank_, buf, [&](const std::vector<const void*>& p) {
      for (int j = 0; j < size_; ++j) {
        to_host(j ? part.data() : sum.data(), p[j], bytes);
        if (j) reduce_into(sum.data(), part.data(), n, dtype, ReduceOp::SUM);
      }
    });
    from_host(buf, sum.data(), bytes);
  }

 protected:
  virtual void sync() = 0;
  virtual void xcopy(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void from_host(void* dst, const void* src, size_t bytes) = 0;

 private:
  Hub& hub_;
  int rank_, size_;
};

// Host memory over the hub: the reference.
class HostHub : public HubBackend {
 public:
  using HubBackend::HubBackend;

 protected:
  void sync() override {}
  void xcopy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void from_host(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
};
using HostRank = HostKernels<HostHub>;

class CudaRank final : public HubBackend {
 public:
  CudaRank(Hub& hub, int rank, int size) : HubBackend(hub, rank, size) {
    cuda(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaRank() override {
    cudaStreamSynchronize(s_);
    for (auto& kv : slots_) cudaFree(kv.second.first);
    cudaStreamDestroy(s_);
  }
  void* scratch(int slot, size_t bytes) override {
    auto& b = slots_[slot];
    if (bytes > b.second) {
      sync();
      cudaFree(b.first);
      b = {nullptr, 0};
      cuda(cudaMalloc(&b.first, bytes), "cudaMalloc");
      b.second = bytes;
    }
    return b.first;
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_), "copy");
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes) cuda(cudaMemsetAsync(dst, 0, bytes, s_), "zero");
  }
  void add(void* dst, const void* src, size_t n, DataType dtype) override {
    cuda_add(dst, src, n, dtype, s_);
  }
  void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) override {
    cuda_subtract(dst, a, b, n, dtype, s_);
  }
  void from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out) override {
    cuda_from_f32(acc, n, divisor, dtype, out, s_);
  }
  void average(void* mine, const void* left, const void* right, size_t n, DataType dtype) override {
    cuda_average(mine, left, right, n, dtype, s_);
  }
  void scale(void* buf, size_t n, DataType dtype, double factor) override {
    cuda_scale(buf, n, dtype, factor, s_);
  }
  void lp_difference(void* d, const void* x, const void* left, const void* right, const void* self,
                     size_t n, DataType dtype) override {
    cuda_lp_difference(d, x, left, right, self, n, dtype, s_);
  }
  void compress(const void* in, DataType dtype, size_t n, size_t chunks, uint8_t* out) override {
    minmax_uint8_compress_cuda(in, dtype, n, chunks, out, s_);
  }
  void decompress(const uint8_t* in, DataType dtype, size_t n, size_t chunks, void* out) override {
    minmax_uint8_decompress_cuda(in, dtype, n, chunks, out, s_);
  }
  void decompress_add(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                      float* acc) override {
    minmax_uint8_decompress_add_f32_cuda(in, dtype, n, chunks, acc, s_);
  }

  // Device copies of host bytes and back (the check's inputs and results).
  void* upload(const std::vector<unsigned char>& h) {
    void* d = nullptr;
    cuda(cudaMalloc(&d, std::max<size_t>(h.size(), 1)), "cudaMalloc");
    cuda(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice), "upload");
    owned_.push_back(d);
    return d;
  }
  std::vector<unsigned char> download(const void* d, size_t bytes) {
    sync();
    std::vector<unsigned char> h(bytes);
    cuda(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost), "download");
    return h;
  }
  void free_uploads() {
    for (void* d : owned_) cudaFree(d);
    owned_.clear();
  }

 protected:
  void sync() override { cuda(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }
  void xcopy(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void to_host(void* dst, const void* src, size_t bytes) override {
    cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "to_host");
  }
  void from_host(void* dst, const void* src, size_t bytes) override {
    cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s_), "from_host");
    sync();
  }

 private:
  cudaStream_t s_ = nullptr;
  std::map<int, std::pair<void*, size_t>> slots_;
  std::vector<void*> owned_;
};

using Bytes = std::vector<unsigned char>;

// Runs body(rank) on n threads; the first exception fails the case.
std::string on_ranks(int n, const std::function<void(int)>& body) {
  std::vector<std::string> err(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        cuda(cudaSetDevice(0), "cudaSetDevice");
        body(r);
      } catch (const std::exception& e) {
        err[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r)
    if (!err[r].empty()) return "rank " + std::to_string(r) + ": " + err[r];
  return "";
}

int failures = 0;
void check(const std::string& name, bool ok, const std::string& detail = "") {
  failures += ok ? 0 : 1;
  std::printf("CHECK 0 %s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : " ",
              detail.c_str());
  std::fflush(stdout);
}

// Per rank: the results of two steps, then the residuals.
std::vector<std::vector<Bytes>> bytegrad(int n, size_t count, DataType dtype, bool average, bool ef,
                                         bool on_gpu, std::string* err) {
  std::vector<std::vector<Bytes>> out(n);
  Hub hub(n);
  *err = on_ranks(n, [&](int k) {
    const size_t es = dtype_size(dtype), chunk = (count + n - 1) / n;
    Bytes ew(chunk * n * es, 0), es_(chunk * es, 0);
    if (on_gpu) {
      CudaRank be(hub, k, n);
      void* w = ef ? be.upload(ew) : nullptr;
      void* v = ef ? be.upload(es_) : nullptr;
      for (int s = 0; s < 2; ++s) {
        void* buf = be.upload(phased_input(k, count, s, dtype, 900));
        allreduce_minmax_uint8_phased(be, buf, count, dtype, average, w, v);
        out[k].push_back(be.download(buf, count * es));
      }
      out[k].push_back(ef ? be.download(w, ew.size()) : ew);
      out[k].push_back(ef ? be.download(v, es_.size()) : es_);
      be.free_uploads();
    } else {
      HostRank be(hub, k, n);
      for (int s = 0; s < 2; ++s) {
        Bytes buf = phased_input(k, count, s, dtype, 900);
        allreduce_minmax_uint8_phased(be, buf.data(), count, dtype, average,
                                      ef ? ew.data() : nullptr, ef ? es_.data() : nullptr);
        out[k].push_back(buf);
      }
      out[k].push_back(ew);
      out[k].push_back(es_);
    }
  });
  return out;
}

std::vector<Bytes> peer_average(int n, size_t count, DataType dtype, PeerMode mode, bool in_place,
                                bool on_gpu, std::string* err) {
  std::vector<Bytes> out(n);
  Hub hub(n);
  *err = on_ranks(n, [&](int k) {
    const Bytes x = phased_input(k, count, 3, dtype, 900);
    const size_t bytes = x.size();
    if (on_gpu) {
      CudaRank be(hub, k, n);
      void* in = be.upload(x);
      void* o = in_place ? in : be.upload(Bytes(bytes, 0xab));
      decentralized_average_phased(be, in, o, count, dtype, mode, 5);
      out[k] = be.download(o, bytes);
      be.free_uploads();
    } else {
      HostRank be(hub, k, n);
      Bytes o = in_place ? x : Bytes(bytes, 0xab);
      const void* in = in_place ? static_cast<const void*>(o.data()) : x.data();
      decentralized_average_phased(be, in, o.data(), count, dtype, mode, 5);
      out[k] = o;
    }
  });
  return out;
}

// Per rank: x, self, left, right after the low-precision ring's init and two steps.
std::vector<std::vector<Bytes>> lp_ring(int n, size_t count, DataType dtype, bool on_gpu,
                                        std::string* err) {
  std::vector<std::vector<Bytes>> out(n);
  Hub hub(n);
  *err = on_ranks(n, [&](int k) {
    const size_t bytes = count * dtype_size(dtype);
    const Bytes x0 = phased_input(k, count, 0, dtype, 910);
    if (on_gpu) {
      CudaRank be(hub, k, n);
      void* x = be.upload(x0);
      void* s = be.upload(Bytes(bytes));
      void* l = be.upload(Bytes(bytes));
      void* r = be.upload(Bytes(bytes));
      lp_decentralized_init_phased(be, x, s, l, r, count, dtype);
      for (int step = 1; step <= 2; ++step) {
        void* g = be.upload(phased_input(k, count, step, dtype, 920));
        be.add(x, g, count, dtype);  // local progress between the steps
        lp_decentralized_phased(be, x, s, l, r, count, dtype);
      }
      out[k] = {be.download(x, bytes), be.download(s, bytes), be.download(l, bytes),
                be.download(r, bytes)};
      be.free_uploads();
    } else {
      HostRank be(hub, k, n);
      Bytes x = x0, s(bytes), l(bytes), r(bytes);
      lp_decentralized_init_phased(be, x.data(), s.data(), l.data(), r.data(), count, dtype);
      for (int step = 1; step <= 2; ++step) {
        const Bytes g = phased_input(k, count, step, dtype, 920);
        be.add(x.data(), g.data(), count, dtype);
        lp_decentralized_phased(be, x.data(), s.data(), l.data(), r.data(), count, dtype);
      }
      out[k] = {x, s, l, r};
    }
  });
  return out;
}

template <typename T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  for (size_t k = 0; k < want.size(); ++k)
    if (!(got[k] == want[k])) return "rank " + std::to_string(k) + " differs";
  return "";
}

}  // namespace
}  // namespace bagua_hvd

int main(int argc, char** argv) {
  using namespace bagua_hvd;
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::printf("CHECK 0 FAIL phased primitives: no CUDA device\n");
    return 1;
  }
  const std::vector<size_t> counts =
      quick ? std::vector<size_t>{7, 300001} : std::vector<size_t>{1, 7, 1000, 300001, 4000037};
  for (int n : {2, 3}) {
    for (size_t count : counts) {
      for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16}) {
        for (bool ef : {false, true}) {
          const bool average = count != 7;  // a sum once
          std::string e1, e2;
          const auto want = bytegrad(n, count, dtype, average, ef, false, &e1);
          const auto got = bytegrad(n, count, dtype, average, ef, true, &e2);
          const std::string name = "phased ByteGrad on CUDA = CPU kernels, n=" + std::to_string(n) +
                                   " count=" + std::to_string(count) + " " + dtype_name(dtype) +
                                   (ef ? " +EF" : "") + (average ? "" : " (sum)");
          const std::string err = e1 + e2;
          check(name, err.empty() && got == want, err.empty() ? first_difference(got, want) : err);
        }
      }
    }
  }
  for (int n : {2, 3, 4}) {
    for (PeerMode mode : {PeerMode::ALL, PeerMode::SHIFT_ONE, PeerMode::RING}) {
      if (mode == PeerMode::SHIFT_ONE && n % 2) continue;  // a rank sits out: no hub round
      for (DataType dtype :
           {DataType::FLOAT32, DataType::FLOAT64, DataType::FLOAT16, DataType::BFLOAT16}) {
        for (bool in_place : {true, false}) {
          const size_t count = quick ? 70001 : 1000003;
          std::string e1, e2;
          const auto want = peer_average(n, count, dtype, mode, in_place, false, &e1);
          const auto got = peer_average(n, count, dtype, mode, in_place, true, &e2);
          const std::string name =
              "phased peer average on CUDA = CPU kernels, n=" + std::to_string(n) +
              " mode=" + std::to_string(static_cast<int>(mode)) + " " + dtype_name(dtype) +
              (in_place ? "" : " (out of place)");
          const std::string err = e1 + e2;
          check(name, err.empty() && got == want, err.empty() ? first_difference(got, want) : err);
        }
      }
    }
  }
  for (int n : {2, 3}) {
    for (DataType dtype : {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16}) {
      for (size_t count : counts) {
        std::string e1, e2;
        const auto want = lp_ring(n, count, dtype, false, &e1);
        const auto got = lp_ring(n, count, dtype, true, &e2);
        const std::string name =
            "phased low-precision ring on CUDA = CPU kernels, n=" + std::to_string(n) +
            " count=" + std::to_string(count) + " " + dtype_name(dtype);
        const std::string err = e1 + e2;
        check(name, err.empty() && got == want, err.empty() ? first_difference(got, want) : err);
      }
    }
  }
  std::printf("%s: %d failed\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
