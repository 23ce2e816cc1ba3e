// The exchanges of a StreamBackend over the real transports (Comm transfers, done at once), and
// with the CPU kernels (host_stream_kernels.h) a StreamBackend of host memory: what the phased
// primitives and the stream engines are checked with on a machine without a GPU.
#pragma once

#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/comm.h"
#include "collectives/stream_backend.h"
#include "host_stream_kernels.h"

namespace bagua_hvd {

class CommExchanges : public StreamBackend {
 public:
  explicit CommExchanges(Comm& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void alltoall(const void* in, void* out, size_t bytes) override {
    std::vector<Comm::Xfer> xs;
    auto* i = static_cast<unsigned char*>(const_cast<void*>(in));
    auto* o = static_cast<unsigned char*>(out);
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({Comm::Xfer::SEND, j, i + j * bytes, bytes});
      xs.push_back({Comm::Xfer::RECV, j, o + j * bytes, bytes});
    }
    comm_.run(xs, "test alltoall");
    std::memmove(o + rank() * bytes, i + rank() * bytes, bytes);
  }
  void allgather(const void* in, void* out, size_t bytes) override {
    auto* o = static_cast<unsigned char*>(out);
    std::memmove(o + rank() * bytes, in, bytes);
    std::vector<Comm::Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({Comm::Xfer::SEND, j, o + rank() * bytes, bytes});
      xs.push_back({Comm::Xfer::RECV, j, o + j * bytes, bytes});
    }
    comm_.run(xs, "test allgather");
  }
  void sendrecv(const std::vector<int>& to, const void* out, const std::vector<int>& from,
                const std::vector<void*>& in, size_t bytes) override {
    std::vector<Comm::Xfer> xs;
    for (int p : to) xs.push_back({Comm::Xfer::SEND, p, const_cast<void*>(out), bytes});
    for (size_t k = 0; k < from.size(); ++k)
      xs.push_back({Comm::Xfer::RECV, from[k], in[k], bytes});
    comm_.run(xs, "test sendrecv");
  }
  void allreduce_sum(void* buf, size_t n, DataType dtype) override {
    allreduce(comm_, buf, n, dtype, ReduceOp::SUM);
  }

 private:
  Comm& comm_;
};
// A StreamBackend of host memory: the CPU kernels and Comm transfers.
using HostBackend = HostKernels<CommExchanges>;

}  // namespace bagua_hvd
