// Latency-optimal allreduce for small buffers: every rank sends its whole buffer to every other
// rank in one round, then folds the n inputs in set-rank order. The order is the same everywhere,
// so every rank computes bitwise-identical results.
#include <cstring>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void allreduce_direct(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  const int n = comm.size(), k = comm.rank();
  const size_t bytes = count * dtype_size(dtype);
  // One slot per peer: slot(r) = r for r < k, r - 1 for r > k.
  unsigned char* in = scratch(bytes * static_cast<size_t>(n - 1));
  auto slot = [&](int r) { return in + bytes * static_cast<size_t>(r < k ? r : r - 1); };

  std::vector<Comm::Xfer> xs;
  xs.reserve(2 * static_cast<size_t>(n - 1));
  for (int i = 1; i < n; ++i) {
    // Staggered peer order spreads the first bytes over all peers.
    const int to = (k + i) % n, from = (k + n - i) % n;
    xs.push_back({Comm::Xfer::SEND, to, buf, bytes});
    xs.push_back({Comm::Xfer::RECV, from, slot(from), bytes});
  }
  comm.run(xs, "allreduce");

  // acc = in_0 (op) in_1 (op) ... (op) in_{n-1}
  auto* mine = static_cast<unsigned char*>(buf);
  unsigned char* acc = k == 0 ? mine : slot(0);
  for (int r = 1; r < n; ++r) reduce_into(acc, r == k ? mine : slot(r), count, dtype, op);
  if (acc != mine) std::memcpy(mine, acc, bytes);
}

}  // namespace bagua_hvd
