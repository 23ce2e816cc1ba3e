// The execution of one negotiated response on this rank (core/runtime.h): errors and control
// ops (join, barrier, process-set changes) here, tensor ops through their executor (ops/) with
// the set's Comm, its host hierarchy (host and device tensors alike), the data engine and the
// fusion buffer.
#include <algorithm>
#include <stdexcept>

#include "core/runtime.h"
#include "engines/device_engine.h"
#include "engines/nccl_library.h"
#include "ops/op.h"

namespace bagua_hvd {

Comm* Runtime::comm_for(int32_t set_id) {
  auto it = comms_.find(set_id);
  return it == comms_.end() ? nullptr : it->second.get();
}

void Runtime::register_set(int32_t id, std::vector<int32_t> ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  std::sort(ranks.begin(), ranks.end());
  sets_[id] = ranks;
  comms_[id] = std::make_unique<Comm>(*transport_, ranks);
}

void Runtime::execute(const Response& r, uint64_t tl_group) {
  if (tl_group) timeline_.activity_end(tl_group);  // out of QUEUE
  stats_.responses++;
  if (r.names.size() > 1) stats_.fused_tensors += static_cast<int64_t>(r.names.size());
  std::vector<std::string> keys;
  for (const auto& name : r.names) keys.push_back(tensor_key(r.process_set_id, name));
  if (r.kind == Response::ERROR) {
    for (const auto& key : keys) finish(key, Status::Precondition(r.error));
    return;
  }
  auto set_result = [&](const std::string& key, int32_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(key);
    if (it != table_.end()) it->second.handle->result = value;
  };
  switch (r.type) {
    case BHVD_OP_JOIN:
      set_result(tensor_key(0, "join"), r.last_joined_rank);
      finish(tensor_key(0, "join"), Status::OK());
      return;
    case BHVD_OP_BARRIER:
      finish(keys[0], Status::OK());
      return;
    case kOpAddProcessSet:
      register_set(r.new_set_id, r.set_ranks);
      if (coordinator_)
        coordinator_->set_next_set_id(std::max(coordinator_->next_set_id(), r.new_set_id + 1));
      set_result(keys[0], r.new_set_id);
      finish(keys[0], Status::OK());
      return;
    case kOpRemoveProcessSet: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        sets_.erase(r.new_set_id);
        comms_.erase(r.new_set_id);
        hierarchies_.erase(r.new_set_id);
      }
      set_result(keys[0], r.new_set_id);
      finish(keys[0], Status::OK());
      return;
    }
    default:
      break;
  }
  Comm* comm = comm_for(r.process_set_id);
  if (!comm || comm->rank() < 0) return;  // not a member of the set
  const WireOpScope wire(horovod_request_type(r.type, static_cast<int32_t>(r.reduce_op)));
  std::vector<Entry*> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& key : keys) {
      auto it = table_.find(key);
      entries.push_back(it == table_.end() ? nullptr : &it->second);
    }
  }
  const OpExecutor exec = op_executor(r.type);
  if (!exec) {
    for (const auto& key : keys)
      finish(key, Status::Error(StatusType::UNKNOWN_ERROR, "unsupported response type"));
    return;
  }
  const auto started = Clock::now();
  // The host hierarchy (BAGUA's hierarchical algorithms, Horovod's hierarchical allreduce) is the
  // op executors' on every engine: within the host over shared memory or NVLink, among the hosts
  // over the network.
  const bool hierarchical = runs_hierarchical(r.type, r.params) ||
                            (r.type == BHVD_OP_ALLREDUCE && hierarchical_allreduce_);
  Hierarchy* hierarchy =
      hierarchical ? hierarchies_.get(r.process_set_id, *transport_, *comm, cfg_.rank) : nullptr;
  DeviceEngine* device = r.device >= 0 ? device_for(entries) : nullptr;
  if (device) {
    // Device tensors: the engine's stream waits for the callers' streams, and the handles get
    // the event after the op.
    std::vector<DeviceEvent> inputs;
    for (Entry* e : entries)
      if (e && e->ready) {
        device->wait(e->ready);
        inputs.push_back(e->ready);
      }
    ExecContext ctx{r, *comm, entries, *device, device->fusion(), hierarchy, mu_, &timeline_,
                    tl_group};
    // Horovod's GPU Adasum with NCCL (its CPU Adasum, on a staged copy, without).
    if (r.type == BHVD_OP_ALLREDUCE && r.reduce_op == ReduceOp::ADASUM && loaded_nccl()) {
      ctx.device_adasum_hosts =
          static_cast<int>(ranks_per_host(*transport_, comm->global_ranks()).size());
      ctx.hierarchy = hierarchies_.get(r.process_set_id, *transport_, *comm, cfg_.rank);
    }
    exec(ctx);
    DeviceEvent done = device->done(std::move(inputs));
    std::lock_guard<std::mutex> lock(mu_);
    for (Entry* e : entries)
      if (e) e->handle->done_event = done;
  } else {
    DataEngine& engine = mpi_engine_ ? *mpi_engine_ : cpu_engine();
    ExecContext ctx{r, *comm, entries, engine, fusion_, hierarchy, mu_, &timeline_, tl_group};
    exec(ctx);
  }
  stats_.exec_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - started).count();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (r.cache_ids[i] >= 0 && entries[i]) {
      cache_.record(keys[i], r.cache_ids[i], entries[i]->request);
    }
    finish(keys[i], Status::OK());
  }
}

DeviceEngine* Runtime::device_for(const std::vector<Entry*>& entries) {
  // This rank's device: its own request's (device ordinals differ between ranks). A rank that
  // joined has no entry: its contribution (zeros) comes from the device it last used.
  int device = -1;
  for (Entry* e : entries)
    if (e) device = e->request.device;
  if (device < 0) device = last_device_ >= 0 ? last_device_ : 0;
  last_device_ = device;
  std::string why;
  DeviceEngine* engine = device_engine(device, &why);
  if (!engine) throw std::runtime_error("CUDA device " + std::to_string(device) + ": " + why);
  return engine;
}

int Runtime::group_size(int32_t set_id, bool hierarchical) {
  std::lock_guard<std::mutex> lock(mu_);
  return group_size_locked(set_id, hierarchical);
}

int Runtime::group_size_locked(int32_t set_id, bool hierarchical) {
  auto it = sets_.find(set_id);
  if (it == sets_.end() || !transport_) return -1;
  return hierarchical_group_size(*transport_, it->second, hierarchical);
}

}  // namespace bagua_hvd
