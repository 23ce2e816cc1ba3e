// Op executors: the execution of one negotiated response on this rank, one op type per file,
// named after the op (ops/allreduce.cc, ops/allgather.cc, ..., ops/peer_average.cc, ...). The
// runtime resolves the context (the process set's Comm, this rank's entries, the data engine of
// the tensors' device) and calls the executor of the response's type on the background thread.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <variant>
#include <vector>

#include "collectives/comm.h"
#include "collectives/hierarchy.h"
#include "engines/data_engine.h"
#include "engines/fusion_buffer.h"
#include "requests/handle.h"
#include "requests/message.h"
#include "requests/timeline.h"

namespace bagua_hvd {

struct ExecContext {
  const Response& r;
  Comm& comm;
  // Per tensor of r: this rank's entry, or null (a joined rank, which contributes zeros).
  std::vector<Entry*>& entries;
  DataEngine& engine;
  FusionBuffer& fusion;
  // The set's host hierarchy when r runs hierarchical (runs_hierarchical, requests/message.h) on
  // several hosts with a crowded one, else null.
  Hierarchy* hierarchy;
  // Guards the handles' core-allocated outputs, which frontend threads read.
  std::mutex& handles_mu;
  // Rank 0's timeline and the response's group on it (0: not recorded, TimelineActivity
  // records nothing).
  Timeline* timeline = nullptr;
  uint64_t tl_group = 0;
  // An Adasum of CUDA tensors (Horovod's GPU Adasum): the set's number of hosts, with hierarchy
  // its host levels when it has several hosts with several ranks; 0 for host tensors.
  int device_adasum_hosts = 0;
};

// The collectives as the timeline names their activity: Horovod's GLOO_* on the core's own
// transports (which play Horovod's Gloo role: gloo_enabled() is true), MPI_* on the MPI engine.
enum class TlCollective { kAllreduce, kAllgather, kBroadcast, kAlltoall, kReducescatter };
const char* timeline_collective(const DataEngine& engine, TlCollective c);

// One activity of the response's tensors on the timeline, for its scope (nothing, one branch,
// when the response is not recorded).
class TimelineActivity {
 public:
  TimelineActivity(const ExecContext& ctx, const char* activity)
      : timeline_(ctx.tl_group ? ctx.timeline : nullptr), group_(ctx.tl_group) {
    if (timeline_) timeline_->activity_begin(group_, activity);
  }
  TimelineActivity(const ExecContext& ctx, TlCollective c)
      : timeline_(ctx.tl_group ? ctx.timeline : nullptr), group_(ctx.tl_group) {
    if (timeline_) timeline_->activity_begin(group_, timeline_collective(ctx.engine, c));
  }
  ~TimelineActivity() {
    if (timeline_) timeline_->activity_end(group_);
  }
  TimelineActivity(const TimelineActivity&) = delete;
  TimelineActivity& operator=(const TimelineActivity&) = delete;

 private:
  Timeline* timeline_;
  uint64_t group_;
};

using OpExecutor = void (*)(ExecContext& ctx);

// The executor of a tensor op type (BHVD_OP_*), or null for types the runtime runs itself (join,
// barrier, process-set changes) and unknown ones.
OpExecutor op_executor(int32_t type);

// Horovod's GPU Adasum on hosts with several ranks each (AdasumGpuAllreduceOp), on any engine:
// buf (the tensors of counts, packed) is summed over the host, then each rank of the host
// combines one slice of it with the same slice on the other hosts (cross: one rank per host;
// the host's last rank also takes the remainder), the dot products summed over the host's
// slices too, and the slices are broadcast back over the host. The hosts exchange one buffer's
// worth, not one per rank. (ops/allreduce.cc)
void adasum_across_hosts(DataEngine& eng, Comm& host, Comm& cross, unsigned char* buf,
                         const std::vector<size_t>& counts, DataType dtype);

// The executors (one file each).
void execute_allreduce(ExecContext& ctx);
void execute_allgather(ExecContext& ctx);
void execute_broadcast(ExecContext& ctx);
void execute_alltoall(ExecContext& ctx);
void execute_reducescatter(ExecContext& ctx);
void execute_compressed_allreduce(ExecContext& ctx);
void execute_peer_average(ExecContext& ctx);
void execute_lp_decentralized_init(ExecContext& ctx);
void execute_lp_decentralized_step(ExecContext& ctx);
void execute_lp_decentralized_exchange(ExecContext& ctx);

// The response's parameters and the entry's state buffers, as the executor of its op type
// takes them (validated at enqueue, core/validate.cc; the types match by construction).
template <typename P>
const P& params(const ExecContext& ctx) {
  return std::get<P>(ctx.r.params);
}
template <typename S>
S& state(Entry* e) {
  return std::get<S>(e->state);
}

// A hierarchical weight average (ctx.hierarchy set): the host's average into e->output, then
// among_leaders on the hosts' leaders, then the leader's result to the host (ops/op.cc).
void host_average_then(ExecContext& ctx, Entry* e, size_t count,
                       const std::function<void(Comm& leaders)>& among_leaders);

}  // namespace bagua_hvd
