// broadcast: the root sends to every peer in one round for small buffers (and always for two
// ranks); large buffers flow down a chain root -> root+1 -> ... in chunks, every rank forwarding
// chunk c while it receives chunk c+1, so each byte crosses n-1 links once and all links are busy.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void broadcast(Comm& comm, void* buf, size_t bytes, int root) {
  const int n = comm.size(), k = comm.rank();
  if (root < 0 || root >= n) {
    throw std::invalid_argument("broadcast: root " + std::to_string(root) +
                                " is not a rank of the process set (size " + std::to_string(n) +
                                ")");
  }
  if (n == 1 || bytes == 0) return;
  auto* data = static_cast<unsigned char*>(buf);
  std::vector<Comm::Xfer> xs;

  if (n == 2 || bytes * static_cast<size_t>(n - 1) <= kBroadcastDirectMaxBytes) {
    if (k == root) {
      for (int i = 1; i < n; ++i) xs.push_back({Comm::Xfer::SEND, (root + i) % n, data, bytes});
    } else {
      xs.push_back({Comm::Xfer::RECV, root, data, bytes});
    }
    comm.run(xs, "broadcast");
    return;
  }

  const int pos = (k - root + n) % n;  // place in the chain
  const int succ = (k + 1) % n, pred = (k + n - 1) % n;
  const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  auto chunk = [&](size_t c) { return std::min(kChunkBytes, bytes - c * kChunkBytes); };
  // Chunk c crosses link (p, p+1) in run c + p.
  const size_t runs = chunks + static_cast<size_t>(n) - 2;
  for (size_t t = 0; t < runs; ++t) {
    xs.clear();
    if (pos < n - 1 && t >= static_cast<size_t>(pos) && t - pos < chunks) {
      const size_t c = t - pos;
      xs.push_back({Comm::Xfer::SEND, succ, data + c * kChunkBytes, chunk(c)});
    }
    if (pos > 0 && t + 1 >= static_cast<size_t>(pos) && t + 1 - pos < chunks) {
      const size_t c = t + 1 - pos;
      xs.push_back({Comm::Xfer::RECV, pred, data + c * kChunkBytes, chunk(c)});
    }
    if (!xs.empty()) comm.run(xs, "broadcast");
  }
}

}  // namespace bagua_hvd
