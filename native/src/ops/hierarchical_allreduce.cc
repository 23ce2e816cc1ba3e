// Hierarchical allreduce (BHVD_OP_HIERARCHICAL_ALLREDUCE): within the host, among the hosts'
// leaders, back to the host. Never fused (coordinator); the plain allreduce where the set has
// no hierarchy (one host, or one rank per host).
#include "ops/op.h"

namespace bagua_hvd {

void execute_hierarchical_allreduce(ExecContext& ctx) {
  Entry* e = ctx.entries[0];
  Hierarchy* h = ctx.hierarchy;
  if (!h || !e) return execute_allreduce(ctx);
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
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

}  // namespace bagua_hvd
