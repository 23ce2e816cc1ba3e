// The fusion buffer each rank packs fused allreduces into (ops/allreduce.cc; the coordinator's
// grouping: core/fusion.h). In host memory; a device engine's (engines/device_engine.h) holds
// device memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace bagua_hvd {

// Grows, never shrinks, until release().
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
