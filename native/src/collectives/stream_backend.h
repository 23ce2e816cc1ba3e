// StreamBackend: what BAGUA's primitives need from an engine whose work is queued in order (a
// CUDA stream with NCCL): element-wise kernels over its memory and exchanges with the ranks of
// one set. The primitives written against it (allreduce_minmax_uint8_phased.cc,
// peer_average_phased.cc) run whole-buffer phases one after the other, where the CPU versions
// (allreduce_minmax_uint8.cc, decentralized.cc) pipeline blocks with the transfers; both compute
// the same bits (native/tests/phased_test.cc runs them side by side with a host StreamBackend).
// lp_decentralized_phased.cc is the low-precision ring's.
// Every call only queues work: nothing here waits for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/common.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

class StreamBackend {
 public:
  virtual ~StreamBackend() = default;
  virtual int rank() const = 0;  // in the set
  virtual int size() const = 0;

  // The engine's memory, kept between calls, one buffer per slot (contents undefined).
  virtual void* scratch(int slot, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;

  // Element-wise, with the CPU engine's rounding (collectives/reduce.cc): 16-bit floats are
  // computed in float32 and rounded once, float64 in double.
  // dst += src (reduce_into's SUM).
  virtual void add(void* dst, const void* src, size_t n, DataType dtype) = 0;
  // dst = a - b, in float32 (float, float16, bfloat16 only).
  virtual void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) = 0;
  // out = dtype(acc / divisor); divisor 0: dtype(acc).
  virtual void from_f32(const float* acc, size_t n, float divisor, DataType dtype, void* out) = 0;
  // The peer averages of decentralized SGD, into mine: right null, (mine + left) / 2; else
  // ((left + mine) + right) / 3 (left and right may be one buffer).
  virtual void average(void* mine, const void* left, const void* right, size_t n,
                       DataType dtype) = 0;
  // buf *= factor (scale_buffer's rounding).
  virtual void scale(void* buf, size_t n, DataType dtype, double factor) = 0;
  // The low-precision ring's difference d = ((x + left / 3) + right / 3) - 5/3 self, in float32
  // (float32, float16, bfloat16), as decentralized.cc's lp_decentralized_local.
  virtual void lp_difference(void* d, const void* x, const void* left, const void* right,
                             const void* self, size_t n, DataType dtype) = 0;

  // MinMaxUInt8 (compression/minmax_uint8.h).
  virtual void compress(const void* in, DataType dtype, size_t n, size_t chunks, uint8_t* out) = 0;
  virtual void decompress(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                          void* out) = 0;
  virtual void decompress_add(const uint8_t* in, DataType dtype, size_t n, size_t chunks,
                              float* acc) = 0;

  // Exchanges among the set's ranks, `bytes` per block.
  // out's block j = rank j's block rank() of in (this rank's own: copied).
  virtual void alltoall(const void* in, void* out, size_t bytes) = 0;
  // out's block j = rank j's in (in may be out's block rank()).
  virtual void allgather(const void* in, void* out, size_t bytes) = 0;
  // Sends `out` to every rank of `to` and receives from from[i] into in[i], concurrently.
  virtual void sendrecv(const std::vector<int>& to, const void* out, const std::vector<int>& from,
                        const std::vector<void*>& in, size_t bytes) = 0;
  // buf = the sum over the set's ranks (the engine's allreduce).
  virtual void allreduce_sum(void* buf, size_t n, DataType dtype) = 0;
};

// ByteGrad (allreduce_minmax_uint8 in collectives.h) in phases: the same arguments, the same bits
// on every rank, the same error-feedback residuals; buffers in the backend's memory.
void allreduce_minmax_uint8_phased(StreamBackend& be, void* buf, size_t count, DataType dtype,
                                   bool average, void* ef_worker, void* ef_server);

// decentralized_average (collectives.h) in phases: the same peers and bits.
void decentralized_average_phased(StreamBackend& be, const void* in, void* out, size_t count,
                                  DataType dtype, PeerMode mode, int64_t step);

// The low-precision ring (collectives.h: lp_decentralized_init, lp_decentralized_exchange,
// lp_decentralized) in phases: the same messages and bits.
void lp_decentralized_init_phased(StreamBackend& be, const void* x, void* self, void* left,
                                  void* right, size_t count, DataType dtype);
void lp_decentralized_exchange_phased(StreamBackend& be, const uint8_t* c, void* left, void* right,
                                      size_t count, DataType dtype);
void lp_decentralized_phased(StreamBackend& be, void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype);
// Its local half alone (collectives.h: lp_decentralized_local), the split step's on a device:
// c receives minmax_uint8_bytes(dtype, count, 1) bytes; work is count elements of scratch of the
// caller's (the kernels only: no exchange, no backend scratch, so another thread's primitives
// may run on the same backend's engine meanwhile).
void lp_decentralized_local_phased(StreamBackend& be, void* x, void* self, const void* left,
                                   const void* right, size_t count, DataType dtype, uint8_t* c,
                                   void* work);

}  // namespace bagua_hvd
