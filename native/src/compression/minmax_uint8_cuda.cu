// CUDA kernels of MinMaxUInt8 (minmax_uint8_cuda.h). Compression is three launches for all
// chunks together:
//  1. minmax_partial: grid over (chunk, segment of kSegment elements); each block reduces its
//     segment to (min, max, non-finite flag) and stores it in the chunk's payload area;
//  2. finalize: one block per chunk reduces the partials (in segment order: deterministic) and
//     writes the 32-byte header;
//  3. quantize: grid over (chunk, segment); every block reads its chunk's header, derives the
//     parameters with the shared math and writes 4 payload bytes per thread and step (zeros past
//     the chunk's end, up to align32(c)).
// Decompression is one launch over (chunk, segment). Every float operation comes from
// minmax_uint8_math.h (explicit _rn intrinsics); the file is also compiled with --fmad=false.
#include <cuda_runtime.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "compression/minmax_uint8.h"
#include "compression/minmax_uint8_cuda.h"
#include "compression/minmax_uint8_math.h"

namespace bagua_hvd {
namespace {

using mmu8::BF16;
using mmu8::F16;
using mmu8::F32;
using mmu8::Params;
using mmu8::dispatch;

constexpr int kThreads = 256;
constexpr size_t kSegment = 4096;  // elements per block: 16 per thread
static_assert(kSegment % (4 * kThreads) == 0, "quantize steps are 4 elements per thread");

struct Partial {
  float mn, mx;
  uint32_t non_finite;
};
// Partials of a chunk fit its payload area: ceil(c / kSegment) * 12 <= align32(c) for c >= 1.
static_assert(sizeof(Partial) == 12 && kSegment >= 2 * sizeof(Partial), "partials fit");

__device__ __forceinline__ void warp_reduce(float& mn, float& mx, uint32_t& bad) {
  for (int o = 16; o > 0; o >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
}

// Reduces (mn, mx, bad) over the block; the result is valid in thread 0.
__device__ __forceinline__ void block_reduce(float& mn, float& mx, uint32_t& bad) {
  __shared__ float s_mn[kThreads / 32], s_mx[kThreads / 32];
  __shared__ uint32_t s_bad[kThreads / 32];
  warp_reduce(mn, mx, bad);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_mn[warp] = mn;
    s_mx[warp] = mx;
    s_bad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    const bool live = lane < kThreads / 32;
    mn = live ? s_mn[lane] : INFINITY;
    mx = live ? s_mx[lane] : -INFINITY;
    bad = live ? s_bad[lane] : 0u;
    warp_reduce(mn, mx, bad);
  }
}

__device__ __forceinline__ Partial* partials(uint8_t* out, size_t chunk, size_t chunk_bytes) {
  return reinterpret_cast<Partial*>(out + chunk * chunk_bytes + mmu8::kHeaderBytes);
}

// NaN and +-Inf are flagged apart, so fminf/fmaxf (which skip NaN) see finite values only.
template <typename Ty>
__global__ void __launch_bounds__(kThreads)
    minmax_partial(const typename Ty::Storage* in, size_t c, size_t segs, uint8_t* out) {
  const size_t chunk = blockIdx.x / segs, seg = blockIdx.x % segs;
  const size_t begin = seg * kSegment, end = min(c, begin + kSegment);
  const typename Ty::Storage* p = in + chunk * c;
  float mn = INFINITY, mx = -INFINITY;
  uint32_t bad = 0;
  for (size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float v = Ty::widen(p[i]);
    bad |= static_cast<uint32_t>(!isfinite(v));
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
  }
  block_reduce(mn, mx, bad);
  if (threadIdx.x == 0) partials(out, chunk, mmu8::chunk_bytes<Ty>(c))[seg] = {mn, mx, bad};
}

template <typename Ty>
__global__ void __launch_bounds__(kThreads) finalize(size_t c, size_t segs, uint8_t* out) {
  const size_t chunk = blockIdx.x;
  const Partial* part = partials(out, chunk, mmu8::chunk_bytes<Ty>(c));
  float mn = INFINITY, mx = -INFINITY;
  uint32_t bad = 0;
  for (size_t s = threadIdx.x; s < segs; s += kThreads) {
    mn = fminf(mn, part[s].mn);
    mx = fmaxf(mx, part[s].mx);
    bad |= part[s].non_finite;
  }
  block_reduce(mn, mx, bad);
  if (threadIdx.x != 0) return;
  const mmu8::Header h = c == 0 ? mmu8::Header{0.0f, 0.0f} : mmu8::make_header(mn, mx, bad == 0);
  uint32_t words[mmu8::kHeaderBytes / 4] = {};
  if constexpr (sizeof(typename Ty::Storage) == 4) {
    words[0] = fbits::f32_bits(h.mn);
    words[1] = fbits::f32_bits(h.mx);
  } else {  // little endian: min at byte 0, max at byte 2
    words[0] = static_cast<uint32_t>(Ty::narrow(h.mn)) |
               (static_cast<uint32_t>(Ty::narrow(h.mx)) << 16);
  }
  uint32_t* dst = reinterpret_cast<uint32_t*>(out + chunk * mmu8::chunk_bytes<Ty>(c));
  for (size_t w = 0; w < mmu8::kHeaderBytes / 4; ++w) dst[w] = words[w];
}

// Parameters of a chunk from its header; nan_header when it holds NaN (non-finite input).
template <typename Ty>
__device__ __forceinline__ Params read_params(const uint8_t* chunk_base) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(chunk_base);
  float mn, mx;
  if constexpr (sizeof(typename Ty::Storage) == 4) {
    mn = fbits::bits_f32(w[0]);
    mx = fbits::bits_f32(w[1]);
  } else {
    mn = Ty::widen(static_cast<uint16_t>(w[0] & 0xffffu));
    mx = Ty::widen(static_cast<uint16_t>(w[0] >> 16));
  }
  return mmu8::params(mn, mx);
}

template <typename Ty>
__global__ void __launch_bounds__(kThreads)
    quantize(const typename Ty::Storage* in, size_t c, size_t segs, uint8_t* out) {
  const size_t chunk = blockIdx.x / segs, seg = blockIdx.x % segs;
  uint8_t* base = out + chunk * mmu8::chunk_bytes<Ty>(c);
  const Params prm = read_params<Ty>(base);
  const bool finite = prm.scale == prm.scale;  // a NaN header: zero payload
  const typename Ty::Storage* p = in + chunk * c;
  uint32_t* q = reinterpret_cast<uint32_t*>(base + mmu8::kHeaderBytes);
  const size_t begin = seg * kSegment, end = min(mmu8::align32(c), begin + kSegment);
  for (size_t i = begin + 4 * threadIdx.x; i < end; i += 4 * kThreads) {
    uint32_t word = 0;
    for (int k = 0; k < 4; ++k) {
      const uint32_t b = (finite && i + k < c) ? mmu8::quantize(Ty::widen(p[i + k]), prm) : 0u;
      word |= b << (8 * k);
    }
    q[i / 4] = word;
  }
}

// kAdd: acc[i] += float(T(x')); else out[i] = T(x').
template <typename Ty, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    dequantize(const uint8_t* in, size_t c, size_t segs, void* out) {
  const size_t chunk = blockIdx.x / segs, seg = blockIdx.x % segs;
  const uint8_t* base = in + chunk * mmu8::chunk_bytes<Ty>(c);
  const Params prm = read_params<Ty>(base);
  const uint32_t* q = reinterpret_cast<const uint32_t*>(base + mmu8::kHeaderBytes);
  const size_t begin = seg * kSegment, end = min(c, begin + kSegment);
  for (size_t i = begin + 4 * threadIdx.x; i < end; i += 4 * kThreads) {
    const uint32_t word = q[i / 4];
    for (int k = 0; k < 4 && i + k < end; ++k) {
      const auto t = Ty::narrow(mmu8::dequantize<Ty>(static_cast<uint8_t>(word >> (8 * k)), prm));
      const size_t j = chunk * c + i + k;
      if constexpr (kAdd) {
        float* acc = static_cast<float*>(out);
        acc[j] = mmu8::accumulate(acc[j], Ty::widen(t));
      } else {
        static_cast<typename Ty::Storage*>(out)[j] = t;
      }
    }
  }
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("MinMaxUInt8 CUDA ") + what + ": " +
                             cudaGetErrorString(e));
  }
}

