#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace bagua_hvd {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);  // close() errors are not actionable here
  fd_ = fd;
}

Deadline deadline_after(double seconds) {
  seconds = std::max(0.0, std::min(seconds, 1e7));  // clamp so the duration cannot overflow
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

double seconds_left(Deadline deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

int poll_ms_left(Deadline deadline, int cap_ms) {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  int64_t ms = (left.count() + 999) / 1000;
  return static_cast<int>(std::min<int64_t>(ms, cap_ms));
}

std::string errno_string(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (not necessarily buf).
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

std::string format_endpoint(const std::string& ip, int port) {
  if (ip.find(':') != std::string::npos) return "[" + ip + "]:" + std::to_string(port);
  return ip + ":" + std::to_string(port);
}

std::string sockaddr_ip(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof(buf));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

int sockaddr_port(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
  if (sa->sa_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port);
  }
  return 0;
}

std::string local_endpoint(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  return format_endpoint(sockaddr_ip(sa), sockaddr_port(sa));
}

std::string remote_endpoint(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  return format_endpoint(sockaddr_ip(sa), sockaddr_port(sa));
}

std::string local_ip(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  return sockaddr_ip(reinterpret_cast<sockaddr*>(&ss));
}

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw TransportError("fcntl(O_NONBLOCK) failed: " + errno_string(errno));
  }
}

void set_nodelay(int fd) {
  int one = 1;
  // Latency matters more than segment count for negotiation messages.
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    throw TransportError("setsockopt(TCP_NODELAY) failed: " + errno_string(errno));
  }
}

std::string interface_address(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw TransportError("getifaddrs failed while looking up interface '" + iface +
                         "': " + errno_string(errno));
  }
  std::string v4, v6, names;
  for (ifaddrs* it = list; it; it = it->ifa_next) {
    if (!it->ifa_name) continue;
    std::string name = it->ifa_name;
    if (names.find(" " + name + ",") == std::string::npos && it->ifa_addr &&
        (it->ifa_addr->sa_family == AF_INET || it->ifa_addr->sa_family == AF_INET6)) {
      names += " " + name + ",";
    }
    if (name != iface || !it->ifa_addr) continue;
    if (it->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = sockaddr_ip(it->ifa_addr);
    if (it->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(it->ifa_addr);
      if (!IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) v6 = sockaddr_ip(it->ifa_addr);
    }
  }
  freeifaddrs(list);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  if (!names.empty()) names.pop_back();  // trailing comma
  throw TransportError("HOROVOD_GLOO_IFACE=" + iface +
                       ": no such network interface with an IP address (interfaces:" + names +
                       ")");
}

static void fill_sockaddr(const std::string& ip, int port, sockaddr_storage* ss, socklen_t* len) {
  std::memset(ss, 0, sizeof(*ss));
  auto* a4 = reinterpret_cast<sockaddr_in*>(ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(ss);
  if (inet_pton(AF_INET, ip.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in6);
  } else {
    throw TransportError("'" + ip + "' is not an IP address to listen on");
  }
}

Listener listen_tcp(const std::string& ip, int port, int backlog) {
  sockaddr_storage ss;
  socklen_t len = 0;
  fill_sockaddr(ip, port, &ss, &len);
  Fd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) throw TransportError("socket() failed: " + errno_string(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    throw TransportError("cannot listen on " + format_endpoint(ip, port) + ": bind: " +
                         errno_string(errno));
  }
  if (listen(fd.get(), backlog) != 0) {
    throw TransportError("listen on " + format_endpoint(ip, port) + " failed: " +
                         errno_string(errno));
  }
  Listener l;
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  l.port = sockaddr_port(reinterpret_cast<sockaddr*>(&bound));
  l.ip = ip;
  l.fd = std::move(fd);
  return l;
}

Fd accept_tcp(int listen_fd, Deadline deadline, std::string* remote) {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int c = accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len,
                    SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) {
      Fd fd(c);
      set_nodelay(fd.get());
      if (remote) {
        auto* sa = reinterpret_cast<sockaddr*>(&ss);
        *remote = format_endpoint(sockaddr_ip(sa), sockaddr_port(sa));
      }
      return fd;
    }
    int err = errno;
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) {
      throw TransportError("accept failed: " + errno_string(err));
    }
    int ms = poll_ms_left(deadline);
    if (ms <= 0) return Fd();
    pollfd p{listen_fd, POLLIN, 0};
    if (poll(&p, 1, ms) < 0 && errno != EINTR) {
      throw TransportError("poll on a listening socket failed: " + errno_string(errno));
    }
  }
}

