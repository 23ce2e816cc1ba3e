#include "core/coordinator.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace bagua_hvd {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::string num_str(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Whether a shape can be a tensor's: no negative dimension, and its size in bytes counts in int64
// (build() and fusion multiply it out). Only a broken or hostile peer sends another.
bool tensor_shape(const std::vector<int64_t>& shape, DataType dtype) {
  int64_t bytes = std::max<int64_t>(1, static_cast<int64_t>(dtype_size(dtype)));
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && bytes > std::numeric_limits<int64_t>::max() / d)) return false;
    bytes *= d;
  }
  return true;
}

}  // namespace

std::string process_set_ranks_error(std::vector<int32_t> ranks, int world_size) {
  std::sort(ranks.begin(), ranks.end());
  if (auto dup = std::adjacent_find(ranks.begin(), ranks.end()); dup != ranks.end())
    return "Tried to register process set with duplicate rank: " + std::to_string(*dup);
  for (int32_t r : ranks)
    if (r < 0 || r >= world_size)
      return "Tried to register process set with invalid rank: " + std::to_string(r);
  return "";
}

namespace {

// The timeline of a coordinator given none: never active.
Timeline& no_timeline() {
  static Timeline off(2);  // never started: its destructor has nothing to stop
  return off;
}

const char* type_name(int32_t type) {
  if (type == kOpAddProcessSet) return "ADD_PROCESS_SET";
  if (type == kOpRemoveProcessSet) return "REMOVE_PROCESS_SET";
  return op_type_name(static_cast<OpType>(type));
}

}  // namespace

Coordinator::Coordinator(int world_size, const std::map<int32_t, std::vector<int32_t>>& sets,
                         CoordinatorParams params, Timeline* timeline)
    : world_size_(world_size),
      sets_(sets),
      params_(params),
      fusion_{params.fusion_threshold, params.no_fuse_bytes},
      joined_(world_size, 0),
      cache_(params.cache_capacity, world_size),
      timeline_(timeline ? *timeline : no_timeline()) {
  for (const auto& kv : sets_) next_set_id_ = std::max(next_set_id_, kv.first + 1);
  if (params_.stall_shutdown_s > 0 && params_.stall_shutdown_s < params_.stall_warning_s) {
    BHVD_LOG(WARNING,
             "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
             "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown.");  // Horovod's rule
    params_.stall_shutdown_s = 0;
  }
}

const std::vector<int32_t>* Coordinator::set_ranks(int32_t id) const {
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : &it->second;
}

int Coordinator::set_rank_of(int32_t set_id, int32_t global_rank) const {
  const auto* ranks = set_ranks(set_id);
  if (!ranks) return -1;
  auto it = std::lower_bound(ranks->begin(), ranks->end(), global_rank);
  return (it != ranks->end() && *it == global_rank) ? static_cast<int>(it - ranks->begin()) : -1;
}

void Coordinator::add(const RequestList& list, int from_rank) {
  if (list.shutdown) shutdown_requested_ = true;
  cache_.ack(from_rank, list.acked_seq);
  for (const auto& r : list.requests) {
    if (!tensor_shape(r.shape, r.dtype))
      throw TransportError("rank " + std::to_string(from_rank) + " sent a request for '" +
                           r.name.substr(0, 200) + "' whose shape no tensor has (a negative " +
                           "dimension, or 2^63 bytes or more)");
    Request copy = r;
    copy.rank = from_rank;
    add_request(std::move(copy));
  }
  for (size_t i = 0; i < list.cached.size(); ++i) {
    int32_t id = list.cached[i];
    const Request* tmpl = cache_.find(id);
    if (!tmpl)
      throw TransportError("rank " + std::to_string(from_rank) +
                           " referred to unknown response-cache entry " + std::to_string(id));
    Request r = *tmpl;
    r.rank = from_rank;
    r.urgent = i < list.cached_urgent.size() && list.cached_urgent[i] != 0;
    add_request(std::move(r));
  }
  for (const auto& name : list.urgent) {
    auto it = table_.find(name);
    if (it != table_.end()) it->second.urgent = true;
  }
}

