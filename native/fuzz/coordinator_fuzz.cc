// Fuzz target: what rank 0 does with the negotiation messages of its peers (core/negotiation.cc):
// decode each RequestList, add() it to the coordinator (core/coordinator.cc), build() the
// responses. Input: a byte giving the world size (2 + byte % 7), then records of
//   u8 from-rank (mod the size) | u8 clock advance (1/4 s) | u16 length | RequestList bytes.
// As in the runtime, the first TransportError (a malformed list, an unknown cache id) ends the
// run: the job is shut down then. Process-set changes are applied as rank 0 applies them. Anything
// else that goes wrong is a finding, and so is a ResponseList that does not survive its own
// encoding (the workers decode it).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "core/coordinator.h"
#include "fuzz_util.h"
#include "requests/message.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("HOROVOD_LOG_LEVEL", "fatal", 0);  // stall reports would flood the fuzzer's output
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bagua_hvd;
  if (size < 1 || size > fuzz::kMaxInput) return 0;
  const int world = 2 + data[0] % 7;
  // The global set and a static one of ranks {0, 1}, as Runtime::init builds them.
  std::map<int32_t, std::vector<int32_t>> sets{{0, {}}, {1, {0, 1}}};
  for (int r = 0; r < world; ++r) sets[0].push_back(r);
  CoordinatorParams params;
  params.stall_shutdown_s = 120;  // reachable through the clock advances
  Coordinator coordinator(world, sets, params);

  auto now = Clock::now();
  size_t pos = 1;
  while (size - pos >= 4) {
    const int from = data[pos] % world;
    now += std::chrono::milliseconds(250 * data[pos + 1]);
    const size_t len = std::min<size_t>(get_u16(data + pos + 2), size - pos - 4);
    const std::string bytes(reinterpret_cast<const char*>(data) + pos + 4, len);
    pos += 4 + len;
    Clock::time_point wake_at;
    ResponseList out;
    try {
      coordinator.add(decode_request_list(bytes), from);
      out = coordinator.build(now, &wake_at);
    } catch (const TransportError&) {
      return 0;
    }
    // Rank 0 applies the process-set changes to the table the coordinator reads (dispatch.cc).
    for (const auto& r : out.responses) {
      if (r.kind != Response::OP) continue;
      if (r.type == kOpAddProcessSet) {
        auto ranks = r.set_ranks;
        std::sort(ranks.begin(), ranks.end());
        sets[r.new_set_id] = ranks;
        coordinator.set_next_set_id(std::max(coordinator.next_set_id(), r.new_set_id + 1));
      } else if (r.type == kOpRemoveProcessSet) {
        sets.erase(r.new_set_id);
      }
    }
    const std::string wire = encode(out);
    try {
      fuzz::check(encode(decode_response_list(wire)) == wire,
                  "a ResponseList changed through its encoding");
    } catch (const TransportError& e) {
      std::fprintf(stderr, "%s\n", e.what());
      fuzz::fail("the coordinator built a ResponseList the workers cannot decode");
    }
  }
  return 0;
}
