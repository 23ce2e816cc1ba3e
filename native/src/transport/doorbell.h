// A futex-based doorbell: a 32-bit sequence word that producers bump and the owner sleeps on.
// Ringing costs one atomic increment plus a load; the futex wake syscall happens only while the
// owner is actually asleep. Lives either in process memory (self transport) or in the shared
// segment (shm transport), hence the `shared` flag selecting private or shared futex ops.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace bagua_hvd {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> seq{0};       // bumped by every ring; the futex word
  std::atomic<uint32_t> sleeping{0};  // 1 while the owner is (about to be) in futex_wait
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "need address-free atomics");

// Bumps seq and wakes the owner if it sleeps.
void ring_doorbell(Doorbell* bell, bool shared);

// Edge-triggered wait: returns true as soon as seq differs from *seen (something rang since the
// previous wait returned), false after `timeout` without a ring. Updates *seen either way.
// Only one thread may wait on a doorbell.
bool wait_doorbell(Doorbell* bell, uint32_t* seen, std::chrono::microseconds timeout,
                   bool shared);

}  // namespace bagua_hvd
