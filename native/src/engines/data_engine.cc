// What every data engine shares (engines/data_engine.h).
#include "engines/data_engine.h"

#include "collectives/building_blocks.h"

namespace bagua_hvd {

Output DataEngine::allocate_output(size_t bytes) {
  auto host = std::make_shared<std::vector<unsigned char>>(bytes);
  return Output{std::shared_ptr<void>(host, host->data()), bytes, -1};
}

// Horovod's NCCL hierarchical allreduce (NCCLHierarchicalAllreduce), over this engine's
// collectives: a reduce-scatter within the host, the allreduce of this rank's shard among the
// ranks with its index on every host (Horovod: MPI on a host copy), an allgather within the host.
// The shards are equal (what NCCL's reduce-scatter takes). The count % n elements left over are
// reduced over the whole set at once (Horovod: reduced to one rank per host, allreduced among
// those, broadcast back), so that every rank ends with the same bits.
void DataEngine::allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf,
                                        size_t count, DataType dtype, ReduceOp op) {
  check_reduction(dtype, op, "allreduce");
  const int n = host.size();
  const size_t es = dtype_size(dtype), shard = count / n, tail = count - shard * n;
  auto* data = static_cast<unsigned char*>(buf);
  if (shard) {
    unsigned char* mine = data + static_cast<size_t>(host.rank()) * shard * es;
    reducescatterv(host, data, mine, std::vector<size_t>(n, shard), dtype, op);
    allreduce(cross, mine, shard, dtype, op);
    allgatherv(host, mine, data, std::vector<size_t>(n, shard * es));
  }
  if (tail) allreduce(comm, data + shard * n * es, tail, dtype, op);
}

}  // namespace bagua_hvd
