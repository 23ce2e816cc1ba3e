// BAGUA's decentralized primitives: the full-precision peer average of weights (all, shift_one,
// ring) and the low-precision ring step with compressed differences. Math: docs/algorithms.md.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/collectives.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

void check_float(DataType dtype, const char* what) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16 &&
      dtype != DataType::FLOAT64) {
    throw std::invalid_argument(std::string(what) + ": weights must be floating point, got " +
                                dtype_name(dtype));
  }
}

// One concurrent exchange: sends `out` to every peer in `to`, receives from every peer in
// `from` into the matching buffer.
void exchange(Comm& comm, const std::vector<int>& to, const void* out, size_t bytes,
              const std::vector<int>& from, const std::vector<void*>& in, const char* what) {
  std::vector<Comm::Xfer> xs;
  for (int p : to) xs.push_back({Comm::Xfer::SEND, p, const_cast<void*>(out), bytes});
  for (size_t i = 0; i < from.size(); ++i) xs.push_back({Comm::Xfer::RECV, from[i], in[i], bytes});
  comm.run(xs, what);
}

}  // namespace

int shift_one_peer(int rank, int n, int64_t step) {
  // BAGUA's rotating bipartite matching over m = n (even) or n + 1 (odd: virtual rank n).
  const int64_t m = n % 2 == 0 ? n : n + 1, h = m / 2;
  const int64_t s = step % h;
  if (rank < h) return static_cast<int>((s + rank) % h + h);
  return static_cast<int>((((rank - h - s) % h) + h) % h);
}

void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                           PeerMode mode, int64_t step) {
  check_float(dtype, "decentralized");
  const int n = comm.size(), me = comm.rank();
  const size_t es = dtype_size(dtype), bytes = count * es;
  if (in != out && bytes) std::memmove(out, in, bytes);
  if (n <= 1 || count == 0) return;
  switch (mode) {
    case PeerMode::ALL:
      allreduce(comm, out, count, dtype, ReduceOp::SUM);
      scale_buffer(out, count, dtype, 1.0 / n);
      return;
    case PeerMode::SHIFT_ONE: {
      const int peer = shift_one_peer(me, n, step);
      if (peer >= n) return;  // the rank left over this round (odd n) keeps its weights
      std::vector<unsigned char> theirs(bytes);
      exchange(comm, {peer}, out, bytes, {peer}, {theirs.data()}, "decentralized shift_one");
      std::vector<float> a(count), b(count);
      to_float(out, dtype, count, a.data());
      to_float(theirs.data(), dtype, count, b.data());
      for (size_t i = 0; i < count; ++i) a[i] = (a[i] + b[i]) / 2.0f;  // symmetric in a, b
      from_float(a.data(), dtype, count, out);
      return;
    }
    case PeerMode::RING: {
      const int left = (me + n - 1) % n, right = (me + 1) % n;
      std::vector<unsigned char> l(bytes), r(bytes);
      if (left == right) {  // n = 2: the one neighbour counts twice
        exchange(comm, {right}, out, bytes, {left}, {l.data()}, "decentralized ring");
        std::memcpy(r.data(), l.data(), bytes);
      } else {
        exchange(comm, {left, right}, out, bytes, {left, right}, {l.data(), r.data()},
                 "decentralized ring");
      }
      std::vector<float> x(count), a(count), b(count);
      to_float(out, dtype, count, x.data());
      to_float(l.data(), dtype, count, a.data());
      to_float(r.data(), dtype, count, b.data());
      for (size_t i = 0; i < count; ++i) x[i] = ((a[i] + x[i]) + b[i]) / 3.0f;
      from_float(x.data(), dtype, count, out);
      return;
    }
  }
  throw std::invalid_argument("decentralized: unknown peer selection mode " +
                              std::to_string(static_cast<int>(mode)));
}

void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                      DataType dtype) {
  if (dtype != DataType::FLOAT32 && dtype != DataType::FLOAT16 && dtype != DataType::BFLOAT16) {
    throw std::invalid_argument(std::string("low-precision decentralized: MinMaxUInt8 needs "
                                            "float32, float16 or bfloat16 weights, got ") +
                                dtype_name(dtype));
  }
  const int n = comm.size(), me = comm.rank();
  if (n <= 1 || count == 0) return;
  const size_t es = dtype_size(dtype), bytes = count * es;
  // d = x + L/3 + R/3 - (5/3) s, in float32, stored as T for the compressor.
  std::vector<float> fx(count), fl(count), fr(count), fs(count);
  to_float(x, dtype, count, fx.data());
  to_float(left, dtype, count, fl.data());
  to_float(right, dtype, count, fr.data());
  to_float(self, dtype, count, fs.data());
  const float third = 1.0f / 3.0f, five_thirds = 5.0f / 3.0f;
  for (size_t i = 0; i < count; ++i)
    fx[i] = ((fx[i] + fl[i] * third) + fr[i] * third) - fs[i] * five_thirds;
  std::vector<unsigned char> d(bytes);
  from_float(fx.data(), dtype, count, d.data());
  const size_t cbytes = minmax_uint8_bytes(dtype, count, 1);
  std::vector<uint8_t> c(cbytes), cl(cbytes), cr(cbytes);
  minmax_uint8_compress(d.data(), dtype, count, 1, c.data());

  const int l = (me + n - 1) % n, r = (me + 1) % n;
  if (l == r) {
    exchange(comm, {r}, c.data(), cbytes, {l}, {cl.data()}, "low-precision decentralized");
    cr = cl;
  } else {
    exchange(comm, {l, r}, c.data(), cbytes, {l, r}, {cl.data(), cr.data()},
             "low-precision decentralized");
  }
  // Replicas advance by the decoded differences; x becomes exactly what the neighbours hold.
  std::vector<unsigned char> dec(bytes);
  minmax_uint8_decompress(cl.data(), dtype, count, 1, dec.data());
  reduce_into(left, dec.data(), count, dtype, ReduceOp::SUM);
  minmax_uint8_decompress(cr.data(), dtype, count, 1, dec.data());
  reduce_into(right, dec.data(), count, dtype, ReduceOp::SUM);
  minmax_uint8_decompress(c.data(), dtype, count, 1, dec.data());
  reduce_into(self, dec.data(), count, dtype, ReduceOp::SUM);
  std::memcpy(x, self, bytes);
}

}  // namespace bagua_hvd
