// Hierarchical allreduce as one two-level pipeline (collectives/building_blocks.h): the host's ring
// over shared memory and the cross-host ring over the network carry different blocks at once.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"

namespace bagua_hvd {

namespace {

// The set ranks in `comm` of the members of `sub`, in sub's order.
std::vector<int> set_ranks(const Comm& comm, const Comm& sub) {
  const std::vector<int>& all = comm.global_ranks();
  std::vector<int> out;
  for (int g : sub.global_ranks()) {
    auto it = std::lower_bound(all.begin(), all.end(), g);
    if (it == all.end() || *it != g)
      throw std::logic_error("hierarchical allreduce: rank " + std::to_string(g) +
                             " is not a member of the process set");
    out.push_back(static_cast<int>(it - all.begin()));
  }
  return out;
}

// Piece i of count elements cut into n near-equal pieces, the first count % n one longer.
size_t piece(size_t count, int n, int i) {
  return count / n + (static_cast<size_t>(i) < count % n ? 1 : 0);
}

int wrap(int x, int n) { return ((x % n) + n) % n; }

}  // namespace

void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                            DataType dtype, ReduceOp op, size_t chunk_bytes) {
  check_reduction(dtype, op, "allreduce");
  if (count == 0 || comm.size() <= 1) return;
  const int n = host.size(), m = cross.size(), k = host.rank(), c = cross.rank();
  const size_t es = dtype_size(dtype);
  auto* data = static_cast<unsigned char*>(buf);
  if (count * es <= kAllreduceDirectMaxBytes) {
    // Latency-bound: three collectives of a round or two each beat 2(n-1) + 2(m-1) ring steps.
    std::vector<size_t> shard(n), bytes(n);
    size_t at = 0;
    for (int i = 0; i < n; ++i) {
      shard[i] = piece(count, n, i);
      bytes[i] = shard[i] * es;
      if (i < k) at += bytes[i];
    }
    reducescatterv(host, data, data + at, shard, dtype, op);
    allreduce(cross, data + at, shard[k], dtype, op);
    allgatherv(host, data + at, data, bytes);
    return;
  }

  TraceSpan span(TraceOp::kAllreduce, static_cast<int64_t>(count));
  const std::vector<int> host_ranks = set_ranks(comm, host), cross_ranks = set_ranks(comm, cross);
  // Part i * m + j: part j of shard i, in bytes. Shard i is reduced on the host's rank i; its
  // parts are reduced around the cross ring of the ranks with index i.
  std::vector<size_t> off(static_cast<size_t>(n) * m), len(off.size());
  size_t pos = 0;
  for (int i = 0; i < n; ++i) {
    const size_t shard = piece(count, n, i);
    for (int j = 0; j < m; ++j) {
      const size_t p = piece(shard, m, j);
      off[i * m + j] = pos * es;
      len[i * m + j] = p * es;
      pos += p;
    }
  }
  const size_t chunk = std::max(es, chunk_bytes / es * es);
  const size_t longest = *std::max_element(len.begin(), len.end());
  const size_t blocks = std::max<size_t>(1, (longest + chunk - 1) / chunk);
  const int host_next = host_ranks[wrap(k + 1, n)], host_prev = host_ranks[wrap(k - 1, n)];
  const int cross_next = cross_ranks[wrap(c + 1, m)], cross_prev = cross_ranks[wrap(c - 1, m)];

  // Chunk b of one part, if the part reaches that far (both ends skip the same chunks).
  auto move = [&](std::vector<Comm::Xfer>& xs, Comm::Xfer::Kind kind, int peer, int part,
                  size_t b) {
    const size_t o = b * chunk;
    if (o >= len[part]) return;
    xs.push_back({kind, peer, data + off[part] + o, std::min(chunk, len[part] - o), dtype, op});
  };
  // A step of the host's ring moves whole shards (all their parts); a step of the cross ring
  // moves parts of shard k. Reduce-scatter step t: pass on x-t-1, fold into x-t-2; allgather
  // step t: pass on x-t, receive x-t-1 (x: the rank's index in that ring).
  const int host_steps = n - 1, cross_steps = m - 1;
  const int steps = 2 * host_steps + 2 * cross_steps;
  run_pipeline(
      comm, blocks, steps,
      [&](size_t b, int s, std::vector<Comm::Xfer>& xs) {
        const bool host_rs = s < host_steps;
        const bool host_ag = s >= host_steps + 2 * cross_steps;
        if (host_rs || host_ag) {
          const int t = host_rs ? s : s - host_steps - 2 * cross_steps;
          const int out = host_rs ? wrap(k - t - 1, n) : wrap(k - t, n);
          const int in = host_rs ? wrap(k - t - 2, n) : wrap(k - t - 1, n);
          for (int j = 0; j < m; ++j) move(xs, Comm::Xfer::SEND, host_next, out * m + j, b);
          for (int j = 0; j < m; ++j)
            move(xs, host_rs ? Comm::Xfer::RECV_REDUCE : Comm::Xfer::RECV, host_prev, in * m + j,
                 b);
          return;
        }
        const int u = s - host_steps;
        const bool rs = u < cross_steps;
        const int t = rs ? u : u - cross_steps;
        const int out = rs ? wrap(c - t - 1, m) : wrap(c - t, m);
        const int in = rs ? wrap(c - t - 2, m) : wrap(c - t - 1, m);
        move(xs, Comm::Xfer::SEND, cross_next, k * m + out, b);
        move(xs, rs ? Comm::Xfer::RECV_REDUCE : Comm::Xfer::RECV, cross_prev, k * m + in, b);
      },
      "allreduce");
}

}  // namespace bagua_hvd
