// The runtime's negotiation cycle (core/runtime.h): drain this rank's queued requests (as cache
// ids where the response cache knows them), exchange RequestLists and ResponseLists with the
// coordinator over the control channel, and apply each ResponseList in its total order.
#include <algorithm>

#include "core/runtime.h"

namespace bagua_hvd {

void Runtime::drain_local(RequestList* out, bool* any) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& name : queue_) {
    auto it = table_.find(name);
    if (it == table_.end()) continue;
    const Request& r = it->second.request;
    if (const int32_t id = cache_.find(name, r); id >= 0) {
      out->cached.push_back(id);
      out->cached_urgent.push_back(r.urgent ? 1 : 0);
      stats_.cache_hits++;
    } else {
      out->requests.push_back(r);
    }
    *any = true;
  }
  queue_.clear();
  if (!urgent_queue_.empty()) {
    out->urgent = std::move(urgent_queue_);
    urgent_queue_.clear();
    *any = true;
  }
  if (shutdown_requested_ && !sent_shutdown_) {
    out->shutdown = true;
    sent_shutdown_ = true;
    *any = true;
  }
}

void Runtime::loop_once_coordinator(bool* active) {
  RequestList own;
  bool any = false;
  drain_local(&own, &any);
  if (any) {
    coordinator_->add(own, 0);
    *active = true;
  }
  std::string msg;
  for (int w = 1; w < cfg_.size; ++w) {
    while (ctrl_->poll(w, &msg)) {
      heard_[w] = Clock::now();
      if (msg.empty()) continue;  // a keepalive (Runtime::check_peers)
      RequestList list = decode_request_list(msg);
      // A worker whose communication failed: the job stops with its reason (Runtime::loop).
      if (!list.failure.empty()) throw TransportError(with_witness(list.failure, w));
      coordinator_->add(list, w);
      *active = true;
    }
  }
  if (TunedParams p; autotuner_.take_proposal(&p)) coordinator_->tune(p);
  ResponseList out = coordinator_->build(Clock::now(), &wake_at_);
  if (out.responses.empty() && !out.shutdown && out.evicted.empty() &&
      out.hierarchical_allreduce < 0)
    return;
  std::string payload = encode(out);
  for (int w = 1; w < cfg_.size; ++w) ctrl_->send(w, payload);
  if (timeline_.active() && !out.responses.empty()) timeline_.mark_cycle();
  apply(out);
  autotuner_.observe(out);
  *active = true;
}

void Runtime::loop_once_worker(bool* active) {
  RequestList rl;
  bool any = false;
  drain_local(&rl, &any);
  if (any) {
    rl.acked_seq = acked_seq_;
    ctrl_->send(0, encode(rl));
    *active = true;
  }
  std::string msg;
  while (ctrl_->poll(0, &msg)) {
    heard_[0] = Clock::now();
    if (msg.empty()) continue;  // a keepalive (Runtime::check_peers)
    apply(decode_response_list(msg));
    *active = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
  }
}

void Runtime::apply(const ResponseList& list) {
  cache_.evict(list.evicted);
  if (list.hierarchical_allreduce >= 0) hierarchical_allreduce_ = list.hierarchical_allreduce != 0;
  // On the timeline (rank 0), every response of the list starts now and waits in QUEUE behind
  // the earlier ones until it executes.
  std::vector<uint64_t> groups;
  if (timeline_.active()) {
    groups.assign(list.responses.size(), 0);
    for (size_t i = 0; i < list.responses.size(); ++i) {
      const Response& r = list.responses[i];
      if (r.kind == Response::ERROR && r.type == kAbortType) continue;
      const Comm* comm = comm_for(r.process_set_id);
      if (!comm || comm->rank() < 0) continue;  // not a member: nothing runs here
      std::vector<std::string> keys;
      keys.reserve(r.names.size());
      for (const auto& name : r.names) keys.push_back(tensor_key(r.process_set_id, name));
      groups[i] = timeline_.op_begin(std::move(keys),
                                     horovod_request_type(r.type, static_cast<int32_t>(r.reduce_op)),
                                     static_cast<int32_t>(r.dtype));
      timeline_.activity_begin(groups[i], kTlQueue);
    }
  }
  std::string abort_reason;
  for (size_t i = 0; i < list.responses.size(); ++i) {
    const Response& r = list.responses[i];
    if (r.kind == Response::ERROR && r.type == kAbortType) {
      abort_reason = r.error;
      continue;
    }
    const uint64_t group = groups.empty() ? 0 : groups[i];
    if (response_log_) {
      // The seq, set, type, the hierarchical allreduce in effect, the names in fusion order.
      *response_log_ << list.seq << ' ' << r.process_set_id << ' ' << r.type << ' '
                     << (hierarchical_allreduce_ ? 1 : 0) << ' ';
      for (size_t k = 0; k < r.names.size(); ++k) *response_log_ << (k ? "," : "") << r.names[k];
      *response_log_ << '\n';
    }
    execute(r, group);
    const WireCounts sent = take_last_scope_bytes();  // read after every response: never stale
    if (group) timeline_.op_end(group, sent);
  }
  stats_.cycles++;
  if (list.seq) acked_seq_ = list.seq;
  if (list.shutdown) {
    ended_by_shutdown_ = abort_reason.empty();
    fail_all(Status::Aborted(abort_reason.empty() ? kShutDown : abort_reason));
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (!abort_reason.empty()) stop_status_ = Status::Aborted(abort_reason);
  }
}

}  // namespace bagua_hvd
