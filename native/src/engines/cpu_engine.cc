// The CPU data engine: host memory, the collectives of collectives/ over the transport's pairs.
#include <cstring>

#include "collectives/building_blocks.h"
#include "engines/data_engine.h"

namespace bagua_hvd {

namespace {

class CpuEngine final : public DataEngine {
 public:
  const char* name() const override { return "cpu"; }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void scale(void* buf, size_t count, DataType dtype, double factor) override {
    scale_buffer(buf, count, dtype, factor);
  }
  void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) override {
    bagua_hvd::allreduce(comm, buf, count, dtype, op);
  }
  void allgatherv(Comm& comm, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    bagua_hvd::allgatherv(comm, in, out, bytes_per_rank);
  }
  void broadcast(Comm& comm, void* buf, size_t bytes, int root) override {
    bagua_hvd::broadcast(comm, buf, bytes, root);
  }
  void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
                 const std::vector<size_t>& recv_bytes) override {
    bagua_hvd::alltoallv(comm, in, send_bytes, out, recv_bytes);
  }
  void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op) override {
    bagua_hvd::reducescatterv(comm, buf, out, counts, dtype, op);
  }
  void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                              DataType dtype, ReduceOp op) override {
    bagua_hvd::allreduce_hierarchical(comm, host, cross, buf, count, dtype, op, kChunkBytes);
  }
  void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                              void* ef_worker, void* ef_server) override {
    bagua_hvd::allreduce_minmax_uint8(comm, buf, count, dtype, average, ef_worker, ef_server);
  }
  void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                             PeerMode mode, int64_t step) override {
    bagua_hvd::decentralized_average(comm, in, out, count, dtype, mode, step);
  }
  void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                        DataType dtype) override {
    bagua_hvd::lp_decentralized(comm, x, self, left, right, count, dtype);
  }
  void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype) override {
    bagua_hvd::lp_decentralized_init(comm, x, self, left, right, count, dtype);
  }
  void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                 size_t count, DataType dtype) override {
    bagua_hvd::lp_decentralized_exchange(comm, c, left, right, count, dtype);
  }
};

}  // namespace

DataEngine& cpu_engine() {
  static CpuEngine engine;
  return engine;
}

}  // namespace bagua_hvd
