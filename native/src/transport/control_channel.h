// The control channel: length-prefixed negotiation frames (u32 little-endian length | payload,
// docs/protocol.md) over the transport's ctrl pairs, one inbox per peer. Background thread only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace bagua_hvd {

class ControlChannel {
 public:
  // Frames over this many bytes mean the channel carries garbage.
  static constexpr uint32_t kMaxFrame = 256u << 20;

  ControlChannel(Transport& transport, double timeout_s);

  // Takes one complete frame from peer into *out; false when none is complete yet. Throws
  // TransportError when the peer failed (after delivering the frames it sent before) or sent an
  // oversized frame.
  bool poll(int peer, std::string* out);
  // Sends one frame, draining the peer's frames meanwhile so that two full channels cannot
  // deadlock. Throws TransportError after timeout_s without progress.
  void send(int peer, const std::string& payload);
  // One non-blocking attempt (the failure notice of a failing rank); errors are ignored, and
  // nothing is sent to a peer whose channel holds a frame cut off by a timed-out send.
  void send_best_effort(int peer, const std::string& payload);

  // The last frame a rank sends each peer at the end of a job (core/farewell.cc): it has
  // executed every response, so its connections may close. "BHBY", which starts no
  // negotiation message (their magics differ; keepalives are empty).
  static const std::string& bye();
  static bool is_bye(const std::string& payload) { return payload == bye(); }
  // Whether peer's frames so far hold a bye, without taking any: yes, no (its channel closed or
  // failed, or its process died, without one), or not yet known.
  enum class Bye { kSaid, kNot, kUnknown };
  Bye said_bye(int peer);

  static std::string frame(const std::string& payload);

 private:
  void fill(int peer);

  Transport& transport_;
  double timeout_s_;
  std::vector<std::string> inbox_;        // per-peer partial frames
  // Per peer: the failure seen after the buffered frames; whether a send timed out mid-frame.
  std::vector<std::optional<TransportError>> inbox_error_;
  std::vector<char> cut_;
};

}  // namespace bagua_hvd
