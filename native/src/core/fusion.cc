// Tensor fusion: the coordinator's grouping (core/fusion.h).
#include "core/fusion.h"

namespace bagua_hvd {

void fuse_into(Response& r, std::vector<Response>& singles, size_t i, std::vector<char>& used,
               const FusionParams& params) {
  const int64_t esize = static_cast<int64_t>(dtype_size(r.dtype));
  int64_t bytes = r.kind == Response::OP ? num_elements(r.shapes[0]) * esize : 0;
  // Only Horovod's plain allreduce is fused: the compressed one's chunking and error-feedback
  // state are per tensor (a bucket of the frontend), the hierarchical one runs alone.
  if (!(r.kind == Response::OP && r.type == BHVD_OP_ALLREDUCE && params.threshold > 0 &&
        bytes < params.no_fuse_bytes))
    return;
  for (size_t j = i + 1; j < singles.size(); ++j) {
    Response& c = singles[j];
    if (used[j] || c.kind != Response::OP || c.type != r.type ||
        c.process_set_id != r.process_set_id || c.dtype != r.dtype ||
        c.reduce_op != r.reduce_op || c.prescale != r.prescale || c.postscale != r.postscale ||
        c.device != r.device)
      continue;
    int64_t cb = num_elements(c.shapes[0]) * esize;
    if (cb >= params.no_fuse_bytes || bytes + cb > params.threshold) continue;
    bytes += cb;
    used[j] = 1;
    r.names.push_back(std::move(c.names[0]));
    r.shapes.push_back(std::move(c.shapes[0]));
    r.per_rank.push_back(std::move(c.per_rank[0]));
    r.cache_ids.push_back(-1);
  }
}

}  // namespace bagua_hvd
