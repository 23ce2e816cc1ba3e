// The control channel's framing (transport/control_channel.h).
#include "transport/control_channel.h"

#include <cstring>

namespace bagua_hvd {

ControlChannel::ControlChannel(Transport& transport, double timeout_s)
    : transport_(transport),
      timeout_s_(timeout_s),
      inbox_(transport.size()),
      inbox_error_(transport.size()),
      cut_(transport.size(), 0) {}

std::string ControlChannel::frame(const std::string& payload) {
  uint32_t len = static_cast<uint32_t>(payload.size());
  std::string f(reinterpret_cast<const char*>(&len), 4);
  f += payload;
  return f;
}

void ControlChannel::fill(int peer) {
  Pair& p = transport_.ctrl(peer);
  std::string& buf = inbox_[peer];
  if (inbox_error_[peer]) return;
  char tmp[65536];
  try {
    while (true) {
      size_t n = p.try_recv(tmp, sizeof(tmp));
      if (n == 0) break;
      buf.append(tmp, n);
    }
  } catch (const TransportError& e) {
    // A peer that exits right after its last message (shutdown) closes the channel: deliver
    // what it sent before reporting the closed connection.
    inbox_error_[peer] = e;
  }
}

bool ControlChannel::poll(int peer, std::string* out) {
  std::string& buf = inbox_[peer];
  if (buf.size() < 4 || [&] {
        uint32_t len;
        std::memcpy(&len, buf.data(), 4);
        return buf.size() < 4 + static_cast<size_t>(len);
      }())
    fill(peer);
  auto pending_error = [&] {
    if (inbox_error_[peer]) throw *inbox_error_[peer];
    return false;
  };
  if (buf.size() < 4) return pending_error();
  uint32_t len;
  std::memcpy(&len, buf.data(), 4);
  if (len > kMaxFrame)
    throw TransportError("rank " + std::to_string(peer) + " sent a negotiation frame of " +
                         std::to_string(len) + " bytes, over the limit: the control channel "
                         "carries garbage");
  if (buf.size() < 4 + static_cast<size_t>(len)) return pending_error();
  out->assign(buf, 4, len);
  buf.erase(0, 4 + static_cast<size_t>(len));
  return true;
}

const std::string& ControlChannel::bye() {
  static const std::string payload("BHBY", 4);
  return payload;
}

ControlChannel::Bye ControlChannel::said_bye(int peer) {
  fill(peer);
  const std::string& buf = inbox_[peer];
  size_t off = 0;
  while (buf.size() - off >= 4) {
    uint32_t len;
    std::memcpy(&len, buf.data() + off, 4);
    if (len > kMaxFrame || buf.size() - off - 4 < len) break;
    if (is_bye(buf.substr(off + 4, len))) return Bye::kSaid;
    off += 4 + static_cast<size_t>(len);
  }
  if (inbox_error_[peer]) return Bye::kNot;
  // Shared memory reports a dead peer only here (its reads just find nothing more).
  try {
    transport_.ctrl(peer).check_alive();
  } catch (const TransportError& e) {
    inbox_error_[peer] = e;
    return Bye::kNot;
  }
  return Bye::kUnknown;
}

void ControlChannel::send(int peer, const std::string& payload) {
  Pair& p = transport_.ctrl(peer);
  const std::string f = frame(payload);
  size_t off = 0;
  auto last = Clock::now();
  while (off < f.size()) {
    size_t n = p.try_send(f.data() + off, f.size() - off);
    if (n) {
      off += n;
      last = Clock::now();
      continue;
    }
    // Keep draining what the peer sends us so two full channels cannot deadlock.
    fill(peer);
    if (seconds_since(last) > timeout_s_) {
      cut_[peer] = off > 0;  // the pair stays open with part of a frame: nothing more may follow
      throw TransportError("timed out after " + format_seconds(timeout_s_) +
                           " s sending a negotiation message to rank " + std::to_string(peer));
    }
    p.check_alive();
    transport_.wait(std::chrono::microseconds(1000));
  }
}

void ControlChannel::send_best_effort(int peer, const std::string& payload) {
  if (cut_[peer]) return;
  try {
    const std::string f = frame(payload);
    transport_.ctrl(peer).try_send(f.data(), f.size());
  } catch (const std::exception&) {
  }
}

}  // namespace bagua_hvd
