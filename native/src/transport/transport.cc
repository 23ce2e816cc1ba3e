// Transport construction (rendezvous through the store, shared memory within a host, TCP across
// hosts) and the wait/notify primitive. Protocol: docs/protocol.md.
#include "transport/transport.h"

#include <netdb.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

#include "transport/auth.h"
#include "transport/doorbell.h"
#include "transport/hmac.h"
#include "transport/shm.h"
#include "transport/socket.h"
#include "transport/store.h"
#include "transport/tcp_pair.h"

namespace bagua_hvd {
namespace {

// A futex cannot be polled together with sockets: with both kinds of peers, wait() polls the
// sockets in slices this long and checks the doorbell between them.
constexpr auto kMixedPollSlice = std::chrono::microseconds(200);
// Bounds one incoming handshake (all of it, not each read) so a silent or trickling stranger
// holds a handshake thread for at most this long.
constexpr double kHandshakeSeconds = 5.0;
// Unauthenticated connections handled at once by a peer listener. A newcomer beyond that evicts
// the oldest one still handshaking, so strangers can neither queue ahead of the real peers nor
// multiply threads; a real peer evicted in a flood retries (connect_peer).
constexpr size_t kMaxPendingHandshakes = 16;
// At most one warning about rejected connections per this many seconds (with a count of those
// not logged): strangers must not be able to flood the log.
constexpr double kRejectLogSeconds = 5.0;

// Runs the server side of handshakes on a thread each, at most kMaxPendingHandshakes
// unauthenticated ones at once. `handshake(fd, remote, claim)` authenticates and may move the fd
// out; it calls `claim()` once the client proved the secret, before answering it: from then on
// the connection cannot be evicted (claim() is false when it was evicted already). The destructor
// cuts the handshakes still unauthenticated (shutdown wakes their reads) and joins every thread.
class HandshakePool {
 public:
  using Handshake =
      std::function<void(Fd&, const std::string&, const std::function<bool()>& claim)>;
  explicit HandshakePool(Handshake handshake) : handshake_(std::move(handshake)) {}
  HandshakePool(const HandshakePool&) = delete;
  HandshakePool& operator=(const HandshakePool&) = delete;
  ~HandshakePool() {
    std::list<Slot> slots;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Slot& s : slots_) {
        if (!s.finished && !s.claimed) ::shutdown(s.fd, SHUT_RDWR);
      }
      slots.swap(slots_);
    }
    for (Slot& s : slots) s.thread.join();
  }

  void start(Fd fd, const std::string& remote) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = slots_.begin(); it != slots_.end();) {  // reap
      if (it->finished) {
        it->thread.join();
        it = slots_.erase(it);
      } else {
        ++it;
      }
    }
    auto evictable = [](const Slot& s) { return !s.finished && !s.claimed && !s.evicted; };
    if (static_cast<size_t>(std::count_if(slots_.begin(), slots_.end(), evictable)) >=
        kMaxPendingHandshakes) {
      auto oldest = std::find_if(slots_.begin(), slots_.end(), evictable);
      oldest->evicted = true;
      ::shutdown(oldest->fd, SHUT_RDWR);  // still open: its thread closes it after `finished`
    }
    slots_.emplace_back();
    Slot* slot = &slots_.back();
    slot->fd = fd.get();
    slot->thread = std::thread([this, slot, remote, c = std::move(fd)]() mutable {
      auto claim = [this, slot] {
        std::lock_guard<std::mutex> lock(mu_);
        if (slot->evicted) return false;
        slot->claimed = true;
        return true;
      };
      try {
        handshake_(c, remote, claim);
      } catch (...) {  // handshake_ reports its own errors; nothing may escape a thread
      }
      std::lock_guard<std::mutex> lock(mu_);
      slot->finished = true;  // before `c` closes the fd: nobody shuts down a reused number
    });
    name_thread(slot->thread, "bhvd_handshake");
  }

 private:
  struct Slot {
    std::thread thread;
    int fd = -1;
    bool finished = false, claimed = false, evicted = false;
  };
  Handshake handshake_;
  std::mutex mu_;
  std::list<Slot> slots_;  // a list: each thread keeps a pointer to its slot
};

