// Tensor fusion, which serves the allreduce (ops/allreduce.cc): the coordinator's grouping of
// ready allreduces into one response. The buffer each rank packs them into is the data engine's
// (engines/fusion_buffer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "requests/message.h"

namespace bagua_hvd {

struct FusionParams {
  int64_t threshold = 128 << 20;  // bytes of one fused response; 0 disables fusion
  // Tensors this large are bandwidth-bound: fusing them would only add two copies through the
  // fusion buffer, so they run alone, in place.
  int64_t no_fuse_bytes = 1 << 20;
};

// Coordinator: appends to head (a single-tensor response, singles[i] moved out) the later
// singles that may run fused with it (plain allreduces with equal parameters, up to the
// threshold, in first-ready order) and marks them used.
void fuse_into(Response& head, std::vector<Response>& singles, size_t i, std::vector<char>& used,
               const FusionParams& params);

}  // namespace bagua_hvd
