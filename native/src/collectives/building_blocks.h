// Internal building blocks shared by the collective algorithms (not part of the core's API).
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "base/common.h"
#include "collectives/comm.h"

namespace bagua_hvd {

// Tuning constants. They choose the algorithm, so every rank must use the same values: they are
// compile-time constants on purpose (an environment knob differing between ranks would make ranks
// run different algorithms and corrupt the byte streams).
//
// Allreduce uses the direct (all-to-all, one round) algorithm up to this many bytes per rank, as
// long as each rank sends at most kAllreduceDirectMaxTotal bytes in all. Measured at n = 2 on
// this 2-core machine: direct and ring cost the same at 64 KiB; below, direct wins by 2x.
constexpr size_t kAllreduceDirectMaxBytes = 64 << 10;
constexpr size_t kAllreduceDirectMaxTotal = 4 << 20;
// Allgatherv and broadcast send directly to every peer up to this many bytes in total.
constexpr size_t kAllgatherDirectMaxBytes = 256 << 10;
constexpr size_t kBroadcastDirectMaxBytes = 256 << 10;
// Reducescatterv reduces directly (one round) up to this many bytes in total.
constexpr size_t kReducescatterDirectMaxBytes = 64 << 10;
// Pipelined algorithms move segments in chunks of about this size.
constexpr size_t kChunkBytes = 512 << 10;

// Reusable scratch memory of the calling thread (collectives run on the background thread only).
unsigned char* scratch(size_t bytes);
// Several such buffers at once, by slot (BAGUA's primitives need a few bucket-sized ones): they
// only grow, so a training loop stops allocating (and faulting pages in) after its first step.
constexpr int kScratchSlots = 8;
unsigned char* scratch_slot(int slot, size_t bytes);
// Element-wise float math over typed buffers in cache-sized blocks: f(i0, m, in..., out) gets
// float32 copies of block [i0, i0 + m) of each input (widened exactly).
constexpr size_t kFloatBlock = 8192;

// The schedule of the pipelined collectives: `blocks` blocks each pass through `steps` steps, and
// in run t block b performs step t - b, so one Comm::run carries up to `steps` blocks at
// different stages. emit(b, s, xs) appends block b's transfers for its step s; blocks are emitted
// in ascending order, so both ends of every stream see them in the same order. A step may only
// use what the block's earlier steps produced (they completed in earlier runs).
using PipelineStep = std::function<void(size_t block, int step, std::vector<Comm::Xfer>& xs)>;
void run_pipeline(Comm& comm, size_t blocks, int steps, const PipelineStep& emit, const char* what);

// Ring over the set ranks in which every segment r (seg_off[r], seg_len[r] bytes of buf, whole
// elements) is moved in chunks of ~chunk_bytes, with all pipeline stages of different chunks in
// flight in one Comm::run:
//  - reduce_scatter: n-1 steps after which this rank holds segment rank() reduced over all ranks
//    along one chain (rank r+1, r+2, ..., r), in buf or, if rs_out is set, in rs_out;
//  - allgather: n-1 steps after which every rank holds every segment, each starting from the
//    rank that owns it (segment r from rank r).
void ring_pipeline(Comm& comm, unsigned char* buf, const std::vector<size_t>& seg_off,
                   const std::vector<size_t>& seg_len, DataType dtype, ReduceOp op,
                   bool reduce_scatter, bool allgather, unsigned char* rs_out, size_t chunk_bytes,
                   const char* what);

// Allreduce over hosts that each hold the same number n of comm's ranks (host: this rank's host's
// members, ascending; cross: the members with this rank's index on every host, one per host,
// ascending; both subsets of comm). The buffer is cut into n shards, shard i into m = cross.size()
// parts. Each block (a chunk of every part) is reduce-scattered around the host's ring (rank i
// ends with shard i), reduce-scattered and allgathered around the cross ring (shard i's parts),
// then allgathered around the host's ring, all in one pipeline: while one block crosses the
// network, others move through shared memory. Across the network each rank sends
// 2(m-1)/m of its shard. Every rank ends with identical bits.
void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                            DataType dtype, ReduceOp op, size_t chunk_bytes);

void allreduce_direct(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
void allreduce_ring(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
                    size_t chunk_bytes);

// Throws std::invalid_argument for ops that are not element-wise reductions (ADASUM) and for
// unknown data types.
void check_reduction(DataType dtype, ReduceOp op, const char* what);
// std::invalid_argument unless dtype is one MinMaxUInt8 compresses (float32, float16, bfloat16),
// named as "<what>: MinMaxUInt8 needs ...".
void check_minmax_uint8_dtype(DataType dtype, const char* what);
// std::invalid_argument unless dtype is floating point (the peer averages' weights).
void check_peer_average_dtype(DataType dtype);

}  // namespace bagua_hvd
