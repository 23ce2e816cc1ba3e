// Hierarchical process sets: the host-local and leader communicators (collectives/hierarchy.h).
#include "collectives/hierarchy.h"

#include <algorithm>
#include <string>

namespace bagua_hvd {

Hierarchy build_hierarchy(Transport& transport, const Comm& comm, int me) {
  Hierarchy h;
  std::map<std::string, std::vector<int>> by_host;  // host -> sorted global ranks
  for (int g : comm.global_ranks()) by_host[transport.host_of(g)].push_back(g);
  std::vector<int> leaders, mine;
  bool crowded = false;
  const std::string my_host = transport.host_of(me);
  for (const auto& kv : by_host) {
    leaders.push_back(kv.second.front());
    crowded = crowded || kv.second.size() > 1;
    if (kv.first == my_host) mine = kv.second;
  }
  h.active = by_host.size() > 1 && crowded;
  if (h.active) {
    std::sort(leaders.begin(), leaders.end());
    h.leader = !mine.empty() && mine.front() == me;
    h.intra = std::make_unique<Comm>(transport, mine);
    h.leaders = std::make_unique<Comm>(transport, leaders);
    const size_t per_host = mine.size();
    const bool uniform = std::all_of(by_host.begin(), by_host.end(),
                                     [&](const auto& kv) { return kv.second.size() == per_host; });
    if (uniform) {
      const size_t index = static_cast<size_t>(
          std::find(mine.begin(), mine.end(), me) - mine.begin());
      std::vector<int> cross;
      for (const auto& kv : by_host) cross.push_back(kv.second[index]);
      std::sort(cross.begin(), cross.end());
      h.cross = std::make_unique<Comm>(transport, cross);
    }
  }
  return h;
}

std::vector<int> ranks_per_host(const Transport& transport, const std::vector<int32_t>& ranks) {
  std::map<std::string, int> per_host;
  for (int g : ranks) ++per_host[transport.host_of(g)];
  std::vector<int> counts;
  for (const auto& kv : per_host) counts.push_back(kv.second);
  return counts;
}

int hierarchical_group_size(const Transport& transport, const std::vector<int32_t>& ranks,
                            bool hierarchical) {
  const int n = static_cast<int>(ranks.size());
  if (!hierarchical) return n;
  const std::vector<int> per_host = ranks_per_host(transport, ranks);
  const bool crowded = std::any_of(per_host.begin(), per_host.end(), [](int c) { return c > 1; });
  return per_host.size() > 1 && crowded ? static_cast<int>(per_host.size()) : n;
}

Hierarchy* Hierarchies::get(int32_t set_id, Transport& transport, const Comm& comm, int me) {
  auto it = by_set_.find(set_id);
  if (it == by_set_.end()) it = by_set_.emplace(set_id, build_hierarchy(transport, comm, me)).first;
  return it->second.active ? &it->second : nullptr;
}

}  // namespace bagua_hvd
