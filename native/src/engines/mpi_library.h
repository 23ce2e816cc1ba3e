// The MPI library this process already runs (mpi4py's under mpirun), reached at run time: nothing
// MPI is needed to build the core, and one build serves Open MPI and the MPICH family (MPICH,
// Intel MPI, MVAPICH, Cray MPICH), whose ABIs differ: Open MPI's handles are pointers to the
// library's predefined objects, MPICH's are fixed integers. Used by the MPI data engine
// (engines/mpi_engine.cc) only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/common.h"

namespace bagua_hvd {

// An MPI handle (communicator, group, datatype, op, error handler) of either ABI family.
using MpiHandle = intptr_t;

class MpiLibrary {
 public:
  // The MPI library mapped into this process and initialised, or null with *why saying what is
  // missing (no MPI loaded, not initialised or already finalised, an unknown ABI).
  static std::unique_ptr<MpiLibrary> attach(std::string* why);
  virtual ~MpiLibrary() = default;

  virtual const char* abi() const = 0;  // "openmpi" or "mpich"
  std::string version();                // MPI_Get_library_version's first line
  std::string error_string(int code);

  // Predefined handles; dtype() and op() return 0 where MPI has no match (float16, bfloat16,
  // bool; Adasum), which the engine leaves to its own collectives.
  virtual MpiHandle world() const = 0;
  virtual MpiHandle byte() const = 0;
  virtual MpiHandle dtype(DataType t) const = 0;
  virtual MpiHandle op(ReduceOp o) const = 0;
  virtual void* in_place() const = 0;

  // The MPI functions the engine calls, with MPI's error codes.
  virtual int finalized(int* flag) = 0;
  virtual int query_thread(int* provided) = 0;
  virtual int comm_rank(MpiHandle comm, int* rank) = 0;
  virtual int comm_size(MpiHandle comm, int* size) = 0;
  // A communicator of world's members `ranks` (collective over those members only), errors
  // returned rather than fatal.
  virtual int comm_create(const int* ranks, int n, MpiHandle* out) = 0;
  virtual int comm_free(MpiHandle* comm) = 0;
  virtual int allreduce(const void* in, void* out, int count, MpiHandle dtype, MpiHandle op,
                        MpiHandle comm) = 0;
  virtual int bcast(void* buf, int count, MpiHandle dtype, int root, MpiHandle comm) = 0;
  virtual int allgatherv(const void* in, int count, void* out, const int* counts, const int* displs,
                         MpiHandle dtype, MpiHandle comm) = 0;
  virtual int alltoallv(const void* in, const int* send_counts, const int* send_displs, void* out,
                        const int* recv_counts, const int* recv_displs, MpiHandle dtype,
                        MpiHandle comm) = 0;
  virtual int reduce_scatter(const void* in, void* out, const int* counts, MpiHandle dtype,
                             MpiHandle op, MpiHandle comm) = 0;

  static constexpr int kThreadSerialized = 2;  // MPI_THREAD_SERIALIZED, the same in both ABIs
  static constexpr int kThreadMultiple = 3;    // MPI_THREAD_MULTIPLE

 protected:
  virtual int get_library_version(char* out, int* len) = 0;
  virtual int get_error_string(int code, char* out, int* len) = 0;
};

}  // namespace bagua_hvd
