// The MPI data engine (HOROVOD_CPU_OPERATIONS=mpi): Horovod's collectives on host memory through
// the MPI library the process runs (engines/mpi_library.h), as Horovod's MPI build does, so that
// interconnects only MPI reaches (InfiniBand, Slingshot) carry them. One MPI communicator per
// member set, created from MPI_COMM_WORLD on first use (every member runs the same responses in
// the same order, so the creations are collective by construction). BAGUA's primitives, and
// the reductions MPI does not do as torch does (reduces() below), go through the CPU engine over
// the core's own transports; every such choice depends only on what all members know, so they
// all make it.
#include <algorithm>
#include <atomic>
#include <climits>
#include <map>
#include <stdexcept>

#include "engines/data_engine.h"
#include "engines/mpi_library.h"

namespace bagua_hvd {

namespace {

std::atomic<int64_t> g_calls{0};

class MpiEngine final : public DataEngine {
 public:
  explicit MpiEngine(std::unique_ptr<MpiLibrary> mpi) : mpi_(std::move(mpi)) {}
  ~MpiEngine() override {
    int finalized = 1;
    if (mpi_->finalized(&finalized) != 0 || finalized) return;
    for (auto& kv : comms_) mpi_->comm_free(&kv.second);
  }
  MpiEngine(const MpiEngine&) = delete;
  MpiEngine& operator=(const MpiEngine&) = delete;

  const char* name() const override { return "mpi"; }
  void copy(void* dst, const void* src, size_t bytes) override { cpu().copy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { cpu().zero(dst, bytes); }
  void scale(void* buf, size_t count, DataType dtype, double factor) override {
    cpu().scale(buf, count, dtype, factor);
  }

  void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) override {
    const MpiHandle t = mpi_->dtype(dtype), o = mpi_->op(op);
    if (!reduces(dtype, op)) return cpu().allreduce(comm, buf, count, dtype, op);
    const MpiHandle c = mpi_comm(comm);
    auto* p = static_cast<unsigned char*>(buf);
    const size_t esize = dtype_size(dtype);
    // Elementwise: pieces of at most INT_MAX elements give the same result.
    for (size_t done = 0; done < count;) {
      const size_t n = std::min<size_t>(count - done, INT_MAX);
      check(mpi_->allreduce(mpi_->in_place(), p + done * esize, static_cast<int>(n), t, o, c),
            "MPI_Allreduce");
      done += n;
    }
  }

  void allgatherv(Comm& comm, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    std::vector<int> counts, displs;
    if (!int_layout(bytes_per_rank, &counts, &displs))
      return cpu().allgatherv(comm, in, out, bytes_per_rank);
    const MpiHandle c = mpi_comm(comm);
    const int me = comm.rank();
    auto* o = static_cast<unsigned char*>(out);
    // MPI forbids a send buffer that overlaps the receive buffer; in place is what that means.
    const void* send = in == o + displs[me] ? mpi_->in_place() : in;
    check(mpi_->allgatherv(send, counts[me], out, counts.data(), displs.data(), mpi_->byte(), c),
          "MPI_Allgatherv");
  }

  void broadcast(Comm& comm, void* buf, size_t bytes, int root) override {
    const MpiHandle c = mpi_comm(comm);
    auto* p = static_cast<unsigned char*>(buf);
    for (size_t done = 0; done < bytes;) {
      const size_t n = std::min<size_t>(bytes - done, INT_MAX);
      check(mpi_->bcast(p + done, static_cast<int>(n), mpi_->byte(), root, c), "MPI_Bcast");
      done += n;
    }
  }

  void alltoallv(Comm& comm, const void* in, const std::vector<size_t>& send_bytes, void* out,
                 const std::vector<size_t>& recv_bytes) override {
    std::vector<int> sc, sd, rc, rd;
    const bool fits = int_layout(send_bytes, &sc, &sd) && int_layout(recv_bytes, &rc, &rd);
    // Each rank knows only its own row and column of the matrix: agree first on whether every
    // rank's fits MPI's int counts.
    const MpiHandle c = mpi_comm(comm);
    int all_fit = fits ? 1 : 0;
    check(mpi_->allreduce(mpi_->in_place(), &all_fit, 1, mpi_->dtype(DataType::INT32),
                          mpi_->op(ReduceOp::MIN), c),
          "MPI_Allreduce");
    if (!all_fit) return cpu().alltoallv(comm, in, send_bytes, out, recv_bytes);
    check(mpi_->alltoallv(in, sc.data(), sd.data(), out, rc.data(), rd.data(), mpi_->byte(), c),
          "MPI_Alltoallv");
  }

  void reducescatterv(Comm& comm, void* buf, void* out, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op) override {
    const MpiHandle t = mpi_->dtype(dtype), o = mpi_->op(op);
    std::vector<int> n, displs;
    if (!reduces(dtype, op) || !int_layout(counts, &n, &displs))
      return cpu().reducescatterv(comm, buf, out, counts, dtype, op);
    const MpiHandle c = mpi_comm(comm);
    // out may lie inside buf (the hierarchical allreduce reduces a shard in place), which MPI
    // forbids: receive into scratch.
    scratch_.resize(counts[comm.rank()] * dtype_size(dtype));
    check(mpi_->reduce_scatter(buf, scratch_.data(), n.data(), t, o, c), "MPI_Reduce_scatter");
    if (!scratch_.empty()) cpu().copy(out, scratch_.data(), scratch_.size());
  }

