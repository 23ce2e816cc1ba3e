// Ending a job together (docs/protocol.md, "Ending a job"). A rank that applied the shutdown has
// executed every response, but its peers may still be inside the last one: a slower rank waiting
// on a third checks that every member of the collective is alive (Comm::run), and a connection
// closed by a rank that simply finished first would fail it. So before its connections close,
// a rank tells every peer it is done (a bye frame on the ctrl pair) and waits until each peer has
// said so too, has gone (its connection closed: it will not need ours either), or has been
// silent for HOROVOD_GLOO_TIMEOUT_SECONDS. Peers inside a long collective send keepalives
// (Transport::heartbeat), so only a stopped or hung one is given up on.
#include <string>
#include <vector>

#include "base/common.h"
#include "core/runtime.h"

namespace bagua_hvd {

void Runtime::farewell() {
  if (cfg_.size <= 1 || !ctrl_) return;
  const std::string& bye = ControlChannel::bye();
  std::vector<char> done(cfg_.size, 0);
  done[cfg_.rank] = 1;
  int waiting = cfg_.size - 1;
  for (int p = 0; p < cfg_.size; ++p) {
    if (done[p]) continue;
    try {
      ctrl_->send(p, bye);
    } catch (const std::exception&) {  // gone already: nothing to wait for
      done[p] = 1;
      --waiting;
    }
  }
  const auto window =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeout_s));
  std::vector<Clock::time_point> heard(cfg_.size, Clock::now());
  std::string msg;
  while (waiting > 0) {
    bool progress = false;
    const auto now = Clock::now();
    for (int p = 0; p < cfg_.size; ++p) {
      if (done[p]) continue;
      bool finished = false;
      try {
        while (!finished && ctrl_->poll(p, &msg)) {
          heard[p] = now;
          finished = ControlChannel::is_bye(msg);  // anything before it (keepalives, requests) is moot now
        }
        // Shared memory reports a dead peer only here.
        if (!finished) transport_->ctrl(p).check_alive();
      } catch (const std::exception&) {
        finished = true;  // closed after its last frame, or dead: it needs nothing from us
      }
      if (!finished && cfg_.timeout_s > 0 && now - heard[p] > window) {
        BHVD_LOG(WARNING, "rank " + std::to_string(p) + " sent nothing for " +
                              format_seconds(cfg_.timeout_s) +
                              " s while the job shut down; closing its connections anyway");
        finished = true;
      }
      if (finished) {
        done[p] = 1;
        --waiting;
        progress = true;
      }
    }
    if (waiting > 0 && !progress) transport_->wait(std::chrono::milliseconds(5));
  }
}

}  // namespace bagua_hvd
