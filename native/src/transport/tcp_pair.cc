#include "transport/tcp_pair.h"

#include <sys/socket.h>

#include <cerrno>

namespace bagua_hvd {

TcpPair::TcpPair(int peer, Fd fd, std::string peer_endpoint, const char* channel)
    : peer_(peer), fd_(std::move(fd)), endpoint_(std::move(peer_endpoint)), channel_(channel) {}

void TcpPair::fail(const std::string& why) {
  if (failed_.empty()) {
    failed_ = "connection to rank " + std::to_string(peer_) + " (" + endpoint_ + ") " + why;
  }
  throw TransportError(failed_, peer_);
}

size_t TcpPair::try_send(const void* buf, size_t len) {
  if (!failed_.empty()) throw TransportError(failed_, peer_);
  if (len == 0) return 0;
  for (;;) {
    ssize_t n = ::send(fd_.get(), buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return 0;
    if (err == EPIPE || err == ECONNRESET) {
      fail("closed: the peer exited or failed (" + errno_string(err) + " on the " + channel_ +
           " channel)");
    }
    fail("failed on send (" + std::string(channel_) + " channel): " + errno_string(err));
  }
}

size_t TcpPair::try_recv(void* buf, size_t len) {
  if (!failed_.empty()) throw TransportError(failed_, peer_);
  if (len == 0) return 0;
  for (;;) {
    ssize_t n = ::recv(fd_.get(), buf, len, MSG_DONTWAIT);
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) fail("closed: the peer exited or failed");
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return 0;
    if (err == ECONNRESET) fail("closed: the peer exited or failed (connection reset)");
    fail("failed on receive (" + std::string(channel_) + " channel): " + errno_string(err));
  }
}

void TcpPair::check_alive() {
  if (!failed_.empty()) throw TransportError(failed_, peer_);
  char c;
  for (;;) {
    ssize_t n = ::recv(fd_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return;  // unread bytes: alive as far as we can tell
    if (n == 0) fail("closed: the peer exited or failed");
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return;
    if (err == ECONNRESET) fail("closed: the peer exited or failed (connection reset)");
    fail("failed on receive (" + std::string(channel_) + " channel): " + errno_string(err));
  }
}

}  // namespace bagua_hvd
