// The data engine: how an op executor moves and reduces the bytes of one device kind over a
// Comm. The seam for a second device and a second data engine (CUDA tensors with NCCL): the op
// executors call only this, so adding one is a new implementation, not branches in every op.
// For host memory: the CPU engine (engines/cpu_engine.cc), over the collectives of collectives/,
// and the MPI engine (engines/mpi_engine.cc) for HOROVOD_CPU_OPERATIONS=mpi; for CUDA memory: the
// device engines (engines/device_engine.h). In engines/ too: the libraries they load at run time
// (engines/mpi_library.h, engines/nccl_library.h) and the fusion buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "collectives/collectives.h"
#include "collectives/comm.h"
#include "requests/handle.h"

namespace bagua_hvd {

class DataEngine {
 public:
  virtual ~DataEngine() = default;
  virtual const char* name() const = 0;

  // Memory for a core-allocated output of `bytes`, where this engine's collectives write.
  virtual Output allocate_output(size_t bytes);

  // Local memory operations on buffers of this engine's device.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void scale(void* buf, size_t count, DataType dtype, double factor) = 0;
  // Horovod's pre/postscale of an allreduce or reducescatter (Average's 1/size included): scale()
  // here; a device engine applies its device's rule where Horovod's differs from the CPU's.
  virtual void scale_horovod(void* buf, size_t count, DataType dtype, double factor) {
    scale(buf, count, dtype, factor);
  }

  // Collectives (semantics: collectives/collectives.h).
  virtual void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) = 0;
  virtual void allgatherv(Comm& comm, const void* in, void* out,
                          const std::vector<size_t>& bytes_per_rank) = 0;
  virtual void broadcast(Comm& comm, void* buf, size_t bytes, int root) = 0;
  virtual void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes,
                         void* out, const std::vector<size_t>& recv_bytes) = 0;
  virtual void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                              DataType dtype, ReduceOp op) = 0;
  // Horovod's Adasum of the tensors packed in buf (collectives.h, dots_also included): host
  // memory here; a device engine overrides it.
  virtual void allreduce_adasum(Comm& comm, void* buf, const std::vector<size_t>& counts,
                                DataType dtype, Comm* dots_also = nullptr) {
    bagua_hvd::allreduce_adasum(comm, buf, counts, dtype, dots_also);
  }
  // Allreduce over hosts with the same number of comm's ranks each (collectives/hierarchy.h):
  // host is this rank's host's members, cross the members with its index on every host. Here
  // Horovod's NCCL hierarchical allreduce over the collectives above (engines/data_engine.cc);
  // the CPU engine pipelines the two levels instead.
  virtual void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                                      DataType dtype, ReduceOp op);

  // BAGUA's primitives (docs/algorithms.md).
  virtual void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype,
                                      bool average, void* ef_worker, void* ef_server) = 0;
  virtual void decentralized_average(Comm& comm, const void* in, void* out, size_t count,
                                     DataType dtype, PeerMode mode, int64_t step) = 0;
  virtual void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right,
                                size_t count, DataType dtype) = 0;
  virtual void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                                     size_t count, DataType dtype) = 0;
  virtual void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                         size_t count, DataType dtype) = 0;
};

// The engine for host memory (device < 0). Process-wide, stateless.
DataEngine& cpu_engine();

// What the MPI engine found out about the process's MPI.
struct MpiFacts {
  bool threads_multiple = false;  // MPI_THREAD_MULTIPLE provided
  std::string version;            // the library's name and version
};

// The MPI engine for host memory (HOROVOD_CPU_OPERATIONS=mpi): Horovod's collectives through the
// MPI library the process runs, BAGUA's primitives and what MPI cannot reduce through the CPU
// engine. MPI_COMM_WORLD must be the job (world rank r is the job's rank r). Null with *error
// saying why MPI cannot serve. Its collectives run on the background thread only.
std::unique_ptr<DataEngine> make_mpi_engine(int rank, int size, MpiFacts* facts,
                                            std::string* error);
// MPI calls the MPI engines of this process have made (a diagnostics counter).
int64_t mpi_engine_calls();

}  // namespace bagua_hvd
