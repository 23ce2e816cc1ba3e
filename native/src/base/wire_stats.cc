// Bytes on the wire per op type (base/wire_stats.h): process-wide relaxed atomics per slot, and
// per thread the slot of the open scope with the bytes it counted so far.
#include "base/wire_stats.h"

#include <atomic>
#include <cctype>
#include <string>

namespace bagua_hvd {
namespace {

struct Slot {
  std::atomic<int64_t> calls{0}, within_host{0}, between_hosts{0};
};

Slot g_slots[kWireSlots];

struct ThreadScope {
  int slot = kWireOther;
  WireCounts bytes;  // of the open scope (calls unused)
  WireCounts last;   // of the last scope closed, until taken
};

thread_local ThreadScope t_scope;

int slot_of(int32_t op_type) {
  return op_type >= 0 && op_type < kWireOpTypes ? op_type : kWireOther;
}

// Lower-case copies of op_type_name(), built once.
struct Names {
  std::string names[kWireSlots];
  Names() {
    for (int s = 0; s < kWireOpTypes; ++s) {
      for (const char* c = op_type_name(static_cast<OpType>(s)); *c; ++c)
        names[s].push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*c))));
    }
    names[kWireOther] = "other";
  }
};

}  // namespace

WireOpScope::WireOpScope(int32_t op_type) : outer_slot_(t_scope.slot), outer_bytes_(t_scope.bytes) {
  t_scope.slot = slot_of(op_type);
  t_scope.bytes = WireCounts{};
  g_slots[t_scope.slot].calls.fetch_add(1, std::memory_order_relaxed);
}

WireOpScope::~WireOpScope() {
  t_scope.last = t_scope.bytes;
  t_scope.last.calls = 1;
  t_scope.slot = outer_slot_;
  t_scope.bytes = outer_bytes_;
}

void count_bytes_sent(bool between_hosts, uint64_t bytes) {
  if (bytes == 0) return;
  const auto n = static_cast<int64_t>(bytes);
  Slot& s = g_slots[t_scope.slot];
  if (between_hosts) {
    s.between_hosts.fetch_add(n, std::memory_order_relaxed);
    t_scope.bytes.between_hosts += n;
  } else {
    s.within_host.fetch_add(n, std::memory_order_relaxed);
    t_scope.bytes.within_host += n;
  }
}

void reset_wire_stats() {
  for (Slot& s : g_slots) {
    s.calls.store(0, std::memory_order_relaxed);
    s.within_host.store(0, std::memory_order_relaxed);
    s.between_hosts.store(0, std::memory_order_relaxed);
  }
}

WireCounts wire_counts(int slot) {
  WireCounts c;
  if (slot < 0 || slot >= kWireSlots) return c;
  const Slot& s = g_slots[slot];
  c.calls = s.calls.load(std::memory_order_relaxed);
  c.within_host = s.within_host.load(std::memory_order_relaxed);
  c.between_hosts = s.between_hosts.load(std::memory_order_relaxed);
  return c;
}

const char* wire_slot_name(int slot) {
  static const Names names;
  return slot >= 0 && slot < kWireSlots ? names.names[slot].c_str() : "";
}

int64_t wire_bytes_sent(bool between_hosts_only) {
  int64_t total = 0;
  for (const Slot& s : g_slots) {
    total += s.between_hosts.load(std::memory_order_relaxed);
    if (!between_hosts_only) total += s.within_host.load(std::memory_order_relaxed);
  }
  return total;
}

WireCounts take_last_scope_bytes() {
  const WireCounts c = t_scope.last;
  t_scope.last = WireCounts{};
  return c;
}

}  // namespace bagua_hvd
