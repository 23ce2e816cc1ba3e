// Fuzz target: the negotiation message decoder (requests/message.cc), fed arbitrary bytes as a
// request list and as a response list. Each must decode or throw TransportError. What decodes must
// encode back to the same bytes, except that a bool byte reads as true for any non-zero value and
// is written as 1; and decoding that encoding must give it back unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "requests/message.h"

namespace bagua_hvd {
namespace {

template <typename List>
void check_round_trip(const std::string& bytes, List (*decode)(const std::string&)) {
  List decoded;
  try {
    decoded = decode(bytes);
  } catch (const TransportError&) {
    return;  // rejected: the expected outcome for most inputs
  }
  const std::string once = encode(decoded);
  fuzz::check(once.size() == bytes.size(), "re-encoding changed the message's length");
  for (size_t i = 0; i < once.size(); ++i) {
    // Only a non-zero bool byte may change, and only to 1.
    fuzz::check(once[i] == bytes[i] || (once[i] == 1 && bytes[i] != 0),
                "re-encoding changed a byte that is not a bool");
  }
  fuzz::check(encode(decode(once)) == once, "decoding an encoding did not give it back");
}

}  // namespace
}  // namespace bagua_hvd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bagua_hvd;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  check_round_trip<RequestList>(bytes, decode_request_list);
  check_round_trip<ResponseList>(bytes, decode_response_list);
  return 0;
}