  // MPI's own collectives one after the other: reduce-scatter within the host, each rank's shard
  // allreduced with the same shard of the other hosts, allgather within the host.
  void allreduce_hierarchical(Comm& comm, Comm& host, Comm& cross, void* buf, size_t count,
                              DataType dtype, ReduceOp op) override {
    (void)comm;
    const int n = host.size(), k = host.rank();
    const size_t esize = dtype_size(dtype);
    std::vector<size_t> shard(n), bytes(n);
    size_t off = 0;
    for (int i = 0; i < n; ++i) {
      shard[i] = count / n + (static_cast<size_t>(i) < count % n ? 1 : 0);
      bytes[i] = shard[i] * esize;
      if (i < k) off += bytes[i];
    }
    auto* p = static_cast<unsigned char*>(buf);
    reducescatterv(host, p, p + off, shard, dtype, op);
    allreduce(cross, p + off, shard[k], dtype, op);
    allgatherv(host, p + off, p, bytes);
  }

  // BAGUA's primitives run over the core's transports (docs/algorithms.md).
  void allreduce_minmax_uint8(Comm& comm, void* buf, size_t count, DataType dtype, bool average,
                              void* ef_worker, void* ef_server) override {
    cpu().allreduce_minmax_uint8(comm, buf, count, dtype, average, ef_worker, ef_server);
  }
  void decentralized_average(Comm& comm, const void* in, void* out, size_t count, DataType dtype,
                             PeerMode mode, int64_t step) override {
    cpu().decentralized_average(comm, in, out, count, dtype, mode, step);
  }
  void lp_decentralized(Comm& comm, void* x, void* self, void* left, void* right, size_t count,
                        DataType dtype) override {
    cpu().lp_decentralized(comm, x, self, left, right, count, dtype);
  }
  void lp_decentralized_init(Comm& comm, const void* x, void* self, void* left, void* right,
                             size_t count, DataType dtype) override {
    cpu().lp_decentralized_init(comm, x, self, left, right, count, dtype);
  }
  void lp_decentralized_exchange(Comm& comm, const uint8_t* c, void* left, void* right,
                                 size_t count, DataType dtype) override {
    cpu().lp_decentralized_exchange(comm, c, left, right, count, dtype);
  }

 private:
  static DataEngine& cpu() { return cpu_engine(); }

  // Whether MPI reduces dtype with op as torch and the CPU engine do. Not float16, bfloat16 or
  // bool (no predefined MPI type), nor sums of 8- and 16-bit integers: Open MPI's AVX reduction
  // saturates them (127 + 1 = 127) where two's complement wraps (127 + 1 = -128).
  bool reduces(DataType dtype, ReduceOp op) const {
    if (!mpi_->dtype(dtype) || !mpi_->op(op)) return false;
    const bool narrow_int = dtype == DataType::INT8 || dtype == DataType::UINT8 ||
                            dtype == DataType::INT16 || dtype == DataType::UINT16;
    return !(narrow_int && (op == ReduceOp::SUM || op == ReduceOp::AVERAGE));
  }

  // Counts and displacements in MPI's int, false if one does not fit.
  static bool int_layout(const std::vector<size_t>& sizes, std::vector<int>* counts,
                         std::vector<int>* displs) {
    size_t off = 0;
    for (size_t s : sizes) {
      if (s > INT_MAX || off > INT_MAX) return false;
      counts->push_back(static_cast<int>(s));
      displs->push_back(static_cast<int>(off));
      off += s;
    }
    return true;
  }

  MpiHandle mpi_comm(Comm& comm) {
    auto it = comms_.find(comm.global_ranks());
    if (it != comms_.end()) return it->second;
    MpiHandle c = 0;
    check(mpi_->comm_create(comm.global_ranks().data(), comm.size(), &c), "MPI_Comm_create_group");
    comms_.emplace(comm.global_ranks(), c);
    return c;
  }

  void check(int err, const char* what) {
    if (err != 0) throw std::runtime_error(std::string(what) + ": " + mpi_->error_string(err));
    g_calls.fetch_add(1, std::memory_order_relaxed);
  }

  std::unique_ptr<MpiLibrary> mpi_;
  std::map<std::vector<int>, MpiHandle> comms_;  // by member set (global = MPI world ranks)
  std::vector<unsigned char> scratch_;
};

}  // namespace

std::unique_ptr<DataEngine> make_mpi_engine(int rank, int size, MpiFacts* facts,
                                            std::string* error) {
  std::string why;
  auto mpi = MpiLibrary::attach(&why);
  if (!mpi) {
    *error = why;
    return nullptr;
  }
  int world_rank = -1, world_size = -1, provided = 0;
  mpi->comm_rank(mpi->world(), &world_rank);
  mpi->comm_size(mpi->world(), &world_size);
  if (world_rank != rank || world_size != size) {
    *error = "MPI_COMM_WORLD (" + mpi->version() + ") has rank " + std::to_string(world_rank) +
             " of " + std::to_string(world_size) + ", the job rank " + std::to_string(rank) +
             " of " + std::to_string(size) + ": MPI did not start this job";
    return nullptr;
  }
  mpi->query_thread(&provided);
  if (provided < MpiLibrary::kThreadSerialized) {
    *error = "MPI was initialised with thread level " + std::to_string(provided) +
             "; the core's background thread needs at least MPI_THREAD_SERIALIZED (mpi4py "
             "asks for MPI_THREAD_MULTIPLE unless mpi4py.rc.thread_level says otherwise)";
    return nullptr;
  }
  facts->threads_multiple = provided >= MpiLibrary::kThreadMultiple;
  facts->version = mpi->version();
  return std::make_unique<MpiEngine>(std::move(mpi));
}

int64_t mpi_engine_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace bagua_hvd