// Logs rejected connections, at most one warning per kRejectLogSeconds (thread-safe).
class RejectLog {
 public:
  explicit RejectLog(std::string listener) : listener_(std::move(listener)) {}
  void rejected(const std::string& remote, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = Clock::now();
    if (logged_ && now - last_ < std::chrono::duration<double>(kRejectLogSeconds)) {
      ++suppressed_;
      return;
    }
    std::string more = suppressed_ ? " (" + std::to_string(suppressed_) +
                                         " more rejected since the last warning)"
                                   : "";
    BHVD_LOG(WARNING, "rejected a connection from " + remote + " to the peer listener of " +
                          listener_ + ": " + why + more);
    logged_ = true;
    last_ = now;
    suppressed_ = 0;
  }

 private:
  std::string listener_;
  std::mutex mu_;
  bool logged_ = false;
  Clock::time_point last_;
  uint64_t suppressed_ = 0;
};

// Connects to a peer's listener and authenticates. A connection the listener dropped before the
// handshake ended (it evicts the oldest of too many unauthenticated connections) is retried
// until the deadline; an authentication refusal is not.
Fd connect_peer(const std::string& addr, int port, const std::string& secret,
                const std::string& purpose, const std::string& info, Deadline deadline,
                const std::string& what) {
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    Fd fd = connect_tcp(addr, port, deadline, what);
    try {
      auth_client(fd.get(), secret, purpose, info, deadline, what);
      return fd;
    } catch (const AuthError&) {
      throw;
    } catch (const TransportError&) {
      if (Clock::now() + backoff >= deadline) throw;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

struct RankInfo {
  std::string host, addr;
  int port = 0, pid = 0;
  bool shm = false;
};

std::string rank_key(int epoch, int rank) {
  return "bhvd/e" + std::to_string(epoch) + "/rank/" + std::to_string(rank);
}

std::string shm_key(int epoch, const std::string& host) {
  return "bhvd/e" + std::to_string(epoch) + "/shm/" + host;
}

std::string encode(const RankInfo& i) {
  return "v1\nhost=" + i.host + "\naddr=" + i.addr + "\nport=" + std::to_string(i.port) +
         "\npid=" + std::to_string(i.pid) + "\nshm=" + (i.shm ? "1" : "0") + "\n";
}

RankInfo decode(const std::string& v, int rank, const std::string& key) {
  auto bad = [&](const std::string& why) -> TransportError {
    return TransportError("malformed rendezvous value for rank " + std::to_string(rank) +
                          " under key '" + key + "': " + why);
  };
  // The elastic driver's mark for a rank whose worker exited before it joined: stop waiting.
  if (v.rfind("gone\n", 0) == 0) {
    throw TransportError("rank " + std::to_string(rank) + " will not join: " + v.substr(5));
  }
  if (v.rfind("v1\n", 0) != 0) throw bad("unknown format (a different bagua_hvd version?)");
  RankInfo info;
  bool have_port = false;
  size_t pos = 3;
  while (pos < v.size()) {
    size_t nl = v.find('\n', pos);
    if (nl == std::string::npos) throw bad("unterminated line");
    std::string line = v.substr(pos, nl - pos);
    pos = nl + 1;
    size_t eq = line.find('=');
    if (eq == std::string::npos) throw bad("line without '='");
    std::string k = line.substr(0, eq), val = line.substr(eq + 1);
    try {
      if (k == "host") info.host = val;
      if (k == "addr") info.addr = val;
      if (k == "port") {
        info.port = std::stoi(val);
        have_port = true;
      }
      if (k == "pid") info.pid = std::stoi(val);
      if (k == "shm") info.shm = val == "1";
    } catch (const std::exception&) {
      throw bad("bad number in '" + line + "'");
    }
  }
  if (info.addr.empty() || !have_port || info.port <= 0 || info.port > 65535) {
    throw bad("missing address or port");
  }
  return info;
}

std::string sanitize(const std::string& s, size_t max_len) {
  std::string out;
  for (char c : s.substr(0, max_len)) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    out.push_back(ok ? c : '_');
  }
  return out.empty() ? "job" : out;
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

// The source address the kernel would use to reach host:port (a UDP connect sends nothing).
std::string route_ip(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) {
    return "";
  }
  std::string ip;
  for (addrinfo* ai = res; ai && ip.empty(); ai = ai->ai_next) {
    Fd fd(socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (fd.valid() && connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) ip = local_ip(fd.get());
  }
  freeaddrinfo(res);
  return ip;
}

std::string this_hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

uint64_t data_ring_bytes(int local_size, int64_t explicit_bytes) {
  uint64_t want = explicit_bytes > 0 ? static_cast<uint64_t>(explicit_bytes)
                                     : kDefaultShmDataRingBytes;
  if (explicit_bytes <= 0) {
    // Many local ranks: keep the default footprint of all data rings under ~1 GiB.
    uint64_t rings = static_cast<uint64_t>(local_size) * (local_size - 1);
    while (want > (256u << 10) && want * rings > (1ull << 30)) want /= 2;
  }
  want = std::max<uint64_t>(4096, std::min<uint64_t>(want, 1ull << 30));
  uint64_t pow2 = 4096;
  while (pow2 < want) pow2 <<= 1;  // rings index with a mask
  return pow2;
}

// ---- a job of size 1 -----------------------------------------------------------------------

class SelfTransport : public Transport {
 public:
  explicit SelfTransport(double timeout_s) { timeout_s_ = timeout_s; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Pair& data(int r) override { return no_pair(r); }
  Pair& ctrl(int r) override { return no_pair(r); }
  const char* kind_to(int r) const override { return r == 0 ? "self" : "none"; }
  std::string host_of(int r) const override { return r == 0 ? "self" : ""; }
  void notify() override { ring_doorbell(&bell_, false); }
  void wait(std::chrono::microseconds timeout) override {
    wait_doorbell(&bell_, &seen_, timeout, false);
  }

 private:
  [[noreturn]] Pair& no_pair(int r) {
    throw TransportError("no pair to rank " + std::to_string(r) + " in a job of size 1");
  }
  Doorbell bell_;
  uint32_t seen_ = 0;
};

// ---- a job of size > 1 ---------------------------------------------------------------------

class NetTransport : public Transport {
 public:
  NetTransport(const BootstrapConfig& cfg, Store& store);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Pair& data(int r) override { return *pair(data_, r); }
  Pair& ctrl(int r) override { return *pair(ctrl_, r); }
  std::string host_of(int r) const override {
    return r >= 0 && r < size_ ? hosts_[r] : std::string();
  }
  const char* kind_to(int r) const override {
    return r >= 0 && r < size_ ? kinds_[r] : "none";
  }
  void notify() override;
  void wait(std::chrono::microseconds timeout) override;

 private:
  Pair* pair(std::vector<std::unique_ptr<Pair>>& v, int r) const;
  std::string get_key(Store& store, const std::string& key, Deadline deadline,
                      const std::string& what);
  bool setup_shm(const BootstrapConfig& cfg, Store& store, const std::string& host,
                 const std::vector<int>& locals, Deadline deadline);
  void setup_tcp(const BootstrapConfig& cfg, Listener& listener,
                 const std::vector<RankInfo>& infos, Deadline deadline);
  void harvest();

  int rank_, size_;
  const Clock::time_point start_ = Clock::now();
  // Declared before the pairs: shm pairs point into the mapping, so it must outlive them.
  std::unique_ptr<ShmSegment> shm_;
  std::vector<std::unique_ptr<Pair>> data_, ctrl_;
  std::vector<const char*> kinds_;
  std::vector<std::string> hosts_;
  Doorbell* bell_ = nullptr;  // ours, in the segment (shm peers only)
  uint32_t seen_ = 0;
  bool any_tcp_ = false;
  Fd epoll_, event_;
};

Pair* NetTransport::pair(std::vector<std::unique_ptr<Pair>>& v, int r) const {
  if (r < 0 || r >= size_ || !v[r]) {
    throw TransportError("no pair from rank " + std::to_string(rank_) + " to rank " +
                         std::to_string(r) + " (job size " + std::to_string(size_) + ")");
  }
  return v[r].get();
}

std::string NetTransport::get_key(Store& store, const std::string& key, Deadline deadline,
                                  const std::string& what) {
  double left = seconds_left(deadline);
  if (left <= 0) {
    throw TransportError("timed out after " + format_seconds(seconds_since(start_)) +
                         "s connecting rank " + std::to_string(rank_) + ": still waiting for " +
                         what + " (rendezvous key '" + key + "')");
  }
  try {
    return store.get(key, left);
  } catch (const TransportError& e) {
    throw TransportError("rank " + std::to_string(rank_) + " could not learn " + what + ": " +
                         e.what());
  }
}

NetTransport::NetTransport(const BootstrapConfig& cfg, Store& store)
    : rank_(cfg.rank), size_(cfg.size) {
  timeout_s_ = cfg.timeout_s;
  if (size_ < 2 || rank_ < 0 || rank_ >= size_) {
    throw TransportError("invalid rank " + std::to_string(rank_) + " for job size " +
                         std::to_string(size_));
  }
  data_.resize(size_);
  ctrl_.resize(size_);
  kinds_.assign(size_, "none");
  kinds_[rank_] = "self";
  const Deadline deadline = deadline_after(cfg.timeout_s);
  const std::string host = cfg.hostname.empty() ? this_hostname() : cfg.hostname;

  // Listen where peers can reach us: the chosen interface, else the address our store connection
  // leaves from (right even inside network namespaces, unlike the hostname).
  std::string ip = cfg.iface.empty() ? store_local_ip(store) : interface_address(cfg.iface);
  if (ip.empty()) ip = route_ip(cfg.store_host, cfg.store_port);
  if (ip.empty()) {
    throw TransportError("cannot tell which local address peers can reach; set "
                         "HOROVOD_GLOO_IFACE to a network interface");
  }
  Listener listener = listen_tcp(ip, 0);

  RankInfo me;
  me.host = host;
  std::replace(me.host.begin(), me.host.end(), '\n', '_');
  me.addr = ip;
  me.port = listener.port;
  me.pid = static_cast<int>(getpid());
  me.shm = !cfg.force_tcp;
  store.set(rank_key(cfg.epoch, rank_), encode(me));
  std::vector<RankInfo> infos(size_);
  infos[rank_] = me;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    std::string key = rank_key(cfg.epoch, r);
    infos[r] = decode(get_key(store, key, deadline,
                              "the address of rank " + std::to_string(r) +
                                  " (published when that rank starts; did it start?)"),
                      r, key);
  }

  hosts_.resize(size_);
  for (int r = 0; r < size_; ++r) hosts_[r] = infos[r].host;

  // Shared memory with the ranks of this host that allow it (all of them agree on this list).
  std::vector<int> locals;
  for (int r = 0; r < size_ && me.shm; ++r) {
    if (infos[r].shm && infos[r].host == me.host) locals.push_back(r);
  }
  if (locals.size() >= 2 && !setup_shm(cfg, store, me.host, locals, deadline)) locals.clear();
  setup_tcp(cfg, listener, infos, deadline);

  if (any_tcp_) {
    epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
    event_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!epoll_.valid() || !event_.valid()) {
      throw TransportError("epoll/eventfd creation failed: " + errno_string(errno));
    }
    auto add = [&](int fd, uint32_t events) {
      epoll_event ev{};
      ev.events = events;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
        throw TransportError("epoll_ctl failed: " + errno_string(errno));
      }
    };
    add(event_.get(), EPOLLIN | EPOLLET);
    for (int r = 0; r < size_; ++r) {
      for (auto* v : {&data_, &ctrl_}) {
        if ((*v)[r] && (*v)[r]->fd() >= 0) {
          // Edge-triggered: wakes on new bytes / freed send space, not on bytes left unread.
          add((*v)[r]->fd(), EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);
        }
      }
    }
  }
  BHVD_LOG(DEBUG, "rank " + std::to_string(rank_) + " connected to " +
                      std::to_string(size_ - 1) + " peers (" + std::to_string(locals.size()) +
                      " local ranks on shared memory) in " +
                      format_seconds(seconds_since(start_)) + "s");
}

