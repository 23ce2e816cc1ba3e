// MinMaxUInt8 CUDA kernels against the CPU kernels, bit for bit, on a GPU; then their speed.
//
// The CPU kernels are checked against an independent numpy reference by tests/test_compression.py
// (in CI); this program closes the chain on a machine with a GPU: for float32, float16 and
// bfloat16, chunk sizes around the kernels' block and alignment boundaries and inputs that hit
// every special case (constant chunks, the saturating [-1, 1] case, NaN/Inf chunks, denormals,
// signed zeros, huge magnitudes), the compressed bytes, the decompressed values and the
// decompress-accumulate results must be identical. Built and run by native/tests/run_cuda_check.sh
// (nvcc only: no CMake, no OpenSSL). Exit status 0 only when every case matches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/float_bits.h"
#include "compression/minmax_uint8.h"
#include "compression/minmax_uint8_cuda.h"

namespace {

using bagua_hvd::DataType;
namespace fb = bagua_hvd::fbits;

#define CUDA_OK(call)                                                                  \
  do {                                                                                 \
    const cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,               \
                   cudaGetErrorString(e_));                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// A device allocation freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    CUDA_OK(cudaMalloc(&p_, bytes ? bytes : 1));
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  void upload(const void* src) { CUDA_OK(cudaMemcpy(p_, src, bytes_, cudaMemcpyHostToDevice)); }
  void download(void* dst) const {
    CUDA_OK(cudaMemcpy(dst, p_, bytes_, cudaMemcpyDeviceToHost));
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

const char* name(DataType t) {
  return t == DataType::FLOAT32 ? "float32" : t == DataType::FLOAT16 ? "float16" : "bfloat16";
}
size_t itemsize(DataType t) { return t == DataType::FLOAT32 ? 4 : 2; }

// float32 values -> the stored bytes of dtype (round to nearest even).
std::vector<uint8_t> to_storage(const std::vector<float>& x, DataType t) {
  std::vector<uint8_t> out(x.size() * itemsize(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DataType::FLOAT32) {
      std::memcpy(&out[4 * i], &x[i], 4);
    } else {
      const uint16_t h = t == DataType::FLOAT16 ? fb::float_to_half(x[i]) : fb::float_to_bf16(x[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

// Per-chunk input patterns; `kind` selects the special case.
constexpr int kKinds = 12;
std::vector<float> make_input(size_t n_chunks, size_t c, int kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> x(n_chunks * c);
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t k = 0; k < n_chunks; ++k) {
    float* p = x.data() + k * c;
    const int chunk_kind = (kind + static_cast<int>(k)) % kKinds;
    for (size_t i = 0; i < c; ++i) {
      switch (chunk_kind) {
        case 0: p[i] = normal(rng) * 1e-3f; break;            // gradient-like
        case 1: p[i] = uni(rng) * 3.0f + 100.0f; break;        // offset: min > 0
        case 2: p[i] = 0.625f; break;                          // constant chunk
        case 3: p[i] = (i % 2) ? 1.0f : -1.0f; break;          // the saturating [-1, 1] case
        case 4: p[i] = normal(rng) * 1e-39f; break;            // denormals
        case 5: p[i] = uni(rng) * 3e38f; break;                // near float32 max
        case 6: p[i] = (i % 3) ? 0.0f : -0.0f; break;          // signed zeros
        case 7: p[i] = normal(rng); if (i == c / 2) p[i] = NAN; break;
        // The overflow rule (finite in, finite out): max * scale, then max - min overflow.
        case 8: p[i] = 1e30f; break;                           // constant, huge
        case 9: p[i] = -3e38f; break;                          // constant, near -max
        case 10: p[i] = (i % 2) ? uni(rng) * 3e38f : ((i % 4) ? 3e38f : -3e38f); break;
        default: p[i] = normal(rng); if (i == c - 1) p[i] = (k % 2) ? inf : -inf; break;
      }
    }
  }
  return x;
}

int g_failures = 0;
int g_cases = 0;

bool same(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::string& what) {
  if (a == b) return true;
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  std::fprintf(stderr, "MISMATCH %s: first differing byte %zu of %zu (cpu %02x, gpu %02x)\n",
               what.c_str(), i, a.size(), a[i], b[i]);
  ++g_failures;
  return false;
}

void check_case(DataType t, size_t n_chunks, size_t c, int kind, std::mt19937& rng) {
  ++g_cases;
  const size_t n = n_chunks * c;
  const std::vector<uint8_t> in = to_storage(make_input(n_chunks, c, kind, rng), t);
  const size_t bytes = bagua_hvd::minmax_uint8_bytes(t, n, n_chunks);
  const std::string what = std::string(name(t)) + " n_chunks=" + std::to_string(n_chunks) +
                           " c=" + std::to_string(c) + " kind=" + std::to_string(kind);

  // CPU.
  std::vector<uint8_t> cpu_c(bytes, 0xAB), cpu_d(in.size()), acc_init(n * 4), cpu_acc;
  bagua_hvd::minmax_uint8_compress(in.data(), t, n, n_chunks, cpu_c.data());
  bagua_hvd::minmax_uint8_decompress(cpu_c.data(), t, n, n_chunks, cpu_d.data());
  for (size_t i = 0; i < n; ++i) {  // a nonzero accumulator: the add must be a real add
    const float v = 0.5f * static_cast<float>(i % 7) - 1.25f;
    std::memcpy(&acc_init[4 * i], &v, 4);
  }
  cpu_acc = acc_init;
  bagua_hvd::minmax_uint8_decompress_add_f32(cpu_c.data(), t, n, n_chunks,
                                             reinterpret_cast<float*>(cpu_acc.data()));

  // GPU: the output buffers start with garbage, so every byte must be written.
  DeviceBuffer d_in(in.size()), d_c(bytes), d_d(in.size()), d_acc(n * 4);
  d_in.upload(in.data());
  CUDA_OK(cudaMemset(d_c.as<void>(), 0xCD, bytes ? bytes : 1));
  CUDA_OK(cudaMemset(d_d.as<void>(), 0xCD, in.size() ? in.size() : 1));
  d_acc.upload(acc_init.data());
  bagua_hvd::minmax_uint8_compress_cuda(d_in.as<void>(), t, n, n_chunks, d_c.as<uint8_t>(),
                                        nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> gpu_c(bytes), gpu_d(in.size()), gpu_acc(n * 4);
  d_c.download(gpu_c.data());
  if (!same(cpu_c, gpu_c, "compress " + what)) return;
  // Decompress the CPU's bytes on the GPU (equal to the GPU's here).
  bagua_hvd::minmax_uint8_decompress_cuda(d_c.as<uint8_t>(), t, n, n_chunks, d_d.as<void>(),
                                          nullptr);
  bagua_hvd::minmax_uint8_decompress_add_f32_cuda(d_c.as<uint8_t>(), t, n, n_chunks,
                                                  d_acc.as<float>(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  d_d.download(gpu_d.data());
  d_acc.download(gpu_acc.data());
  same(cpu_d, gpu_d, "decompress " + what);
  same(cpu_acc, gpu_acc, "decompress_add_f32 " + what);
}

// GB/s of input (uncompressed) bytes processed, median of `reps` timed launches.
void bench(DataType t, size_t n, size_t n_chunks) {
  std::mt19937 rng(7);
  const std::vector<uint8_t> in = to_storage(make_input(1, n, 0, rng), t);
  const size_t bytes = bagua_hvd::minmax_uint8_bytes(t, n, n_chunks);
  DeviceBuffer d_in(in.size()), d_c(bytes), d_d(in.size());
  d_in.upload(in.data());
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  auto time_ms = [&](auto&& launch) {
    for (int i = 0; i < 3; ++i) launch();  // warm-up
    std::vector<float> ms;
    for (int i = 0; i < 20; ++i) {
      CUDA_OK(cudaEventRecord(a));
      launch();
      CUDA_OK(cudaEventRecord(b));
      CUDA_OK(cudaEventSynchronize(b));
      float m = 0;
      CUDA_OK(cudaEventElapsedTime(&m, a, b));
      ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const float c_ms = time_ms([&] {
    bagua_hvd::minmax_uint8_compress_cuda(d_in.as<void>(), t, n, n_chunks, d_c.as<uint8_t>(),
                                          nullptr);
  });
  const float d_ms = time_ms([&] {
    bagua_hvd::minmax_uint8_decompress_cuda(d_c.as<uint8_t>(), t, n, n_chunks, d_d.as<void>(),
                                            nullptr);
  });
  // Device-to-device copy of the input: the memory-bandwidth yardstick on this GPU.
  const float copy_ms = time_ms([&] {
    CUDA_OK(cudaMemcpyAsync(d_d.as<void>(), d_in.as<void>(), in.size(),
                            cudaMemcpyDeviceToDevice));
  });
  const double gb = static_cast<double>(in.size()) / 1e9;
  std::printf(
      "bench %-8s n=%zu (%.0f MiB) n_chunks=%zu: compress %.3f ms (%.0f GB/s of input), "
      "decompress %.3f ms (%.0f GB/s of output), d2d copy %.3f ms (%.0f GB/s read+write)\n",
      name(t), n, in.size() / 1048576.0, n_chunks, c_ms, gb / (c_ms / 1e3), d_ms,
      gb / (d_ms / 1e3), copy_ms, 2 * gb / (copy_ms / 1e3));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace

// Arguments: --quick (chunks up to 100003 elements, no timings: for compute-sanitizer runs).
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  std::mt19937 rng(12345);
  const DataType types[] = {DataType::FLOAT32, DataType::FLOAT16, DataType::BFLOAT16};
  const size_t sizes[] = {0, 1, 3, 31, 32, 33, 255, 1000, 1023, 4095, 4096, 4097, 8193, 12289,
                          100003, 1u << 20};
  for (DataType t : types) {
    for (size_t c : sizes) {
      if (quick && c > 100003) continue;
      for (size_t n_chunks : {1, 2, 5}) {
        if (c == 0 && n_chunks > 1) continue;
        const int kinds = c >= (1u << 20) ? 2 : kKinds;
        for (int kind = 0; kind < kinds; ++kind) check_case(t, n_chunks, c, kind, rng);
      }
    }
  }
  std::printf("correctness: %d cases, %d mismatches\n", g_cases, g_failures);

  if (!quick) {
    for (DataType t : types) {
      bench(t, size_t{64} << 20, 1);  // 64M elements: 256 MiB of float32
      bench(t, size_t{64} << 20, 8);
    }
    bench(DataType::FLOAT32, size_t{25} << 20, 2);  // the 25.1M-parameter MLP, 2 ranks' chunks
  }

  // Bad arguments raise, as on the CPU.
  int arg_errors = 0;
  DeviceBuffer d(64);
  try {
    bagua_hvd::minmax_uint8_compress_cuda(d.as<void>(), DataType::INT32, 4, 1, d.as<uint8_t>(),
                                          nullptr);
  } catch (const std::invalid_argument& e) {
    ++arg_errors;
    std::printf("expected error: %s\n", e.what());
  }
  try {
    bagua_hvd::minmax_uint8_compress_cuda(d.as<void>(), DataType::FLOAT32, 4, 1,
                                          d.as<uint8_t>() + 1, nullptr);
  } catch (const std::invalid_argument& e) {
    ++arg_errors;
    std::printf("expected error: %s\n", e.what());
  }
  const bool ok = g_failures == 0 && g_cases > 0 && arg_errors == 2;
  std::printf("%s\n", ok ? "CUDA CHECK PASSED" : "CUDA CHECK FAILED");
  return ok ? 0 : 1;
}