void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 4 != 0) {
    throw std::invalid_argument(std::string("MinMaxUInt8 CUDA: the compressed buffer (") + what +
                                ") must be 4-byte aligned");
  }
}

// Blocks for n_chunks chunks of `elems` elements each, kSegment per block.
unsigned grid(size_t n_chunks, size_t segs) {
  const size_t blocks = n_chunks * segs;
  if (blocks > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw std::invalid_argument("MinMaxUInt8 CUDA: buffer too large for one launch");
  }
  return static_cast<unsigned>(blocks);
}

size_t segments(size_t elems) { return (elems + kSegment - 1) / kSegment; }

}  // namespace

void minmax_uint8_compress_cuda(const void* in, DataType dtype, size_t n, size_t n_chunks,
                                uint8_t* out, void* stream) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  check_aligned(out, "out");
  const size_t c = n / n_chunks;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    const auto* p = static_cast<const typename Ty::Storage*>(in);
    const size_t segs = segments(c);
    if (segs > 0) {
      minmax_partial<Ty><<<grid(n_chunks, segs), kThreads, 0, s>>>(p, c, segs, out);
      check_launch("min/max kernel");
    }
    finalize<Ty><<<grid(n_chunks, 1), kThreads, 0, s>>>(c, segs, out);
    check_launch("header kernel");
    const size_t qsegs = segments(mmu8::align32(c));
    if (qsegs > 0) {
      quantize<Ty><<<grid(n_chunks, qsegs), kThreads, 0, s>>>(p, c, qsegs, out);
      check_launch("quantize kernel");
    }
  });
}

void minmax_uint8_decompress_cuda(const uint8_t* in, DataType dtype, size_t n, size_t n_chunks,
                                  void* out, void* stream) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  check_aligned(in, "in");
  const size_t c = n / n_chunks, segs = segments(c);
  if (segs == 0) return;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    dequantize<Ty, false>
        <<<grid(n_chunks, segs), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(in, c, segs,
                                                                                   out);
    check_launch("decompress kernel");
  });
}

void minmax_uint8_decompress_add_f32_cuda(const uint8_t* in, DataType dtype, size_t n,
                                          size_t n_chunks, float* acc, void* stream) {
  minmax_uint8_check_args(dtype, n, n_chunks);
  check_aligned(in, "in");
  const size_t c = n / n_chunks, segs = segments(c);
  if (segs == 0) return;
  dispatch(dtype, [&](auto ty) {
    using Ty = decltype(ty);
    dequantize<Ty, true>
        <<<grid(n_chunks, segs), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(in, c, segs,
                                                                                   acc);
    check_launch("decompress-add kernel");
  });
}

}  // namespace bagua_hvd
