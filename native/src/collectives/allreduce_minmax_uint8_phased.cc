// ByteGrad in whole-buffer phases over a StreamBackend (stream_backend.h): the steps of
// allreduce_minmax_uint8.cc one after the other (docs/algorithms.md), for engines that queue
// their work (CUDA kernels and NCCL on one stream). Same bytes on the wire, same float operations
// in the same order (the sum adds rank 0's decoded chunk first), so the same bits.
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {
enum Slot { kInput, kCompressed, kMine, kSum, kChunk, kGathered, kDecoded };
}  // namespace

void allreduce_minmax_uint8_phased(StreamBackend& be, void* buf, size_t count, DataType dtype,
                                   bool average, void* ef_worker, void* ef_server) {
  check_minmax_uint8_dtype(dtype, "compressed allreduce");
  const int n = be.size(), me = be.rank();
  if (n <= 1 || count == 0) return;
  const size_t es = dtype_size(dtype);
  const size_t chunk = (count + n - 1) / n, padded = chunk * n;
  const size_t cbytes = minmax_uint8_bytes(dtype, chunk, 1);

  // 1-2. The (padded) input plus the worker residual, compressed in n chunks; the residual
  // becomes what the compression lost.
  void* g = buf;
  if (padded != count || ef_worker) {
    g = be.scratch(kInput, padded * es);
    be.copy(g, buf, count * es);
    be.zero(static_cast<unsigned char*>(g) + count * es, (padded - count) * es);
    if (ef_worker) be.add(g, ef_worker, padded, dtype);
  }
  auto* q = static_cast<uint8_t*>(be.scratch(kCompressed, cbytes * n));
  be.compress(g, dtype, padded, n, q);
  if (ef_worker) {
    void* dec = be.scratch(kDecoded, padded * es);
    be.decompress(q, dtype, padded, n, dec);
    be.subtract(ef_worker, g, dec, padded, dtype);
  }

  // 3-4. Chunk j to rank j; the mean (or sum) of the n decoded copies of chunk `me`, in rank
  // order, in float32, plus the server residual.
  auto* mine = static_cast<uint8_t*>(be.scratch(kMine, cbytes * n));
  be.alltoall(q, mine, cbytes);
  auto* acc = static_cast<float*>(be.scratch(kSum, chunk * sizeof(float)));
  be.zero(acc, chunk * sizeof(float));
  for (int j = 0; j < n; ++j) be.decompress_add(mine + j * cbytes, dtype, chunk, 1, acc);
  void* a = be.scratch(kChunk, chunk * es);
  be.from_f32(acc, chunk, average ? static_cast<float>(n) : 0.0f, dtype, a);
  if (ef_server) be.add(a, ef_server, chunk, dtype);

  // 5-7. `a` re-compressed into this rank's block of the allgather (the server residual becomes
  // what that lost); every rank decodes every chunk, its own too, so all hold the same bits.
  auto* all = static_cast<uint8_t*>(be.scratch(kGathered, cbytes * n));
  uint8_t* own = all + static_cast<size_t>(me) * cbytes;
  be.compress(a, dtype, chunk, 1, own);
  if (ef_server) {
    void* dec = be.scratch(kDecoded, chunk * es);
    be.decompress(own, dtype, chunk, 1, dec);
    be.subtract(ef_server, a, dec, chunk, dtype);
  }
  be.allgather(own, all, cbytes);
  if (padded == count) {
    be.decompress(all, dtype, padded, n, buf);
  } else {
    void* out = be.scratch(kDecoded, padded * es);
    be.decompress(all, dtype, padded, n, out);
    be.copy(buf, out, count * es);
  }
}

}  // namespace bagua_hvd
