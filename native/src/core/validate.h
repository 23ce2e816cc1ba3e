// Validation of a frontend's request (bhvd_request) before it is queued: the checks that need
// only the request, then those against its process set, then each tensor's, with Horovod's
// error texts. The runtime calls them in this order under its lock where state is involved;
// the checks of requests against each other (shapes, dtypes across ranks) are the
// coordinator's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/common.h"
#include "requests/handle.h"
#include "requests/message.h"

namespace bagua_hvd {

// "Allreduce", "Allgather", ... as Horovod's per-op messages spell them.
std::string op_title(int32_t type);
// The base of an unnamed op's name: "allreduce", "grouped_allreduce", ...
std::string op_prefix(int32_t type, bool grouped);

int64_t tensor_elements(const bhvd_tensor& t);

// Error feedback's residuals of a compressed allreduce of `count` elements among `group` ranks
// (c_api.h's bhvd_compression_residuals): the worker's, count padded to a multiple of group; the
// server's, one chunk.
struct ResidualSizes {
  int64_t worker = 0, server = 0;
};
ResidualSizes residual_sizes(int64_t count, int group);

// The checks that need nothing but the request (known op type, tensors present, reduce op,
// host tensors).
Status validate_request(const bhvd_request& req, const std::string& title);

// The checks against the request's process set (sorted global ranks, which must hold me):
// membership, the parameter struct of BAGUA's primitives (one check per op type, into the
// negotiated *params and this rank's *state; group_size(hierarchical): the ranks of a
// compressed allreduce, called only when needed), finite scale factors, the broadcast root.
Status validate_for_set(const bhvd_request& req, const std::string& title,
                        const std::vector<int32_t>& ranks, int me,
                        const std::function<int(bool hierarchical)>& group_size, OpParams* params,
                        StateBuffers* state);

// Horovod's (CPU) Adasum: a power-of-2 number of ranks.
Status validate_adasum_ranks(size_t ranks);
// Horovod's GPU Adasum (an Adasum of CUDA tensors with NCCL) sums within each host and combines
// the hosts:
// every host must hold as many of the set's ranks (ranks_per_host: one count per host) and the
// hosts must be a power of 2 (Horovod's messages).
Status validate_device_adasum(const std::vector<int>& ranks_per_host);

// Tensor i of req: fills r's dtype, shape and (alltoall) splits.
Status validate_tensor(const bhvd_request& req, int i, const std::string& title, int set_size,
                       Request* r);

}  // namespace bagua_hvd
