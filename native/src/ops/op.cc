// The table from op type to executor (ops/op.h).
#include "ops/op.h"

namespace bagua_hvd {

OpExecutor op_executor(int32_t type) {
  switch (type) {
    case BHVD_OP_ALLREDUCE: return execute_allreduce;
    case BHVD_OP_ALLGATHER: return execute_allgather;
    case BHVD_OP_BROADCAST: return execute_broadcast;
    case BHVD_OP_ALLTOALL: return execute_alltoall;
    case BHVD_OP_REDUCESCATTER: return execute_reducescatter;
    case BHVD_OP_DECENTRALIZED: return execute_decentralized;
    case BHVD_OP_LP_DECENTRALIZED: return execute_lp_decentralized;
  }
  return nullptr;
}

}  // namespace bagua_hvd
