// Decentralized SGD's peer average of weights (full precision; peer mode all, shift_one or
// ring; BHVD_OP_PEER_AVERAGE), flat or hierarchical: the host's average, the peer average among
// the hosts' leaders, the result back to the host.
#include "ops/op.h"

namespace bagua_hvd {

void execute_peer_average(ExecContext& ctx) {
  const Response& r = ctx.r;
  Entry* e = ctx.entries[0];
  if (!e) return;
  const auto& p = params<PeerAverageParams>(ctx);
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  const auto mode = static_cast<PeerMode>(p.peer_mode);
  TimelineActivity activity(ctx, kTlPeerExchange);
  if (ctx.hierarchy) {
    host_average_then(ctx, e, count, [&](Comm& leaders) {
      ctx.engine.decentralized_average(leaders, e->output, e->output, count, r.dtype, mode, p.step);
    });
    return;
  }
  ctx.engine.decentralized_average(ctx.comm, e->input, e->output, count, r.dtype, mode, p.step);
}

}  // namespace bagua_hvd
