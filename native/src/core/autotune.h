// Horovod's autotuner (HOROVOD_AUTOTUNE, docs/autotune.md), split where the work is: the core
// measures (Autotuner, here: Horovod's score, bytes reduced per microsecond over samples of
// HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE steps, the median of five) and applies (the coordinator
// takes the parameters at the start of a cycle and the ResponseList carries what the other
// ranks need, so that every rank switches at the same point of the same order); rank 0's
// Python (bagua_hvd/common/autotune.py) decides, with Horovod's chain of tunables and its
// Bayesian optimisation, through bhvd_autotune_* (c_api.h). The sampling pauses while Python
// decides: a score never mixes two settings.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "base/common.h"
#include "requests/message.h"

namespace bagua_hvd {

// What the autotuner sets in the core (bagua_hvd's bucket size is the frontend's).
struct TunedParams {
  bool hierarchical_allreduce = false;
  bool cache_enabled = true;
  double cycle_time_ms = 1;
  int64_t fusion_threshold = int64_t(128) << 20;  // bytes
};

class Autotuner {
 public:
  static constexpr int kSamples = 5;  // Horovod's: the score is the median of five samples

  // Frontend thread (rank 0's tuner). Sampling starts with the next cycle.
  Status start(int steps_per_sample);
  // At shutdown: sampling ends, next_score returns.
  void stop();
  bool running() const { return running_.load(std::memory_order_relaxed); }
  // Waits up to timeout_ms for the next score: 1 with *score set (sampling then pauses until
  // propose), 0 on timeout, -1 once stopped.
  int next_score(double* score, int64_t timeout_ms);
  // The parameters to run from the next cycle on; sampling resumes with them (active) or ends
  // (tuning done: these are the best).
  void propose(const TunedParams& p, bool active);

  // Background thread (rank 0). A proposal to apply from this cycle on, the sampler reset.
  bool take_proposal(TunedParams* p);
  // After a ResponseList executed: counts the global set's reductions.
  void observe(const ResponseList& list);

 private:
  void reset_locked();

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> running_{false};
  bool stopped_ = false;
  bool paused_ = false;  // a score was handed out: nothing is measured until propose
  std::optional<double> score_;
  std::optional<TunedParams> proposal_;
  bool proposal_active_ = true;

  // The sample under way.
  int steps_per_sample_ = 10;
  std::unordered_map<std::string, int32_t> counts_;  // per tensor: times reduced
  std::array<double, kSamples> scores_{};
  int sample_ = 0;
  int64_t bytes_ = 0;
  Clock::time_point sample_start_;
};

}  // namespace bagua_hvd
