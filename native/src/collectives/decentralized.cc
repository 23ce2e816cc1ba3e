// BAGUA's decentralized primitives: the full-precision peer average of weights (all, shift_one,
// ring) and the low-precision ring step with compressed differences. Math: docs/algorithms.md.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// One concurrent exchange: sends `out` to every peer in `to`, receives from every peer in
// `from` into the matching buffer.
void exchange(Comm& comm, const std::vector<int>& to, const void* out, size_t bytes,
              const std::vector<int>& from, const std::vector<void*>& in, const char* what) {
  std::vector<Comm::Xfer> xs;
  for (int p : to) xs.push_back({Comm::Xfer::SEND, p, const_cast<void*>(out), bytes});
  for (size_t i = 0; i < from.size(); ++i) xs.push_back({Comm::Xfer::RECV, from[i], in[i], bytes});
  comm.run(xs, what);
}

// Element-wise f over float32 blocks: out[i] = f(a[i], b[i], ...) for up to four typed inputs of
// the same dtype, written (rounded once) to out, which may alias an input. float64 is computed
// in double where f takes doubles (the peer averages), so its weights keep their precision.
template <typename F>
void blockwise(DataType dtype, size_t n, void* out, std::initializer_list<const void*> in, F&& f) {
  const size_t k = in.size();
  if constexpr (std::is_invocable_v<F, const double*>) {
    if (dtype == DataType::FLOAT64) {
      const double* p[4] = {};
      size_t j = 0;
      for (const void* q : in) p[j++] = static_cast<const double*>(q);
      auto* o = static_cast<double*>(out);
      for (size_t e = 0; e < n; ++e) {
        const double v[4] = {p[0][e], k > 1 ? p[1][e] : 0.0, k > 2 ? p[2][e] : 0.0,
                             k > 3 ? p[3][e] : 0.0};
        o[e] = f(v);
      }
      return;
    }
  }
  const size_t es = dtype_size(dtype);
  float buf[4][kFloatBlock];
  for (size_t i = 0; i < n; i += kFloatBlock) {
    const size_t m = std::min(kFloatBlock, n - i);
    size_t j = 0;
    for (const void* p : in) to_float(static_cast<const unsigned char*>(p) + i * es, dtype, m,
                                      buf[j++]);
    for (size_t e = 0; e < m; ++e) {
      float v[4] = {buf[0][e], k > 1 ? buf[1][e] : 0.0f, k > 2 ? buf[2][e] : 0.0f,
                    k > 3 ? buf[3][e] : 0.0f};
      buf[0][e] = f(v);
    }
    from_float(buf[0], dtype, m, static_cast<unsigned char*>(out) + i * es);
  }
}

enum Slot { kPeerA = 0, kPeerB = 1, kDiff = 2, kMine = 3, kLeft = 4, kRight = 5, kDecoded = 6 };

// Elements per piece of a peer average computed while the exchange is still on the wire.
constexpr size_t kAverageBlock = 64 << 10;

// One concurrent exchange of `count` elements that averages as it goes: sends `out` to every
// peer in `to`, receives from every peer in `from` into the matching buffer, and runs
// combine(begin, end) on each range of elements once every receive holds it and every send is
// past it (combine overwrites `out`), in order, a piece at a time; the link no longer idles
// through a whole-bucket pass after the last byte. Element-wise, so the bits of one pass after.
template <typename F>
void exchange_combining(Comm& comm, const std::vector<int>& to, void* out, size_t count, size_t es,
                        const std::vector<int>& from, const std::vector<void*>& in,
                        const char* what, F&& combine) {
  std::vector<Comm::Xfer> xs;
  const size_t bytes = count * es;
  for (int p : to) xs.push_back({Comm::Xfer::SEND, p, out, bytes});
  for (size_t i = 0; i < from.size(); ++i) xs.push_back({Comm::Xfer::RECV, from[i], in[i], bytes});
  size_t combined = 0;
  const Comm::Work work = [&]() -> bool {
    size_t frontier = bytes;
    for (const Comm::Xfer& x : xs) frontier = std::min(frontier, x.done);
    const size_t upto = frontier / es;
    if (upto == combined || (upto - combined < kAverageBlock && upto < count)) return false;
    const size_t end = std::min(upto, combined + kAverageBlock);
    combine(combined, end);
    combined = end;
    return true;
  };
  comm.run(xs, what, work);
  if (combined < count) combine(combined, count);
}

// Elements per piece of the exchange's decoding, done while further bytes arrive.
constexpr size_t kLpBlock = 128 << 10;

}  // namespace

