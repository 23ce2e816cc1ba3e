// ByteGrad (BAGUA's CentralizedLowPrecisionSynchronous): compressed alltoall, mean of this rank's
// chunk in float32, re-compression of that chunk, compressed allgather. Optional error feedback on
// both quantizations (BAGUA has none). Math: docs/algorithms.md.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// dst = a - b in the element type (float32 arithmetic, rounded once).
void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) {
  std::vector<float> fa(n), fb(n);
  to_float(a, dtype, n, fa.data());
  to_float(b, dtype, n, fb.data());
  for (size_t i = 0; i < n; ++i) fa[i] -= fb[i];
  from_float(fa.data(), dtype, n, dst);
}

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

  // 1-2. Padded input (plus the worker residual), compressed in n chunks.
  std::vector<unsigned char> g(padded * es, 0);
  std::memcpy(g.data(), buf, count * es);
  if (ef_worker) reduce_into(g.data(), ef_worker, padded, dtype, ReduceOp::SUM);
  std::vector<uint8_t> q(cbytes * n);
  minmax_uint8_compress(g.data(), dtype, padded, n, q.data());
  std::vector<unsigned char> dec(padded * es);
  if (ef_worker) {
    minmax_uint8_decompress(q.data(), dtype, padded, n, dec.data());
    subtract(ef_worker, g.data(), dec.data(), padded, dtype);
  }

  // 3. Chunk j goes to rank j.
  std::vector<uint8_t> mine(cbytes * n);
  alltoallv(comm, q.data(), std::vector<size_t>(n, cbytes), mine.data(),
            std::vector<size_t>(n, cbytes));

  // 4. Sum (or mean) of the n decoded copies of chunk `me`, in rank order, in float32.
  std::vector<float> acc(chunk, 0.0f);
  for (int j = 0; j < n; ++j)
    minmax_uint8_decompress_add_f32(mine.data() + j * cbytes, dtype, chunk, 1, acc.data());
  if (average) {
    const float fn = static_cast<float>(n);
    for (auto& v : acc) v /= fn;
  }
  std::vector<unsigned char> a(chunk * es);
  from_float(acc.data(), dtype, chunk, a.data());

  // 5-6. Plus the server residual; re-compressed into this rank's slot of the allgather buffer.
  if (ef_server) reduce_into(a.data(), ef_server, chunk, dtype, ReduceOp::SUM);
  std::vector<uint8_t> all(cbytes * n);
  minmax_uint8_compress(a.data(), dtype, chunk, 1, all.data() + me * cbytes);
  if (ef_server) {
    minmax_uint8_decompress(all.data() + me * cbytes, dtype, chunk, 1, dec.data());
    subtract(ef_server, a.data(), dec.data(), chunk, dtype);
  }

  // 7. Everybody decodes every chunk, its own included, so all ranks hold the same bits.
  allgatherv(comm, all.data() + me * cbytes, all.data(), std::vector<size_t>(n, cbytes));
  minmax_uint8_decompress(all.data(), dtype, padded, n, dec.data());
  std::memcpy(buf, dec.data(), count * es);
}

}  // namespace bagua_hvd
