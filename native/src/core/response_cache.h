// The response cache (docs/design-core.md): after a tensor's first successful response every
// rank knows its parameters under a cache id, and a rank resubmitting it with the same
// parameters sends only the id. Two sides of one protocol, here together:
// - ResponseCache, held by the coordinator: assigns ids (LRU, capacity
//   HOROVOD_CACHE_CAPACITY), resolves ids back to request templates, and keeps evicted
//   templates resolvable until every rank has acknowledged the eviction;
// - ResponseCache::Mirror, held by every rank's runtime: name -> (id, request) as learnt from
//   executed responses, dropped as the coordinator evicts.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "requests/message.h"

namespace bagua_hvd {

class ResponseCache {
 public:
  // capacity <= 0 disables the cache.
  ResponseCache(int64_t capacity, int world_size);

  // The request template of a cached id (live, or evicted but not yet acknowledged by every
  // rank); null for an unknown id.
  const Request* find(int32_t id) const;
  // Assigns cache ids to the tensors of an executable response (r.cache_ids), evicting the least
  // recently used entries and ids whose parameters changed.
  void assign(Response& r);
  // A new capacity (the autotuner turning the cache off and on): the least recently used
  // entries beyond it are evicted, as assign() evicts.
  void set_capacity(int64_t capacity);
  // rank has applied every ResponseList up to seq.
  void ack(int rank, uint64_t seq);
  // Forgets evicted templates that every worker has acknowledged by now (last_seq: the last
  // ResponseList sent).
  void retire(uint64_t last_seq);
  bool has_evictions() const { return !pending_evictions_.empty(); }
  // The ids evicted since the last call, published in ResponseList seq.
  std::vector<int32_t> take_evictions(uint64_t seq);

  // Every rank's copy: what it may send as a cache id.
  class Mirror {
   public:
    // The id of key if cached with the same parameters as r, else -1.
    int32_t find(const std::string& key, const Request& r) const;
    void record(const std::string& key, int32_t id, const Request& r);
    void evict(const std::vector<int32_t>& ids);
    void clear();

   private:
    std::unordered_map<std::string, std::pair<int32_t, Request>> by_key_;
    std::unordered_map<int32_t, std::string> keys_;
  };

 private:
  void evict_lru();

  struct CacheEntry {
    Request tmpl;
    std::list<int32_t>::iterator lru;
  };
  int64_t capacity_;
  std::unordered_map<int32_t, CacheEntry> cache_;
  std::unordered_map<std::string, int32_t> by_name_;
  std::list<int32_t> lru_;  // front: most recent
  std::map<uint64_t, std::vector<int32_t>> tombstones_;  // eviction seq -> ids
  std::unordered_map<int32_t, Request> dead_templates_;
  std::vector<uint64_t> acked_;
  std::vector<int32_t> pending_evictions_;
  int32_t next_id_ = 0;
};

}  // namespace bagua_hvd
