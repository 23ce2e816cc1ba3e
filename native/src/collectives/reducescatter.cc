// reducescatterv: direct for small totals (each rank sends segment r to rank r in one round and
// folds the n copies of its own segment in set-rank order), pipelined ring reduce-scatter for
// large ones (each segment reduced along one chain of ranks, ending at its owner).
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                    DataType dtype, ReduceOp op) {
  check_reduction(dtype, op, "reducescatter");
  const int n = comm.size(), k = comm.rank();
  if (counts.size() != static_cast<size_t>(n)) {
    throw std::invalid_argument("reducescatterv: " + std::to_string(counts.size()) +
                                " segment counts for a process set of " + std::to_string(n) +
                                " ranks");
  }
  const size_t es = dtype_size(dtype);
  std::vector<size_t> off(n), len(n);
  size_t total = 0;
  for (int r = 0; r < n; ++r) {
    off[r] = total;
    len[r] = counts[r] * es;
    total += len[r];
  }
  auto* data = static_cast<unsigned char*>(buf);
  auto* result = static_cast<unsigned char*>(out);
  const size_t mine = len[k];
  if (n == 1 || total == 0) {
    if (mine != 0 && result != data + off[k]) std::memmove(result, data + off[k], mine);
    return;
  }

  if (total > kReducescatterDirectMaxBytes) {
    ring_pipeline(comm, data, off, len, dtype, op, /*reduce_scatter=*/true, /*allgather=*/false,
                  result, kChunkBytes, "reducescatter");
    return;
  }

  unsigned char* in = scratch(mine * static_cast<size_t>(n - 1));
  auto slot = [&](int r) { return in + mine * static_cast<size_t>(r < k ? r : r - 1); };
  std::vector<Comm::Xfer> xs;
  xs.reserve(2 * static_cast<size_t>(n - 1));
  for (int i = 1; i < n; ++i) {
    const int to = (k + i) % n, from = (k + n - i) % n;
    xs.push_back({Comm::Xfer::SEND, to, data + off[to], len[to]});
    xs.push_back({Comm::Xfer::RECV, from, slot(from), mine});
  }
  comm.run(xs, "reducescatter");
  if (mine == 0) return;
  // acc = in_0 (op) in_1 (op) ... (op) in_{n-1}, the same order on every rank.
  unsigned char* own = data + off[k];
  unsigned char* acc = k == 0 ? own : slot(0);
  for (int r = 1; r < n; ++r) reduce_into(acc, r == k ? own : slot(r), counts[k], dtype, op);
  if (acc != result) std::memmove(result, acc, mine);
}

}  // namespace bagua_hvd
