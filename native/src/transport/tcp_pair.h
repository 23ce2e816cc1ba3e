// A Pair over one non-blocking, authenticated TCP connection.
#pragma once

#include <string>

#include "transport/socket.h"
#include "transport/transport.h"

namespace bagua_hvd {

class TcpPair : public Pair {
 public:
  // channel: "ctrl" or "data" (for messages only).
  TcpPair(int peer, Fd fd, std::string peer_endpoint, const char* channel);
  int peer() const override { return peer_; }
  const char* kind() const override { return "tcp"; }
  size_t try_send(const void* buf, size_t len) override;
  size_t try_recv(void* buf, size_t len) override;
  int fd() const override { return fd_.get(); }
  // Detects an orderly close or reset without consuming data (MSG_PEEK).
  void check_alive() override;

 private:
  [[noreturn]] void fail(const std::string& why);
  int peer_;
  Fd fd_;
  std::string endpoint_;
  const char* channel_;
  std::string failed_;  // once broken, every call repeats the first error
};

}  // namespace bagua_hvd
