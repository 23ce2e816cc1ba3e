// Allgather: per tensor, every rank's rows (dim 0 may differ between ranks) concatenated in set
// rank order into a core-allocated output that the frontend copies out.
#include "ops/op.h"

namespace bagua_hvd {

void execute_allgather(ExecContext& ctx) {
  const Response& r = ctx.r;
  Comm& comm = ctx.comm;
  const size_t esize = dtype_size(r.dtype);
  TimelineActivity activity(ctx, TlCollective::kAllgather);
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = ctx.entries[i];
    const auto& shape = e ? e->request.shape : r.shapes[i];
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    std::vector<size_t> bytes(comm.size());
    size_t total = 0;
    int64_t rows = 0;
    for (int k = 0; k < comm.size(); ++k) {
      bytes[k] = static_cast<size_t>(r.per_rank[i][k] * row) * esize;
      total += bytes[k];
      rows += r.per_rank[i][k];
    }
    Output out = ctx.engine.allocate_output(total);
    ctx.engine.allgatherv(comm, e ? e->input : nullptr, out.data.get(), bytes);
    if (e) {
      std::vector<int64_t> oshape = shape;
      oshape[0] = rows;
      std::lock_guard<std::mutex> lock(ctx.handles_mu);
      e->handle->outputs[e->index] = std::move(out);
      e->handle->output_shapes[e->index] = std::move(oshape);
    }
  }
}

}  // namespace bagua_hvd
