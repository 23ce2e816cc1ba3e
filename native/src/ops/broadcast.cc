// Broadcast: the root's tensors to every rank of the set, in place.
#include <algorithm>

#include "ops/op.h"

namespace bagua_hvd {

void execute_broadcast(ExecContext& ctx) {
  const Response& r = ctx.r;
  Comm& comm = ctx.comm;
  const size_t esize = dtype_size(r.dtype);
  const auto& ranks = comm.global_ranks();
  int root =
      static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), r.root_rank) - ranks.begin());
  TimelineActivity activity(ctx, TlCollective::kBroadcast);
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = ctx.entries[i];
    if (!e) continue;
    size_t bytes = static_cast<size_t>(num_elements(r.shapes[i])) * esize;
    if (comm.rank() == root && e->input != e->output && bytes)
      ctx.engine.copy(e->output, e->input, bytes);
    ctx.engine.broadcast(comm, e->output, bytes, root);
  }
}

}  // namespace bagua_hvd
