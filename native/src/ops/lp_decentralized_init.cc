// Low-precision decentralized SGD: the replicas' initialisation (BHVD_OP_LP_DECENTRALIZED_INIT):
// self = x, left and right = the ring neighbours' x; among the hosts' leaders when hierarchical.
#include "ops/op.h"

namespace bagua_hvd {

void execute_lp_decentralized_init(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  Entry* e = ctx.entries[0];
  if (!e) return;
  TimelineActivity activity(ctx, kTlPeerExchange);
  Replicas& rep = state<Replicas>(e);
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  Hierarchy* h = ctx.hierarchy;
  if (!h || h->leader) {
    eng.lp_decentralized_init(h ? *h->leaders : ctx.comm, e->output, rep.self, rep.left, rep.right,
                              count, r.dtype);
    return;
  }
  // Only the leaders' replicas are used; the others keep plain copies.
  const size_t bytes = count * dtype_size(r.dtype);
  for (void* a : {rep.self, rep.left, rep.right}) eng.copy(a, e->output, bytes);
}

}  // namespace bagua_hvd
