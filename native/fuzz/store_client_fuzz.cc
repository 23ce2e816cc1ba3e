// Fuzz target: the rendezvous store client (TcpStore, transport/store.cc) reading replies from a
// server that may send anything. Input: a byte whose low 3 bits give the number of requests
// (1..8), one byte per request, then the server's whole byte stream (then EOF). Request byte: bit 0
// GET (else SET), bits 1-3 the key length (0 and 7 stand for invalid keys: empty, and one byte over
// the limit), bits 4-7 the SET value's length / 5.
// Each call's outcome (value, or an exception) is checked against a model of docs/protocol.md, and
// the requests that reach the server against their wire format: a failed connection sends nothing
// more and every later call fails.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "transport/store.h"

namespace bagua_hvd {
namespace {

using fuzz::check;

struct Call {
  bool get = false;
  std::string key, value;
  bool valid_key() const { return !key.empty() && key.size() <= kMaxStoreKey; }
  std::string request() const {
    std::string r = get ? "G" : "S";
    if (get) put_u32(&r, 0);  // timeout_ms: the calls wait 0 s
    put_u32(&r, static_cast<uint32_t>(key.size()));
    return r + key + (get ? "" : value);
  }
};

struct Result {
  bool ok = false;
  std::string value;  // GET
  bool operator==(const Result& o) const { return ok == o.ok && value == o.value; }
};

// Reads the replies as docs/protocol.md says a client must; *sent: the requests sent.
std::vector<Result> model(const std::vector<Call>& calls, const std::string& stream,
                          std::vector<std::string>* sent) {
  std::vector<Result> results(calls.size());
  size_t pos = 0;
  bool broken = false;  // a failed connection: the stream position is unknown
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    if (!c.valid_key() || broken) continue;
    sent->push_back(c.request());
    const size_t left = stream.size() - pos;
    const uint32_t len = left >= 4 ? get_u32(stream.data() + pos) : 0;
    if (left < 4 || len > kMaxStoreFrame || left - 4 < len || len == 0 || stream[pos + 4] == 'E') {
      broken = true;  // EOF, an oversized, empty or error reply
      continue;
    }
    const std::string reply = stream.substr(pos + 4, len);
    pos += 4 + len;
    if (c.get && reply[0] == 'V') results[i] = {true, reply.substr(1)};
    if (!c.get && reply == "K") results[i] = {true, ""};
  }
  return results;
}

}  // namespace
}  // namespace bagua_hvd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bagua_hvd;
  if (size < 1 || size > fuzz::kMaxInput) return 0;
  const size_t n = (data[0] & 7) + 1;
  if (size < 1 + n) return 0;
  std::vector<Call> calls(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t d = data[1 + i];
    const size_t klen = (d >> 1) & 7;
    calls[i].get = d & 1;
    calls[i].key.assign(klen == 7 ? kMaxStoreKey + 1 : klen, static_cast<char>('a' + i));
    if (!calls[i].get) calls[i].value.assign(5 * (d >> 4), 'v');
  }
  const std::string stream(reinterpret_cast<const char*>(data) + 1 + n, size - 1 - n);

  auto sockets = fuzz::socket_pair();
  fuzz::feed_and_close(sockets.theirs.get(), stream);
  std::vector<Result> got(n);
  {
    TcpStore store(std::move(sockets.ours), "127.0.0.1", 1, 2.0);
    for (size_t i = 0; i < n; ++i) {
      try {
        if (calls[i].get) {
          got[i] = {true, store.get(calls[i].key, 0.0)};
        } else {
          store.set(calls[i].key, calls[i].value);
          got[i] = {true, ""};
        }
      } catch (const TransportError&) {
      }
    }
  }  // closes the client's end: the harness reads its requests up to EOF

  std::vector<std::string> expected_sent;
  fuzz::check(got == model(calls, stream, &expected_sent),
              "a call's outcome differs from the model");
  std::vector<std::string> sent;
  const Deadline deadline = deadline_after(5);
  try {
    while (true) sent.push_back(recv_frame(sockets.theirs.get(), 1 << 20, deadline, "the client"));
  } catch (const TransportError&) {  // EOF
  }
  fuzz::check(sent == expected_sent, "the requests sent differ from the protocol's");
  return 0;
}