bool NetTransport::setup_shm(const BootstrapConfig& cfg, Store& store, const std::string& host,
                             const std::vector<int>& locals, Deadline deadline) {
  const int n = static_cast<int>(locals.size());
  const int me = static_cast<int>(std::find(locals.begin(), locals.end(), rank_) - locals.begin());
  const std::string key = shm_key(cfg.epoch, host);
  if (me == 0) {
    // The name is unique per job, epoch and attempt; it only lives until all local ranks attached.
    const std::string name = "/bhvd_" + sanitize(cfg.job_id, 64) + "_e" +
                             std::to_string(cfg.epoch) + "_" + hex(random_bytes(6));
    try {
      shm_ = ShmSegment::create(name, n, data_ring_bytes(n, cfg.shm_ring_bytes), kShmCtrlRingBytes);
    } catch (const TransportError& e) {
      BHVD_LOG(WARNING, std::string(e.what()) + "; the ranks on this host use TCP instead");
      store.set(key, "none");
      return false;
    }
    store.set(key, "name=" + name);
  } else {
    std::string v = get_key(store, key, deadline,
                            "the shared memory segment of this host from rank " +
                                std::to_string(locals[0]));
    if (v == "none") return false;  // the creator failed and warned; everybody falls back
    if (v.rfind("name=/", 0) != 0 || v.size() > 255) {
      throw TransportError("malformed shared memory segment name under rendezvous key '" + key +
                           "'");
    }
    shm_ = ShmSegment::attach(v.substr(5), n);
  }
  shm_->join(me, getpid());
  shm_->wait_all_joined(deadline, locals);
  bell_ = shm_->doorbell(me);
  seen_ = bell_->seq.load(std::memory_order_acquire);
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    const int peer = locals[j];
    for (bool is_ctrl : {false, true}) {
      auto p = std::make_unique<ShmPair>(peer, shm_->pid(j), shm_->ring(me, j, is_ctrl),
                                         shm_->ring(j, me, is_ctrl), shm_->doorbell(j));
      (is_ctrl ? ctrl_ : data_)[peer] = std::move(p);
    }
    kinds_[peer] = "shm";
  }
  return true;
}

