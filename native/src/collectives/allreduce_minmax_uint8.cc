// ByteGrad (BAGUA's CentralizedLowPrecisionSynchronous): compressed alltoall, mean of this rank's
// chunk in float32, re-compression of that chunk, compressed allgather. Optional error feedback on
// both quantizations (BAGUA has none). Math: docs/algorithms.md.
//
// Pipelined: each phase's CPU work runs in blocks between passes of the transfers (Comm::run's
// work), so a block is on the wire while the next one is compressed and received bytes are
// decoded as they arrive. The bytes sent and every float operation are those of the phases run
// one after the other (the kernels are element-wise; each chunk's header is computed from the
// whole chunk before any of its values; the sum adds rank j's value of an element only after rank
// j - 1's), so the result is bit-identical to the unpipelined form.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// Elements per piece of pipelined work: ~0.1 ms of CPU, and 128 KiB on the wire.
constexpr size_t kPipeBlock = 128 << 10;

// dst = a - b in the element type (float32 arithmetic, rounded once), in cache-sized blocks.
void subtract(void* dst, const void* a, const void* b, size_t n, DataType dtype) {
  const size_t es = dtype_size(dtype);
  float fa[kFloatBlock], fb[kFloatBlock];
  for (size_t i = 0; i < n; i += kFloatBlock) {
    const size_t m = std::min(kFloatBlock, n - i);
    to_float(static_cast<const unsigned char*>(a) + i * es, dtype, m, fa);
    to_float(static_cast<const unsigned char*>(b) + i * es, dtype, m, fb);
    for (size_t k = 0; k < m; ++k) fa[k] -= fb[k];
    from_float(fa, dtype, m, static_cast<unsigned char*>(dst) + i * es);
  }
}

enum Slot { kInput, kCompressed, kDecoded, kMine, kSum, kChunk, kGathered, kBlock };

// Compresses chunk `src` (c elements) into `dst` block by block; after each block the
// residual (if any) becomes src - Decompress(dst) for it and `*ready` (if any) covers it.
class ChunkCompressor {
 public:
  ChunkCompressor() = default;
  // scanned: the chunk's min and max when the caller already has them (no scan here).
  ChunkCompressor(const unsigned char* src, size_t c, DataType dtype, uint8_t* dst,
                  unsigned char* residual, size_t* ready,
                  const MinMaxUint8Scan* scanned = nullptr)
      : src_(src), c_(c), dtype_(dtype), dst_(dst), residual_(residual), ready_(ready),
        scanned_(scanned), bytes_(minmax_uint8_bytes(dtype, c, 1)),
        header_(bytes_ - ((c + 31) / 32) * 32) {}

  bool done() const { return started_ && next_ == c_; }

  // One piece: the header (a scan of the chunk) or the next block. False when done.
  bool step() {
    if (done()) return false;
    const size_t es = dtype_size(dtype_);
    if (!started_) {
      if (scanned_) {
        minmax_uint8_write_header(*scanned_, dtype_, c_, dst_);
      } else {
        minmax_uint8_compress_header(src_, dtype_, c_, dst_);
      }
      started_ = true;
    } else {
      const size_t m = std::min(kPipeBlock, c_ - next_);
      minmax_uint8_compress_range(src_ + next_ * es, dtype_, next_, m, dst_);
      if (residual_) {
        unsigned char* dec = scratch_slot(kBlock, m * es);
        minmax_uint8_decompress_range(dst_, dtype_, next_, m, dec);
        subtract(residual_ + next_ * es, src_ + next_ * es, dec, m, dtype_);
      }
      next_ += m;
    }
    // The header and the values so far may go; the payload's padding with the last block.
    if (ready_) *ready_ = next_ == c_ ? bytes_ : header_ + next_;
    return true;
  }

