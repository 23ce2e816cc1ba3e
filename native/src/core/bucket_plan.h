// BAGUA's bucket plan: the first-guess layout of gradient and weight buckets, which the torch
// DistributedOptimizer, torch's algorithms and the TensorFlow engine share through the C API
// (bhvd_bucket_layout). docs/algorithms.md.
#pragma once

#include <cstdint>
#include <vector>

namespace bagua_hvd {

// Tensors taken in `order` (indices into `bytes` and `group`) are appended to the open bucket
// of their group (one dtype and device); a bucket closes when the next tensor would take it past
// `cap` bytes (a bigger tensor gets a bucket of its own); cap == 0: one bucket per tensor.
// Returns, for each position of `order`, the bucket of that tensor; buckets are numbered in the
// order they open.
std::vector<int64_t> bucket_layout(const std::vector<int64_t>& bytes,
                                   const std::vector<int32_t>& group,
                                   const std::vector<int64_t>& order, int64_t cap);

}  // namespace bagua_hvd
