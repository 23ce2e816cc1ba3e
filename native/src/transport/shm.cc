#include "transport/shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

namespace bagua_hvd {
namespace {

constexpr char kMagic[8] = {'B', 'H', 'V', 'D', 'S', 'H', 'M', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kPage = 4096;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Offsets of everything in a segment; a pure function of its parameters, so creator and
// attachers agree.
struct Layout {
  size_t pids, bells, rings, data_block, ctrl_block, total;
  Layout(int n, uint64_t data, uint64_t ctrl) {
    size_t off = kPage;  // header page
    pids = off;
    off += round_up(sizeof(std::atomic<int32_t>) * n, 64);
    bells = off;
    off += sizeof(Doorbell) * n;
    rings = round_up(off, kPage);
    data_block = kPage + data;  // control page + buffer
    ctrl_block = kPage + ctrl;
    total = rings + static_cast<size_t>(n) * (n - 1) * (data_block + ctrl_block);
  }
};

}  // namespace

struct ShmSegment::Header {
  char magic[8];
  uint32_t version;
  uint32_t local_size;
  uint64_t data_bytes, ctrl_bytes, total_bytes;
  alignas(64) std::atomic<uint32_t> joined;
};

ShmSegment::ShmSegment(std::string name, void* base, size_t size, int local_size)
    : name_(std::move(name)), base_(base), size_(size), local_size_(local_size) {}

ShmSegment::~ShmSegment() {
  unlink();
  munmap(base_, size_);
}

void ShmSegment::unlink() {
  if (!unlinked_) {
    shm_unlink(name_.c_str());  // ENOENT: another local rank removed it already
    unlinked_ = true;
  }
}

std::unique_ptr<ShmSegment> ShmSegment::create(const std::string& name, int local_size,
                                               uint64_t data_bytes, uint64_t ctrl_bytes) {
  static_assert(sizeof(Header) <= kPage, "the header must fit its page");
  Layout lay(local_size, data_bytes, ctrl_bytes);
  Fd fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    throw TransportError("cannot create shared memory segment " + name + ": " +
                         errno_string(errno));
  }
  auto fail = [&](const std::string& what, int err) {
    shm_unlink(name.c_str());
    char mib[32];
    std::snprintf(mib, sizeof(mib), "%.1f MiB", lay.total / 1048576.0);
    throw TransportError("cannot " + what + " " + mib + " of shared memory for " + name + ": " +
                         errno_string(err) +
                         " (free space in /dev/shm, lower BAGUA_HVD_SHM_RING_BYTES, or set "
                         "BAGUA_HVD_TRANSPORT=tcp)");
  };
  if (ftruncate(fd.get(), static_cast<off_t>(lay.total)) != 0) fail("size", errno);
  // tmpfs allocates lazily; reserving now turns "no space" into an error instead of a SIGBUS.
  if (int err = posix_fallocate(fd.get(), 0, static_cast<off_t>(lay.total))) fail("reserve", err);
  void* base = mmap(nullptr, lay.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) fail("map", errno);
  std::unique_ptr<ShmSegment> seg(new ShmSegment(name, base, lay.total, local_size));
  // Fresh tmpfs pages are zero, which is the initial state of every atomic and ring.
  Header* h = seg->header();
  h->version = kVersion;
  h->local_size = static_cast<uint32_t>(local_size);
  h->data_bytes = data_bytes;
  h->ctrl_bytes = ctrl_bytes;
  h->total_bytes = lay.total;
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  return seg;
}

std::unique_ptr<ShmSegment> ShmSegment::attach(const std::string& name, int local_size) {
  Fd fd(shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!fd.valid()) {
    throw TransportError("cannot open shared memory segment " + name +
                         " made by the lowest local rank: " + errno_string(errno) +
                         " (did it fail, or do the local ranks run as different users?)");
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0 || st.st_size < static_cast<off_t>(kPage)) {
    throw TransportError("shared memory segment " + name + " is truncated");
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) {
    throw TransportError("cannot map shared memory segment " + name + ": " + errno_string(errno));
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment(name, base, size, local_size));
  seg->unlinked_ = true;  // the creator or the last joiner removes the name
  Header* h = seg->header();
  std::atomic_thread_fence(std::memory_order_acquire);
  if (std::memcmp(h->magic, kMagic, sizeof(kMagic)) != 0 || h->version != kVersion) {
    throw TransportError("shared memory segment " + name + " is not a bagua_hvd segment");
  }
  if (h->local_size != static_cast<uint32_t>(local_size) ||
      Layout(local_size, h->data_bytes, h->ctrl_bytes).total != size ||
      h->total_bytes != size) {
    throw TransportError("shared memory segment " + name + " was made for " +
                         std::to_string(h->local_size) + " local ranks, this rank expects " +
                         std::to_string(local_size) + " (inconsistent HOROVOD_HOSTNAME?)");
  }
  return seg;
}

void ShmSegment::join(int local_index, pid_t pid) {
  auto* pids = reinterpret_cast<std::atomic<int32_t>*>(static_cast<char*>(base_) +
                                                       Layout(local_size_, 0, 0).pids);
  pids[local_index].store(pid, std::memory_order_release);
  uint32_t n = header()->joined.fetch_add(1, std::memory_order_acq_rel) + 1;
  // Everybody has the mapping now: remove the name so a crash cannot leave it behind.
  if (n == static_cast<uint32_t>(local_size_)) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

void ShmSegment::wait_all_joined(Deadline deadline, const std::vector<int>& globals) {
  const auto start = Clock::now();
  auto sleep = std::chrono::microseconds(50);
  while (header()->joined.load(std::memory_order_acquire) < static_cast<uint32_t>(local_size_)) {
    if (Clock::now() >= deadline) {
      shm_unlink(name_.c_str());  // whoever gives up removes the name (attachers too)
      unlinked_ = true;
      std::string missing;
      for (int i = 0; i < local_size_; ++i) {
        if (pid(i) == 0) missing += (missing.empty() ? "" : ", ") + std::to_string(globals[i]);
      }
      throw TransportError("timed out after " + format_seconds(seconds_since(start)) +
                           "s waiting for rank(s) " + missing +
                           " on this host to attach shared memory segment " + name_);
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(2000));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
}

Doorbell* ShmSegment::doorbell(int local_index) const {
  Layout lay(local_size_, 0, 0);
  return reinterpret_cast<Doorbell*>(static_cast<char*>(base_) + lay.bells) + local_index;
}

RingRef ShmSegment::ring(int src, int dst, bool ctrl) const {
  const Header* h = header();
  Layout lay(local_size_, h->data_bytes, h->ctrl_bytes);
  size_t idx = static_cast<size_t>(src) * (local_size_ - 1) + (dst < src ? dst : dst - 1);
  char* block = static_cast<char*>(base_) + lay.rings + idx * (lay.data_block + lay.ctrl_block) +
                (ctrl ? lay.data_block : 0);
  RingRef r;
  r.ctl = reinterpret_cast<RingCtl*>(block);
  r.buf = reinterpret_cast<uint8_t*>(block + kPage);
  r.cap = ctrl ? h->ctrl_bytes : h->data_bytes;
  return r;
}

pid_t ShmSegment::pid(int local_index) const {
  auto* pids = reinterpret_cast<std::atomic<int32_t>*>(static_cast<char*>(base_) +
                                                       Layout(local_size_, 0, 0).pids);
  return pids[local_index].load(std::memory_order_acquire);
}

uint64_t ShmSegment::data_bytes() const { return header()->data_bytes; }

bool pid_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child of a launcher that has not reaped it yet still "exists" as a zombie.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  Fd fd(open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return errno != ENOENT;
  char buf[512];
  ssize_t n = read(fd.get(), buf, sizeof(buf) - 1);
  if (n <= 0) return true;
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may contain spaces or ')'
  if (!paren || paren[1] != ' ') return true;
  char state = paren[2];
  return state != 'Z' && state != 'X' && state != 'x';
}

// ---- ShmPair -------------------------------------------------------------------------------

ShmPair::ShmPair(int peer, pid_t peer_pid, RingRef out, RingRef in, Doorbell* peer_bell)
    : peer_(peer), peer_pid_(peer_pid), out_(out), in_(in), peer_bell_(peer_bell) {
  out_tail_ = out_.ctl->tail.load(std::memory_order_relaxed);
  out_head_cache_ = out_.ctl->head.load(std::memory_order_acquire);
  in_head_ = in_.ctl->head.load(std::memory_order_relaxed);
  in_tail_cache_ = in_.ctl->tail.load(std::memory_order_acquire);
}

size_t ShmPair::try_send(const void* buf, size_t len) {
  if (len == 0) return 0;
  const uint64_t cap = out_.cap;
  uint64_t free = cap - (out_tail_ - out_head_cache_);
  if (free < len) {
    out_head_cache_ = out_.ctl->head.load(std::memory_order_acquire);
    free = cap - (out_tail_ - out_head_cache_);
    if (free < len) {
      // We will come up short: ask the consumer to ring us when it frees space, then re-check
      // (the fence pairs with the one in after_consume()).
      out_.ctl->want_space.store(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      out_head_cache_ = out_.ctl->head.load(std::memory_order_acquire);
      free = cap - (out_tail_ - out_head_cache_);
    }
  }
  size_t n = static_cast<size_t>(std::min<uint64_t>(len, free));
  if (n == 0) return 0;
  size_t off = static_cast<size_t>(out_tail_ & (cap - 1));
  size_t first = std::min<size_t>(n, cap - off);
  std::memcpy(out_.buf + off, buf, first);
  if (n > first) std::memcpy(out_.buf, static_cast<const char*>(buf) + first, n - first);
  out_tail_ += n;
  out_.ctl->tail.store(out_tail_, std::memory_order_release);
  ring_doorbell(peer_bell_, true);
  return n;
}

size_t ShmPair::peek(const void** ptr) {
  uint64_t avail = in_tail_cache_ - in_head_;
  if (avail == 0) {
    in_tail_cache_ = in_.ctl->tail.load(std::memory_order_acquire);
    avail = in_tail_cache_ - in_head_;
    if (avail == 0) {
      *ptr = nullptr;
      return 0;
    }
  }
  size_t off = static_cast<size_t>(in_head_ & (in_.cap - 1));
  *ptr = in_.buf + off;
  return static_cast<size_t>(std::min<uint64_t>(avail, in_.cap - off));
}

void ShmPair::consume(size_t n) {
  if (n == 0) return;
  if (n > in_tail_cache_ - in_head_) {
    throw TransportError("shm consume(" + std::to_string(n) +
                         ") past the readable bytes from rank " + std::to_string(peer_));
  }
  in_head_ += n;
  in_.ctl->head.store(in_head_, std::memory_order_release);
  after_consume();
}

size_t ShmPair::try_recv(void* buf, size_t len) {
  size_t done = 0;
  // At most two contiguous pieces (before and after the wrap).
  for (int piece = 0; piece < 2 && done < len; ++piece) {
    const void* p = nullptr;
    size_t n = std::min(peek(&p), len - done);
    if (n == 0) break;
    std::memcpy(static_cast<char*>(buf) + done, p, n);
    done += n;
    in_head_ += n;
  }
  if (done) {
    in_.ctl->head.store(in_head_, std::memory_order_release);
    after_consume();
  }
  return done;
}

void ShmPair::after_consume() {
  // Pairs with the fence in try_send(): either the producer sees our new head, or we see its
  // want_space flag and ring it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (in_.ctl->want_space.load(std::memory_order_relaxed) &&
      in_.ctl->want_space.exchange(0, std::memory_order_relaxed)) {
    ring_doorbell(peer_bell_, true);
  }
}

void ShmPair::check_alive() {
  if (pid_alive(peer_pid_)) return;
  // Like TCP, bytes the peer wrote before it died are still delivered: report the death once
  // they are consumed, unless we are stuck sending to it.
  const bool unread = in_.ctl->tail.load(std::memory_order_acquire) != in_head_;
  const bool send_blocked = out_.ctl->want_space.load(std::memory_order_relaxed) != 0;
  if (!unread || send_blocked) {
    throw TransportError("rank " + std::to_string(peer_) + " (pid " + std::to_string(peer_pid_) +
                             ") on this host exited",
                         peer_);
  }
}

}  // namespace bagua_hvd
