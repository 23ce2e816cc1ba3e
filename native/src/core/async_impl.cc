#include "core/async_impl.h"

#include <cstring>

#include "core/config.h"
#include "core/validate.h"

namespace bagua_hvd {

std::string averager_name(const std::string& prefix, int64_t restarts) {
  return prefix + "." + std::to_string(elastic_generation()) + "." + std::to_string(restarts);
}

AsyncImpl::~AsyncImpl() {
  if (averager_ != 0) AsyncRegistry::get().release(averager_);
}

Status AsyncImpl::copy_in(const Step& s) {
  if (!s.staged) return Status::OK();
  for (int32_t i = 0; i < s.num_tensors; ++i) {
    const bhvd_tensor &dst = s.weights[i], &src = s.staged[i];
    if (src.data == dst.data) continue;
    const int64_t n = tensor_elements(dst);
    if (src.dtype != dst.dtype || tensor_elements(src) != n || (n > 0 && !src.data))
      return Status::InvalidArgument(
          "async model averaging: staged weights of another dtype or size than the buffers");
    const size_t bytes = static_cast<size_t>(n) * dtype_size(static_cast<DataType>(dst.dtype));
    if (bytes == 0) continue;
    if (s.device >= 0) {
      ops_.device_copy(s.device, dst.data, src.data, bytes, s.stream);
    } else {
      std::memcpy(dst.data, src.data, bytes);
    }
  }
  return Status::OK();
}

Status AsyncImpl::step(const Step& s, bool* merged) {
  *merged = false;
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) return Status::OK();
  if (s.num_tensors < 1 || !s.weights)
    return Status::InvalidArgument("async model averaging: no weight buffers");
  std::shared_ptr<AsyncAverager> a;
  if (averager_ == 0) {
    // The averager reads the buffers only at a step boundary: the staged weights go in after.
    if (Status st = ops_.start(averager_name(s.prefix, restarts_), s, &a); !st.ok()) return st;
    averager_ = AsyncRegistry::get().add(a);
    buffers_.clear();
    for (int32_t i = 0; i < s.num_tensors; ++i) buffers_.push_back(s.weights[i].data);
  } else {
    bool same = buffers_.size() == static_cast<size_t>(s.num_tensors);
    for (int32_t i = 0; same && i < s.num_tensors; ++i) same = buffers_[i] == s.weights[i].data;
    // The averager writes into the buffers it was started over: no others while it runs.
    if (!same)
      return Status::InvalidArgument(
          "async model averaging: the weight buffers changed while an averager runs over them");
    a = AsyncRegistry::get().find(averager_);
    if (!a) return Status::InvalidArgument("unknown async averager " + std::to_string(averager_));
  }
  if (Status st = copy_in(s); !st.ok()) return st;
  const int64_t before = a->rounds();
  a->step(s.stream);
  *merged = a->rounds() != before;
  return Status::OK();
}

Status AsyncImpl::abort() {
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    std::swap(id, averager_);
    buffers_.clear();
  }
  if (id == 0) return Status::OK();
  // Unlocked: the wait is for the other ranks; a step meanwhile sees the abort and does nothing.
  auto a = AsyncRegistry::get().find(id);
  Status s = a ? a->abort(-1) : Status::OK();
  AsyncRegistry::get().release(id);
  return s.type == StatusType::ABORTED ? Status::OK() : s;
}

void AsyncImpl::resume() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) return;
  aborted_ = false;
  ++restarts_;  // a new averager, under a new name
}

AsyncImpl::State AsyncImpl::state() {
  std::lock_guard<std::mutex> lock(mu_);
  State st;
  st.aborted = aborted_;
  st.restarts = restarts_;
  st.averager = averager_;
  if (averager_ != 0) {
    auto a = AsyncRegistry::get().find(averager_);
    if (a) st.rounds = a->rounds();
  }
  return st;
}

void AsyncImpl::end_job() {
  std::lock_guard<std::mutex> lock(mu_);
  averager_ = 0;
  restarts_ = 0;
  buffers_.clear();
}

AsyncImpls& AsyncImpls::get() {
  AsyncRegistry::get();  // made first, so destroyed after the implementations that use it
  static AsyncImpls r;
  return r;
}

void AsyncImpls::end_job() {
  for (auto& impl : all()) impl->end_job();
}

}  // namespace bagua_hvd
