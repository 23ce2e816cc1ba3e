// A data engine whose work is queued in order on a stream (the CUDA engine's,
// engines/device_engine.h): BAGUA's primitives run in phases (collectives/stream_backend.h) with
// the engine's own kernels, whatever moves the bytes (NCCL, or the host transports with only the
// exchanged bytes staged through host memory), so a bucket is compressed and decompressed where it
// lives. The host hierarchy around them is the op executors' (ops/), the same code as on the CPU
// engine. Another stream engine (another device, or another framework's streams) implements
// backend() and Horovod's collectives: new files, not branches.
#pragma once

#include <memory>

#include "collectives/stream_backend.h"
#include "engines/data_engine.h"

namespace bagua_hvd {

class StreamEngine : public DataEngine {
 public:
  // The kernels of this engine and the exchanges among comm's ranks, for one primitive's call.
  virtual std::unique_ptr<StreamBackend> backend(Comm& comm) = 0;

  void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                              void* ef_worker, void* ef_server) override;
  void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                             PeerMode mode, int64_t step) override;
  void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                        DataType dtype) override;
  void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype) override;
  void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                 size_t count, DataType dtype) override;
};

}  // namespace bagua_hvd
