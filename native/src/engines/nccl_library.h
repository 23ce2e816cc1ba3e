// NCCL, reached at run time: nothing NCCL is needed to build or import
// bagua_hvd. A CUDA build of torch brings libnccl.so.2 (the
// nvidia-nccl-cu12/-cu13 wheel) and has usually loaded it already; NVIDIA's
// system packages install it too. Only the part of nccl.h's ABI the core calls
// is declared here; those declarations have not changed since NCCL 2.12.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/common.h"

namespace bagua_hvd {
namespace nccl {

using Result = int;  // ncclResult_t
constexpr Result kSuccess = 0;
constexpr Result kInProgress = 7;
struct CommImpl;  // ncclComm
using Comm = CommImpl*;
struct UniqueId {
  char internal[128];
};
// ncclDataType_t and ncclRedOp_t.
enum DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
};
enum RedOp : int { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

// NCCL's type for a core dtype; false where NCCL has none (int16, uint16,
// bool).
bool data_type(bagua_hvd::DataType t, DataType* out);
// NCCL's element-wise op for a core op; false for Adasum. AVERAGE maps to SUM:
// the executors divide afterwards, as on the host (ops/allreduce.cc), so
// results match the host path.
bool red_op(ReduceOp op, RedOp* out);

}  // namespace nccl

// The functions of one loaded libnccl.
struct NcclLibrary {
  std::string path;  // the file it was loaded from
  int version = 0;   // NCCL_VERSION_CODE (22703 for 2.27.3)

  nccl::Result (*get_version)(int*) = nullptr;
  nccl::Result (*get_unique_id)(nccl::UniqueId*) = nullptr;
  nccl::Result (*comm_init_rank)(nccl::Comm*, int, nccl::UniqueId, int) = nullptr;
  nccl::Result (*comm_destroy)(nccl::Comm) = nullptr;
  nccl::Result (*comm_abort)(nccl::Comm) = nullptr;
  nccl::Result (*comm_get_async_error)(nccl::Comm, nccl::Result*) = nullptr;
  const char* (*get_error_string)(nccl::Result) = nullptr;
  const char* (*get_last_error)(nccl::Comm) = nullptr;
  nccl::Result (*all_reduce)(const void*, void*, size_t, int, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*broadcast)(const void*, void*, size_t, int, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*all_gather)(const void*, void*, size_t, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*reduce_scatter)(const void*, void*, size_t, int, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*send)(const void*, size_t, int, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*recv)(void*, size_t, int, int, nccl::Comm, void*) = nullptr;
  nccl::Result (*group_start)() = nullptr;
  nccl::Result (*group_end)() = nullptr;

  // "NCCL error <name of code>: <last error>" for a failed call.
  std::string error(nccl::Result r, nccl::Comm comm = nullptr) const;
};

// Loads NCCL once per process; later calls return the first outcome. Tried in
// this order: `library` when not empty (the user's BAGUA_HVD_NCCL_LIBRARY: only
// it), else a libnccl already mapped into the process (torch's), else
// `fallback` when not empty (the Python package's nvidia-nccl wheel), else
// "libnccl.so.2" on the loader's search path. Null with *why on failure.
const NcclLibrary* load_nccl(const std::string& library, const std::string& fallback,
                             std::string* why);
// The library load_nccl() loaded, or null (not tried yet, or failed).
const NcclLibrary* loaded_nccl();

// NCCL_VERSION_CODE as text: "2.27.3".
std::string nccl_version_text(int code);

}  // namespace bagua_hvd