void Coordinator::add_request(Request r) {
  auto now = Clock::now();
  if (r.type == BHVD_OP_JOIN) {
    if (!joined_[r.rank]) {
      joined_[r.rank] = 1;
      ++joined_count_;
    }
    last_joined_ = r.rank;
    // Pending tensors may now be complete, with the joined rank contributing zeros.
    for (auto& kv : table_) check_ready(kv.first, kv.second, now);
    return;
  }
  const std::string key = tensor_key(r.process_set_id, r.name);
  auto& p = table_[key];
  if (p.reqs.empty()) {
    p.set_id = r.process_set_id;
    const auto* ranks = set_ranks(r.process_set_id);
    size_t n = ranks ? ranks->size() : static_cast<size_t>(world_size_);
    p.reqs.resize(n);
    p.have.assign(n, 0);
    p.first_seen = now;
    p.last_warning = now;
  }
  int sr = set_rank_of(p.set_id, r.rank);
  if (sr < 0 || sr >= static_cast<int>(p.reqs.size())) {
    // The enqueue-time checks make this unreachable unless ranks disagree on the set: report it
    // on the rank's own entry by treating the tensor as ready with an error.
    sr = 0;
  }
  if (timeline_.active()) {
    if (p.count == 0)
      timeline_.negotiate_begin(
          key, horovod_request_type(r.type, static_cast<int32_t>(r.reduce_op)));
    timeline_.negotiate_rank(key, r.rank);
  }
  if (!p.have[sr]) {
    p.have[sr] = 1;
    ++p.count;
  }
  p.urgent = p.urgent || r.urgent;
  p.reqs[sr] = std::move(r);
  check_ready(key, p, now);
}

void Coordinator::check_ready(const std::string& name, Pending& p, Clock::time_point now) {
  if (p.ready) return;
  const auto* ranks = set_ranks(p.set_id);
  for (size_t i = 0; i < p.have.size(); ++i) {
    if (p.have[i]) continue;
    int g = ranks ? (*ranks)[i] : static_cast<int>(i);
    if (!joined_[g]) return;
  }
  p.ready = true;
  p.ready_time = now;
  ready_.push_back(name);
  if (timeline_.active()) timeline_.negotiate_end(name);
}

bool Coordinator::member_joined(const Pending& p) const {
  for (size_t i = 0; i < p.have.size(); ++i)
    if (!p.have[i]) return true;
  return false;
}