 private:
  const unsigned char* src_ = nullptr;
  size_t c_ = 0;
  DataType dtype_ = DataType::FLOAT32;
  uint8_t* dst_ = nullptr;
  unsigned char* residual_ = nullptr;
  size_t* ready_ = nullptr;
  const MinMaxUint8Scan* scanned_ = nullptr;
  size_t bytes_ = 0, header_ = 0;
  bool started_ = false;
  size_t next_ = 0;
};

// Decoded elements available in a compressed chunk of c elements of which `bytes` arrived.
size_t arrived_elements(size_t bytes, size_t c, size_t header) {
  return bytes <= header ? 0 : std::min(c, bytes - header);
}

}  // namespace

void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                            void* ef_worker, void* ef_server) {
  check_minmax_uint8_dtype(dtype, "compressed allreduce");
  const int n = comm.size(), me = comm.rank();
  if (n <= 1 || count == 0) return;
  TraceSpan span(TraceOp::kCompressedAllreduce, count);
  const size_t es = dtype_size(dtype);
  const size_t chunk = (count + n - 1) / n, padded = chunk * n;
  const size_t cbytes = minmax_uint8_bytes(dtype, chunk, 1);
  const size_t hbytes = cbytes - ((chunk + 31) / 32) * 32;  // a chunk's header, before its values

  // 1-2. The (padded) input plus the worker residual, compressed in n chunks.
  unsigned char* g = static_cast<unsigned char*>(buf);
  if (padded != count || ef_worker) {
    g = scratch_slot(kInput, padded * es);
    std::memcpy(g, buf, count * es);
    std::memset(g + count * es, 0, (padded - count) * es);
    if (ef_worker) reduce_into(g, ef_worker, padded, dtype, ReduceOp::SUM);
  }
  uint8_t* q = scratch_slot(kCompressed, cbytes * n);
  uint8_t* mine = scratch_slot(kMine, cbytes * n);
  auto* ew = static_cast<unsigned char*>(ef_worker);

  // 3-4. Chunk j goes to rank j (the next ranks' first, as their sends wait for them); this
  // rank's own chunk is compressed straight into its slot of `mine`. Meanwhile the sum (or mean)
  // of the n decoded copies of chunk `me`, in rank order, in float32, follows the bytes received.
  std::vector<Comm::Xfer> xfers;
  xfers.reserve(2 * static_cast<size_t>(n));
  std::vector<int> recv_of(n, -1), send_of(n, -1);
  for (int s = 1; s < n; ++s) {
    const int j = (me + s) % n;
    send_of[j] = static_cast<int>(xfers.size());
    xfers.push_back({Comm::Xfer::SEND, j, q + j * cbytes, cbytes});
    xfers.back().ready = 0;
  }
  for (int s = 1; s < n; ++s) {
    const int j = (me - s + n) % n;
    recv_of[j] = static_cast<int>(xfers.size());
    xfers.push_back({Comm::Xfer::RECV, j, mine + j * cbytes, cbytes});
  }
  std::vector<ChunkCompressor> comp;
  comp.reserve(n);
  for (int s = 1; s <= n; ++s) {
    const int j = (me + s) % n;
    uint8_t* dst = j == me ? mine + me * cbytes : q + j * cbytes;
    comp.emplace_back(g + j * chunk * es, chunk, dtype, dst, ew ? ew + j * chunk * es : nullptr,
                      j == me ? nullptr : &xfers[send_of[j]].ready);
  }
  auto* acc = reinterpret_cast<float*>(scratch_slot(kSum, chunk * sizeof(float)));
  std::memset(acc, 0, chunk * sizeof(float));
  unsigned char* a = scratch_slot(kChunk, chunk * es);
  auto* es_srv = static_cast<unsigned char*>(ef_server);
  std::vector<size_t> summed(n, 0);  // elements of chunk `me` rank j's copy was added for
  size_t finished = 0;               // elements of `a` final (mean, rounded, server residual)
  size_t next_comp = 0;
  MinMaxUint8Scan a_scan;
  const float fn = static_cast<float>(n);
  auto phase1 = [&]() -> bool {
    bool did = false;
    while (next_comp < comp.size() && comp[next_comp].done()) ++next_comp;
    if (next_comp < comp.size()) did = comp[next_comp].step();
    // One block of the sum: the first rank whose copy can advance (available, and rank j - 1's
    // added there already).
    for (int j = 0; j < n; ++j) {
      size_t avail;
      if (j == me) {
        const ChunkCompressor& own = comp.back();
        avail = own.done() ? chunk : 0;  // its blocks land in `mine` without a transfer
      } else {
        avail = arrived_elements(xfers[recv_of[j]].done, chunk, hbytes);
      }
      if (j > 0) avail = std::min(avail, summed[j - 1]);
      if (avail > summed[j]) {
        const size_t m = std::min(kPipeBlock, avail - summed[j]);
        minmax_uint8_decompress_add_range(mine + j * cbytes, dtype, summed[j], m,
                                          acc + summed[j]);
        summed[j] += m;
        did = true;
        break;
      }
    }
    if (summed[n - 1] > finished) {
      const size_t i0 = finished, m = summed[n - 1] - finished;
      if (average)
        for (size_t i = i0; i < i0 + m; ++i) acc[i] /= fn;
      from_float(acc + i0, dtype, m, a + i0 * es);
      // 5. Plus the server residual.
      if (es_srv) reduce_into(a + i0 * es, es_srv + i0 * es, m, dtype, ReduceOp::SUM);
      minmax_uint8_scan_range(a + i0 * es, dtype, m, &a_scan);  // for the header of step 6
      finished += m;
      did = true;
    }
    return did;
  };
  comm.run(xfers, "compressed allreduce (alltoall)", phase1);
  if (finished != chunk) throw std::logic_error("compressed allreduce: the sum is incomplete");
  trace_mark(TraceOp::kCompressedAllreduceHalf, count);

  // 6-7. `a` re-compressed into this rank's slot of the allgather buffer, sent to every rank as
  // its blocks are ready; everybody decodes every chunk, its own included, so all ranks hold the
  // same bits.
  uint8_t* all = scratch_slot(kGathered, cbytes * n);
  unsigned char* out = static_cast<unsigned char*>(buf);
  if (padded != count) out = scratch_slot(kDecoded, padded * es);
  xfers.clear();
  size_t released = 0;
  for (int s = 1; s < n; ++s) {
    const int j = (me + s) % n;
    xfers.push_back({Comm::Xfer::SEND, j, all + me * cbytes, cbytes});
    xfers.back().ready = 0;
  }
  for (int s = 1; s < n; ++s) {
    const int j = (me - s + n) % n;
    recv_of[j] = static_cast<int>(xfers.size());
    xfers.push_back({Comm::Xfer::RECV, j, all + j * cbytes, cbytes});
  }
  ChunkCompressor mine_comp(a, chunk, dtype, all + me * cbytes, es_srv, &released, &a_scan);
  std::vector<size_t> decoded(n, 0);
  auto phase2 = [&]() -> bool {
    bool did = false;
    if (mine_comp.step()) {
      for (int s = 0; s < n - 1; ++s) xfers[s].ready = released;
      did = true;
    }
    for (int j = 0; j < n; ++j) {
      const size_t bytes = j == me ? released : xfers[recv_of[j]].done;
      const size_t avail = arrived_elements(bytes, chunk, hbytes);
      if (avail > decoded[j]) {
        const size_t m = std::min(kPipeBlock, avail - decoded[j]);
        minmax_uint8_decompress_range(all + j * cbytes, dtype, decoded[j], m,
                                      out + (j * chunk + decoded[j]) * es);
        decoded[j] += m;
        did = true;
        break;
      }
    }
    return did;
  };
  comm.run(xfers, "compressed allreduce (allgather)", phase2);
  for (int j = 0; j < n; ++j)
    if (decoded[j] != chunk) throw std::logic_error("compressed allreduce: a chunk is undecoded");
  if (padded != count) std::memcpy(buf, out, count * es);
}

}  // namespace bagua_hvd
