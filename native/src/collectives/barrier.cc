// barrier: dissemination in ceil(log2 n) rounds; in round i every rank signals rank + 2^i and
// waits for rank - 2^i, so no rank leaves before every rank has entered.
#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void barrier(Comm& comm) {
  const int n = comm.size(), k = comm.rank();
  if (n <= 1) return;
  unsigned char token = 1, got = 0;
  std::vector<Comm::Xfer> xs(2);
  for (int d = 1; d < n; d <<= 1) {
    xs[0] = {Comm::Xfer::SEND, (k + d) % n, &token, 1};
    xs[1] = {Comm::Xfer::RECV, (k + n - d) % n, &got, 1};
    comm.run(xs, "barrier");
  }
}

}  // namespace bagua_hvd