Response Coordinator::construct(const std::string& key, Pending& p) {
  Response resp;
  resp.process_set_id = p.set_id;
  resp.names = {key_name(key)};
  // The first submitted request is the reference the others are compared with.
  size_t first = 0;
  while (first < p.have.size() && !p.have[first]) ++first;
  const Request& a = p.reqs[first];
  resp.type = a.type;
  resp.dtype = a.dtype;
  resp.reduce_op = a.reduce_op;
  resp.root_rank = a.root_rank;
  resp.device = a.device;
  resp.prescale = a.prescale;
  resp.postscale = a.postscale;
  resp.params = a.params;
  resp.shapes = {a.shape};
  resp.per_rank = {{}};
  resp.cache_ids = {-1};

  auto fail = [&](std::string msg) {
    resp.kind = Response::ERROR;
    resp.error = std::move(msg);
    return resp;
  };

  const int32_t t = a.type;
  const char* tn = type_name(t);
  for (size_t i = 0; i < p.reqs.size(); ++i) {
    if (!p.have[i] || i == first) continue;
    const Request& b = p.reqs[i];
    if (b.type != t)
      return fail(std::string("Mismatched operations: One rank did an ") + tn +
                  ", but another rank did an " + type_name(b.type) + ".");
  }
  for (size_t i = 0; i < p.reqs.size(); ++i) {
    if (!p.have[i] || i == first) continue;
    const Request& b = p.reqs[i];
    if (b.dtype != a.dtype)
      return fail(std::string("Mismatched data types: One rank had type ") + dtype_name(a.dtype) +
                  ", but another rank had type " + dtype_name(b.dtype) + ".");
  }
  if (member_joined(p)) {
    switch (t) {
      case BHVD_OP_ALLGATHER:
        return fail(
            "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if "
            "using DistributedOptimizer");
      case BHVD_OP_ALLTOALL:
        return fail("Alltoall is not supported with Join at this time.");
      case BHVD_OP_REDUCESCATTER:
        return fail("Reducescatter is not supported with Join at this time.");
      case BHVD_OP_BROADCAST:
        return fail("Broadcast is not supported with Join at this time.");
      case BHVD_OP_COMPRESSED_ALLREDUCE:
        return fail("Compressed allreduce (ByteGrad) is not supported with Join at this time.");
      case BHVD_OP_HIERARCHICAL_ALLREDUCE:
        return fail("Hierarchical allreduce is not supported with Join at this time.");
      case BHVD_OP_ALLREDUCE:
      case BHVD_OP_ADASUM:
      case BHVD_OP_JOIN:
        break;
      default:  // process-set changes, barrier, BAGUA's other primitives
        return fail(std::string(tn) + " is not supported with Join at this time.");
    }
  }
  const bool gather_like = t == BHVD_OP_ALLGATHER || t == BHVD_OP_ALLTOALL;
  // Every op type but the gather-like ones (and the control ones, which carry no tensor) needs
  // the same shape on every rank.
  if (!gather_like && t != BHVD_OP_JOIN && t != BHVD_OP_BARRIER && t != kOpAddProcessSet &&
      t != kOpRemoveProcessSet) {
    for (size_t i = 0; i < p.reqs.size(); ++i) {
      if (!p.have[i] || i == first) continue;
      if (p.reqs[i].shape != a.shape)
        return fail(std::string("Mismatched ") + tn +
                    " tensor shapes: One rank sent a tensor of shape " + shape_str(a.shape) +
                    ", but another rank sent a tensor of shape " + shape_str(p.reqs[i].shape) +
                    ".");
    }
  }
  if (t == BHVD_OP_REDUCESCATTER && a.shape.empty())
    return fail("Process-set rank zero tried to REDUCESCATTER a rank-zero tensor.");
  if (gather_like) {
    if (a.shape.empty())
      return fail(std::string("Process-set rank zero tried to ") + tn + " a rank-zero tensor.");
    for (size_t i = 0; i < p.reqs.size(); ++i) {
      if (!p.have[i] || i == first) continue;
      const auto& bs = p.reqs[i].shape;
      if (bs.size() != a.shape.size())
        return fail(std::string("Mismatched ") + tn +
                    " tensor shapes: One rank sent a tensor of rank " +
                    std::to_string(a.shape.size()) + ", but another rank sent a tensor of rank " +
                    std::to_string(bs.size()) + ".");
      for (size_t d = 1; d < bs.size(); ++d) {
        if (bs[d] != a.shape[d])
          return fail(std::string("Mismatched ") + tn +
                      " tensor shapes: One rank sent a tensor with dimension " + std::to_string(d) +
                      " equal to " + std::to_string(a.shape[d]) +
                      ", but another rank sent a tensor with dimension " + std::to_string(d) +
                      " equal to " + std::to_string(bs[d]) + ".");
      }
    }
  }
  for (size_t i = 0; i < p.reqs.size(); ++i) {
    if (!p.have[i] || i == first) continue;
    const Request& b = p.reqs[i];
    if ((b.device < 0) != (a.device < 0))
      return fail(std::string("Mismatched ") + tn +
                  " CPU/GPU device selection: One rank specified device " +
                  (a.device < 0 ? "CPU" : "GPU") + ", but another rank specified device " +
                  (b.device < 0 ? "CPU" : "GPU") + ".");
    if (t == BHVD_OP_BROADCAST && b.root_rank != a.root_rank)
      return fail("Mismatched BROADCAST root ranks: One rank specified root rank " +
                  std::to_string(a.root_rank) + ", but another rank specified root rank " +
                  std::to_string(b.root_rank) + ".");
    if ((is_allreduce(t) || t == BHVD_OP_REDUCESCATTER) &&
        (b.prescale != a.prescale || b.postscale != a.postscale))
      return fail("Mismatched prescale and/or postscale factors: One rank sent factors (" +
                  num_str(a.prescale) + ", " + num_str(a.postscale) +
                  "), but another rank sent factors (" + num_str(b.prescale) + ", " +
                  num_str(b.postscale) + ").");
    if ((is_allreduce(t) || t == BHVD_OP_REDUCESCATTER) && b.reduce_op != a.reduce_op)
      return fail("Mismatched reduction operation: One rank sent reduction op " +
                  std::to_string(static_cast<int>(a.reduce_op)) +
                  ", but another rank sent reduction op " +
                  std::to_string(static_cast<int>(b.reduce_op)) + ".");
    if (!(b.params == a.params))
      return fail(std::string("Mismatched ") + tn + " algorithm parameters: One rank sent (" +
                  describe(a.params) + "), but another rank sent (" + describe(b.params) +
                  "): every rank must use the same algorithm and step.");
    if ((t == kOpAddProcessSet || t == kOpRemoveProcessSet) && b.splits != a.splits)
      return fail(
          "Mismatched process set arguments: every rank must pass the same ranks (or id) "
          "to add_process_set/remove_process_set.");
  }

  const size_t n = p.reqs.size();
  if (t == BHVD_OP_ALLGATHER) {
    auto& dims = resp.per_rank[0];
    for (size_t i = 0; i < n; ++i) dims.push_back(p.reqs[i].shape[0]);
  } else if (t == BHVD_OP_ALLTOALL) {
    auto& m = resp.per_rank[0];
    for (size_t s = 0; s < n; ++s) {
      if (p.reqs[s].splits.size() != n)
        return fail("Number of entries in splits does not equal number of workers.");
      for (size_t r = 0; r < n; ++r) m.push_back(p.reqs[s].splits[r]);
    }
  } else if (t == kOpAddProcessSet) {
    std::vector<int32_t> ranks = a.splits;
    if (std::string e = process_set_ranks_error(ranks, world_size_); !e.empty()) return fail(e);
    for (const auto& kv : sets_) {
      if (kv.second == ranks) {
        std::ostringstream os;
        os << "Attempted to add a duplicate process set: ProcessSet(process_set_id=None, ranks=[";
        for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
        os << "], mpi_comm=None)";
        return fail(os.str());
      }
    }
    // Horovod's ids: a removed set's id is given again, oldest first (ProcessSetTable's
    // free_ids_ queue), before a new one.
    if (!free_set_ids_.empty()) {
      resp.new_set_id = free_set_ids_.front();
      free_set_ids_.pop_front();
    } else {
      resp.new_set_id = next_set_id_++;
    }
    resp.set_ranks = ranks;
  } else if (t == kOpRemoveProcessSet) {
    int32_t id = a.splits.empty() ? -1 : a.splits[0];
    if (id <= 0 || !set_ranks(id))
      return fail("Process set " + std::to_string(id) + " does not exist or cannot be removed.");
    resp.new_set_id = id;
    free_set_ids_.push_back(id);
  }
  return resp;
}

