// Allreduce: plain (fused through the fusion buffer, or in place for one tensor), hierarchical
// (within the host, among the hosts' leaders, back), and BAGUA's MinMaxUInt8-compressed form
// (ByteGrad), flat or hierarchical. Fusion itself: ops/fusion.cc.
#include "ops/op.h"

namespace bagua_hvd {

namespace {

// ByteGrad. Never fused (coordinator): one tensor, this rank's entry.
void compressed_allreduce(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  const size_t esize = dtype_size(r.dtype);
  Entry* e = ctx.entries[0];
  if (!e) return;
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  if (e->input != e->output && count) eng.copy(e->output, e->input, count * esize);
  if (r.prescale != 1.0) eng.scale(e->output, count, r.dtype, r.prescale);
  const bool average = r.reduce_op == ReduceOp::AVERAGE;
  void* ef_w = e->aux.size() > 0 ? e->aux[0] : nullptr;
  void* ef_s = e->aux.size() > 1 ? e->aux[1] : nullptr;
  if (Hierarchy* h = ctx.hierarchy) {
    // BAGUA's hierarchy: full precision within the host, compressed among the hosts.
    eng.allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
    if (average) eng.scale(e->output, count, r.dtype, 1.0 / h->intra->size());
    if (h->leader)
      eng.allreduce_minmax_uint8(*h->leaders, e->output, count, r.dtype, average, ef_w, ef_s);
    eng.broadcast(*h->intra, e->output, count * esize, 0);
  } else {
    eng.allreduce_minmax_uint8(ctx.comm, e->output, count, r.dtype, average, ef_w, ef_s);
  }
  if (r.postscale != 1.0) eng.scale(e->output, count, r.dtype, r.postscale);
}

// Never fused (coordinator): within the host, among the hosts' leaders, back.
void hierarchical_allreduce(ExecContext& ctx, Entry* e) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  Hierarchy* h = ctx.hierarchy;
  const size_t esize = dtype_size(r.dtype);
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  if (e->input != e->output && count) eng.copy(e->output, e->input, count * esize);
  if (r.prescale != 1.0) eng.scale(e->output, count, r.dtype, r.prescale);
  eng.allreduce(*h->intra, e->output, count, r.dtype, r.reduce_op);
  if (h->leader) eng.allreduce(*h->leaders, e->output, count, r.dtype, r.reduce_op);
  eng.broadcast(*h->intra, e->output, count * esize, 0);
  double post = r.postscale;
  if (r.reduce_op == ReduceOp::AVERAGE) post /= ctx.comm.size();
  if (post != 1.0) eng.scale(e->output, count, r.dtype, post);
}

}  // namespace

void execute_allreduce(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  auto& entries = ctx.entries;
  if (r.compression == BHVD_COMPRESSION_MINMAX_UINT8) return compressed_allreduce(ctx);
  if (ctx.hierarchy && entries.size() == 1 && entries[0])
    return hierarchical_allreduce(ctx, entries[0]);
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
  if (r.prescale != 1.0) eng.scale(buf, total, r.dtype, r.prescale);
  eng.allreduce(ctx.comm, buf, total, r.dtype, r.reduce_op);
  double post = r.postscale;
  if (r.reduce_op == ReduceOp::AVERAGE) post /= ctx.comm.size();
  if (post != 1.0) eng.scale(buf, total, r.dtype, post);
  if (!direct) {
    size_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      size_t bytes = counts[i] * esize;
      if (entries[i] && entries[i]->output && bytes) eng.copy(entries[i]->output, buf + off, bytes);
      off += bytes;
    }
  }
}

}  // namespace bagua_hvd
