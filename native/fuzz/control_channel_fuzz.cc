// Fuzz target: the control channel's framing (transport/control_channel.cc), the untrusted length
// prefixes of negotiation frames. Input: one byte choosing the chunk size (1..256), then what the
// peer sends, delivered a chunk per read with "nothing yet" between chunks and a closed connection
// at the end. poll() must deliver exactly the complete frames of the stream, in order, then throw
// TransportError; each frame is then decoded as the coordinator and the workers do.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "requests/message.h"
#include "transport/control_channel.h"

namespace bagua_hvd {
namespace {

class ScriptedPair : public Pair {
 public:
  ScriptedPair(std::string stream, size_t chunk) : stream_(std::move(stream)), chunk_(chunk) {}
  int peer() const override { return 1; }
  const char* kind() const override { return "fuzz"; }
  size_t try_send(const void*, size_t len) override { return len; }
  size_t try_recv(void* buf, size_t len) override {
    if (pos_ == stream_.size()) throw TransportError("connection to rank 1 closed");
    idle_ = !idle_;
    if (idle_) return 0;  // every other read finds nothing, so frames arrive in pieces
    size_t n = std::min({len, chunk_, stream_.size() - pos_});
    std::memcpy(buf, stream_.data() + pos_, n);
    pos_ += n;
    return n;
  }

 private:
  std::string stream_;
  size_t chunk_, pos_ = 0;
  bool idle_ = false;
};

// Rank 0 of two; rank 1 is the scripted peer.
class ScriptedTransport : public Transport {
 public:
  explicit ScriptedTransport(ScriptedPair& pair) : pair_(pair) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Pair& data(int) override { return pair_; }
  Pair& ctrl(int) override { return pair_; }
  const char* kind_to(int) const override { return "fuzz"; }
  std::string host_of(int) const override { return "localhost"; }
  void notify() override {}
  void wait(std::chrono::microseconds) override {}

 private:
  ScriptedPair& pair_;
};

// The complete frames at the start of the stream (docs/protocol.md): the expected deliveries.
std::vector<std::string> complete_frames(const std::string& stream) {
  std::vector<std::string> frames;
  size_t pos = 0;
  while (stream.size() - pos >= 4) {
    uint32_t len = get_u32(stream.data() + pos);
    if (len > ControlChannel::kMaxFrame || stream.size() - pos - 4 < len) break;
    frames.push_back(stream.substr(pos + 4, len));
    pos += 4 + len;
  }
  return frames;
}

}  // namespace
}  // namespace bagua_hvd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bagua_hvd;
  if (size < 1 || size > fuzz::kMaxInput) return 0;
  const std::string stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  ScriptedPair pair(stream, size_t{data[0]} + 1);
  ScriptedTransport transport(pair);
  ControlChannel channel(transport, 1.0);

  std::vector<std::string> got;
  // Each poll either delivers a frame or reads a chunk (or an idle read): a bound on progress.
  const size_t max_polls = 3 * stream.size() + 8;
  for (size_t polls = 0;; ++polls) {
    fuzz::check(polls <= max_polls, "poll() made no progress on a finite stream");
    std::string frame;
    try {
      if (channel.poll(1, &frame)) got.push_back(std::move(frame));
    } catch (const TransportError&) {
      break;  // the closed connection, or an oversized frame
    }
  }
  fuzz::check(got == complete_frames(stream), "poll() did not deliver the stream's frames");
  for (const auto& f : got) {
    try {
      decode_request_list(f);
    } catch (const TransportError&) {
    }
    try {
      decode_response_list(f);
    } catch (const TransportError&) {
    }
  }
  return 0;
}
