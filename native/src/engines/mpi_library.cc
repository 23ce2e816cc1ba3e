// Attaching to the process's MPI library (engines/mpi_library.h). The library is found among the
// objects already mapped into the process (mpi4py dlopens it RTLD_LOCAL, so its symbols are not
// global: they are looked up in its own handle), and its ABI family is told by Open MPI's
// predefined objects. The MPICH-family constants are those of its mpi.h (the MPICH ABI
// Compatibility Initiative keeps them fixed across MPICH, Intel MPI, MVAPICH and Cray MPICH).
#include "engines/mpi_library.h"

#include <dlfcn.h>

#include <cstring>
#include <sstream>
#include <vector>

namespace bagua_hvd {

namespace {

// dlopen handles of the libraries found, kept open (RTLD_NOLOAD adds a reference) for the life
// of the process: the engine may be created again after hvd.shutdown().
struct Found {
  void* handle = nullptr;
  std::string path;
};

// The first mapped object named libmpi*/libmpich* that exports MPI_Allreduce.
Found find_loaded_mpi() {
  for (const auto& path : mapped_libraries("libmpi")) {
    void* h = dlopen(path.c_str(), RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
    if (!h) continue;
    if (dlsym(h, "MPI_Allreduce")) return {h, path};
    dlclose(h);
  }
  return {};
}

template <typename F>
bool bind(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

// The functions and constants of one ABI family; H is the C type of its handles (a pointer for
// Open MPI, int for MPICH).
template <typename H>
class Abi final : public MpiLibrary {
 public:
  struct Constants {
    const char* name;
    H world, byte, u8, i8, u16, i16, i32, i64, f32, f64;
    H sum, min, max, prod, errors_return, group_null;
    void* in_place;
  };

  Abi(void* lib, const Constants& c) : lib_(lib), c_(c) {}

  // Binds every function; false (with *why) when one is missing.
  bool bind_all(std::string* why) {
    const char* missing = nullptr;
    auto need = [&](const char* name, auto* fn) {
      if (!bind(lib_, name, fn) && !missing) missing = name;
    };
    need("MPI_Initialized", &initialized_);
    need("MPI_Finalized", &finalized_);
    need("MPI_Query_thread", &query_thread_);
    need("MPI_Comm_rank", &comm_rank_);
    need("MPI_Comm_size", &comm_size_);
    need("MPI_Comm_group", &comm_group_);
    need("MPI_Group_incl", &group_incl_);
    need("MPI_Group_free", &group_free_);
    need("MPI_Comm_create_group", &comm_create_group_);
    need("MPI_Comm_set_errhandler", &comm_set_errhandler_);
    need("MPI_Comm_free", &comm_free_);
    need("MPI_Allreduce", &allreduce_);
    need("MPI_Bcast", &bcast_);
    need("MPI_Allgatherv", &allgatherv_);
    need("MPI_Alltoallv", &alltoallv_);
    need("MPI_Reduce_scatter", &reduce_scatter_);
    need("MPI_Get_library_version", &get_library_version_);
    need("MPI_Error_string", &error_string_);
    if (missing) *why = std::string("the MPI library has no ") + missing;
    return !missing;
  }

  bool is_initialized() {
    int flag = 0;
    return initialized_(&flag) == 0 && flag;
  }

  const char* abi() const override { return c_.name; }
  MpiHandle world() const override { return to_handle(c_.world); }
  MpiHandle byte() const override { return to_handle(c_.byte); }
  MpiHandle dtype(DataType t) const override {
    switch (t) {
      case DataType::UINT8:
        return to_handle(c_.u8);
      case DataType::INT8:
        return to_handle(c_.i8);
      case DataType::UINT16:
        return to_handle(c_.u16);
      case DataType::INT16:
        return to_handle(c_.i16);
      case DataType::INT32:
        return to_handle(c_.i32);
      case DataType::INT64:
        return to_handle(c_.i64);
      case DataType::FLOAT32:
        return to_handle(c_.f32);
      case DataType::FLOAT64:
        return to_handle(c_.f64);
      default:
        return 0;  // float16, bfloat16, bool: no predefined MPI type reduces them
    }
  }
  MpiHandle op(ReduceOp o) const override {
    switch (o) {
      case ReduceOp::SUM:
      case ReduceOp::AVERAGE:
        return to_handle(c_.sum);  // the executor divides afterwards
      case ReduceOp::MIN:
        return to_handle(c_.min);
      case ReduceOp::MAX:
        return to_handle(c_.max);
      case ReduceOp::PRODUCT:
        return to_handle(c_.prod);
      default:
        return 0;
    }
  }
  void* in_place() const override { return c_.in_place; }

  int finalized(int* flag) override { return finalized_(flag); }
  int query_thread(int* provided) override { return query_thread_(provided); }
  int comm_rank(MpiHandle comm, int* rank) override { return comm_rank_(h(comm), rank); }
  int comm_size(MpiHandle comm, int* size) override { return comm_size_(h(comm), size); }
  int comm_create(const int* ranks, int n, MpiHandle* out) override {
    H world_group = c_.group_null, group = c_.group_null, comm{};
    int err = comm_group_(c_.world, &world_group);
    if (!err) err = group_incl_(world_group, n, ranks, &group);
    // The tag only has to agree among the members; creations are ordered the same on all.
    if (!err) err = comm_create_group_(c_.world, group, kCreateTag, &comm);
    if (!err) err = comm_set_errhandler_(comm, c_.errors_return);
    if (group != c_.group_null) group_free_(&group);
    if (world_group != c_.group_null) group_free_(&world_group);
    if (!err) *out = to_handle(comm);
    return err;
  }
  int comm_free(MpiHandle* comm) override {
    H c = h(*comm);
    int err = comm_free_(&c);
    *comm = 0;
    return err;
  }
  int allreduce(const void* in, void* out, int count, MpiHandle dtype, MpiHandle op,
                MpiHandle comm) override {
    return allreduce_(in, out, count, h(dtype), h(op), h(comm));
  }
  int bcast(void* buf, int count, MpiHandle dtype, int root, MpiHandle comm) override {
    return bcast_(buf, count, h(dtype), root, h(comm));
  }
  int allgatherv(const void* in, int count, void* out, const int* counts, const int* displs,
                 MpiHandle dtype, MpiHandle comm) override {
    return allgatherv_(in, count, h(dtype), out, counts, displs, h(dtype), h(comm));
  }
  int alltoallv(const void* in, const int* send_counts, const int* send_displs, void* out,
                const int* recv_counts, const int* recv_displs, MpiHandle dtype,
                MpiHandle comm) override {
    return alltoallv_(in, send_counts, send_displs, h(dtype), out, recv_counts, recv_displs,
                      h(dtype), h(comm));
  }
  int reduce_scatter(const void* in, void* out, const int* counts, MpiHandle dtype, MpiHandle op,
                     MpiHandle comm) override {
    return reduce_scatter_(in, out, counts, h(dtype), h(op), h(comm));
  }

 protected:
  int get_library_version(char* out, int* len) override { return get_library_version_(out, len); }
  int get_error_string(int code, char* out, int* len) override {
    return error_string_(code, out, len);
  }

 private:
  static constexpr int kCreateTag = 0x6268;
  static MpiHandle to_handle(H v) { return (MpiHandle)(v); }
  static H h(MpiHandle v) { return (H)(v); }

  void* lib_;
  Constants c_;
  int (*initialized_)(int*) = nullptr;
  int (*finalized_)(int*) = nullptr;
  int (*query_thread_)(int*) = nullptr;
  int (*comm_rank_)(H, int*) = nullptr;
  int (*comm_size_)(H, int*) = nullptr;
  int (*comm_group_)(H, H*) = nullptr;
  int (*group_incl_)(H, int, const int*, H*) = nullptr;
  int (*group_free_)(H*) = nullptr;
  int (*comm_create_group_)(H, H, int, H*) = nullptr;
  int (*comm_set_errhandler_)(H, H) = nullptr;
  int (*comm_free_)(H*) = nullptr;
  int (*allreduce_)(const void*, void*, int, H, H, H) = nullptr;
  int (*bcast_)(void*, int, H, int, H) = nullptr;
  int (*allgatherv_)(const void*, int, H, void*, const int*, const int*, H, H) = nullptr;
  int (*alltoallv_)(const void*, const int*, const int*, H, void*, const int*, const int*, H,
                    H) = nullptr;
  int (*reduce_scatter_)(const void*, void*, const int*, H, H, H) = nullptr;
  int (*get_library_version_)(char*, int*) = nullptr;
  int (*error_string_)(int, char*, int*) = nullptr;
};

// abi once its functions are bound and MPI is initialised, else null with *why.
template <typename H>
std::unique_ptr<MpiLibrary> ready(std::unique_ptr<Abi<H>> abi, std::string* why) {
  if (!abi->bind_all(why)) return nullptr;
  if (!abi->is_initialized()) {
    *why = "MPI is loaded but not initialised";
    return nullptr;
  }
  return abi;
}

// Open MPI: a handle is the address of the library's predefined object of that name.
std::unique_ptr<MpiLibrary> open_mpi(void* lib, std::string* why) {
  using H = void*;
  const char* missing = nullptr;
  auto sym = [&](const char* name) -> H {
    void* p = dlsym(lib, name);
    if (!p && !missing) missing = name;
    return p;
  };
  Abi<H>::Constants c{"openmpi",
                      sym("ompi_mpi_comm_world"),
                      sym("ompi_mpi_byte"),
                      sym("ompi_mpi_uint8_t"),
                      sym("ompi_mpi_int8_t"),
                      sym("ompi_mpi_uint16_t"),
                      sym("ompi_mpi_int16_t"),
                      sym("ompi_mpi_int32_t"),
                      sym("ompi_mpi_int64_t"),
                      sym("ompi_mpi_float"),
                      sym("ompi_mpi_double"),
                      sym("ompi_mpi_op_sum"),
                      sym("ompi_mpi_op_min"),
                      sym("ompi_mpi_op_max"),
                      sym("ompi_mpi_op_prod"),
                      sym("ompi_mpi_errors_return"),
                      sym("ompi_mpi_group_null"),
                      reinterpret_cast<void*>(1)};  // MPI_IN_PLACE
  if (missing) {
    *why = std::string("Open MPI's library has no ") + missing;
    return nullptr;
  }
  return ready(std::make_unique<Abi<H>>(lib, c), why);
}

// The MPICH family: fixed integer handles (MPICH's mpi.h).
std::unique_ptr<MpiLibrary> mpich(void* lib, std::string* why) {
  using H = int;
  Abi<H>::Constants c{"mpich",
                      0x44000000,                              // MPI_COMM_WORLD
                      0x4c00010d,                              // MPI_BYTE
                      0x4c00013b,                              // MPI_UINT8_T
                      0x4c000137,                              // MPI_INT8_T
                      0x4c00023c,                              // MPI_UINT16_T
                      0x4c000238,                              // MPI_INT16_T
                      0x4c000439,                              // MPI_INT32_T
                      0x4c00083a,                              // MPI_INT64_T
                      0x4c00040a,                              // MPI_FLOAT
                      0x4c00080b,                              // MPI_DOUBLE
                      0x58000003,                              // MPI_SUM
                      0x58000002,                              // MPI_MIN
                      0x58000001,                              // MPI_MAX
                      0x58000004,                              // MPI_PROD
                      0x54000001,                              // MPI_ERRORS_RETURN
                      0x08000000,                              // MPI_GROUP_NULL
                      reinterpret_cast<void*>(intptr_t{-1})};  // MPI_IN_PLACE
  return ready(std::make_unique<Abi<H>>(lib, c), why);
}

}  // namespace

std::unique_ptr<MpiLibrary> MpiLibrary::attach(std::string* why) {
  Found found = find_loaded_mpi();
  if (!found.handle) {
    *why = "no MPI library is loaded in this process";
    return nullptr;
  }
  std::unique_ptr<MpiLibrary> lib;
  std::string reason;
  int (*abi_version)(int*, int*) = nullptr;
  int major = 0, minor = 0;
  if (bind(found.handle, "MPI_Abi_get_version", &abi_version) && abi_version(&major, &minor) == 0 &&
      major > 0) {
    reason = "it uses the MPI standard ABI (" + std::to_string(major) + "." +
             std::to_string(minor) + "), which bagua_hvd does not support yet";
  } else if (dlsym(found.handle, "ompi_mpi_comm_self")) {
    lib = open_mpi(found.handle, &reason);
  } else {
    lib = mpich(found.handle, &reason);
  }
  if (!lib) *why = found.path + ": " + reason;
  return lib;
}

std::string MpiLibrary::version() {
  std::vector<char> buf(8192);  // MPI_MAX_LIBRARY_VERSION_STRING is 256 (Open MPI) to 8192
  int len = 0;
  if (get_library_version(buf.data(), &len) != 0) return abi();
  std::string s(buf.data(), std::min<size_t>(static_cast<size_t>(std::max(len, 0)), buf.size()));
  auto end = s.find_first_of(",\n");
  return end == std::string::npos ? s : s.substr(0, end);
}

std::string MpiLibrary::error_string(int code) {
  std::vector<char> buf(1024);  // MPI_MAX_ERROR_STRING is 256 (Open MPI) or 512 (MPICH)
  int len = 0;
  if (get_error_string(code, buf.data(), &len) != 0) return "MPI error " + std::to_string(code);
  return std::string(buf.data(),
                     std::min<size_t>(static_cast<size_t>(std::max(len, 0)), buf.size()));
}

}  // namespace bagua_hvd
