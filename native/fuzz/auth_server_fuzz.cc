// Fuzz target: the server side of the authentication handshake (auth_server, transport/auth.cc).
// Input: a flags byte, then
//   bit 0 clear ("raw"): the client's whole byte stream, frames and all, then EOF. No stream can
//     carry the right proof (it covers the server's random nonce), so the server must refuse: this
//     covers the framing and the parsing of HELLO and PROOF.
//   bit 0 set ("scripted"): a HELLO payload. The harness sends it, reads the challenge, answers
//     the right proof (bit 1: one with a bit flipped) and reads the result, which reaches the paths
//     behind the proof (a wrong purpose; bit 2: the server's validate() refuses the info). The
//     answers are checked against docs/protocol.md.
// Every run ends in AuthError/TransportError or a return, within the deadline.
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

#include "fuzz_util.h"
#include "transport/auth.h"

namespace bagua_hvd {
namespace {

using fuzz::check;

constexpr double kTimeoutS = 2.0;

struct Outcome {
  bool accepted = false;
  std::string info;
};

Outcome run_server(int fd, bool refuse_info) {
  Outcome o;
  auto validate = [refuse_info](const std::string&) {
    return refuse_info ? std::string("this info is not expected here") : std::string();
  };
  try {
    o.info = auth_server(fd, fuzz::kSecret, store_purpose(), deadline_after(kTimeoutS), validate,
                         "the fuzz client");
    o.accepted = true;
  } catch (const TransportError&) {  // AuthError included: a refusal
  }
  return o;
}

void raw(const std::string& stream) {
  auto sockets = fuzz::socket_pair();
  fuzz::feed_and_close(sockets.theirs.get(), stream);
  check(!run_server(sockets.ours.get(), false).accepted,
        "accepted a client that cannot know the server's nonce");
}

// The HELLO's fields per docs/protocol.md; false when it is malformed.
bool parse_hello(const std::string& h, std::string* purpose, std::string* info) {
  if (h.size() < fuzz::kHeaderLen + 1 || h.compare(0, 6, fuzz::handshake_header(fuzz::kHello))) {
    return false;
  }
  const size_t plen = static_cast<uint8_t>(h[6]);
  if (h.size() < 7 + plen + 2) return false;
  const size_t ilen = get_u16(h.data() + 7 + plen);
  if (h.size() != 9 + plen + ilen + fuzz::kNonceLen) return false;
  *purpose = h.substr(7, plen);
  *info = h.substr(9 + plen, ilen);
  return true;
}

bool has_header(const std::string& msg, uint8_t type) {
  return msg.size() > fuzz::kHeaderLen && msg.compare(0, 6, fuzz::handshake_header(type)) == 0;
}

void scripted(const std::string& hello, uint8_t flags) {
  // The server drops a larger HELLO without an answer (raw inputs cover that).
  if (hello.size() > kMaxHandshakeFrame) return;
  const bool wrong_proof = flags & 2, refuse_info = flags & 4;
  std::string purpose, info;
  const bool well_formed = parse_hello(hello, &purpose, &info);
  bool expect_accept = false;

  auto sockets = fuzz::socket_pair();
  Outcome outcome;
  std::thread server([&] { outcome = run_server(sockets.ours.get(), refuse_info); });
  const int fd = sockets.theirs.get();
  const Deadline deadline = deadline_after(kTimeoutS + 1);
  const std::string what = "the server under test";
  try {
    send_frame(fd, hello, deadline, what);
    const std::string ch = recv_frame(fd, 1 << 20, deadline, what);
    check(has_header(ch, fuzz::kChallenge), "the challenge has no header");
    check((ch[6] == fuzz::kStatusOk) == well_formed, "the hello's form decided the wrong answer");
    if (well_formed) {
      check(ch.size() == 7 + fuzz::kNonceLen, "a challenge without a nonce");
      const std::string nonce = ch.substr(7);
      std::string proof = fuzz::mac(fuzz::kClientLabel, hello, nonce);
      if (wrong_proof) proof[0] ^= 1;
      send_frame(fd, fuzz::handshake_header(fuzz::kProof) + proof, deadline, what);
      const std::string res = recv_frame(fd, 1 << 20, deadline, what);
      check(has_header(res, fuzz::kResult), "the result has no header");
      expect_accept = !wrong_proof && purpose == store_purpose() && !refuse_info;
      check((res[6] == fuzz::kStatusOk) == expect_accept, "the result has the wrong status");
      if (expect_accept) {
        check(res.substr(7) == fuzz::mac(fuzz::kServerLabel, hello, nonce),
              "an acceptance without the server's proof");
      }
      if (wrong_proof) check(res.size() == 7, "the refusal of a wrong proof says why");
    }
  } catch (const TransportError& e) {
    std::fprintf(stderr, "harness: %s\n", e.what());
    fuzz::fail("the server did not answer as the protocol says");
  }
  server.join();
  check(outcome.accepted == expect_accept, "auth_server's outcome differs from its answer");
  if (outcome.accepted) check(outcome.info == info, "auth_server returned another info");
}

}  // namespace
}  // namespace bagua_hvd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return bagua_hvd::fuzz::two_modes(data, size, bagua_hvd::scripted, bagua_hvd::raw);
}