void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                           PeerMode mode, int64_t step) {
  check_peer_average_dtype(dtype);
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
      unsigned char* theirs = scratch_slot(kPeerA, bytes);
      auto* mine = static_cast<unsigned char*>(out);
      // (a + b) / 2 is symmetric in a and b: both ranks of the pair hold the same bits.
      exchange_combining(comm, {peer}, out, count, es, {peer}, {theirs}, "decentralized shift_one",
                         [&](size_t b, size_t e) {
                           blockwise(dtype, e - b, mine + b * es, {mine + b * es, theirs + b * es},
                                     [](const auto* v) { return (v[0] + v[1]) / 2; });
                         });
      return;
    }
    case PeerMode::RING: {
      const int left = (me + n - 1) % n, right = (me + 1) % n;
      unsigned char* l = scratch_slot(kPeerA, bytes);
      unsigned char* r = l;
      auto* mine = static_cast<unsigned char*>(out);
      auto average = [&](size_t b, size_t e) {
        const size_t o = b * es;
        blockwise(dtype, e - b, mine + o, {mine + o, l + o, r + o}, [](const auto* v) {
          return ((v[1] + v[0]) + v[2]) / 3;
        });
      };
      if (left == right) {  // n = 2: the one neighbour counts twice
        exchange_combining(comm, {right}, out, count, es, {left}, {l}, "decentralized ring",
                           average);
      } else {
        r = scratch_slot(kPeerB, bytes);
        exchange_combining(comm, {left, right}, out, count, es, {left, right}, {l, r},
                           "decentralized ring", average);
      }
      return;
    }
  }
  throw std::invalid_argument("decentralized: unknown peer selection mode " +
                              std::to_string(static_cast<int>(mode)));
}

void lp_decentralized_local(void* x, void* self, const void* left, const void* right,
                            size_t count, DataType dtype, uint8_t* c) {
  const XSegment one{x, count};
  lp_decentralized_local(&one, count ? 1 : 0, self, left, right, dtype, c);
}

void lp_decentralized_local(const XSegment* xs, size_t num_segments, void* self,
                            const void* left, const void* right, DataType dtype, uint8_t* c) {
  check_minmax_uint8_dtype(dtype, "low-precision decentralized");
  size_t count = 0;
  for (size_t g = 0; g < num_segments; ++g) count += xs[g].count;
  if (count == 0) return;
  TraceSpan span(TraceOp::kLpLocal, static_cast<int64_t>(count));
  const size_t es = dtype_size(dtype);
  const size_t bytes = count * es;
  // Runs f(x_piece, i, m) over elements [i, i + m) of the bucket in pieces of at most kLpBlock
  // elements that do not cross a segment of x (element-wise work: the split changes no bits).
  auto pieces = [&](auto&& f) {
    size_t i = 0;
    for (size_t g = 0; g < num_segments; ++g) {
      unsigned char* xg = static_cast<unsigned char*>(xs[g].data);
      for (size_t k = 0; k < xs[g].count; k += kLpBlock) {
        const size_t m = std::min(kLpBlock, xs[g].count - k);
        f(xg + k * es, i, m);
        i += m;
      }
    }
  };
  // d = x + L/3 + R/3 - (5/3) s, in float32, stored as T for the compressor, and the chunk's
  // min and max on the way. Then, per block: c = MinMaxUInt8(d), and x becomes exactly what the
  // neighbours will hold: s += D(c), x = s. Two passes over the bucket, each block's decoded
  // difference staying in cache (element-wise: the bits of compress(d), decompress, add, copy).
  // (Scratch of the calling thread: the training thread's own when called through the C API.)
  unsigned char* d = scratch_slot(kDiff, bytes);
  const float third = 1.0f / 3.0f, five_thirds = 5.0f / 3.0f;
  MinMaxUint8Scan scan;
  pieces([&](unsigned char* xp, size_t i, size_t m) {
    const size_t o = i * es;
    if (dtype == DataType::FLOAT32) {  // the same expression on the buffers themselves
      const float* xf = reinterpret_cast<const float*>(xp);
      const float* lf = static_cast<const float*>(left) + i;
      const float* rf = static_cast<const float*>(right) + i;
      const float* sf = static_cast<const float*>(self) + i;
      float* df = reinterpret_cast<float*>(d) + i;
      for (size_t k = 0; k < m; ++k)
        df[k] = ((xf[k] + lf[k] * third) + rf[k] * third) - sf[k] * five_thirds;
    } else {
      blockwise(dtype, m, d + o,
                {xp, static_cast<const unsigned char*>(left) + o,
                 static_cast<const unsigned char*>(right) + o,
                 static_cast<unsigned char*>(self) + o},
                [&](const float* v) {
                  return ((v[0] + v[1] * third) + v[2] * third) - v[3] * five_thirds;
                });
    }
    minmax_uint8_scan_range(d + o, dtype, m, &scan);
  });
  minmax_uint8_write_header(scan, dtype, count, c);
  unsigned char* dec = scratch_slot(kDecoded, kLpBlock * es);
  pieces([&](unsigned char* xp, size_t i, size_t m) {
    const size_t o = i * es;
    unsigned char* s_i = static_cast<unsigned char*>(self) + o;
    minmax_uint8_compress_range(d + o, dtype, i, m, c);
    minmax_uint8_decompress_range(c, dtype, i, m, dec);
    if (dtype == DataType::FLOAT32) {  // s += D(c); x = s, in one pass
      float* sf = reinterpret_cast<float*>(s_i);
      float* xf = reinterpret_cast<float*>(xp);
      const float* df = reinterpret_cast<const float*>(dec);
      for (size_t k = 0; k < m; ++k) xf[k] = sf[k] = sf[k] + df[k];
    } else {
      reduce_into(s_i, dec, m, dtype, ReduceOp::SUM);
      std::memcpy(xp, s_i, m * es);
    }
  });
}

