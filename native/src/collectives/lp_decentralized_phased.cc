// The low-precision ring (decentralized.cc: lp_decentralized_init, _exchange and the step) in
// whole-buffer phases over a StreamBackend (stream_backend.h): the local half (difference,
// MinMaxUInt8, the own replica advanced, x = it), then the compressed differences exchanged with
// both neighbours, whose replicas advance by them. The pipelined CPU form does the same work
// block by block, element-wise: the same bits.
#include "collectives/building_blocks.h"
#include "collectives/stream_backend.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {
enum Slot { kDiff = 0, kMine = 1, kLeft = 2, kRight = 3, kDecoded = 4 };
}  // namespace

void lp_decentralized_init_phased(StreamBackend& be, const void* x, void* self, void* left,
                                  void* right, size_t count, DataType dtype) {
  const int n = be.size(), me = be.rank();
  const size_t bytes = count * dtype_size(dtype);
  if (self != x) be.copy(self, x, bytes);
  if (n <= 1) {
    be.copy(left, x, bytes);
    be.copy(right, x, bytes);
    return;
  }
  const int l = (me + n - 1) % n, r = (me + 1) % n;
  if (l == r) {
    be.sendrecv({r}, x, {l}, {left}, bytes);
    be.copy(right, left, bytes);
  } else {
    be.sendrecv({l, r}, x, {l, r}, {left, right}, bytes);
  }
}

void lp_decentralized_exchange_phased(StreamBackend& be, const uint8_t* c, void* left, void* right,
                                      size_t count, DataType dtype) {
  const int n = be.size(), me = be.rank();
  if (n <= 1 || count == 0) return;
  const size_t cbytes = minmax_uint8_bytes(dtype, count, 1);
  const int l = (me + n - 1) % n, r = (me + 1) % n;
  auto* cl = static_cast<uint8_t*>(be.scratch(kLeft, cbytes));
  void* dec = be.scratch(kDecoded, count * dtype_size(dtype));
  if (l == r) {  // n = 2: the one neighbour's difference advances both replicas
    be.sendrecv({r}, c, {l}, {cl}, cbytes);
    be.decompress(cl, dtype, count, 1, dec);
    be.add(left, dec, count, dtype);
    be.add(right, dec, count, dtype);
    return;
  }
  auto* cr = static_cast<uint8_t*>(be.scratch(kRight, cbytes));
  be.sendrecv({r, l}, c, {l, r}, {cl, cr}, cbytes);
  be.decompress(cl, dtype, count, 1, dec);
  be.add(left, dec, count, dtype);
  be.decompress(cr, dtype, count, 1, dec);
  be.add(right, dec, count, dtype);
}

void lp_decentralized_local_phased(StreamBackend& be, void* x, void* self, const void* left,
                                   const void* right, size_t count, DataType dtype, uint8_t* c,
                                   void* work) {
  check_minmax_uint8_dtype(dtype, "low-precision decentralized");
  if (count == 0) return;
  // d, c = MinMaxUInt8(d), self += D(c), x = self (what the neighbours will hold); D(c) is
  // decoded into d's buffer, which c no longer needs.
  be.lp_difference(work, x, left, right, self, count, dtype);
  be.compress(work, dtype, count, 1, c);
  be.decompress(c, dtype, count, 1, work);
  be.add(self, work, count, dtype);
  be.copy(x, self, count * dtype_size(dtype));
}

void lp_decentralized_phased(StreamBackend& be, void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype) {
  if (be.size() <= 1 || count == 0) return;  // as the CPU form: no local half either
  auto* c = static_cast<uint8_t*>(be.scratch(kMine, minmax_uint8_bytes(dtype, count, 1)));
  lp_decentralized_local_phased(be, x, self, left, right, count, dtype, c,
                                be.scratch(kDiff, count * dtype_size(dtype)));
  lp_decentralized_exchange_phased(be, c, left, right, count, dtype);
}

}  // namespace bagua_hvd
