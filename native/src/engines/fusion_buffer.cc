// The fusion buffer in host memory (engines/fusion_buffer.h).
#include "engines/fusion_buffer.h"

namespace bagua_hvd {

unsigned char* FusionBuffer::get(size_t bytes) {
  if (buf_.size() < bytes) {
    buf_.resize(bytes);
    bytes_stat_ = static_cast<int64_t>(buf_.size());
  }
  return buf_.data();
}

void FusionBuffer::release() {
  std::vector<unsigned char>().swap(buf_);
  bytes_stat_ = 0;
}

}  // namespace bagua_hvd
