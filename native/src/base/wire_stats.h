// Bytes on the wire per op type (hvd.communication_stats(), bhvd_communication_stats in c_api.h).
//
// The thread executing a response opens a WireOpScope with the response's op type
// (core/dispatch.cc); every payload byte a transfer of that thread sends to another rank is then
// counted once under that op type, as within-host (the peer has this rank's HOROVOD_HOSTNAME:
// shared memory, or TCP with BAGUA_HVD_TRANSPORT=tcp) or between-hosts. Comm::run
// (collectives/comm.cc) counts its transfers here; a device engine whose library moves the bytes
// itself (NCCL) calls count_bytes_sent() for them (the CUDA engine: by NCCL's ring model).
//
// Not counted: negotiation and the other control messages (the control pairs), bytes a rank
// "sends" to itself, and collectives the MPI engine runs (HOROVOD_CPU_OPERATIONS=mpi: the MPI
// library's traffic is invisible here). Bytes sent while no scope is open count under "other"
// (nothing sends so today). The counters are process-wide atomics, reset by Runtime::init:
// counting starts at init().
#pragma once

#include <cstdint>

#include "base/common.h"

namespace bagua_hvd {

// Counter slots: one per op type BHVD_OP_ALLREDUCE (0) .. BHVD_OP_LP_DECENTRALIZED_EXCHANGE, then
// "other".
inline constexpr int kWireOpTypes = BHVD_OP_LP_DECENTRALIZED_EXCHANGE + 1;
inline constexpr int kWireOther = kWireOpTypes;
inline constexpr int kWireSlots = kWireOpTypes + 1;

struct WireCounts {
  int64_t calls = 0;          // responses executed (scopes opened)
  int64_t within_host = 0;    // bytes sent to ranks on this host
  int64_t between_hosts = 0;  // bytes sent to ranks on other hosts
};

// While alive, this thread's sent bytes count under op_type (a BHVD_OP_* value; any other value
// counts under "other"); its construction counts one call. Scopes nest: the inner one counts
// alone and the outer one resumes after it.
class WireOpScope {
 public:
  explicit WireOpScope(int32_t op_type);
  ~WireOpScope();
  WireOpScope(const WireOpScope&) = delete;
  WireOpScope& operator=(const WireOpScope&) = delete;

 private:
  int outer_slot_;
  WireCounts outer_bytes_;
};

// Counts `bytes` sent by this thread to another rank under the op type of its open scope
// ("other" without one). For the layer that hands bytes to a peer: Comm::run for the core's own
// transports; a device engine for what its library (NCCL) sent, between_hosts being whether the
// peer's host differs from this rank's (Transport::host_of). Thread-safe, lock-free.
void count_bytes_sent(bool between_hosts, uint64_t bytes);

// Zeroes every counter (Runtime::init, before the background thread starts).
void reset_wire_stats();
// One slot's counters so far (slot in [0, kWireSlots)).
WireCounts wire_counts(int slot);
// The slot's key in hvd.communication_stats(): Horovod's request type names in snake_case
// ("allreduce", "adasum", "compressed_allreduce", ...), and "other".
const char* wire_slot_name(int slot);
// Bytes sent since init over every slot: all of them, or only those between hosts.
int64_t wire_bytes_sent(bool between_hosts_only);
// The bytes counted by the last scope that closed on this thread (calls = 1), then zero (calls
// = 0) until another one closes: the timeline's figure of one response.
WireCounts take_last_scope_bytes();

}  // namespace bagua_hvd
