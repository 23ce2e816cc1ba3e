// Pipelined ring: the bandwidth-optimal schedule behind large allreduce, reducescatterv and
// allgatherv, and the run loop shared with the hierarchical allreduce (run_pipeline).
//
// Every segment is cut into chunks; chunk b of every segment forms "block" b, which walks through
// S = (reduce-scatter steps) + (allgather steps) ring steps. Block b performs step t - b in run t,
// so one Comm::run carries up to S blocks at different stages: the streams never drain between
// steps, and the chunk a rank just reduced is sent on while it is still in cache.
#include <algorithm>
#include <cstring>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {

void run_pipeline(Comm& comm, size_t blocks, int steps, const PipelineStep& emit,
                  const char* what) {
  if (steps <= 0 || blocks == 0) return;
  std::vector<Comm::Xfer> xs;
  const size_t last_step = static_cast<size_t>(steps - 1);
  const size_t runs = blocks + last_step;
  for (size_t t = 0; t < runs; ++t) {
    xs.clear();
    const size_t b_lo = t >= last_step ? t - last_step : 0;
    const size_t b_hi = std::min(blocks - 1, t);
    // Blocks in ascending order on both ends of every stream.
    for (size_t b = b_lo; b <= b_hi; ++b) emit(b, static_cast<int>(t - b), xs);
    comm.run(xs, what);
  }
}

void ring_pipeline(Comm& comm, unsigned char* buf, const std::vector<size_t>& seg_off,
                   const std::vector<size_t>& seg_len, DataType dtype, ReduceOp op,
                   bool reduce_scatter, bool allgather, unsigned char* rs_out, size_t chunk_bytes,
                   const char* what) {
  const int n = comm.size(), k = comm.rank();
  const size_t es = dtype_size(dtype);
  // Segment k is only written by the last reduce-scatter step, so it can be seeded into rs_out
  // first and reduced there.
  if (reduce_scatter && rs_out != nullptr && seg_len[k] != 0 && rs_out != buf + seg_off[k]) {
    std::memmove(rs_out, buf + seg_off[k], seg_len[k]);
  }
  const int rs_steps = reduce_scatter ? n - 1 : 0;
  const int steps = rs_steps + (allgather ? n - 1 : 0);
  if (steps == 0) return;

  const size_t chunk = std::max(es, chunk_bytes / es * es);
  const size_t longest = *std::max_element(seg_len.begin(), seg_len.end());
  const size_t blocks = std::max<size_t>(1, (longest + chunk - 1) / chunk);
  const int next = (k + 1) % n, prev = (k + n - 1) % n;
  auto seg = [n](int x) { return ((x % n) + n) % n; };

  run_pipeline(
      comm, blocks, steps,
      [&](size_t b, int s, std::vector<Comm::Xfer>& xs) {
        const bool rs = s < rs_steps;
        // Reduce-scatter step s: pass on segment k-s-1 (reduced by s+1 ranks so far), fold this
        // rank's data into k-s-2. Allgather step j: pass on k-j, receive k-j-1.
        const int j = s - rs_steps;
        const int send_seg = rs ? seg(k - s - 1) : seg(k - j);
        const int recv_seg = rs ? seg(k - s - 2) : seg(k - j - 1);
        const size_t off = b * chunk;
        if (off < seg_len[send_seg]) {
          const size_t len = std::min(chunk, seg_len[send_seg] - off);
          xs.push_back({Comm::Xfer::SEND, next, buf + seg_off[send_seg] + off, len});
        }
        if (off < seg_len[recv_seg]) {
          const size_t len = std::min(chunk, seg_len[recv_seg] - off);
          unsigned char* dst = buf + seg_off[recv_seg] + off;
          if (rs && s == rs_steps - 1 && rs_out != nullptr) dst = rs_out + off;  // recv_seg == k
          xs.push_back(
              {rs ? Comm::Xfer::RECV_REDUCE : Comm::Xfer::RECV, prev, dst, len, dtype, op});
        }
      },
      what);
}

}  // namespace bagua_hvd
