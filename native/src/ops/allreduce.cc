// Allreduce (Horovod's): fused through the fusion buffer, or in place for one tensor; flat, or
// through the set's hierarchy when the runtime gives one (HOROVOD_HIERARCHICAL_ALLREDUCE, and
// the op type BHVD_OP_HIERARCHICAL_ALLREDUCE). Fusion itself: core/fusion.cc (the grouping) and
// engines/fusion_buffer.h; the compressed allreduce: ops/compressed_allreduce.cc.
#include <algorithm>
#include <optional>
#include <vector>

#include "ops/op.h"

namespace bagua_hvd {

void adasum_across_hosts(DataEngine& eng, Comm& host, Comm& cross, unsigned char* buf,
                         const std::vector<size_t>& counts, DataType dtype) {
  size_t total = 0;
  for (size_t c : counts) total += c;
  const size_t es = dtype_size(dtype);
  eng.allreduce(host, buf, total, dtype, ReduceOp::SUM);
  const int ranks = host.size();
  const size_t per = total / ranks;
  auto start = [&](int i) { return static_cast<size_t>(i) * per; };
  auto length = [&](int i) { return i == ranks - 1 ? total - start(i) : per; };
  // This rank's slice, per tensor: the part of each tensor inside [begin, end).
  const size_t begin = start(host.rank()), end = begin + length(host.rank());
  std::vector<size_t> mine(counts.size());
  for (size_t i = 0, at = 0; i < counts.size(); at += counts[i], ++i)
    mine[i] = std::clamp(end, at, at + counts[i]) - std::clamp(begin, at, at + counts[i]);
  eng.allreduce_adasum(cross, buf + begin * es, mine, dtype, &host);
  for (int i = 0; i < ranks; ++i)
    if (length(i)) eng.broadcast(host, buf + start(i) * es, length(i) * es, i);
}

void execute_allreduce(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  auto& entries = ctx.entries;
  const size_t esize = dtype_size(r.dtype);
  std::vector<size_t> counts(r.names.size());
  size_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    counts[i] = static_cast<size_t>(num_elements(r.shapes[i]));
    total += counts[i];
  }
  unsigned char* buf;
  const bool direct = entries.size() == 1 && entries[0] && entries[0]->output;
  if (direct) {
    buf = static_cast<unsigned char*>(entries[0]->output);
    if (entries[0]->input != entries[0]->output && total)
      eng.copy(buf, entries[0]->input, total * esize);
  } else {
    TimelineActivity memcpy_in(ctx, kTlMemcpyIn);
    buf = ctx.fusion.get(total * esize);
    size_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      size_t bytes = counts[i] * esize;
      if (entries[i] && bytes)
        eng.copy(buf + off, entries[i]->input, bytes);
      else if (bytes)
        eng.zero(buf + off, bytes);  // a joined rank contributes zeros
      off += bytes;
    }
  }
  std::optional<TimelineActivity> collective(std::in_place, ctx, TlCollective::kAllreduce);
  if (r.prescale != 1.0) eng.scale_horovod(buf, total, r.dtype, r.prescale);
  if (r.reduce_op == ReduceOp::ADASUM && ctx.device_adasum_hosts > 0) {
    // Horovod's GPU Adasum (AdasumGpuAllreduceOp): the sum of each host's ranks, then the Adasum
    // of the hosts' sums, then divided by the ranks per host (below).
    if (Hierarchy* h = ctx.hierarchy) {
      adasum_across_hosts(eng, *h->intra, *h->cross, buf, counts, r.dtype);
    } else if (ctx.device_adasum_hosts == 1) {
      eng.allreduce(ctx.comm, buf, total, r.dtype, ReduceOp::SUM);
    } else {  // one rank per host
      eng.allreduce_adasum(ctx.comm, buf, counts, r.dtype);
    }
  } else if (r.reduce_op == ReduceOp::ADASUM) {
    // Per tensor of the fused buffer, flat over the set's ranks as Horovod's CPU Adasum
    // (HOROVOD_HIERARCHICAL_ALLREDUCE does not apply to it there either).
    eng.allreduce_adasum(ctx.comm, buf, counts, r.dtype);
  } else if (Hierarchy* h = ctx.hierarchy; h && h->cross) {
    // The network carries one allreduce's worth per host, not per rank, spread over the host's
    // ranks (collectives/allreduce_hierarchical.cc).
    eng.allreduce_hierarchical(ctx.comm, *h->intra, *h->cross, buf, total, r.dtype, r.reduce_op);
  } else if (h) {
    // Hosts with different numbers of ranks: within the host, among the hosts' leaders, back.
    eng.allreduce(*h->intra, buf, total, r.dtype, r.reduce_op);
    if (h->leader) eng.allreduce(*h->leaders, buf, total, r.dtype, r.reduce_op);
    eng.broadcast(*h->intra, buf, total * esize, 0);
  } else {
    eng.allreduce(ctx.comm, buf, total, r.dtype, r.reduce_op);
  }
  double post = r.postscale;
  if (r.reduce_op == ReduceOp::AVERAGE) post /= ctx.comm.size();
  // Horovod folds the GPU Adasum's averaging within the host into the postscale factor
  // (EnqueueTensorAllreduces: postscale_factor /= local size); the hosts hold as many ranks each.
  if (ctx.device_adasum_hosts > 0) post /= ctx.comm.size() / ctx.device_adasum_hosts;
  if (post != 1.0) eng.scale_horovod(buf, total, r.dtype, post);
  collective.reset();
  if (!direct) {
    TimelineActivity memcpy_out(ctx, kTlMemcpyOut);
    size_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      size_t bytes = counts[i] * esize;
      if (entries[i] && entries[i]->output && bytes) eng.copy(entries[i]->output, buf + off, bytes);
      off += bytes;
    }
  }
}

}  // namespace bagua_hvd
