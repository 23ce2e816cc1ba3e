// The table from op type to executor (ops/op.h), the timeline's names of the collectives, and
// the helper the hierarchical weight averages share.
#include "ops/op.h"

#include <cstring>

namespace bagua_hvd {

const char* timeline_collective(const DataEngine& engine, TlCollective c) {
  static const char* const kNames[2][5] = {
      {"GLOO_ALLREDUCE", "GLOO_ALLGATHER", "GLOO_BCAST", "GLOO_ALLTOALL", "GLOO_REDUCESCATTER"},
      {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BCAST", "MPI_ALLTOALL", "MPI_REDUCESCATTER"}};
  const int mpi = std::strcmp(engine.name(), "mpi") == 0 ? 1 : 0;
  return kNames[mpi][static_cast<int>(c)];
}

OpExecutor op_executor(int32_t type) {
  switch (type) {
    case BHVD_OP_ALLREDUCE:
      return execute_allreduce;
    case BHVD_OP_ALLGATHER:
      return execute_allgather;
    case BHVD_OP_BROADCAST:
      return execute_broadcast;
    case BHVD_OP_ALLTOALL:
      return execute_alltoall;
    case BHVD_OP_REDUCESCATTER:
      return execute_reducescatter;
    case BHVD_OP_HIERARCHICAL_ALLREDUCE:
      return execute_allreduce;  // with the hierarchy
    case BHVD_OP_COMPRESSED_ALLREDUCE:
      return execute_compressed_allreduce;
    case BHVD_OP_PEER_AVERAGE:
      return execute_peer_average;
    case BHVD_OP_LP_DECENTRALIZED_INIT:
      return execute_lp_decentralized_init;
    case BHVD_OP_LP_DECENTRALIZED_STEP:
      return execute_lp_decentralized_step;
    case BHVD_OP_LP_DECENTRALIZED_EXCHANGE:
      return execute_lp_decentralized_exchange;
  }
  return nullptr;
}

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

}  // namespace bagua_hvd
