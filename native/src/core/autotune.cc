// The autotuner's measurement and hand-off (core/autotune.h).
#include "core/autotune.h"

#include <algorithm>
#include <chrono>

namespace bagua_hvd {

namespace {
// What Horovod scores is its allreduces; here BAGUA's reductions of gradients and weights too.
bool scored(const Response& r) {
  return r.kind == Response::OP && r.process_set_id == 0 &&
         (r.type == BHVD_OP_ALLREDUCE || r.type == BHVD_OP_COMPRESSED_ALLREDUCE ||
          r.type == BHVD_OP_PEER_AVERAGE);
}
}  // namespace

Status Autotuner::start(int steps_per_sample) {
  if (steps_per_sample < 1)
    return Status::InvalidArgument("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE must be at least 1, got " +
                                   std::to_string(steps_per_sample));
  std::lock_guard<std::mutex> lock(mu_);
  steps_per_sample_ = steps_per_sample;
  stopped_ = false;
  paused_ = false;
  score_.reset();
  proposal_.reset();
  reset_locked();
  running_ = true;
  return Status::OK();
}

void Autotuner::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    running_ = false;
    proposal_.reset();
  }
  cv_.notify_all();
}

int Autotuner::next_score(double* score, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
               [&] { return stopped_ || score_.has_value(); });
  if (score_) {
    *score = *score_;
    score_.reset();
    return 1;
  }
  return stopped_ ? -1 : 0;
}

void Autotuner::propose(const TunedParams& p, bool active) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return;
  proposal_ = p;
  proposal_active_ = active;
}

bool Autotuner::take_proposal(TunedParams* p) {
  if (!running()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (!proposal_) return false;
  *p = *proposal_;
  proposal_.reset();
  paused_ = false;
  if (!proposal_active_) running_ = false;  // tuning done: the best parameters stay
  reset_locked();
  return true;
}

void Autotuner::reset_locked() {
  counts_.clear();
  sample_ = 0;
  bytes_ = 0;
  sample_start_ = Clock::now();
}

void Autotuner::observe(const ResponseList& list) {
  if (!running()) return;
  int64_t bytes = 0;
  bool any = false;
  for (const Response& r : list.responses) {
    if (!scored(r)) continue;
    any = true;
    for (const auto& shape : r.shapes)
      bytes += num_elements(shape) * static_cast<int64_t>(dtype_size(r.dtype));
  }
  if (!any) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (paused_ || stopped_) return;
  // Horovod's sampling (ParameterManager::Update): a sample ends when some tensor has been
  // reduced steps_per_sample more times; the bytes of the cycle that ends it count to the next.
  bool ended = false;
  for (const Response& r : list.responses) {
    if (!scored(r) || ended) continue;
    for (const auto& name : r.names) {
      const int32_t step = counts_[name]++;
      if (step >= (sample_ + 1) * steps_per_sample_) {
        const auto now = Clock::now();
        const double us =
            std::max(1.0, std::chrono::duration<double, std::micro>(now - sample_start_).count());
        scores_[sample_++] = static_cast<double>(bytes_) / us;
        bytes_ = 0;
        sample_start_ = now;
        ended = true;
        break;
      }
    }
  }
  bytes_ += bytes;
  if (sample_ < kSamples) return;
  std::array<double, kSamples> sorted = scores_;
  std::sort(sorted.begin(), sorted.end());
  score_ = sorted[kSamples / 2];
  paused_ = true;
  reset_locked();
  cv_.notify_all();
}

}  // namespace bagua_hvd
