// Shared-memory transport within one host: one POSIX shm segment per host and job epoch holding,
// for every ordered pair of local ranks, an SPSC byte ring for "data" and one for "ctrl", plus a
// doorbell and the pid of every local rank. Layout and protocol: docs/protocol.md.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "transport/doorbell.h"
#include "transport/socket.h"
#include "transport/transport.h"

namespace bagua_hvd {

constexpr uint64_t kDefaultShmDataRingBytes = 4u << 20;   // BAGUA_HVD_SHM_RING_BYTES
constexpr uint64_t kShmCtrlRingBytes = 256u << 10;

// Control block of one ring: the producer's line (tail, want_space) and the consumer's line (head)
// are separate cache lines so the two sides do not false-share.
struct RingCtl {
  alignas(64) std::atomic<uint64_t> tail{0};     // bytes ever written (producer)
  std::atomic<uint32_t> want_space{0};           // producer is blocked on a full ring
  alignas(64) std::atomic<uint64_t> head{0};     // bytes ever consumed (consumer)
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need address-free 64-bit atomics");

struct RingRef {
  RingCtl* ctl = nullptr;
  uint8_t* buf = nullptr;
  uint64_t cap = 0;  // a power of two
};

// The mapping of one segment. The creator makes and sizes it; the others attach by name.
class ShmSegment {
 public:
  // Creates and initializes the segment (O_EXCL, mode 0600) and reserves its memory, so that a
  // full /dev/shm is a clear error here rather than a SIGBUS later.
  static std::unique_ptr<ShmSegment> create(const std::string& name, int local_size,
                                            uint64_t data_bytes, uint64_t ctrl_bytes);
  static std::unique_ptr<ShmSegment> attach(const std::string& name, int local_size);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Records our pid and counts us as attached; the last of local_size attachers unlinks the name.
  void join(int local_index, pid_t pid);
  // Waits until every local rank joined; on timeout unlinks the name and throws, naming the
  // local ranks (as global ranks from `globals`) that did not attach.
  void wait_all_joined(Deadline deadline, const std::vector<int>& globals);

  Doorbell* doorbell(int local_index) const;
  RingRef ring(int src, int dst, bool ctrl) const;
  pid_t pid(int local_index) const;
  const std::string& name() const { return name_; }
  uint64_t data_bytes() const;

 private:
  ShmSegment(std::string name, void* base, size_t size, int local_size);
  void unlink();  // the creator's duty until the last joiner removed the name (idempotent)
  struct Header;
  Header* header() const { return static_cast<Header*>(base_); }
  std::string name_;
  void* base_;
  size_t size_;
  int local_size_;
  bool unlinked_ = false;  // nothing left for this process to unlink
};

// One direction-agnostic stream to a local peer over two rings (ours -> peer, peer -> ours).
class ShmPair : public Pair {
 public:
  ShmPair(int peer, pid_t peer_pid, RingRef out, RingRef in, Doorbell* peer_bell);
  int peer() const override { return peer_; }
  const char* kind() const override { return "shm"; }
  size_t try_send(const void* buf, size_t len) override;
  size_t try_recv(void* buf, size_t len) override;
  size_t peek(const void** ptr) override;
  void consume(size_t n) override;
  // Throws once the peer's pid is gone or a zombie and nothing it wrote is left unread (or our
  // send to it is blocked).
  void check_alive() override;

 private:
  void after_consume();
  int peer_;
  pid_t peer_pid_;
  RingRef out_, in_;
  Doorbell* peer_bell_;
  uint64_t out_tail_ = 0, out_head_cache_ = 0;  // producer-local copies
  uint64_t in_head_ = 0, in_tail_cache_ = 0;    // consumer-local copies
};

// True unless the process is gone or a zombie.
bool pid_alive(pid_t pid);

}  // namespace bagua_hvd
