// alltoallv: every pair exchanges its blocks concurrently in one round; the block to self is a
// local copy.
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
               const std::vector<size_t>& recv_bytes) {
  const int n = comm.size(), k = comm.rank();
  if (send_bytes.size() != static_cast<size_t>(n) || recv_bytes.size() != static_cast<size_t>(n)) {
    throw std::invalid_argument("alltoallv: " + std::to_string(send_bytes.size()) + " send and " +
                                std::to_string(recv_bytes.size()) +
                                " receive sizes for a process set of " + std::to_string(n) +
                                " ranks");
  }
  if (send_bytes[k] != recv_bytes[k]) {
    throw std::invalid_argument("alltoallv: sends " + std::to_string(send_bytes[k]) +
                                " bytes to itself but expects " + std::to_string(recv_bytes[k]));
  }
  std::vector<size_t> soff(n), roff(n);
  for (int r = 1; r < n; ++r) {
    soff[r] = soff[r - 1] + send_bytes[r - 1];
    roff[r] = roff[r - 1] + recv_bytes[r - 1];
  }
  auto* src = static_cast<unsigned char*>(const_cast<void*>(in));
  auto* dst = static_cast<unsigned char*>(out);
  if (recv_bytes[k] != 0) std::memmove(dst + roff[k], src + soff[k], recv_bytes[k]);
  if (n == 1) return;

  std::vector<Comm::Xfer> xs;
  xs.reserve(2 * static_cast<size_t>(n - 1));
  for (int i = 1; i < n; ++i) {
    const int to = (k + i) % n, from = (k + n - i) % n;
    xs.push_back({Comm::Xfer::SEND, to, src + soff[to], send_bytes[to]});
    xs.push_back({Comm::Xfer::RECV, from, dst + roff[from], recv_bytes[from]});
  }
  comm.run(xs, "alltoall");
}

}  // namespace bagua_hvd
