// allreduce(): picks the algorithm. Also the helpers shared by all collectives.
#include <string>

#include "collectives/building_blocks.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"

namespace bagua_hvd {

unsigned char* scratch(size_t bytes) {
  thread_local std::vector<unsigned char> mem;
  if (mem.size() < bytes) mem.resize(bytes);
  return mem.data();
}

unsigned char* scratch_slot(int slot, size_t bytes) {
  thread_local std::vector<unsigned char> mem[kScratchSlots];
  auto& m = mem[slot];
  if (m.size() < bytes) m.resize(bytes);
  return m.data();
}

void check_reduction(DataType dtype, ReduceOp op, const char* what) {
  if (dtype_size(dtype) == 0) {
    throw std::invalid_argument(std::string(what) + ": unsupported data type " +
                                std::to_string(static_cast<int>(dtype)));
  }
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVERAGE:
    case ReduceOp::MIN:
    case ReduceOp::MAX:
    case ReduceOp::PRODUCT:
      return;
    default:
      throw std::invalid_argument(std::string(what) + ": reduce op " +
                                  std::to_string(static_cast<int>(op)) +
                                  " is not an element-wise reduction");
  }
}

// AVERAGE is reduced as SUM: the caller applies postscale /= size, like Horovod.
void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  check_reduction(dtype, op, "allreduce");
  if (comm.size() <= 1 || count == 0) return;
  TraceSpan span(TraceOp::kAllreduce, static_cast<int64_t>(count));
  // Direct: one round, n-1 copies of the buffer per rank; ring: 2(n-1) rounds, 2(n-1)/n copies.
  const size_t bytes = count * dtype_size(dtype);
  if (bytes <= kAllreduceDirectMaxBytes &&
      bytes * static_cast<size_t>(comm.size() - 1) <= kAllreduceDirectMaxTotal) {
    allreduce_direct(comm, buf, count, dtype, op);
  } else {
    allreduce_ring(comm, buf, count, dtype, op, kChunkBytes);
  }
}

}  // namespace bagua_hvd
