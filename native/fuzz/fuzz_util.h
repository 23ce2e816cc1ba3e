// Shared by the fuzz targets and make_seeds: failing a check, socket pairs whose far end holds the
// fuzzer's bytes, and the wire format's pieces written from docs/protocol.md (not taken from
// transport/auth.cc, which they check).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "transport/hmac.h"
#include "transport/socket.h"

namespace bagua_hvd {
namespace fuzz {

// Longer inputs are skipped: each must fit in a socket buffer before the code under test reads it
// (run.sh passes a smaller -max_len; this bounds inputs replayed by hand).
constexpr size_t kMaxInput = 64 << 10;

// libFuzzer reports an abort as a crash and saves the input.
[[noreturn]] inline void fail(const char* why) {
  std::fprintf(stderr, "fuzz check failed: %s\n", why);
  std::abort();
}
inline void check(bool ok, const char* why) {
  if (!ok) fail(why);
}

// The handshake targets' two modes: the first byte's low bit picks `scripted` (the harness plays
// the other end, right or wrong by the first byte) or `raw` (the rest is the other end's whole
// byte stream).
template <typename Scripted, typename Raw>
int two_modes(const uint8_t* data, size_t size, Scripted scripted, Raw raw) {
  if (size < 1 || size > kMaxInput) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    scripted(rest, data[0]);
  } else {
    raw(rest);
  }
  return 0;
}

// A connected AF_UNIX stream pair: `ours` for the code under test (non-blocking, as its sockets
// are), `theirs` for the harness playing the other end.
struct SocketPair {
  Fd ours, theirs;
};
inline SocketPair socket_pair() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) fail("socketpair failed");
  set_nonblocking(fds[0]);
  return {Fd(fds[0]), Fd(fds[1])};
}

// The other end's whole byte stream and then its end of stream: the code under test reads these
// bytes and then EOF, so no run waits for a deadline.
inline void feed_and_close(int fd, const std::string& bytes) {
  send_all(fd, bytes.data(), bytes.size(), deadline_after(5), "the fuzz harness's socket");
  shutdown(fd, SHUT_WR);
}

// u32 little-endian length | payload.
inline std::string frame(const std::string& payload) {
  std::string f;
  put_u32(&f, static_cast<uint32_t>(payload.size()));
  return f + payload;
}

// ---- the authentication handshake ------------------------------------------------------------
constexpr uint8_t kHello = 1, kChallenge = 2, kProof = 3, kResult = 4;
constexpr uint8_t kStatusOk = 0, kStatusRefused = 1;
constexpr size_t kHeaderLen = 6, kNonceLen = 32, kMacLen = 32;
constexpr char kClientLabel[] = "bagua_hvd auth v2 client";
constexpr char kServerLabel[] = "bagua_hvd auth v2 server";
// The job secret of every target: fixed, so the harness can compute the proofs the fuzzer cannot.
inline const std::string kSecret(32, '\x5a');

inline std::string handshake_header(uint8_t type) {
  return std::string("BHVD\x02", 5) + static_cast<char>(type);
}

inline std::string hello_payload(const std::string& purpose, const std::string& info,
                                 const std::string& nonce) {
  std::string h = handshake_header(kHello);
  h.push_back(static_cast<char>(purpose.size()));
  h += purpose;
  put_u16(&h, static_cast<uint16_t>(info.size()));
  return h + info + nonce;
}

inline std::string mac(const char* label, const std::string& hello, const std::string& nonce) {
  const std::string msg = label + hello + nonce;
  auto m = hmac_sha256(kSecret.data(), kSecret.size(), msg.data(), msg.size());
  return std::string(reinterpret_cast<const char*>(m.data()), m.size());
}

}  // namespace fuzz
}  // namespace bagua_hvd
