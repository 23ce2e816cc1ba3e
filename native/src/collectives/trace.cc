// The collectives' trace buffer (trace.h); its C entry points are in core/c_api.cc.
#include "collectives/trace.h"

#include <time.h>

#include <algorithm>
#include <array>
#include <mutex>

namespace bagua_hvd {

std::atomic<bool> g_trace_on{false};

namespace {

constexpr size_t kTraceEvents = 4096;

struct Event {
  int64_t t_ns, op, phase, count;
};

struct Ring {
  std::mutex mu;
  std::array<Event, kTraceEvents> ev{};
  size_t head = 0, size = 0;  // oldest event, events held
};

Ring& ring() {
  static Ring r;
  return r;
}

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // Python's time.monotonic_ns() clock
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

void trace_record(TraceOp op, TracePhase phase, int64_t count) {
  const Event e{monotonic_ns(), static_cast<int64_t>(op), static_cast<int64_t>(phase), count};
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  r.ev[(r.head + r.size) % kTraceEvents] = e;
  if (r.size < kTraceEvents) {
    ++r.size;
  } else {
    r.head = (r.head + 1) % kTraceEvents;  // full: the oldest goes
  }
}

bool trace_enable(bool on) { return g_trace_on.exchange(on); }

int trace_read(int64_t* out, int max_events) {
  if (out == nullptr || max_events <= 0) return 0;
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mu);
  const size_t n = std::min(r.size, static_cast<size_t>(max_events));
  for (size_t i = 0; i < n; ++i) {
    const Event& e = r.ev[(r.head + i) % kTraceEvents];
    out[4 * i] = e.t_ns;
    out[4 * i + 1] = e.op;
    out[4 * i + 2] = e.phase;
    out[4 * i + 3] = e.count;
  }
  r.head = (r.head + n) % kTraceEvents;
  r.size -= n;
  return static_cast<int>(n);
}

}  // namespace bagua_hvd