void NetTransport::setup_tcp(const BootstrapConfig& cfg, Listener& listener,
                             const std::vector<RankInfo>& infos, Deadline deadline) {
  const std::string purpose = peer_purpose(cfg.job_id, cfg.epoch);
  // The higher rank connects, the lower one accepts: no cycles, so no deadlock.
  std::vector<char> expect(size_, 0);
  int expected = 0;
  for (int r = rank_ + 1; r < size_; ++r) {
    if (!data_[r]) {
      expect[r] = 1;
      expected += 2;  // ctrl and data
    }
  }
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && !data_[r]) any_tcp_ = true;
  }
  if (!any_tcp_) return;

  // Incoming connections are accepted on a helper thread while this one connects out; each is
  // authenticated on a thread of its own (HandshakePool), so a silent, slow or garbage connection
  // never delays the others.
  std::mutex mu;  // guards the five below, written by the handshake threads
  std::vector<Fd> in_ctrl(size_), in_data(size_);
  std::vector<std::string> in_ep(size_);
  std::vector<char> claimed_ctrl(size_, 0), claimed_data(size_, 0);
  int got = 0;
  std::exception_ptr accept_error;
  std::atomic<bool> stop{false};
  std::thread acceptor;
  const std::string me = "rank " + std::to_string(rank_) + " at " +
                         format_endpoint(listener.ip, listener.port);
  auto handshake = [&](Fd& c, const std::string& remote, const std::function<bool()>& claim,
                       RejectLog& rejects) {
    int from = -1;
    bool is_ctrl = false, claimed = false;
    // Runs once the client proved the secret: who it says it is must be someone we expect.
    auto validate = [&](const std::string& info) -> std::string {
      int to = -1;
      char ch[8] = {0};
      if (std::sscanf(info.c_str(), "from=%d to=%d ch=%4s", &from, &to, ch) != 3) {
        return "malformed peer identity '" + info.substr(0, 64) + "'";
      }
      if (to != rank_) return "connection meant for rank " + std::to_string(to);
      is_ctrl = std::string(ch) == "ctrl";
      if (!is_ctrl && std::string(ch) != "data") return "unknown channel";
      if (from <= rank_ || from >= size_ || !expect[from]) {
        return "rank " + std::to_string(from) + " is not expected to connect here";
      }
      std::lock_guard<std::mutex> lock(mu);
      char& mine = (is_ctrl ? claimed_ctrl : claimed_data)[from];
      if (mine) return "duplicate connection from rank " + std::to_string(from);
      if (!claim()) return "too many connections were handshaking at once";
      mine = 1;
      claimed = true;
      return "";
    };
    try {
      auth_server(c.get(), cfg.secret, purpose,
                  std::min(deadline, deadline_after(kHandshakeSeconds)), validate, "the client");
    } catch (const TransportError& e) {
      // A stranger, a stale peer or garbage: drop it; the listener goes on.
      if (claimed) {
        std::lock_guard<std::mutex> lock(mu);
        (is_ctrl ? claimed_ctrl : claimed_data)[from] = 0;
      }
      rejects.rejected(remote, e.what());
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    (is_ctrl ? in_ctrl : in_data)[from] = std::move(c);
    in_ep[from] = remote;
    ++got;
  };
  if (expected > 0) {
    acceptor = std::thread([&] {
      try {
        RejectLog rejects(me);
        HandshakePool pool([&](Fd& c, const std::string& remote,
                               const std::function<bool()>& claim) {
          handshake(c, remote, claim, rejects);
        });
        while (!stop.load()) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (got == expected) break;
          }
          std::string remote;
          Deadline slice = std::min(deadline, deadline_after(0.05));
          Fd c = accept_tcp(listener.fd.get(), slice, &remote);
          if (c.valid()) {
            pool.start(std::move(c), remote);
            continue;
          }
          if (Clock::now() < deadline) continue;
          std::string missing;
          std::lock_guard<std::mutex> lock(mu);
          for (int r = rank_ + 1; r < size_; ++r) {
            if (!expect[r]) continue;
            if (!in_ctrl[r].valid() || !in_data[r].valid()) {
              missing += (missing.empty() ? "" : ", ") + std::to_string(r) + " (" +
                         (in_ctrl[r].valid() ? "data" : in_data[r].valid() ? "ctrl"
                                                                            : "ctrl, data") +
                         ")";
            }
          }
          throw TransportError("timed out after " + format_seconds(seconds_since(start_)) +
                               "s waiting for rank(s) " + missing + " to connect to " + me);
        }
      } catch (...) {
        accept_error = std::current_exception();
      }
    });
    name_thread(acceptor, "bhvd_accept");
  }
  // Joins the acceptor on every exit path (it polls `stop` every 50 ms).
  struct Joiner {
    std::thread& t;
    std::atomic<bool>& stop;
    ~Joiner() {
      stop.store(true);
      if (t.joinable()) t.join();
    }
  } joiner{acceptor, stop};

  for (int r = 0; r < rank_; ++r) {
    if (data_[r]) continue;
    const std::string ep = format_endpoint(infos[r].addr, infos[r].port);
    const std::string what = "rank " + std::to_string(r) + " (" + ep + ")";
    for (const char* ch : {"ctrl", "data"}) {
      std::string info = "from=" + std::to_string(rank_) + " to=" + std::to_string(r) +
                         " ch=" + ch;
      Fd fd = connect_peer(infos[r].addr, infos[r].port, cfg.secret, purpose, info, deadline,
                           what);
      auto p = std::make_unique<TcpPair>(r, std::move(fd), ep, ch);
      (ch[0] == 'c' ? ctrl_ : data_)[r] = std::move(p);
    }
    kinds_[r] = "tcp";
  }
  if (acceptor.joinable()) acceptor.join();
  if (accept_error) std::rethrow_exception(accept_error);
  for (int r = rank_ + 1; r < size_; ++r) {
    if (!expect[r]) continue;
    // The endpoint we name in errors is the peer's published listener, which users recognize.
    const std::string ep = format_endpoint(infos[r].addr, infos[r].port);
    ctrl_[r] = std::make_unique<TcpPair>(r, std::move(in_ctrl[r]), ep, "ctrl");
    data_[r] = std::make_unique<TcpPair>(r, std::move(in_data[r]), ep, "data");
    kinds_[r] = "tcp";
  }
}

