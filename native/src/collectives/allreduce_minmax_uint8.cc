// ByteGrad (BAGUA's CentralizedLowPrecisionSynchronous): compressed alltoall, mean of this rank's
// chunk in float32, re-compression of that chunk, compressed allgather. Optional error feedback on
// both quantizations (BAGUA has none). Math: docs/algorithms.md.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// dst = a - b in the element type (float32 arithmetic, rounded once), in cache-sized blocks.
void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) {
  const size_t es = dtype_size(dtype);
  float fa[kFloatBlock], fb[kFloatBlock];
  for (size_t i = 0; i < n; i += kFloatBlock) {
    const size_t m = std::min(kFloatBlock, n - i);
    to_float(static_cast<const unsigned char*>(a) + i * es, dtype, m, fa);
    to_float(static_cast<const unsigned char*>(b) + i * es, dtype, m, fb);
    for (size_t k = 0; k < m; ++k) fa[k] -= fb[k];
    from_float(fa, dtype, m, static_cast<unsigned char*>(dst) + i * es);
  }
}

enum Slot { kInput, kCompressed, kDecoded, kMine, kSum, kChunk, kGathered };

}  // namespace

void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                            void* ef_worker, void* ef_server) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16) {
    throw std::invalid_argument(std::string("compressed allreduce: MinMaxUInt8 needs float32, "
                                            "float16 or bfloat16 data, got ") +
                                dtype_name(dtype));
  }
  const int n = comm.size(), me = comm.rank();
  if (n <= 1 || count == 0) return;
  const size_t es = dtype_size(dtype);
  const size_t chunk = (count + n - 1) / n, padded = chunk * n;
  const size_t cbytes = minmax_uint8_bytes(dtype, chunk, 1);

  // 1-2. The (padded) input plus the worker residual, compressed in n chunks.
  unsigned char* g = static_cast<unsigned char*>(buf);
  if (padded != count || ef_worker) {
    g = scratch_slot(kInput, padded * es);
    std::memcpy(g, buf, count * es);
    std::memset(g + count * es, 0, (padded - count) * es);
    if (ef_worker) reduce_into(g, ef_worker, padded, dtype, ReduceOp::SUM);
  }
  uint8_t* q = scratch_slot(kCompressed, cbytes * n);
  minmax_uint8_compress(g, dtype, padded, n, q);
  if (ef_worker) {
    unsigned char* dec = scratch_slot(kDecoded, padded * es);
    minmax_uint8_decompress(q, dtype, padded, n, dec);
    subtract(ef_worker, g, dec, padded, dtype);
  }

  // 3. Chunk j goes to rank j.
  uint8_t* mine = scratch_slot(kMine, cbytes * n);
  alltoallv(comm, q, std::vector<size_t>(n, cbytes), mine, std::vector<size_t>(n, cbytes));

  // 4. Sum (or mean) of the n decoded copies of chunk `me`, in rank order, in float32.
  auto* acc = reinterpret_cast<float*>(scratch_slot(kSum, chunk * sizeof(float)));
  std::memset(acc, 0, chunk * sizeof(float));
  for (int j = 0; j < n; ++j)
    minmax_uint8_decompress_add_f32(mine + j * cbytes, dtype, chunk, 1, acc);
  if (average) {
    const float fn = static_cast<float>(n);
    for (size_t i = 0; i < chunk; ++i) acc[i] /= fn;
  }
  unsigned char* a = scratch_slot(kChunk, chunk * es);
  from_float(acc, dtype, chunk, a);

  // 5-6. Plus the server residual; re-compressed into this rank's slot of the allgather buffer.
  if (ef_server) reduce_into(a, ef_server, chunk, dtype, ReduceOp::SUM);
  uint8_t* all = scratch_slot(kGathered, cbytes * n);
  minmax_uint8_compress(a, dtype, chunk, 1, all + me * cbytes);
  if (ef_server) {
    unsigned char* dec = scratch_slot(kDecoded, chunk * es);
    minmax_uint8_decompress(all + me * cbytes, dtype, chunk, 1, dec);
    subtract(ef_server, a, dec, chunk, dtype);
  }

  // 7. Everybody decodes every chunk, its own included, so all ranks hold the same bits.
  allgatherv(comm, all + me * cbytes, all, std::vector<size_t>(n, cbytes));
  if (padded == count) {
    minmax_uint8_decompress(all, dtype, padded, n, buf);
  } else {
    unsigned char* dec = scratch_slot(kDecoded, padded * es);
    minmax_uint8_decompress(all, dtype, padded, n, dec);
    std::memcpy(buf, dec, count * es);
  }
}

}  // namespace bagua_hvd
