// Fuzz target: the client side of the authentication handshake (auth_client, transport/auth.cc).
// Input: a flags byte, then
//   bit 0 clear ("raw"): the server's whole byte stream, frames and all, then EOF. No stream can
//     carry the server's proof (it covers the client's random nonce), so the client must throw:
//     this covers the parsing of CHALLENGE and RESULT, refusals included.
//   bit 0 set ("scripted"): the harness plays a server that knows the secret, with the first 32
//     bytes of the rest as its nonce. It checks the client's HELLO and proof against
//     docs/protocol.md and answers the right result (bit 1: one with the bit chosen by the next
//     byte flipped), which the client must accept (refuse).
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
const std::string kInfo = "pid=1 host=fuzz";

bool run_client(int fd) {
  try {
    auth_client(fd, fuzz::kSecret, store_purpose(), kInfo, deadline_after(kTimeoutS),
                "the fuzz server");
    return true;
  } catch (const TransportError&) {  // AuthError included
    return false;
  }
}

void raw(const std::string& stream) {
  auto sockets = fuzz::socket_pair();
  fuzz::feed_and_close(sockets.theirs.get(), stream);
  check(!run_client(sockets.ours.get()), "accepted a server that cannot know the client's nonce");
}

void scripted(const std::string& rest, uint8_t flags) {
  const bool wrong_result = flags & 2;
  std::string nonce = rest.substr(0, fuzz::kNonceLen);
  nonce.resize(fuzz::kNonceLen, '\0');
  const size_t flip = rest.size() > fuzz::kNonceLen ? static_cast<uint8_t>(rest[32]) : 0;

  auto sockets = fuzz::socket_pair();
  bool accepted = false;
  std::thread client([&] { accepted = run_client(sockets.ours.get()); });
  const int fd = sockets.theirs.get();
  const Deadline deadline = deadline_after(kTimeoutS + 1);
  const std::string what = "the client under test";
  try {
    const std::string hello = recv_frame(fd, 1 << 20, deadline, what);
    const std::string purpose = store_purpose();
    std::string expected_start = fuzz::handshake_header(fuzz::kHello);
    expected_start.push_back(static_cast<char>(purpose.size()));
    expected_start += purpose;
    put_u16(&expected_start, static_cast<uint16_t>(kInfo.size()));
    expected_start += kInfo;
    check(hello.size() == expected_start.size() + fuzz::kNonceLen &&
              hello.compare(0, expected_start.size(), expected_start) == 0,
          "the client's hello does not follow the protocol");
    std::string challenge = fuzz::handshake_header(fuzz::kChallenge);
    challenge.push_back(static_cast<char>(fuzz::kStatusOk));
    send_frame(fd, challenge + nonce, deadline, what);
    const std::string proof = recv_frame(fd, 1 << 20, deadline, what);
    check(
        proof == fuzz::handshake_header(fuzz::kProof) + fuzz::mac(fuzz::kClientLabel, hello, nonce),
        "the client's proof is not the protocol's");
    std::string result = fuzz::handshake_header(fuzz::kResult);
    result.push_back(static_cast<char>(fuzz::kStatusOk));
    result += fuzz::mac(fuzz::kServerLabel, hello, nonce);
    if (wrong_result) result[flip % result.size()] ^= static_cast<char>(1 << (flip % 8));
    send_frame(fd, result, deadline, what);
  } catch (const TransportError& e) {
    std::fprintf(stderr, "harness: %s\n", e.what());
    fuzz::fail("the client did not follow the protocol");
  }
  client.join();
  check(accepted == !wrong_result, "auth_client's outcome is wrong for the server's result");
}

}  // namespace
}  // namespace bagua_hvd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return bagua_hvd::fuzz::two_modes(data, size, bagua_hvd::scripted, bagua_hvd::raw);
}
