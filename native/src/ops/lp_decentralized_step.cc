// Low-precision decentralized SGD: the whole step on the ring, in the core
// (BHVD_OP_LP_DECENTRALIZED_STEP), flat or hierarchical (the host's average, the step among the
// hosts' leaders, the result back to the host).
#include "ops/op.h"

namespace bagua_hvd {

void execute_lp_decentralized_step(ExecContext& ctx) {
  const Response& r = ctx.r;
  Entry* e = ctx.entries[0];
  if (!e) return;
  TimelineActivity activity(ctx, kTlPeerExchange);
  Replicas& rep = state<Replicas>(e);
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  if (ctx.hierarchy) {
    host_average_then(ctx, e, count, [&](Comm& leaders) {
      ctx.engine.lp_decentralized(leaders, e->output, rep.self, rep.left, rep.right, count,
                                  r.dtype);
    });
    return;
  }
  ctx.engine.lp_decentralized(ctx.comm, e->output, rep.self, rep.left, rep.right, count, r.dtype);
}

}  // namespace bagua_hvd
