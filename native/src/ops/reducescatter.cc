// Reducescatter: the reduction of every rank's tensor, each rank receiving its rows (Horovod's
// split: the first dim0 % n ranks get one more). The input is staged in the fusion buffer, which
// the collective uses as scratch.
#include "ops/op.h"

namespace bagua_hvd {

void execute_reducescatter(ExecContext& ctx) {
  const Response& r = ctx.r;
  Comm& comm = ctx.comm;
  DataEngine& eng = ctx.engine;
  const size_t esize = dtype_size(r.dtype);
  const int n = comm.size();
  TimelineActivity activity(ctx, TlCollective::kReducescatter);
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = ctx.entries[i];
    if (!e) continue;
    const auto& shape = r.shapes[i];
    int64_t dim0 = shape.empty() ? 0 : shape[0];
    int64_t total = num_elements(shape);
    int64_t row = dim0 ? total / dim0 : 0;
    std::vector<size_t> counts(n);
    for (int k = 0; k < n; ++k)
      counts[k] = static_cast<size_t>(reducescatter_rows(dim0, n, k) * row);
    unsigned char* scratch = ctx.fusion.get(static_cast<size_t>(total) * esize);
    if (total) eng.copy(scratch, e->input, static_cast<size_t>(total) * esize);
    if (r.prescale != 1.0) eng.scale_horovod(scratch, total, r.dtype, r.prescale);
    eng.reducescatterv(comm, scratch, e->output, counts, r.dtype, r.reduce_op);
    double post = r.postscale;
    if (r.reduce_op == ReduceOp::AVERAGE) post /= n;
    if (post != 1.0) eng.scale_horovod(e->output, counts[comm.rank()], r.dtype, post);
  }
}

}  // namespace bagua_hvd
