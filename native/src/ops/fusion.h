// Tensor fusion, which serves the allreduce (ops/allreduce.cc): the coordinator's grouping of
// ready allreduces into one response, and the fusion buffer each rank packs them into.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/message.h"

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

// Each rank: the buffer fused tensors are packed into. Grows, never shrinks, until release().
// In host memory; a device engine's (ops/device_engine.h) holds device memory.
class FusionBuffer {
 public:
  explicit FusionBuffer(std::atomic<int64_t>& bytes_stat) : bytes_stat_(bytes_stat) {}
  virtual ~FusionBuffer() = default;
  virtual unsigned char* get(size_t bytes);
  virtual void release();

 protected:
  std::atomic<int64_t>& bytes_stat_;  // reported through bhvd_stat("fusion_buffer_bytes")

 private:
  std::vector<unsigned char> buf_;
};

}  // namespace bagua_hvd
