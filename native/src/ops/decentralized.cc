// Decentralized SGD's peer average (full precision; peer mode all, shift_one or ring), flat or
// hierarchical: the host's average, the peer average among the hosts' leaders, the result back
// to the host.
#include "ops/op.h"

namespace bagua_hvd {

void host_average_then(ExecContext& ctx, Entry* e, size_t count,
                       const std::function<void(Comm& leaders)>& among_leaders) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  Hierarchy* h = ctx.hierarchy;
  const size_t bytes = count * dtype_size(r.dtype);
  if (e->input != e->output && bytes) eng.copy(e->output, e->input, bytes);
  eng.allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
  eng.scale(e->output, count, r.dtype, 1.0 / h->intra->size());
  if (h->leader) among_leaders(*h->leaders);
  eng.broadcast(*h->intra, e->output, bytes, 0);
}

void execute_decentralized(ExecContext& ctx) {
  const Response& r = ctx.r;
  Entry* e = ctx.entries[0];
  if (!e) return;
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  const auto mode = static_cast<PeerMode>(r.peer_mode);
  if (ctx.hierarchy) {
    host_average_then(ctx, e, count, [&](Comm& leaders) {
      ctx.engine.decentralized_average(leaders, e->output, e->output, count, r.dtype, mode,
                                       r.step);
    });
    return;
  }
  ctx.engine.decentralized_average(ctx.comm, e->input, e->output, count, r.dtype, mode, r.step);
}

}  // namespace bagua_hvd
