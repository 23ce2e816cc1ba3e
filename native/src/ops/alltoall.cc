// Alltoall: rows split per destination rank (the coordinator's n x n splits matrix), received
// into a core-allocated output with the received splits.
#include "ops/op.h"

namespace bagua_hvd {

void execute_alltoall(ExecContext& ctx) {
  const Response& r = ctx.r;
  Comm& comm = ctx.comm;
  const size_t esize = dtype_size(r.dtype);
  const int n = comm.size(), me = comm.rank();
  TimelineActivity activity(ctx, TlCollective::kAlltoall);
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = ctx.entries[i];
    if (!e) continue;
    const auto& shape = e->request.shape;
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    const auto& m = r.per_rank[i];
    std::vector<size_t> send(n), recv(n);
    std::vector<int32_t> rsplits(n);
    size_t total = 0;
    int64_t rows = 0;
    for (int k = 0; k < n; ++k) {
      send[k] = static_cast<size_t>(m[me * n + k] * row) * esize;
      recv[k] = static_cast<size_t>(m[k * n + me] * row) * esize;
      rsplits[k] = static_cast<int32_t>(m[k * n + me]);
      total += recv[k];
      rows += m[k * n + me];
    }
    Output out = ctx.engine.allocate_output(total);
    ctx.engine.alltoallv(comm, e->input, send, out.data.get(), recv);
    std::vector<int64_t> oshape = shape;
    oshape[0] = rows;
    std::lock_guard<std::mutex> lock(ctx.handles_mu);
    e->handle->outputs[e->index] = std::move(out);
    e->handle->output_shapes[e->index] = std::move(oshape);
    e->handle->received_splits = std::move(rsplits);
  }
}

}  // namespace bagua_hvd
