// allgatherv: direct (every rank sends its block to every peer in one round) for small totals and
// two ranks, pipelined ring for large ones (each block crosses each ring link once).
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void allgatherv(Comm& comm, const void* in, void* out, const std::vector<size_t>& bytes_per_rank) {
  const int n = comm.size(), k = comm.rank();
  if (bytes_per_rank.size() != static_cast<size_t>(n)) {
    throw std::invalid_argument("allgatherv: " + std::to_string(bytes_per_rank.size()) +
                                " block sizes for a process set of " + std::to_string(n) +
                                " ranks");
  }
  std::vector<size_t> off(n);
  size_t total = 0;
  for (int r = 0; r < n; ++r) {
    off[r] = total;
    total += bytes_per_rank[r];
  }
  auto* dst = static_cast<unsigned char*>(out);
  if (bytes_per_rank[k] != 0 && in != dst + off[k]) {
    std::memmove(dst + off[k], in, bytes_per_rank[k]);
  }
  if (n == 1 || total == 0) return;

  if (n == 2 || total <= kAllgatherDirectMaxBytes) {
    std::vector<Comm::Xfer> xs;
    xs.reserve(2 * static_cast<size_t>(n - 1));
    for (int i = 1; i < n; ++i) {
      const int to = (k + i) % n, from = (k + n - i) % n;
      xs.push_back({Comm::Xfer::SEND, to, dst + off[k], bytes_per_rank[k]});
      xs.push_back({Comm::Xfer::RECV, from, dst + off[from], bytes_per_rank[from]});
    }
    comm.run(xs, "allgather");
    return;
  }
  ring_pipeline(comm, dst, off, bytes_per_rank, DataType::UINT8, ReduceOp::SUM,
                /*reduce_scatter=*/false, /*allgather=*/true, nullptr, kChunkBytes, "allgather");
}

}  // namespace bagua_hvd
