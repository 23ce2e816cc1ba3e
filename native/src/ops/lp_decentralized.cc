// Low-precision decentralized SGD on the ring (peer_mode 0: a step, 1: initialise the replicas,
// 2: the exchange half of a split step), flat or hierarchical (among the hosts' leaders).
#include "ops/op.h"

namespace bagua_hvd {

void execute_lp_decentralized(ExecContext& ctx) {
  const Response& r = ctx.r;
  DataEngine& eng = ctx.engine;
  Entry* e = ctx.entries[0];
  if (!e) return;
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  const size_t bytes = count * dtype_size(r.dtype);
  Hierarchy* h = ctx.hierarchy;
  if (r.peer_mode == 2) {  // the exchange half of a split step (never hierarchical)
    eng.lp_decentralized_exchange(ctx.comm, static_cast<const uint8_t*>(e->input), e->aux[0],
                                  e->aux[1], e->aux_count, e->aux_dtype);
    return;
  }
  if (r.peer_mode == 1) {  // replicas: among the hosts' leaders when hierarchical
    if (!h || h->leader) {
      eng.lp_decentralized_init(h ? *h->leaders : ctx.comm, e->output, e->aux[0], e->aux[1],
                                e->aux[2], count, r.dtype);
    } else {  // only the leaders' replicas are used; the others keep plain copies
      for (void* a : e->aux) eng.copy(a, e->output, bytes);
    }
    return;
  }
  if (h) {
    host_average_then(ctx, e, count, [&](Comm& leaders) {
      eng.lp_decentralized(leaders, e->output, e->aux[0], e->aux[1], e->aux[2], count, r.dtype);
    });
    return;
  }
  eng.lp_decentralized(ctx.comm, e->output, e->aux[0], e->aux[1], e->aux[2], count, r.dtype);
}

}  // namespace bagua_hvd
