// ByteGrad's MinMaxUInt8-compressed allreduce (BHVD_OP_COMPRESSED_ALLREDUCE), flat or
// hierarchical (full precision within the host, compressed among the hosts' leaders), with
// optional error-feedback residuals. Never fused (coordinator): one tensor, this rank's entry.
#include "ops/op.h"

namespace bagua_hvd {

void execute_compressed_allreduce(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  Entry* e = ctx.entries[0];
  if (!e) return;
  const Residuals& ef = state<Residuals>(e);
  const size_t esize = dtype_size(r.dtype);
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  if (e->input != e->output && count) eng.copy(e->output, e->input, count * esize);
  if (r.prescale != 1.0) eng.scale(e->output, count, r.dtype, r.prescale);
  const bool average = r.reduce_op == ReduceOp::AVERAGE;
  // Compression, exchange and decompression are pipelined block by block in one collective
  // (collectives/allreduce_minmax_uint8.cc): one activity.
  TimelineActivity activity(ctx, kTlCompressedAllreduce);
  if (Hierarchy* h = ctx.hierarchy) {
    // BAGUA's hierarchy: full precision within the host, compressed among the hosts.
    eng.allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
    if (average) eng.scale(e->output, count, r.dtype, 1.0 / h->intra->size());
    if (h->leader)
      eng.allreduce_minmax_uint8(*h->leaders, e->output, count, r.dtype, average, ef.worker,
                                 ef.server);
    eng.broadcast(*h->intra, e->output, count * esize, 0);
  } else {
    eng.allreduce_minmax_uint8(ctx.comm, e->output, count, r.dtype, average, ef.worker, ef.server);
  }
  if (r.postscale != 1.0) eng.scale(e->output, count, r.dtype, r.postscale);
}

}  // namespace bagua_hvd
