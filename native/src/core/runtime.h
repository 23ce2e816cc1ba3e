// The runtime: one per process. Frontend threads enqueue requests and wait on handles; one
// background thread owns the transport, talks to the coordinator (over the control channel,
// transport/control_channel.h) and runs each response through its op executor (ops/). Request
// validation: core/validate.cc; configuration: core/config.cc; the response cache:
// core/response_cache.cc; host hierarchies: collectives/hierarchy.cc.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "base/common.h"
#include "base/wire_stats.h"
#include "collectives/comm.h"
#include "collectives/hierarchy.h"
#include "core/autotune.h"
#include "core/coordinator.h"
#include "core/response_cache.h"
#include "engines/data_engine.h"
#include "engines/device_engine.h"
#include "engines/fusion_buffer.h"
#include "requests/handle.h"
#include "requests/message.h"
#include "requests/timeline.h"
#include "transport/control_channel.h"
#include "transport/transport.h"

namespace bagua_hvd {

// Horovod's texts.
inline constexpr const char* kShutDown =
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message.";
inline constexpr const char* kDuplicateName =
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name.";
// A response of this type with shutdown set carries the reason a rank gave up.
inline constexpr int32_t kAbortType = -1;

struct RuntimeStats {
  std::atomic<int64_t> responses{0}, fused_tensors{0}, cycles{0}, cache_hits{0};
  std::atomic<int64_t> fusion_buffer_bytes{0};
  std::atomic<int64_t> exec_ns{0};  // time the background thread spent executing operations
};

class Runtime {
 public:
  static Runtime& get();

  Status init(const std::vector<std::vector<int32_t>>& static_sets, bool dynamic_sets);
  Status shutdown();
  bool initialized() const { return initialized_.load(); }

  const BootstrapConfig& config() const { return cfg_; }
  bool dynamic_sets() const { return dynamic_sets_; }

  Status enqueue(const bhvd_request& req, int64_t* handle_out);
  // Enqueues an internal request (process-set changes) and waits for it.
  Status run_internal(int32_t type, std::vector<int32_t> args, int32_t* result);

  int poll(int64_t handle);
  Status wait(int64_t handle, int64_t timeout_ms);
  // Runs fn(final status) once when the handle completes: on the background thread, or on this
  // thread before returning if it already has. fn runs without mu_ held and must not block.
  Status on_done(int64_t handle, std::function<void(const Status&)> fn);
  std::shared_ptr<Handle> find(int64_t handle);
  void release(int64_t handle);

  // Process sets: id -> sorted global ranks.
  std::map<int32_t, std::vector<int32_t>> process_sets();
  const char* transport_kind(int peer);

  RuntimeStats& stats() { return stats_; }
  // Horovod's autotuner: the core's half (core/autotune.h); rank 0 measures, its frontend decides.
  Autotuner& autotuner() { return autotuner_; }

  // Horovod's dynamic timeline (hvd.start_timeline/stop_timeline): rank 0 writes, the other
  // ranks accept and do nothing. Refused (Horovod's text) unless HOROVOD_TIMELINE was set.
  Status start_timeline(const std::string& path, bool mark_cycles);
  Status stop_timeline();

  // HOROVOD_CPU_OPERATIONS=mpi in effect: the MPI engine runs the collectives (null otherwise).
  const MpiFacts* mpi() const { return mpi_engine_ ? &mpi_facts_ : nullptr; }

  // Ranks that take part in a (compressed) collective of the set: the set's size, or with
  // hierarchical=1 on several hosts with a crowded host, its number of hosts. Sizes the
  // error-feedback residuals. -1 for an unknown set. Caller must not hold mu_.
  int group_size(int32_t set_id, bool hierarchical);