// One connection attempt to one resolved address; returns 0 or an errno.
static int try_connect(const addrinfo* ai, Deadline deadline, Fd* out) {
  Fd fd(socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (!fd.valid()) return errno;
  if (connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return errno;
    for (;;) {
      int ms = poll_ms_left(deadline);
      if (ms <= 0) return ETIMEDOUT;
      pollfd p{fd.get(), POLLOUT, 0};
      int r = poll(&p, 1, ms);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return errno;
      if (r > 0) break;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
    if (err != 0) return err;
  }
  // Retrying against a port nobody listens on can end in a TCP self-connect on loopback.
  if (local_endpoint(fd.get()) == remote_endpoint(fd.get())) return ECONNREFUSED;
  set_nodelay(fd.get());
  *out = std::move(fd);
  return 0;
}

Fd connect_tcp(const std::string& host, int port, Deadline deadline, const std::string& what) {
  const auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai == 0) {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        Fd fd;
        int err = try_connect(ai, deadline, &fd);
        if (err == 0) {
          freeaddrinfo(res);
          return fd;
        }
        last_error = errno_string(err);
      }
      freeaddrinfo(res);
    } else if (gai == EAI_AGAIN) {
      last_error = std::string("name resolution: ") + gai_strerror(gai);
    } else {
      throw TransportError("cannot resolve '" + host + "' to connect to " + what + ": " +
                           gai_strerror(gai));
    }
    if (seconds_left(deadline) <= 0) break;
    std::this_thread::sleep_for(
        std::min<Clock::duration>(backoff, std::max<Clock::duration>(
                                               deadline - Clock::now(), Clock::duration(0))));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
    if (seconds_left(deadline) <= 0) break;
  }
  throw TransportError("could not connect to " + what + " at " + format_endpoint(host, port) +
                       " within " + format_seconds(seconds_since(start)) + "s (last error: " + last_error + ")");
}

void send_all(int fd, const void* buf, size_t len, Deadline deadline, const std::string& what) {
  const auto start = Clock::now();
  auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw TransportError("sending to " + what + " failed: " + errno_string(errno));
    }
    int ms = poll_ms_left(deadline);
    if (ms <= 0) {
      throw TransportError("timed out after " + format_seconds(seconds_since(start)) + "s sending to " +
                           what);
    }
    pollfd pfd{fd, POLLOUT, 0};
    poll(&pfd, 1, ms);
  }
}

void recv_all(int fd, void* buf, size_t len, Deadline deadline, const std::string& what) {
  const auto start = Clock::now();
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) throw TransportError(what + " closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw TransportError("receiving from " + what + " failed: " + errno_string(errno));
    }
    int ms = poll_ms_left(deadline);
    if (ms <= 0) {
      throw TransportError("timed out after " + format_seconds(seconds_since(start)) +
                           "s waiting for data from " + what);
    }
    pollfd pfd{fd, POLLIN, 0};
    poll(&pfd, 1, ms);
  }
}

void send_frame(int fd, const std::string& payload, Deadline deadline, const std::string& what) {
  if (payload.size() > UINT32_MAX) throw TransportError("frame too large for " + what);
  std::string buf;
  buf.reserve(4 + payload.size());
  put_u32(&buf, static_cast<uint32_t>(payload.size()));
  buf += payload;
  send_all(fd, buf.data(), buf.size(), deadline, what);
}

std::string recv_frame(int fd, size_t max_len, Deadline deadline, const std::string& what) {
  unsigned char hdr[4];
  recv_all(fd, hdr, 4, deadline, what);
  uint32_t len = get_u32(hdr);
  if (len > max_len) {
    throw TransportError("malformed frame from " + what + ": length " + std::to_string(len) +
                         " exceeds the maximum of " + std::to_string(max_len) +
                         " (is something else talking on this port?)");
  }
  std::string payload(len, '\0');
  if (len) recv_all(fd, &payload[0], len, deadline, what);
  return payload;
}

void put_u16(std::string* s, uint16_t v) {
  s->push_back(static_cast<char>(v & 0xff));
  s->push_back(static_cast<char>(v >> 8));
}

void put_u32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_u64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const void* p) {
  auto* b = static_cast<const unsigned char*>(p);
  return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}

uint16_t get_u16(const void* p) {
  auto* b = static_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(b[0] | b[1] << 8);
}

}  // namespace bagua_hvd
