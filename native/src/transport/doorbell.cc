#include "transport/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace bagua_hvd {

static long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

void ring_doorbell(Doorbell* bell, bool shared) {
  // seq_cst pairs with the waiter's sleeping.store / seq.load (a Dekker handshake): either the
  // waiter sees the new seq before it sleeps, or we see sleeping == 1 and wake it.
  bell->seq.fetch_add(1, std::memory_order_seq_cst);
  if (bell->sleeping.load(std::memory_order_seq_cst)) {
    futex(&bell->seq, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
  }
}

bool wait_doorbell(Doorbell* bell, uint32_t* seen, std::chrono::microseconds timeout,
                   bool shared) {
  uint32_t s = bell->seq.load(std::memory_order_acquire);
  if (s != *seen || timeout.count() <= 0) {
    bool changed = s != *seen;
    *seen = s;
    return changed;
  }
  bell->sleeping.store(1, std::memory_order_seq_cst);
  s = bell->seq.load(std::memory_order_seq_cst);
  if (s == *seen) {
    timespec ts;
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
    ts.tv_nsec = static_cast<long>(timeout.count() % 1000000) * 1000;
    // Returns early on a wake, a changed word (EAGAIN), a signal or the timeout: all fine, the
    // caller re-checks its pairs either way.
    futex(&bell->seq, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, s, &ts);
  }
  bell->sleeping.store(0, std::memory_order_relaxed);
  s = bell->seq.load(std::memory_order_acquire);
  bool changed = s != *seen;
  *seen = s;
  return changed;
}

}  // namespace bagua_hvd
