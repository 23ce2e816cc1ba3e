// Horovod's timeline (HOROVOD_TIMELINE, hvd.start_timeline): a Chrome-trace JSON that rank 0
// writes, one row ("pid", with its process_name metadata) per tensor, Horovod's activity names.
// The background thread only stamps small records and pushes them into a bounded queue; a writer
// thread owned by the Timeline formats and writes them. While off, every hook costs one relaxed
// load and one predictable branch (active()).
//
// What a tensor's row shows (the hooks: core/coordinator.cc for negotiation, core/negotiation.cc
// and core/dispatch.cc for the response, the op executors in ops/ for the activities):
//   NEGOTIATE_<TYPE>   from the first rank's request to the tensor being ready on all ranks,
//                      with one zero-length "X" event named after each rank when its request
//                      arrives;
//   <TYPE>             the response's execution (ALLREDUCE, ALLGATHER, ..., BAGUA's op types by
//                      their own names); its end event's args: the dtype and, for a tensor op
//                      this rank took part in, the bytes it sent to other ranks
//                      (within_host_bytes_sent, between_hosts_bytes_sent: base/wire_stats.h;
//                      the response's, all its tensors' when fused); nested activities: QUEUE
//                      (behind earlier responses of the same cycle), MEMCPY_IN_FUSION_BUFFER, the
//                      collective (GLOO_ALLREDUCE on the core's own transports, MPI_ALLREDUCE with
//                      HOROVOD_CPU_OPERATIONS=mpi, ...), MEMCPY_OUT_FUSION_BUFFER.
// CYCLE_START instant events mark each cycle that ran responses (mark_cycles).
//
// The file is valid JSON after every write (the array is closed, and reopened by the next
// write) and B/E events are well nested per row whatever the producers do: the writer closes a
// row's open events before a new top-level event, drops an end with nothing open, and closes
// what is still open when the file is stopped. When the queue is full a record is dropped and
// counted; the writer then closes every open event and writes a TIMELINE_RECORDS_DROPPED marker.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "base/wire_stats.h"

namespace bagua_hvd {

// Activity names (Horovod's where Horovod has the phase).
inline constexpr const char* kTlQueue = "QUEUE";
inline constexpr const char* kTlMemcpyIn = "MEMCPY_IN_FUSION_BUFFER";
inline constexpr const char* kTlMemcpyOut = "MEMCPY_OUT_FUSION_BUFFER";
inline constexpr const char* kTlPeerExchange = "PEER_EXCHANGE";
inline constexpr const char* kTlCompressedAllreduce = "COMPRESSED_ALLREDUCE";

struct TimelineRecord {
  enum Kind : uint8_t {
    kNegotiateBegin,  // name, value = op type
    kNegotiateRank,   // name, value = rank
    kNegotiateEnd,    // name
    kOpBegin,         // names, group, value = op type, dtype
    kActivityBegin,   // group, activity
    kActivityEnd,     // group
    kOpEnd,           // group, sent
    kCycle,           // (mark_cycles)
    kOpen,            // control: open names[0] (start)
    kClose,           // control: close the file (stop)
  };
  Kind kind = kCycle;
  int32_t value = 0;
  int32_t dtype = -1;
  uint64_t group = 0;
  int64_t ts_ns = 0;               // Clock (steady), nanoseconds
  const char* activity = nullptr;  // a static string
  WireCounts sent;                 // kOpEnd: the response's bytes (calls 0: none counted)
  std::vector<std::string> names;  // tensor keys (set:name, requests/message.h)
};

class Timeline {
 public:
  // capacity: records the queue holds before it drops; flush_ms: how often the writer wakes
  // without being asked (it is also woken when the queue is half full).
  explicit Timeline(size_t capacity = size_t(1) << 16, int flush_ms = 20);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool active() const { return active_.load(std::memory_order_relaxed); }

  // Opens path (truncating; another open file is stopped first) and starts recording; the same
  // path while recording only changes mark_cycles. An unwritable path: an error status, and the
  // timeline stays off. Blocks until the writer has the file open.
  Status start(const std::string& path, bool mark_cycles);
  // Stops recording: what was recorded is written, open events closed, the array closed. Blocks
  // until the file is complete. A no-op when off.
  void stop();
  // stop(), then the writer thread ends (a later start() starts another).
  void shutdown();
  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  // Hooks; call only when active() (checked by the caller: the one branch when off).
  void negotiate_begin(const std::string& key, int32_t op_type);
  void negotiate_rank(const std::string& key, int32_t rank);
  void negotiate_end(const std::string& key);
  // A response's tensors start executing: returns the group the activities refer to (0 when
  // the timeline went off meanwhile: hooks given group 0 record nothing).
  uint64_t op_begin(std::vector<std::string> keys, int32_t op_type, int32_t dtype);
  void activity_begin(uint64_t group, const char* activity);
  void activity_end(uint64_t group);
  // sent: what the response's WireOpScope counted (take_last_scope_bytes; calls 0: no args).
  void op_end(uint64_t group, const WireCounts& sent = WireCounts{});
  void mark_cycle();

 private:
  void push(TimelineRecord&& r);
  void push_tensor(TimelineRecord::Kind kind, const std::string& key, int32_t value);
  void push_group(TimelineRecord::Kind kind, uint64_t group, const char* activity);
  // Control records bypass the capacity; waits until the writer has handled it.
  void control(TimelineRecord&& r);
  void writer_loop();

  const size_t capacity_;
  const int flush_ms_;
  std::atomic<bool> active_{false};
  std::atomic<bool> mark_cycles_{false};
  std::atomic<int64_t> dropped_{0};
  std::atomic<uint64_t> next_group_{1};
  std::string path_;  // the file being written; guarded by api_mu_

  std::mutex api_mu_;             // start/stop/shutdown, one at a time
  std::mutex mu_;                 // the queue and the writer's replies
  std::condition_variable wake_;  // the writer: records or a control record wait
  std::condition_variable done_;  // a control record was handled
  std::deque<TimelineRecord> queue_;
  size_t data_records_ = 0;  // queue_'s records that count against the capacity
  bool lost_ = false;        // a record was dropped since the writer last looked
  bool quit_ = false;
  uint64_t control_seq_ = 0, control_done_ = 0;
  Status control_status_;
  std::thread writer_;
};

}  // namespace bagua_hvd
