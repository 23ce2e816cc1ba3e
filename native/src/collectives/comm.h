// Comm: the ranks of one process set and a progress loop that drives several transfers at once
// over the transport's data pairs. Collective algorithms are written against this only.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/common.h"
#include "transport/transport.h"

namespace bagua_hvd {

class Comm {
 public:
  // global_ranks: the members, sorted; this process need not be one of them.
  Comm(Transport& transport, std::vector<int> global_ranks);

  int rank() const { return rank_; }  // rank within the set, -1 if not a member
  int size() const { return static_cast<int>(global_ranks_.size()); }
  int global_rank(int set_rank) const { return global_ranks_[set_rank]; }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  Transport& transport() { return transport_; }
  // Whether set rank `set_rank` is on another host than this rank (HOROVOD_HOSTNAME).
  bool remote(int set_rank) const { return remote_[set_rank] != 0; }

  struct Xfer {
    enum Kind { SEND, RECV, RECV_REDUCE } kind;
    int peer;          // set rank
    void* buf;         // SEND reads it; RECV writes it; RECV_REDUCE does buf = buf (op) incoming
    size_t len;        // bytes
    DataType dtype = DataType::UINT8;  // RECV_REDUCE only
    ReduceOp op = ReduceOp::SUM;       // RECV_REDUCE only; AVERAGE reduces as SUM
    size_t done = 0;   // progress, owned by run()
    // SEND only: bytes of buf that may be sent so far; a pipelined collective's work (below)
    // raises it as it produces the data. Default: all of it.
    size_t ready = SIZE_MAX;
  };

  // A pipelined collective's CPU work between passes over the transfers: each call does one
  // small piece (compress the next block and raise a send's `ready`, decode bytes received so
  // far: a receive's `done`) and returns whether it did any. The wire and the CPU then overlap.
  using Work = std::function<bool()>;

  // Drives all transfers concurrently until every one completes. Transfers to the same peer in
  // the same direction complete in vector order (they share one byte stream). Throws
  // TransportError when a peer fails, or when nothing moved for the transport's timeout; the
  // message names the peer (global rank) and `what` (e.g. "allreduce"). The payload of every
  // SEND to another rank is counted once, within-host or between-hosts, under the op type this
  // thread executes (base/wire_stats.h).
  void run(std::vector<Xfer>& xfers, const char* what);
  // The same, calling work() once per pass until every transfer completed and work() found
  // nothing left to do. work() must never need a byte that only a later call of it would let a
  // transfer move (a send it does not release, data it has not decoded yet stays pending).
  void run(std::vector<Xfer>& xfers, const char* what, const Work& work);

  void send(int peer, const void* buf, size_t len, const char* what);
  void recv(int peer, void* buf, size_t len, const char* what);

 private:
  Transport& transport_;
  std::vector<int> global_ranks_;
  int rank_ = -1;
  std::vector<unsigned char> partial_;  // staging for RECV_REDUCE element fragments
  std::vector<char> remote_;            // per set rank: on another host than this rank
};

}  // namespace bagua_hvd
