// Transports: byte streams between two ranks (Pair), the set of them for one job (Transport) and
// the rendezvous key-value store that bootstraps them (Store).
//
// Everything here is driven by the single background thread, except Transport::notify(), which
// any thread may call to wake that thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"

namespace bagua_hvd {

// One direction-agnostic byte stream to one peer. Non-blocking; the progress loop in Comm (and the
// controller's message channel) drive it.
class Pair {
 public:
  virtual ~Pair() = default;
  virtual int peer() const = 0;            // global rank of the other end
  virtual const char* kind() const = 0;    // "shm" or "tcp"
  // Move up to len bytes without blocking; return how many moved (0: none now).
  // Throw TransportError naming the peer when the connection failed or the peer is gone.
  virtual size_t try_send(const void* buf, size_t len) = 0;
  virtual size_t try_recv(void* buf, size_t len) = 0;
  // Zero-copy receive where the transport has the bytes in memory (shm): a pointer to the
  // contiguous readable bytes and their count, to be followed by consume(). Transports that
  // cannot do this return 0 and callers fall back to try_recv().
  virtual size_t peek(const void** ptr) {
    *ptr = nullptr;
    return 0;
  }
  virtual void consume(size_t /*n*/) {}
  // A pollable fd (sockets), or -1.
  virtual int fd() const { return -1; }
  // Called while waiting a long time on this pair: throw TransportError if the peer is known to
  // be dead (shm: its pid is gone). Cheap enough to call every few milliseconds.
  virtual void check_alive() {}
};

// Rendezvous key-value store, served by the launcher (bagua_hvd/rendezvous/store.py).
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until key exists; throws TransportError("timed out after Ns waiting for rendezvous key
  // 'K' ...") when it does not appear in time.
  virtual std::string get(const std::string& key, double timeout_s) = 0;
};

// Connects to the launcher's store over TCP, proving job membership with an HMAC-SHA256
// challenge (the secret never crosses the wire).
std::unique_ptr<Store> connect_tcp_store(const std::string& host, int port,
                                         const std::string& secret, double timeout_s);

struct BootstrapConfig {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  int cross_rank = 0, cross_size = 1;
  std::string hostname;      // HOROVOD_HOSTNAME; ranks with the same one may share memory
  std::string store_host;    // HOROVOD_GLOO_RENDEZVOUS_ADDR
  int store_port = 0;        // HOROVOD_GLOO_RENDEZVOUS_PORT
  std::string secret;        // raw bytes of the per-job secret (BAGUA_HVD_SECRET is its hex)
  std::string job_id;        // BAGUA_HVD_JOB_ID: unique per job, used in shm names
  int epoch = 0;             // how many times this process initialized; namespaces store keys
  bool force_tcp = false;    // BAGUA_HVD_TRANSPORT=tcp
  double timeout_s = 30;     // HOROVOD_GLOO_TIMEOUT_SECONDS / BAGUA_HVD_TIMEOUT_SECONDS
  std::string iface;         // HOROVOD_GLOO_IFACE: interface whose address peers connect to
  int64_t shm_ring_bytes = 0;  // BAGUA_HVD_SHM_RING_BYTES: shm data ring size; <= 0 picks one
};

// All pairs of one job. For every other rank there are two pairs: "ctrl" carries negotiation
// messages, "data" carries collective payloads, so that a control message arriving at any time
// never interleaves with a collective in flight.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Pair& data(int global_rank) = 0;
  virtual Pair& ctrl(int global_rank) = 0;
  // "self", "shm" or "tcp"
  virtual const char* kind_to(int global_rank) const = 0;
  // The host a rank runs on (HOROVOD_HOSTNAME), whatever transport reaches it: hierarchical
  // algorithms group ranks by it.
  virtual std::string host_of(int global_rank) const = 0;
  // Wake wait() from any thread.
  virtual void notify() = 0;
  // Block until a pair may have made progress, notify() was called, or timeout passed.
  virtual void wait(std::chrono::microseconds timeout) = 0;
  double timeout_seconds() const { return timeout_s_; }
  // Called every few milliseconds while a collective waits (Comm::run), on the thread running
  // it: the runtime keeps the ranks it negotiates with hearing from it during a long collective
  // they are not part of (Runtime::send_keepalives).
  void set_heartbeat(std::function<void()> f) { heartbeat_ = std::move(f); }
  void heartbeat() {
    if (heartbeat_) heartbeat_();
  }
  // Whether a peer whose connection closed may have ended normally (Comm::run asks before it
  // fails a collective over a member it was not waiting on): the runtime answers from the
  // peer's control frames (its bye, core/farewell.cc). Without an answer: no.
  void set_finished_probe(std::function<bool(int)> f) { finished_probe_ = std::move(f); }
  bool may_have_finished(int global_rank) {
    return finished_probe_ && finished_probe_(global_rank);
  }

 protected:
  double timeout_s_ = 30;
  std::function<void()> heartbeat_;
  std::function<bool(int)> finished_probe_;
};

// Builds the transport: publishes this rank's address in the store, learns the others', maps
// shared memory with the ranks on this host (unless force_tcp) and connects TCP to the rest.
// Frees every resource (sockets, mappings, shm names) in its destructor; shm names are unlinked as
// soon as every local rank has attached, so a crash leaves nothing in /dev/shm.
std::unique_ptr<Transport> connect_transport(const BootstrapConfig& cfg, Store& store);

// A transport for a job of size 1 (no peers): wait() only waits for notify().
std::unique_ptr<Transport> make_self_transport();

}  // namespace bagua_hvd
