// Low-precision decentralized SGD: the exchange half of a step split around
// bhvd_lp_decentralized_local (BHVD_OP_LP_DECENTRALIZED_EXCHANGE; never hierarchical): this
// rank's compressed difference to both ring neighbours, theirs into the left and right replicas.
#include "ops/op.h"

namespace bagua_hvd {

void execute_lp_decentralized_exchange(ExecContext& ctx) {
  Entry* e = ctx.entries[0];
  if (!e) return;
  TimelineActivity activity(ctx, kTlPeerExchange);
  Replicas& rep = state<Replicas>(e);
  ctx.engine.lp_decentralized_exchange(ctx.comm, static_cast<const uint8_t*>(e->input), rep.left,
                                       rep.right, rep.count, rep.dtype);
}

}  // namespace bagua_hvd
