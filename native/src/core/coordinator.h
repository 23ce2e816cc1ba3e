// The coordinator (global rank 0): collects every rank's requests, decides when a tensor is
// ready on all members of its process set, validates the requests against each other with
// Horovod's error texts, fuses ready allreduces (core/fusion.cc), assigns response-cache ids
// (core/response_cache.cc), and emits one totally ordered ResponseList.
#pragma once

#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/common.h"
#include "core/autotune.h"
#include "core/fusion.h"
#include "core/response_cache.h"
#include "requests/message.h"
#include "requests/timeline.h"

namespace bagua_hvd {

struct CoordinatorParams {
  int64_t fusion_threshold = 128 << 20;  // bytes; 0 disables fusion
  // Tensors this large are bandwidth-bound: fusing them would only add two copies through the
  // fusion buffer, so they run alone, in place.
  int64_t no_fuse_bytes = 1 << 20;
  double cycle_time_s = 1e-3;     // how long non-urgent ready tensors may wait to fuse
  int64_t cache_capacity = 1024;  // 0 disables the response cache
  double stall_warning_s = 60;    // 0 disables the stall inspector (shutdown included)
  double stall_shutdown_s = 0;    // 0: never shut the job down for a stalled tensor
  bool hierarchical_allreduce = false;  // HOROVOD_HIERARCHICAL_ALLREDUCE (the autotuner's after)
};

// Horovod's checks of a process set's global ranks (ProcessSetTable::RegisterProcessSet): "" when
// they are valid, else its message ("Tried to register process set with duplicate rank: 1"). For
// the sets given at init and those added later alike: every rank's tables are indexed by them.
std::string process_set_ranks_error(std::vector<int32_t> ranks, int world_size);

class Coordinator {
 public:
  // sets: process set id -> sorted global ranks (the runtime's table, updated by it as
  // add/remove responses execute). timeline: where the negotiations are recorded while it is
  // active (rank 0's; null: never).
  Coordinator(int world_size, const std::map<int32_t, std::vector<int32_t>>& sets,
              CoordinatorParams params, Timeline* timeline = nullptr);

  // Adds one rank's RequestList (the coordinator's own requests come through here too).
  void add(const RequestList& list, int from_rank);

  // The responses to run now. Sets *wake_at when ready tensors are being held for fusion or the
  // stall inspector needs to look again.
  ResponseList build(Clock::time_point now, Clock::time_point* wake_at);

  bool shutdown_requested() const { return shutdown_requested_; }

  // The autotuner's parameters (core/autotune.h), from the next build() on; a change of the
  // hierarchical allreduce goes out in that ResponseList (ResponseList::hierarchical_allreduce).
  void tune(const TunedParams& p);

 private:
  struct Pending {
    int32_t set_id = 0;
    std::vector<Request> reqs;  // by set rank
    std::vector<char> have;     // by set rank
    int count = 0;
    bool urgent = false;
    bool ready = false;
    Clock::time_point first_seen;
    Clock::time_point ready_time;
    Clock::time_point last_warning;
  };

  void add_request(Request r);
  void check_ready(const std::string& name, Pending& p, Clock::time_point now);
  Response construct(const std::string& name, Pending& p);
  bool member_joined(const Pending& p) const;
  const std::vector<int32_t>* set_ranks(int32_t id) const;
  int set_rank_of(int32_t set_id, int32_t global_rank) const;
  void stall_check(Clock::time_point now, Clock::time_point* wake_at);

  int world_size_;
  const std::map<int32_t, std::vector<int32_t>>& sets_;
  CoordinatorParams params_;
  FusionParams fusion_;

  std::unordered_map<std::string, Pending> table_;
  std::vector<std::string> ready_;  // names in the order they became ready

  std::vector<char> joined_;
  int joined_count_ = 0;
  int32_t last_joined_ = -1;

  bool shutdown_requested_ = false;
  bool hierarchical_sent_ = true;  // the last change of params_.hierarchical_allreduce went out
  uint64_t seq_ = 0;
  int32_t next_set_id_ = 1;
  std::deque<int32_t> free_set_ids_;  // removed sets' ids, given again first (Horovod's rule)

  ResponseCache cache_;
  Timeline& timeline_;

 public:
  // Exposed for tests through bhvd_stat.
  int32_t next_set_id() const { return next_set_id_; }
  void set_next_set_id(int32_t v) { next_set_id_ = v; }
};

}  // namespace bagua_hvd
