// Allreduce (Horovod's): fused through the fusion buffer, or in place for one tensor. Fusion
// itself: ops/fusion.cc; the hierarchical and the compressed allreduce are op types of their own
// (ops/hierarchical_allreduce.cc, ops/compressed_allreduce.cc).
#include "ops/op.h"

namespace bagua_hvd {

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
