// Builds without nvcc: no device engine (engines/device_engine.h); the frontends
// stage CUDA tensors through host memory themselves. CUDA builds define these
// in engines/cuda_engine.cu. The counters exist in every build.
#include "engines/device_engine.h"

namespace bagua_hvd {

DeviceStats& device_stats() {
  static DeviceStats stats;
  return stats;
}

#ifndef BHVD_CUDA_BUILT

DeviceEngine* device_engine(int device, std::string* why) {
  if (why) *why = "this build of bagua_hvd has no CUDA support (built without nvcc)";
  return nullptr;
}

void release_device_communicators(double) {}

bool device_engines_stalled(double) { return false; }

bool device_engines_built() { return false; }
#endif

}  // namespace bagua_hvd
