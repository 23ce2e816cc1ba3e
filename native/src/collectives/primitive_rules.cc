// What BAGUA's primitives accept and whom they exchange with, shared by their host forms
// (allreduce_minmax_uint8.cc, decentralized.cc) and their phased forms (stream_backend.h).
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void check_minmax_uint8_dtype(DataType dtype, const char* what) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16) {
    throw std::invalid_argument(std::string(what) +
                                ": MinMaxUInt8 needs float32, float16 or bfloat16 data, got " +
                                dtype_name(dtype));
  }
}

void check_peer_average_dtype(DataType dtype) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16 &&
      dtype != DataType::FLOAT64) {
    throw std::invalid_argument(std::string("decentralized: weights must be floating point, got ") +
                                dtype_name(dtype));
  }
}

int shift_one_peer(int rank, int n, int64_t step) {
  // BAGUA's rotating bipartite matching over m = n (even) or n + 1 (odd: virtual rank n).
  const int64_t m = n % 2 == 0 ? n : n + 1, h = m / 2;
  const int64_t s = step % h;
  if (rank < h) return static_cast<int>((s + rank) % h + h);
  return static_cast<int>((((rank - h - s) % h) + h) % h);
}

}  // namespace bagua_hvd