 private:
  Runtime() = default;
  void loop();
  // Negotiation (core/negotiation.cc).
  void loop_once_coordinator(bool* active);
  void loop_once_worker(bool* active);
  // Liveness of the ranks this one negotiates with (runtime.cc).
  void check_peers(Clock::time_point now, Clock::duration since_last);
  // An empty frame to each of those ranks, at most every min(1 s, timeout / 4).
  void send_keepalives(Clock::time_point now);
  // The failure path (runtime.cc): the reason this rank raises, the notice a peer sent before it
  // stopped, and this rank's own notices.
  std::string failure_reason(const std::string& what, int peer);
  std::string relayed_failure(int peer);
  static std::string with_witness(const std::string& reason, int rank);
  void send_failure_notices(const std::string& reason);
  // The end of a job that shut down (core/farewell.cc): waits, bounded, until every peer has
  // executed its last response, so that no connection closes under a collective still running.
  void farewell();
  void drain_local(RequestList* out, bool* any);
  void apply(const ResponseList& list);
  // Execution of one response (core/dispatch.cc).
  // tl_group: the response's group on the timeline (0: not recorded).
  void execute(const Response& r, uint64_t tl_group);
  int group_size_locked(int32_t set_id, bool hierarchical);
  // The device engine of a response on CUDA tensors (core/dispatch.cc); throws where none.
  DeviceEngine* device_for(const std::vector<Entry*>& entries);
  void finish(const std::string& name, const Status& s);
  void fail_all(const Status& s);
  // Marks h done (mu_ held); its on_done callback, if any, moves to *callbacks to run after
  // mu_ is released.
  void complete_locked(Handle& h, std::vector<std::function<void()>>* callbacks);
  void mark_seen_locked(Handle& h);
  Comm* comm_for(int32_t set_id);
  void register_set(int32_t id, std::vector<int32_t> ranks);

  RuntimeStats stats_;  // before fusion_, which reports into it
  BootstrapConfig cfg_;
  std::atomic<bool> initialized_{false};
  bool dynamic_sets_ = false;
  int epoch_ = 0;

  std::unique_ptr<Store> store_;
  std::unique_ptr<Transport> transport_;
  std::thread thread_;

  // Guarded by mu_.
  std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<Handle>> handles_;
  std::unordered_map<std::string, Entry> table_;  // pending tensors by name
  // Names from enqueue until their caller has seen the handle complete. A name may be reused
  // only then: the duplicate check depends on the program's order alone, the same on every
  // rank, not on whether the background thread happened to finish the first request yet.
  std::unordered_set<std::string> reserved_;
  std::deque<std::string> queue_;          // names not yet sent to the coordinator
  std::vector<std::string> urgent_queue_;  // sent names whose caller now blocks
  std::map<int32_t, std::vector<int32_t>> sets_;
  std::map<int32_t, std::unique_ptr<Comm>> comms_;
  Hierarchies hierarchies_;  // background thread only
  bool shutdown_requested_ = false;
  bool stopped_ = false;  // background thread finished: no more work is accepted
  Status stop_status_;
  int64_t next_handle_ = 1;
  std::map<int32_t, int64_t> barrier_counter_;
  // Unnamed requests so far per (op prefix, process set's ranks): "<prefix>.noname.<count>".
  std::map<std::pair<std::string, std::vector<int32_t>>, int64_t> unnamed_counter_;
  int64_t internal_counter_ = 0;

  // Background-thread state.
  std::unique_ptr<Coordinator> coordinator_;
  ResponseCache::Mirror cache_;
  uint64_t acked_seq_ = 0;
  bool sent_shutdown_ = false;
  bool ended_by_shutdown_ = false;  // the loop applied a plain shutdown (not a failure's)
  std::unique_ptr<ControlChannel> ctrl_;
  std::vector<Clock::time_point> heard_;  // per rank: when a frame from it last arrived
  Clock::time_point last_keepalive_{};
  std::atomic<std::thread::id> loop_thread_id_{};  // the background thread's (set as loop() starts)
  FusionBuffer fusion_{stats_.fusion_buffer_bytes};
  std::atomic<int> waiters_{0};             // frontend threads blocked in wait()
  std::atomic<int> callbacks_pending_{0};   // on_done callbacks not yet run (a caller waits)
  bool oversubscribed_ = false;             // more local ranks than cores
  std::chrono::microseconds spin_{1000};    // BAGUA_HVD_SPIN_US: poll this long before sleeping
  bool hierarchical_allreduce_ = false;     // HOROVOD_HIERARCHICAL_ALLREDUCE (core/config.h)
  int last_device_ = -1;                    // the CUDA device of the last device response
  std::unique_ptr<DataEngine> mpi_engine_;  // HOROVOD_CPU_OPERATIONS=mpi (engines/mpi_engine.cc)
  MpiFacts mpi_facts_;
  Clock::time_point wake_at_ = Clock::time_point::max();
  Autotuner autotuner_;            // sampling on rank 0 while HOROVOD_AUTOTUNE tunes
  // BAGUA_HVD_RESPONSE_LOG: each response this rank executes, a line each (docs/autotune.md).
  std::unique_ptr<std::ofstream> response_log_;
  Timeline timeline_;              // rank 0's (requests/timeline.h)
  bool timeline_enabled_ = false;  // HOROVOD_TIMELINE set: start_timeline allowed
};

}  // namespace bagua_hvd
