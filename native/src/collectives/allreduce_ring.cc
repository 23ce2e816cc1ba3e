// Bandwidth-optimal allreduce: pipelined ring reduce-scatter then allgather over n segments of
// count/n elements (the first count % n segments one element longer). Each segment is reduced
// along one chain of ranks and then copied, so every rank ends with identical bits.
#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void allreduce_ring(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
                    size_t chunk_bytes) {
  const int n = comm.size();
  if (n <= 1 || count == 0) return;
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off(n), len(n);
  const size_t base = count / n, rem = count % n;
  size_t pos = 0;
  for (int r = 0; r < n; ++r) {
    off[r] = pos * es;
    const size_t c = base + (static_cast<size_t>(r) < rem ? 1 : 0);
    len[r] = c * es;
    pos += c;
  }
  ring_pipeline(comm, static_cast<unsigned char*>(buf), off, len, dtype, op,
                /*reduce_scatter=*/true, /*allgather=*/true, nullptr, chunk_bytes, "allreduce");
}

}  // namespace bagua_hvd
