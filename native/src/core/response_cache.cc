// The response cache, coordinator and rank sides (core/response_cache.h).
#include "core/response_cache.h"

#include <algorithm>

namespace bagua_hvd {

namespace {

bool cacheable(int32_t type) {
  // Shapes are identical on every rank only for these. BAGUA's other primitives are not cached:
  // a peer average's round changes with every call, the replicas' initialisation runs once.
  return is_allreduce(type) || type == BHVD_OP_BROADCAST || type == BHVD_OP_REDUCESCATTER;
}

}  // namespace

ResponseCache::ResponseCache(int64_t capacity, int world_size)
    : capacity_(capacity), acked_(world_size, 0) {}

const Request* ResponseCache::find(int32_t id) const {
  if (auto it = cache_.find(id); it != cache_.end()) return &it->second.tmpl;
  if (auto dt = dead_templates_.find(id); dt != dead_templates_.end()) return &dt->second;
  return nullptr;
}

void ResponseCache::ack(int rank, uint64_t seq) {
  if (rank >= 0 && rank < static_cast<int>(acked_.size()))
    acked_[rank] = std::max(acked_[rank], seq);
}

void ResponseCache::assign(Response& r) {
  if (capacity_ <= 0 || r.kind != Response::OP || !cacheable(r.type)) return;
  for (size_t i = 0; i < r.names.size(); ++i) {
    const std::string& name = r.names[i];
    const std::string key = tensor_key(r.process_set_id, name);
    auto it = by_name_.find(key);
    // The template is rebuilt from the response, which carries every parameter of the request.
    Request tmpl;
    tmpl.type = r.type;
    tmpl.dtype = r.dtype;
    tmpl.name = name;
    tmpl.process_set_id = r.process_set_id;
    tmpl.reduce_op = r.reduce_op;
    tmpl.root_rank = r.root_rank;
    tmpl.device = r.device;
    tmpl.prescale = r.prescale;
    tmpl.postscale = r.postscale;
    tmpl.params = r.params;
    tmpl.shape = r.shapes[i];
    if (it != by_name_.end()) {
      auto& e = cache_.at(it->second);
      if (e.tmpl.same_params(tmpl)) {
        lru_.splice(lru_.begin(), lru_, e.lru);
        r.cache_ids[i] = it->second;
        continue;
      }
      // Parameters changed: retire the old id.
      int32_t old = it->second;
      dead_templates_[old] = e.tmpl;
      lru_.erase(e.lru);
      cache_.erase(old);
      by_name_.erase(it);
      pending_evictions_.push_back(old);
    }
    if (static_cast<int64_t>(cache_.size()) >= capacity_) evict_lru();
    int32_t id = next_id_++;
    lru_.push_front(id);
    cache_[id] = CacheEntry{std::move(tmpl), lru_.begin()};
    by_name_[key] = id;
    r.cache_ids[i] = id;
  }
}

void ResponseCache::evict_lru() {
  int32_t victim = lru_.back();
  lru_.pop_back();
  auto& ve = cache_.at(victim);
  by_name_.erase(tensor_key(ve.tmpl.process_set_id, ve.tmpl.name));
  dead_templates_[victim] = std::move(ve.tmpl);
  cache_.erase(victim);
  pending_evictions_.push_back(victim);
}

void ResponseCache::set_capacity(int64_t capacity) {
  capacity_ = capacity;
  while (!lru_.empty() && static_cast<int64_t>(cache_.size()) > std::max<int64_t>(capacity_, 0))
    evict_lru();
}

void ResponseCache::retire(uint64_t last_seq) {
  uint64_t min_acked = last_seq;
  for (size_t r = 1; r < acked_.size(); ++r) min_acked = std::min(min_acked, acked_[r]);
  while (!tombstones_.empty() && tombstones_.begin()->first <= min_acked) {
    for (int32_t id : tombstones_.begin()->second) dead_templates_.erase(id);
    tombstones_.erase(tombstones_.begin());
  }
}

std::vector<int32_t> ResponseCache::take_evictions(uint64_t seq) {
  std::vector<int32_t> out = std::move(pending_evictions_);
  pending_evictions_.clear();
  if (!out.empty()) tombstones_[seq] = out;
  return out;
}

int32_t ResponseCache::Mirror::find(const std::string& key, const Request& r) const {
  auto c = by_key_.find(key);
  return c != by_key_.end() && c->second.second.same_params(r) ? c->second.first : -1;
}

void ResponseCache::Mirror::record(const std::string& key, int32_t id, const Request& r) {
  if (auto old = by_key_.find(key); old != by_key_.end()) keys_.erase(old->second.first);
  by_key_[key] = {id, r};
  keys_[id] = key;
}

void ResponseCache::Mirror::evict(const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    auto n = keys_.find(id);
    if (n == keys_.end()) continue;
    auto c = by_key_.find(n->second);
    if (c != by_key_.end() && c->second.first == id) by_key_.erase(c);
    keys_.erase(n);
  }
}

void ResponseCache::Mirror::clear() {
  by_key_.clear();
  keys_.clear();
}

}  // namespace bagua_hvd
