// Socket utilities shared by the store client and the TCP pairs: an RAII fd, listening and
// connecting with deadlines, deadline-bounded I/O and length-prefixed frames.
#pragma once

#include <sys/socket.h>

#include <string>

#include "base/common.h"

namespace bagua_hvd {

// Owns a file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

using Deadline = Clock::time_point;
Deadline deadline_after(double seconds);
double seconds_left(Deadline deadline);  // <= 0 when passed
// Milliseconds until the deadline for poll(): rounded up, clamped to [0, cap_ms].
int poll_ms_left(Deadline deadline, int cap_ms = 1 << 30);

std::string errno_string(int err);
// "1.2.3.4:80" or "[::1]:80"
std::string format_endpoint(const std::string& ip, int port);
std::string sockaddr_ip(const sockaddr* sa);
int sockaddr_port(const sockaddr* sa);
std::string local_endpoint(int fd);   // "" on error
std::string remote_endpoint(int fd);  // "" on error
std::string local_ip(int fd);         // "" on error

void set_nonblocking(int fd);
void set_nodelay(int fd);

// First IPv4 (else IPv6) address of a network interface; throws TransportError naming the
// interfaces that exist when there is none.
std::string interface_address(const std::string& iface);

struct Listener {
  Fd fd;
  std::string ip;
  int port = 0;
};
// Listens on ip:port (port 0: an ephemeral port), non-blocking, close-on-exec.
Listener listen_tcp(const std::string& ip, int port, int backlog = 128);
// Waits until deadline for one connection; returns an invalid Fd on timeout. The accepted socket
// is non-blocking with TCP_NODELAY; *remote receives its "ip:port".
Fd accept_tcp(int listen_fd, Deadline deadline, std::string* remote);

// Connects to host:port, retrying refused/unreachable attempts until the deadline (the other end
// may not be listening yet). Throws TransportError naming `what` and the last error. The socket
// is non-blocking with TCP_NODELAY.
Fd connect_tcp(const std::string& host, int port, Deadline deadline, const std::string& what);

// Deadline-bounded blocking I/O over a (non-blocking) socket. Throw TransportError naming
// `what` on timeout, error or EOF.
void send_all(int fd, const void* buf, size_t len, Deadline deadline, const std::string& what);
void recv_all(int fd, void* buf, size_t len, Deadline deadline, const std::string& what);

// Frames: [u32 little-endian length][payload]. recv_frame rejects lengths above max_len before
// allocating, so garbage on a port is an error, never a huge allocation.
void send_frame(int fd, const std::string& payload, Deadline deadline, const std::string& what);
std::string recv_frame(int fd, size_t max_len, Deadline deadline, const std::string& what);

// Little-endian encoding helpers for wire formats.
void put_u16(std::string* s, uint16_t v);
void put_u32(std::string* s, uint32_t v);
void put_u64(std::string* s, uint64_t v);
uint32_t get_u32(const void* p);
uint16_t get_u16(const void* p);

}  // namespace bagua_hvd