void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                               size_t count, DataType dtype) {
  const int n = comm.size(), me = comm.rank();
  if (n <= 1 || count == 0) return;
  TraceSpan span(TraceOp::kLpExchange, static_cast<int64_t>(count));
  const size_t es = dtype_size(dtype);
  const size_t cbytes = minmax_uint8_bytes(dtype, count, 1);
  const size_t header = cbytes - ((count + 31) / 32) * 32;
  uint8_t* cl = scratch_slot(kLeft, cbytes);
  uint8_t* cr = cl;
  const int l = (me + n - 1) % n, r = (me + 1) % n;
  std::vector<Comm::Xfer> xs;
  xs.push_back({Comm::Xfer::SEND, r, const_cast<uint8_t*>(c), cbytes});
  if (l != r) {
    cr = scratch_slot(kRight, cbytes);
    xs.push_back({Comm::Xfer::SEND, l, const_cast<uint8_t*>(c), cbytes});
  }
  const size_t rx_left = xs.size();
  xs.push_back({Comm::Xfer::RECV, l, cl, cbytes});
  if (l != r) xs.push_back({Comm::Xfer::RECV, r, cr, cbytes});
  // The neighbours' replicas advance by their decoded differences, block by block as the bytes
  // arrive (element-wise: the same bits as decoding the whole difference after the exchange).
  // n = 2: the one neighbour's difference advances both replicas.
  unsigned char* dec = scratch_slot(kDecoded, kLpBlock * es);
  size_t done_l = 0, done_r = 0;
  auto advance = [&](const uint8_t* cd, size_t arrived, size_t& done, void* rep, void* rep2) {
    const size_t avail = arrived <= header ? 0 : std::min(count, arrived - header);
    if (avail <= done) return false;
    const size_t m = std::min(kLpBlock, avail - done);
    minmax_uint8_decompress_range(cd, dtype, done, m, dec);
    reduce_into(static_cast<unsigned char*>(rep) + done * es, dec, m, dtype, ReduceOp::SUM);
    if (rep2) reduce_into(static_cast<unsigned char*>(rep2) + done * es, dec, m, dtype,
                          ReduceOp::SUM);
    done += m;
    return true;
  };
  auto work = [&]() -> bool {
    if (l == r) return advance(cl, xs[rx_left].done, done_l, left, right);
    const bool a = advance(cl, xs[rx_left].done, done_l, left, nullptr);
    const bool b = advance(cr, xs[rx_left + 1].done, done_r, right, nullptr);
    return a || b;
  };
  comm.run(xs, "low-precision decentralized", work);
  if (done_l != count || (l != r && done_r != count))
    throw std::logic_error("low-precision decentralized: a difference is undecoded");
}

void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                      DataType dtype) {
  if (comm.size() <= 1 || count == 0) return;
  uint8_t* c = scratch_slot(kMine, minmax_uint8_bytes(dtype, count, 1));
  lp_decentralized_local(x, self, left, right, count, dtype, c);
  lp_decentralized_exchange(comm, c, left, right, count, dtype);
}

void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                           size_t count, DataType dtype) {
  const int n = comm.size(), me = comm.rank();
  const size_t bytes = count * dtype_size(dtype);
  if (self != x) std::memcpy(self, x, bytes);
  if (n <= 1) {
    std::memcpy(left, x, bytes);
    std::memcpy(right, x, bytes);
    return;
  }
  const int l = (me + n - 1) % n, r = (me + 1) % n;
  if (l == r) {
    exchange(comm, {r}, x, bytes, {l}, {left}, "low-precision decentralized initialisation");
    std::memcpy(right, left, bytes);
  } else {
    exchange(comm, {l, r}, x, bytes, {l, r}, {left, right},
             "low-precision decentralized initialisation");
  }
}

}  // namespace bagua_hvd