// Horovod's stall inspector (horovod/common/stall_inspector.cc): a tensor some ranks submitted
// and others did not for longer than HOROVOD_STALL_CHECK_TIME_SECONDS is reported (rank 0's log)
// with the missing ranks and their tensors; past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS those ranks
// are marked "!" and the job shuts down (every rank's pending and later operations fail with
// Horovod's shut-down error). HOROVOD_STALL_CHECK_DISABLE turns off both.
void Coordinator::stall_check(Clock::time_point now, Clock::time_point* wake_at) {
  const double warn_s = params_.stall_warning_s, shutdown_s = params_.stall_shutdown_s;
  if (warn_s <= 0 || shutdown_requested_) return;
  const auto after = [](Clock::time_point t, double s) {
    return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  std::map<int, std::set<std::string>> missing;  // global rank -> tensor names, sorted
  std::set<int> shut_ranks;
  bool report = false;
  for (auto& kv : table_) {
    Pending& p = kv.second;
    if (p.ready) continue;
    const double waited = std::chrono::duration<double>(now - p.first_seen).count();
    if (waited <= warn_s) {
      *wake_at = std::min(*wake_at, after(p.first_seen, warn_s));
      continue;
    }
    const bool shut = shutdown_s > 0 && waited > shutdown_s;
    // Reported once per HOROVOD_STALL_CHECK_TIME_SECONDS (as Horovod checks at that interval).
    if (shut || std::chrono::duration<double>(now - p.last_warning).count() >= warn_s) {
      p.last_warning = now;
      report = true;
    }
    *wake_at = std::min(*wake_at, after(p.last_warning, warn_s));
    if (shutdown_s > 0 && !shut) *wake_at = std::min(*wake_at, after(p.first_seen, shutdown_s));
    const auto* ranks = set_ranks(p.set_id);
    for (size_t i = 0; i < p.have.size(); ++i) {
      const int g = ranks ? (*ranks)[i] : static_cast<int>(i);
      if (p.have[i] || joined_[g]) continue;
      missing[g].insert(key_name(kv.first));
      if (shut) shut_ranks.insert(g);
    }
  }
  if (!report || missing.empty()) return;
  std::ostringstream os;
  os << "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
        "ranks and are waiting for remainder of ranks for more than "
     << static_cast<int64_t>(warn_s)
     << " seconds. This may indicate that different ranks are trying to submit different tensors "
        "or that only subset of ranks is submitting tensors, which will cause deadlock. \n"
        "Missing ranks:";
  for (const auto& kv : missing) {
    os << "\n" << kv.first << (shut_ranks.count(kv.first) ? "!" : "") << ": [";
    size_t shown = 0;  // as Horovod: the first six names, then " ..." when there are more
    for (const auto& name : kv.second) {
      if (shown == 6) {
        os << " ...";
        break;
      }
      os << (shown++ ? ", " : "") << name;
    }
    os << "]";
  }
  if (shut_ranks.empty()) {
    BHVD_LOG(WARNING, os.str());
    return;
  }
  os << "\nOne or more rank (marked by \"!\") is stalled for longer than "
     << static_cast<int64_t>(shutdown_s) << " seconds. Will shutdown.";
  BHVD_LOG(ERROR, os.str());
  shutdown_requested_ = true;  // build() sends the shutdown to every rank
}

void Coordinator::tune(const TunedParams& p) {
  params_.fusion_threshold = fusion_.threshold = p.fusion_threshold;
  params_.cycle_time_s = p.cycle_time_ms / 1000.0;
  cache_.set_capacity(p.cache_enabled ? params_.cache_capacity : 0);
  if (p.hierarchical_allreduce != params_.hierarchical_allreduce) {
    params_.hierarchical_allreduce = p.hierarchical_allreduce;
    hierarchical_sent_ = false;
  }
}

ResponseList Coordinator::build(Clock::time_point now, Clock::time_point* wake_at) {
  ResponseList out;
  *wake_at = Clock::time_point::max();

  // Join completes when every rank has joined.
  bool all_joined = joined_count_ == world_size_;

  // Hold non-urgent ready tensors for up to one cycle so that more can be fused with them.
  bool flush = all_joined || shutdown_requested_;
  int64_t ready_bytes = 0;
  Clock::time_point oldest = Clock::time_point::max();
  for (const auto& name : ready_) {
    const Pending& p = table_.at(name);
    if (p.urgent) flush = true;
    oldest = std::min(oldest, p.ready_time);
    size_t first = 0;
    while (first < p.have.size() && !p.have[first]) ++first;
    if (first < p.have.size()) {
      // Only whether the sum reaches the threshold matters: counting up to it, no sum of (peer
      // sent) sizes overflows.
      const int64_t bytes =
          num_elements(p.reqs[first].shape) * static_cast<int64_t>(dtype_size(p.reqs[first].dtype));
      ready_bytes += std::min(bytes, params_.fusion_threshold - ready_bytes);
    }
  }
  if (!ready_.empty() && !flush) {
    auto due = oldest + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(params_.cycle_time_s));
    if (due <= now || (params_.fusion_threshold > 0 && ready_bytes >= params_.fusion_threshold))
      flush = true;
    else
      *wake_at = due;
  }

  if (flush && !ready_.empty()) {
    std::vector<Response> singles;
    singles.reserve(ready_.size());
    for (const auto& name : ready_) {
      auto it = table_.find(name);
      singles.push_back(construct(name, it->second));
      table_.erase(it);
    }
    ready_.clear();
    // Fuse allreduces with equal parameters, up to the threshold, keeping first-ready order.
    std::vector<char> used(singles.size(), 0);
    for (size_t i = 0; i < singles.size(); ++i) {
      if (used[i]) continue;
      used[i] = 1;
      Response r = std::move(singles[i]);
      fuse_into(r, singles, i, used, fusion_);
      // Responses completed with zeros from joined ranks are not cached: their requests differ.
      if (joined_count_ == 0) cache_.assign(r);
      out.responses.push_back(std::move(r));
    }
  }

  if (all_joined) {
    Response j;
    j.type = BHVD_OP_JOIN;
    j.last_joined_rank = last_joined_;
    j.names = {"join"};
    j.shapes = {{}};
    j.per_rank = {{}};
    j.cache_ids = {-1};
    out.responses.push_back(std::move(j));
    std::fill(joined_.begin(), joined_.end(), 0);
    joined_count_ = 0;
    last_joined_ = -1;
  }

  stall_check(now, wake_at);

  // Retire evicted cache templates once every rank has seen the eviction.
  cache_.retire(seq_);

  if (!hierarchical_sent_) {
    out.hierarchical_allreduce = params_.hierarchical_allreduce ? 1 : 0;
    hierarchical_sent_ = true;
  }
  if (!out.responses.empty() || cache_.has_evictions() || shutdown_requested_ ||
      out.hierarchical_allreduce >= 0) {
    out.seq = ++seq_;
    out.shutdown = shutdown_requested_;
    out.evicted = cache_.take_evictions(out.seq);
  }
  return out;
}

}  // namespace bagua_hvd
