// decentralized_average (decentralized.cc) in whole-buffer phases over a StreamBackend
// (stream_backend.h): exchange with the round's peers, then one averaging pass, the pass
// decentralized.cc makes piece by piece as the bytes arrive (the same bits).
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/stream_backend.h"

namespace bagua_hvd {
namespace {
enum Slot { kLeft = 0, kRight = 1 };
}  // namespace

void decentralized_average_phased(StreamBackend& be, const void* in, void* out, size_t count,
                                  DataType dtype, PeerMode mode, int64_t step) {
  check_peer_average_dtype(dtype);
  const int n = be.size(), me = be.rank();
  const size_t bytes = count * dtype_size(dtype);
  if (in != out) be.copy(out, in, bytes);
  if (n <= 1 || count == 0) return;
  switch (mode) {
    case PeerMode::ALL:
      be.allreduce_sum(out, count, dtype);
      be.scale(out, count, dtype, 1.0 / n);
      return;
    case PeerMode::SHIFT_ONE: {
      const int peer = shift_one_peer(me, n, step);
      if (peer >= n) return;  // the rank left over this round (odd n) keeps its weights
      void* theirs = be.scratch(kLeft, bytes);
      be.sendrecv({peer}, out, {peer}, {theirs}, bytes);
      be.average(out, theirs, nullptr, count, dtype);
      return;
    }
    case PeerMode::RING: {
      const int left = (me + n - 1) % n, right = (me + 1) % n;
      void* l = be.scratch(kLeft, bytes);
      if (left == right) {  // n = 2: the one neighbour counts twice
        be.sendrecv({right}, out, {left}, {l}, bytes);
        be.average(out, l, l, count, dtype);
      } else {
        void* r = be.scratch(kRight, bytes);
        be.sendrecv({left, right}, out, {left, right}, {l, r}, bytes);
        be.average(out, l, r, count, dtype);
      }
      return;
    }
  }
  throw std::invalid_argument("decentralized: unknown peer selection mode " +
                              std::to_string(static_cast<int>(mode)));
}

}  // namespace bagua_hvd
