// Comm: process-set membership and the progress loop that drives transfers over data pairs.
//
// run() keeps one "lane" per (peer, direction): the transfers of a lane share one byte stream and
// go strictly in vector order, while lanes progress independently, so a rank can send to and
// receive from many peers at once without deadlocking on full buffers. When nothing moves it
// backs off in stages (pause spin, sched_yield, transport wait) so a fast peer is answered within
// microseconds while a slow one costs no CPU.
#include "collectives/comm.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "base/wire_stats.h"
#include "collectives/building_blocks.h"
#include "collectives/collectives.h"

namespace bagua_hvd {
namespace {

// Bounded staging for RECV_REDUCE over pairs without zero-copy peek (tcp): big enough to keep
// syscalls rare, small enough to stay in L2 between recv and reduce.
constexpr size_t kStagingBytes = 128 << 10;
constexpr size_t kMaxElement = 8;  // bytes of the widest dtype: one fragment slot per peer

// Stall back-off, measured from the last pass that moved a byte.
constexpr double kSpinSeconds = 30e-6;
constexpr double kYieldSeconds = 300e-6;
// Over TCP the kernel wakes the waiting thread when bytes arrive (epoll), and a link slower than
// memory leaves gaps of hundreds of microseconds between bursts: yielding through them only takes
// the cores from the training threads (1 Gbit/s, 2 ranks on 2 cores: 210 ms of CPU per step of
// bench/algorithms.py's full-precision allreduce; docs/benchmarks.md).
// Loopback TCP's small-message latency does not change (bench/allreduce.py). A shared-memory peer
// answers within microseconds, so there the yield stage stays long (it halves small-message
// latency).
constexpr double kYieldSecondsTcp = 40e-6;
constexpr auto kWaitTimeout = std::chrono::microseconds(1000);
constexpr double kCheckSeconds = 10e-3;  // check_alive() and timeouts while stalled

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Lane {
  int peer;                 // set rank
  bool send;                // direction
  Pair* pair;               // nullptr for this rank itself
  std::vector<size_t> q;    // transfer indices, in vector order
  size_t head = 0;          // first unfinished entry of q
  Clock::time_point last;   // last time the head moved (or became head)
};

}  // namespace

Comm::Comm(Transport& transport, std::vector<int> global_ranks)
    : transport_(transport), global_ranks_(std::move(global_ranks)) {
  for (size_t i = 0; i < global_ranks_.size(); ++i) {
    const int g = global_ranks_[i];
    if (g < 0 || g >= transport_.size()) {
      throw std::invalid_argument("process set member " + std::to_string(g) +
                                  " is not a rank of this job of size " +
                                  std::to_string(transport_.size()));
    }
    if (i > 0 && g <= global_ranks_[i - 1]) {
      throw std::invalid_argument("process set ranks must be sorted and unique (got " +
                                  std::to_string(global_ranks_[i - 1]) + " before " +
                                  std::to_string(g) + ")");
    }
    if (g == transport_.rank()) rank_ = static_cast<int>(i);
  }
  const std::string here = transport_.host_of(transport_.rank());
  remote_.resize(global_ranks_.size());
  for (size_t i = 0; i < global_ranks_.size(); ++i)
    remote_[i] = transport_.host_of(global_ranks_[i]) != here;
}

namespace {

// Feeds n incoming bytes into a RECV_REDUCE transfer: buf = buf (op) incoming. Bytes that do not
// complete an element wait in frag (kMaxElement bytes owned by this lane) until the rest arrives.
void reduce_incoming(Comm::Xfer& x, const unsigned char* src, size_t n, size_t es,
                     unsigned char* frag) {
  auto* dst = static_cast<unsigned char*>(x.buf);
  size_t k = x.done % es;
  if (k != 0) {
    const size_t t = std::min(es - k, n);
    std::memcpy(frag + k, src, t);
    src += t;
    n -= t;
    x.done += t;
    if (k + t < es) return;
    reduce_into(dst + x.done - es, frag, 1, x.dtype, x.op);
  }
  const size_t whole = n / es;
  if (whole != 0) {
    reduce_into(dst + x.done, src, whole, x.dtype, x.op);
    src += whole * es;
    n -= whole * es;
    x.done += whole * es;
  }
  if (n != 0) {
    std::memcpy(frag, src, n);
    x.done += n;
  }
}

// Moves bytes from src into a receiving transfer (plain copy or reduction).
void deliver(Comm::Xfer& x, const unsigned char* src, size_t n, unsigned char* frag) {
  if (x.kind == Comm::Xfer::RECV) {
    std::memcpy(static_cast<unsigned char*>(x.buf) + x.done, src, n);
    x.done += n;
  } else {
    reduce_incoming(x, src, n, dtype_size(x.dtype), frag);
  }
}

}  // namespace

void Comm::run(std::vector<Xfer>& xfers, const char* what) { run(xfers, what, Work()); }

void Comm::run(std::vector<Xfer>& xfers, const char* what, const Work& work) {
  if (rank_ < 0) {
    throw std::invalid_argument(std::string("rank ") + std::to_string(transport_.rank()) +
                                " is not a member of this process set (" + what + ")");
  }
  const int n = size();
  const auto start = Clock::now();

  // Build lanes: index 2*peer (+1 for send), created on first use.
  std::vector<int> lane_of(2 * static_cast<size_t>(n), -1);
  std::vector<Lane> lanes;
  size_t self_send = 0, self_recv = 0;
  for (size_t i = 0; i < xfers.size(); ++i) {
    Xfer& x = xfers[i];
    if (x.peer < 0 || x.peer >= n) {
      throw std::invalid_argument(std::string(what) + ": transfer peer " +
                                  std::to_string(x.peer) + " is not a set rank (size " +
                                  std::to_string(n) + ")");
    }
    if (x.len != 0 && x.buf == nullptr) {
      throw std::invalid_argument(std::string(what) + ": transfer of " + std::to_string(x.len) +
                                  " bytes with a null buffer");
    }
    if (x.kind == Xfer::RECV_REDUCE) {
      check_reduction(x.dtype, x.op, what);
      if (x.len % dtype_size(x.dtype) != 0) {
        throw std::invalid_argument(std::string(what) + ": reducing transfer of " +
                                    std::to_string(x.len) + " bytes is not a whole number of " +
                                    dtype_name(x.dtype) + " elements");
      }
    }
    x.done = 0;
    if (x.len == 0) continue;  // completes at once
    const bool send = x.kind == Xfer::SEND;
    if (x.peer == rank_) (send ? self_send : self_recv) += x.len;
    if (send && x.peer != rank_) count_bytes_sent(remote_[x.peer] != 0, x.len);
    int& li = lane_of[2 * static_cast<size_t>(x.peer) + (send ? 1 : 0)];
    if (li < 0) {
      li = static_cast<int>(lanes.size());
      Pair* pair = x.peer == rank_ ? nullptr : &transport_.data(global_rank(x.peer));
      lanes.push_back(Lane{x.peer, send, pair, {}, 0, start});
    }
    lanes[li].q.push_back(i);
  }
  if (self_send != self_recv) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(self_send) +
                                " bytes sent to self but " + std::to_string(self_recv) +
                                " received");
  }
  if (lanes.empty()) {
    while (work && work()) {
    }
    return;
  }

  // partial_: [staging | one fragment slot per peer]; grows once, reused by later runs.
  const size_t need = kStagingBytes + kMaxElement * static_cast<size_t>(n);
  if (partial_.size() < need) partial_.resize(need);
  unsigned char* staging = partial_.data();
  auto frag_of = [&](int peer) { return partial_.data() + kStagingBytes + kMaxElement * peer; };

  std::vector<size_t> active(lanes.size());
  for (size_t i = 0; i < active.size(); ++i) active[i] = i;
  double yield_seconds = kYieldSeconds;
  for (const Lane& lane : lanes) {
    if (lane.pair != nullptr &&
        std::strcmp(transport_.kind_to(global_rank(lane.peer)), "tcp") == 0) {
      yield_seconds = kYieldSecondsTcp;
    }
  }

  // Moves what it can on one lane; returns whether any byte moved.
  auto step = [&](Lane& lane) -> bool {
    bool moved = false;
    while (lane.head < lane.q.size()) {
      Xfer& x = xfers[lane.q[lane.head]];
      auto* buf = static_cast<unsigned char*>(x.buf);
      // A send moves only what its producer released so far.
      const size_t limit = x.kind == Xfer::SEND ? std::min(x.len, x.ready) : x.len;
      if (x.done >= limit) break;
      const size_t left = limit - x.done;
      size_t got = 0;
      if (lane.pair == nullptr) {
        // Self: copy from the head send straight into the head receive.
        if (!lane.send) break;  // driven from the sending lane
        Lane& rx = lanes[lane_of[2 * static_cast<size_t>(rank_)]];
        if (rx.head >= rx.q.size()) break;
        Xfer& y = xfers[rx.q[rx.head]];
        got = std::min(left, y.len - y.done);
        deliver(y, buf + x.done, got, frag_of(rank_));
        if (y.done == y.len) ++rx.head;
        x.done += got;
      } else if (x.kind == Xfer::SEND) {
        got = lane.pair->try_send(buf + x.done, left);
        x.done += got;
      } else if (x.kind == Xfer::RECV) {
        got = lane.pair->try_recv(buf + x.done, left);
        x.done += got;
      } else {
        const void* p = nullptr;
        got = std::min(lane.pair->peek(&p), left);
        if (got != 0) {
          // Zero-copy: reduce straight out of the transport's memory.
          reduce_incoming(x, static_cast<const unsigned char*>(p), got, dtype_size(x.dtype),
                          frag_of(lane.peer));
          lane.pair->consume(got);
        } else {
          got = lane.pair->try_recv(staging, std::min(left, kStagingBytes));
          if (got != 0) {
            reduce_incoming(x, staging, got, dtype_size(x.dtype), frag_of(lane.peer));
          }
        }
      }
      if (got == 0) break;
      moved = true;
      if (x.done == x.len) ++lane.head;
    }
    return moved;
  };

  auto stuck_error = [&](const Lane& lane, double waited) {
    const std::string secs = format_seconds(waited);
    const int g = global_rank(lane.peer);
    if (lane.send) {
      return TransportError(
          "timed out after " + secs + " s waiting to send data to rank " + std::to_string(g) +
              " during " + what,
          g);
    }
    return TransportError("timed out after " + secs + " s waiting for data from rank " +
                              std::to_string(g) + " during " + what,
                          g);
  };

  const double timeout = transport_.timeout_seconds();
  auto last_progress = start;
  auto next_check = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(kCheckSeconds));
  uint64_t pass = 0;
  const bool working = static_cast<bool>(work);
  while (!active.empty()) {
    bool progress = false;
    bool need_now = (++pass & 255) == 0;
    Clock::time_point now{};
    if (working && work()) {
      // CPU work is progress too: the lanes it feeds (or that wait for it) are not stalled.
      now = Clock::now();
      progress = true;
      for (size_t ai : active) lanes[ai].last = now;
    }
    for (size_t a = 0; a < active.size();) {
      Lane& lane = lanes[active[a]];
      if (step(lane)) {
        if (!progress) now = Clock::now();
        progress = true;
        lane.last = now;
      }
      if (lane.head == lane.q.size()) {
        active[a] = active.back();
        active.pop_back();
      } else {
        ++a;
      }
    }
    if (progress) {
      last_progress = now;
      if (!need_now) continue;
    }
    if (active.empty()) break;
    now = Clock::now();
    if (!progress) {
      const double stalled = std::chrono::duration<double>(now - last_progress).count();
      if (stalled < kSpinSeconds) {
        for (int i = 0; i < 16; ++i) cpu_relax();
      } else if (stalled < yield_seconds) {
        sched_yield();
      } else {
        transport_.wait(kWaitTimeout);
      }
    }
    if (now >= next_check) {
      next_check = now + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(kCheckSeconds));
      transport_.heartbeat();
      for (size_t ai : active) {
        Lane& lane = lanes[ai];
        const double idle = std::chrono::duration<double>(now - lane.last).count();
        if (idle < kCheckSeconds) continue;
        if (lane.pair != nullptr) lane.pair->check_alive();
        if (idle >= timeout) throw stuck_error(lane, timeout);
      }
      // A rank we are not waiting on may be the one that died (the peer we wait on is then
      // stuck behind it): check every member so the error names the rank that is gone. One
      // that finished the job (the last collective done, its bye sent) closes normally.
      if (!progress) {
        for (int r = 0; r < size(); ++r) {
          if (r == rank_) continue;
          try {
            transport_.data(global_ranks_[r]).check_alive();
          } catch (const TransportError&) {
            if (!transport_.may_have_finished(global_ranks_[r])) throw;
          }
        }
      }
    }
  }
  while (working && work()) {  // what is left once every byte moved (the last decoding)
  }
}

void Comm::send(int peer, const void* buf, size_t len, const char* what) {
  std::vector<Xfer> x{{Xfer::SEND, peer, const_cast<void*>(buf), len}};
  run(x, what);
}

void Comm::recv(int peer, void* buf, size_t len, const char* what) {
  std::vector<Xfer> x{{Xfer::RECV, peer, buf, len}};
  run(x, what);
}

}  // namespace bagua_hvd
