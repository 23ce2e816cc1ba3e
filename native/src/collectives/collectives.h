// Collective algorithms over a Comm. Every member of the Comm calls the same collective with
// matching arguments in the same order (the controller guarantees that). All run on the background
// thread and throw TransportError on failure. Non-members must not call them.
#pragma once

#include <cstddef>
#include <vector>

#include "base/common.h"
#include "collectives/comm.h"

namespace bagua_hvd {

// ---- element-wise kernels (collectives/reduce.cc) ------------------------------------------
// dst[i] = dst[i] (op) src[i] for count elements. AVERAGE reduces as SUM (the caller scales).
// float16 and bfloat16 are computed in float32 and rounded to nearest-even once per call.
// bool: SUM/MAX = or, PRODUCT/MIN = and.
void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);
// buf[i] *= factor. Integers are computed in double and truncated toward zero, like Horovod.
void scale_buffer(void* buf, size_t count, DataType dtype, double factor);

// Floating-point types (float32, float16, bfloat16, float64) to and from float32; 16-bit
// results are rounded to nearest-even. Other types throw std::invalid_argument.
void to_float(const void* src, DataType dtype, size_t n, float* out);
void from_float(const float* src, DataType dtype, size_t n, void* out);

// ---- collectives ----------------------------------------------------------------------------
// In-place allreduce of count elements. Picks a latency-optimal algorithm for small buffers and a
// bandwidth-optimal ring for large ones (collectives/allreduce_*.cc). Every rank ends with
// bitwise-identical results.
void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);

// Concatenates each rank's bytes in set-rank order into out (sum of bytes_per_rank bytes).
// in may point inside out at this rank's offset.
void allgatherv(Comm& comm, const void* in, void* out, const std::vector<size_t>& bytes_per_rank);

// root is a set rank; buf holds bytes on every rank.
void broadcast(Comm& comm, void* buf, size_t bytes, int root);

// send_bytes[r]: bytes this rank sends to set rank r (consecutive in `in`);
// recv_bytes[r]: bytes it receives from r (consecutive in `out`).
void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
               const std::vector<size_t>& recv_bytes);

// Reduces count elements of buf across ranks; this rank receives the reduced segment
// [offset(rank), offset(rank)+counts[rank]) in out, where segments are consecutive and
// counts[r] is set rank r's element count. buf may be used as scratch (its contents after the
// call are unspecified).
void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                    DataType dtype, ReduceOp op);

void barrier(Comm& comm);

// Horovod's Adasum over the set (collectives/allreduce_adasum.cc), in place: buf holds the
// tensors one after the other, counts[i] elements each, and each tensor is combined with its own
// coefficients. float16, float32 or float64; a power-of-2 number of ranks (check_adasum throws
// std::invalid_argument otherwise, naming the problem).
// dots_also: a second group whose members run the same tree on other slices of the same tensors
// (the ranks of this rank's host in Horovod's GPU Adasum, each combining one slice with the other
// hosts): each level's dot products and norms are summed over it too, so that the coefficients
// are the whole tensors'. Its members call this even with an empty slice.
void allreduce_adasum(Comm& comm, void* buf, const std::vector<size_t>& counts, DataType dtype,
                      Comm* dots_also = nullptr);
void check_adasum(DataType dtype, int ranks);

// ---- BAGUA's primitives (docs/algorithms.md) --------------------------------------------------
// ByteGrad: MinMaxUInt8-compressed alltoall, mean (average) or sum in float32, re-compression of
// this rank's chunk, compressed allgather. buf holds count elements (float32/16/bfloat16), in and
// out. ef_worker (n * ceil(count / n) elements) and ef_server (ceil(count / n) elements) are the
// error-feedback residuals, or null without error feedback.
void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                            void* ef_worker, void* ef_server);

enum class PeerMode : int32_t { ALL = 0, SHIFT_ONE = 1, RING = 2 };
// The peer of set rank `rank` in round `step` of shift_one over n ranks; n (no peer) for the
// rank left over when n is odd.
int shift_one_peer(int rank, int n, int64_t step);
// out = the peer average of in (full precision); in and out may alias.
void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                           PeerMode mode, int64_t step);
// Low-precision decentralized step on the ring: x (the updated weights) and the replicas self,
// left, right of count elements are updated in place. It is the two halves below: the local one
// (no communication; c receives minmax_uint8_bytes(dtype, count, 1) bytes), after which x is
// final, and the exchange of c with both neighbours, which advances left and right.
void lp_decentralized_local(void* x, void* self, const void* left, const void* right,
                            size_t count, DataType dtype, uint8_t* c);
// The same with x in pieces (count elements in all, in order): a framework's variables read and
// written in place rather than copied into a bucket and back. The same bits.
struct XSegment {
  void* data;
  size_t count;
};
void lp_decentralized_local(const XSegment* xs, size_t num_segments, void* self,
                            const void* left, const void* right, DataType dtype, uint8_t* c);
void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                               size_t count, DataType dtype);
void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                      DataType dtype);
// Its initialisation: self = x, left and right = the ring neighbours' x (full precision).
void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                           size_t count, DataType dtype);

}  // namespace bagua_hvd
