// Writes the seed corpora of the fuzz targets: valid inputs built with the product's encoders and
// docs/protocol.md, so that the fuzzers start from messages that get past the first checks.
// Usage: make_seeds DIR  (writes DIR/<target>/<name>; run.sh copies DIR to a temporary corpus).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "requests/message.h"
#include "transport/control_channel.h"

namespace bagua_hvd {
namespace {

using fuzz::frame;
using fuzz::handshake_header;

RequestList sample_requests() {
  RequestList m;
  m.acked_seq = 7;
  Request r;
  r.rank = 1;
  r.type = BHVD_OP_ALLREDUCE;
  r.name = "grad/w";
  r.shape = {4, 3};
  r.params = params_for_type(r.type);
  m.requests.push_back(r);
  Request c = r;
  c.type = BHVD_OP_COMPRESSED_ALLREDUCE;
  c.params = CompressedAllreduceParams{};
  m.requests.push_back(c);
  Request p = r;
  p.type = BHVD_OP_PEER_AVERAGE;
  p.params = PeerAverageParams{BHVD_PEER_ALL, 3, true};
  m.requests.push_back(p);
  Request lp = r;
  lp.type = BHVD_OP_LP_DECENTRALIZED_STEP;
  lp.params = LpRingParams{true};
  lp.splits = {1, 2};
  m.requests.push_back(lp);
  m.cached = {3};
  m.cached_urgent = {1};
  m.urgent = {"grad/b"};
  return m;
}

ResponseList sample_responses() {
  ResponseList m;
  m.seq = 8;
  Response r;
  r.type = BHVD_OP_ALLGATHER;
  r.names = {"a", "b"};
  r.shapes = {{2}, {3, 1}};
  r.per_rank = {{1, 1}, {2, 1}};
  r.cache_ids = {0, -1};
  r.params = params_for_type(r.type);
  m.responses.push_back(r);
  Response e;
  e.kind = Response::ERROR;
  e.type = BHVD_OP_PEER_AVERAGE;
  e.params = PeerAverageParams{};
  e.error = "mismatched shapes";
  m.responses.push_back(e);
  Response s;
  s.type = kOpAddProcessSet;
  s.new_set_id = 1;
  s.set_ranks = {0, 1};
  m.responses.push_back(s);
  m.evicted = {2};
  return m;
}

std::map<std::string, std::vector<std::string>> seeds() {
  std::map<std::string, std::vector<std::string>> out;
  const std::string req = encode(sample_requests()), resp = encode(sample_responses());
  RequestList notice;  // a failing rank's failure notice (Runtime::send_failure_notices)
  notice.shutdown = true;
  notice.failure = "connection to rank 2 (10.0.0.2:4000) closed: the peer exited or failed";
  out["message"] = {encode(RequestList{}), encode(ResponseList{}), req, resp, encode(notice)};

  // World-size byte, then records: from-rank, clock advance, u16 length, a RequestList.
  auto record = [](int from, int advance, const RequestList& m) {
    std::string r(1, static_cast<char>(from));
    r.push_back(static_cast<char>(advance));
    const std::string bytes = encode(m);
    put_u16(&r, static_cast<uint16_t>(bytes.size()));
    return r + bytes;
  };
  auto one = [](int32_t type, std::vector<int64_t> shape, std::vector<int32_t> splits = {}) {
    RequestList m;
    Request r;
    r.type = type;
    r.name = "t" + std::to_string(type);
    r.shape = std::move(shape);
    r.splits = std::move(splits);
    r.params = params_for_type(type);
    m.requests.push_back(r);
    return m;
  };
  std::string rounds(1, '\x00');  // 2 ranks
  // Each op by both ranks; the set changes add {0} and remove the static set 1.
  const int32_t types[] = {BHVD_OP_ALLREDUCE, BHVD_OP_ALLGATHER,     BHVD_OP_BROADCAST,
                           BHVD_OP_ALLTOALL,  BHVD_OP_REDUCESCATTER, BHVD_OP_BARRIER,
                           BHVD_OP_JOIN,      kOpAddProcessSet,      kOpRemoveProcessSet};
  for (int32_t type : types) {
    std::vector<int32_t> splits = {1, 1};
    if (type == kOpAddProcessSet) splits = {0};
    if (type == kOpRemoveProcessSet) splits = {1};
    for (int rank = 0; rank < 2; ++rank) rounds += record(rank, 1, one(type, {2, 3}, splits));
  }
  RequestList cached;
  cached.cached = {0};
  out["coordinator"] = {
      rounds,
      std::string(1, '\x01') + record(0, 0, sample_requests()) + record(1, 0, sample_requests()) +
          record(2, 0, sample_requests()) + record(1, 4, cached),
      std::string(1, '\x00') + record(0, 0, one(BHVD_OP_ALLREDUCE, {4})) + record(0, 255, {}),
  };

  const std::string frames = ControlChannel::frame(req) + ControlChannel::frame(resp);
  out["control_channel"] = {std::string(1, '\x00') + frames, std::string(1, '\x07') + frames,
                            std::string(1, '\xff') + frames + ControlChannel::frame("")};

  const std::string nonce(fuzz::kNonceLen, 'n'), mac(fuzz::kMacLen, 'm');
  const std::string hello = fuzz::hello_payload("store", "pid=1 host=h", nonce);
  const std::string proof = handshake_header(fuzz::kProof) + mac;
  // flags byte first: bit 0 raw (0) or scripted (1); see the targets.
  out["auth_server"] = {
      std::string(1, '\x00') + frame(hello) + frame(proof),
      std::string(1, '\x00') + frame(handshake_header(fuzz::kHello)),
      std::string(1, '\x01') + hello,
      std::string(1, '\x03') + hello,
      std::string(1, '\x05') + hello,
      std::string(1, '\x01') + fuzz::hello_payload("peer/job/0", "from=1 to=0 ch=ctrl", nonce),
  };

  const std::string ok_challenge = handshake_header(fuzz::kChallenge) + '\x00' + nonce;
  const std::string refused = handshake_header(fuzz::kChallenge) + '\x01' + "malformed hello";
  const std::string ok_result = handshake_header(fuzz::kResult) + '\x00' + mac;
  const std::string refused_result = handshake_header(fuzz::kResult) + '\x01' + "wrong endpoint";
  out["auth_client"] = {
      std::string(1, '\x00') + frame(ok_challenge) + frame(ok_result),
      std::string(1, '\x00') + frame(ok_challenge) + frame(refused_result),
      std::string(1, '\x00') + frame(refused),
      std::string(1, '\x01') + nonce,
      std::string(1, '\x03') + nonce + '\x07',
  };

  // Request count - 1, one byte per request (bit 0 GET, bits 1-3 key length), then the replies.
  out["store_client"] = {
      std::string("\x01\x02\x03", 3) + frame("K") + frame("Vvalue"),
      std::string("\x02\x12\x03\x05", 4) + frame("K") + frame("T") + frame("Vx"),
      std::string("\x00\x03", 2) + frame("Ebad key length 0 in GET request"),
      std::string("\x01\x0e\x04", 3) + frame("K"),
  };
  return out;
}

}  // namespace
}  // namespace bagua_hvd

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  namespace fs = std::filesystem;
  for (const auto& [target, inputs] : bagua_hvd::seeds()) {
    const fs::path dir = fs::path(argv[1]) / target;
    fs::create_directories(dir);
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::ofstream f(dir / ("seed-" + std::to_string(i)), std::ios::binary);
      f << inputs[i];
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", (dir / ("seed-" + std::to_string(i))).c_str());
        return 1;
      }
    }
  }
  return 0;
}
