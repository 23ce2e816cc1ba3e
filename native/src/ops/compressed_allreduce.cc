// ByteGrad's MinMaxUInt8-compressed allreduce (BHVD_OP_COMPRESSED_ALLREDUCE), flat or
// hierarchical (full precision within the host, compressed among the hosts' leaders), with
// optional error-feedback residuals. Never fused (coordinator): one tensor, this rank's entry.
#include <stdexcept>
#include <string>

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
  // The residuals were sized at enqueue for the layout that runs (core/validate.cc); a rank
  // that would run another would read and write past them: refuse before anything is sent.
  Hierarchy* h = ctx.hierarchy;
  Comm& exchange = h ? *h->leaders : ctx.comm;
  if (ef.worker && ef.group != exchange.size())
    throw std::logic_error("compressed allreduce: error-feedback residuals sized for " +
                           std::to_string(ef.group) + " ranks, but the exchange runs over " +
                           std::to_string(exchange.size()));
  // Compression, exchange and decompression are pipelined block by block in one collective
  // (collectives/allreduce_minmax_uint8.cc): one activity.
  TimelineActivity activity(ctx, kTlCompressedAllreduce);
  if (h) {
    // BAGUA's hierarchy: full precision within the host, compressed among the hosts.
    eng.allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
    if (average) eng.scale(e->output, count, r.dtype, 1.0 / h->intra->size());
    if (h->leader)
      eng.allreduce_minmax_uint8(*h->leaders, e->output, count, r.dtype, average, ef.worker,
                                 ef.server);
    eng.broadcast(*h->intra, e->output, count * esize, 0);
  } else {
    eng.allreduce_minmax_uint8(exchange, e->output, count, r.dtype, average, ef.worker, ef.server);
  }
  if (r.postscale != 1.0) eng.scale(e->output, count, r.dtype, r.postscale);
}

}  // namespace bagua_hvd