void NetTransport::notify() {
  if (bell_) ring_doorbell(bell_, true);
  if (event_.valid()) {
    uint64_t one = 1;
    ssize_t ignored = ::write(event_.get(), &one, sizeof(one));  // EAGAIN: already pending
    (void)ignored;
  }
}

void NetTransport::harvest() {
  epoll_event evs[64];
  for (;;) {
    int n = epoll_wait(epoll_.get(), evs, 64, 0);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == event_.get()) {
        uint64_t count;
        ssize_t ignored = ::read(event_.get(), &count, sizeof(count));
        (void)ignored;
      }
    }
    if (n < 64) return;
  }
}

void NetTransport::wait(std::chrono::microseconds timeout) {
  if (!any_tcp_) {  // every peer on shared memory: sleep on our doorbell
    wait_doorbell(bell_, &seen_, timeout, true);
    return;
  }
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (bell_) {
      uint32_t s = bell_->seq.load(std::memory_order_acquire);
      if (s != seen_) {
        seen_ = s;
        return;
      }
    }
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
    if (left.count() < 0) left = std::chrono::nanoseconds(0);
    if (bell_) left = std::min<std::chrono::nanoseconds>(left, kMixedPollSlice);
    timespec ts{static_cast<time_t>(left.count() / 1000000000),
                static_cast<long>(left.count() % 1000000000)};
    // The epoll fd is readable while its (edge-triggered) ready list is non-empty.
    pollfd p{epoll_.get(), POLLIN, 0};
    int r = ppoll(&p, 1, &ts, nullptr);
    if (r > 0) harvest();
    if (r > 0 || Clock::now() >= deadline) {
      // Whatever rang meanwhile is covered by this return: the caller re-checks every pair.
      if (bell_) seen_ = bell_->seq.load(std::memory_order_acquire);
      return;
    }
  }
}

}  // namespace

std::unique_ptr<Transport> connect_transport(const BootstrapConfig& cfg, Store& store) {
  if (cfg.size <= 1) return std::make_unique<SelfTransport>(cfg.timeout_s);
  return std::make_unique<NetTransport>(cfg, store);
}

std::unique_ptr<Transport> make_self_transport() { return std::make_unique<SelfTransport>(30); }

}  // namespace bagua_hvd
