// The two levels of a process set for hierarchical algorithms (docs/algorithms.md): its ranks on
// this host, and one leader (the lowest rank) per host. Hosts are told apart by the transport
// (HOROVOD_HOSTNAME).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "collectives/comm.h"
#include "transport/transport.h"

namespace bagua_hvd {

struct Hierarchy {
  bool active = false;  // several hosts, and some host with several ranks of the set
  bool leader = false;
  std::unique_ptr<Comm> intra, leaders;
  // When every host has the same number of the set's ranks: the ranks with this rank's index
  // within its host, one per host (the hierarchical allreduce's shard exchange).
  std::unique_ptr<Comm> cross;
};

// Builds the hierarchy of the ranks of `comm` as seen from global rank `me`.
Hierarchy build_hierarchy(Transport& transport, const Comm& comm, int me);

// How many of `ranks` (global) each host holds, one count per host.
std::vector<int> ranks_per_host(const Transport& transport, const std::vector<int32_t>& ranks);

// Ranks that take part in a (compressed) collective of a set of global ranks: their number, or
// with hierarchical on several hosts with a crowded host, the number of hosts.
int hierarchical_group_size(const Transport& transport, const std::vector<int32_t>& ranks,
                            bool hierarchical);

// The hierarchies of the process sets, built on first use (background thread only).
class Hierarchies {
 public:
  // The active hierarchy of set_id (whose members are comm's), or nullptr when it is flat.
  Hierarchy* get(int32_t set_id, Transport& transport, const Comm& comm, int me);
  void erase(int32_t set_id) { by_set_.erase(set_id); }
  void clear() { by_set_.clear(); }

 private:
  std::map<int32_t, Hierarchy> by_set_;
};

}  // namespace bagua_hvd
