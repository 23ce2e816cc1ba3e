// Timestamps of the collectives' phases for bench/timeline.py (bhvd_trace_*): a small ring
// buffer, recording only while enabled (one relaxed atomic load otherwise).
#pragma once

#include <atomic>
#include <cstdint>

namespace bagua_hvd {

// Ops and phases as bhvd_trace_read reports them (bench/timeline.py names them).
enum class TraceOp : int32_t {
  kCompressedAllreduce = 1,      // ByteGrad's: begin, the alltoall half done (mark), end
  kCompressedAllreduceHalf = 2,  // (the mark's op)
  kAllreduce = 3,                // the plain allreduce
  kLpExchange = 4,               // the exchange half of a low-precision decentralized step
  kLpLocal = 5,                  // its local half (the caller's thread)
  kLpRingLaunch = 6,             // the core's ring launches a bucket's exchange (mark)
  kLpRingWaited = 7,             // its wait for a bucket's previous exchange returned (mark)
};
enum class TracePhase : int32_t { kBegin = 0, kMark = 1, kEnd = 2 };

extern std::atomic<bool> g_trace_on;
void trace_record(TraceOp op, TracePhase phase, int64_t count);
// bhvd_trace_enable / bhvd_trace_read (c_api.h): the previous setting; events moved into out.
bool trace_enable(bool on);
int trace_read(int64_t* out, int max_events);

inline void trace_mark(TraceOp op, int64_t count) {
  if (g_trace_on.load(std::memory_order_relaxed)) trace_record(op, TracePhase::kMark, count);
}

// Records kBegin now and kEnd when it goes out of scope (also on an exception).
class TraceSpan {
 public:
  TraceSpan(TraceOp op, int64_t count) : op_(op), count_(count) {
    if (g_trace_on.load(std::memory_order_relaxed)) trace_record(op, TracePhase::kBegin, count);
  }
  ~TraceSpan() {
    if (g_trace_on.load(std::memory_order_relaxed)) trace_record(op_, TracePhase::kEnd, count_);
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  TraceOp op_;
  int64_t count_;
};

}  // namespace bagua_hvd
