#include "core/bucket_plan.h"

#include <unordered_map>

namespace bagua_hvd {

std::vector<int64_t> bucket_layout(const std::vector<int64_t>& bytes,
                                   const std::vector<int32_t>& group,
                                   const std::vector<int64_t>& order, int64_t cap) {
  struct Open {
    int64_t bucket;
    int64_t bytes;
  };
  std::unordered_map<int32_t, Open> open;  // group -> its open bucket
  std::vector<int64_t> out;
  out.reserve(order.size());
  int64_t buckets = 0;
  for (int64_t i : order) {
    const int64_t nbytes = bytes[i];
    if (cap == 0) {
      out.push_back(buckets++);
      continue;
    }
    auto it = open.find(group[i]);
    if (it == open.end() || it->second.bytes + nbytes > cap) {
      it = open.insert_or_assign(group[i], Open{buckets++, 0}).first;
    }
    it->second.bytes += nbytes;
    out.push_back(it->second.bucket);
  }
  return out;
}

}  // namespace bagua_hvd
