// Loading NCCL at run time (engines/nccl_library.h).
#include "engines/nccl_library.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <vector>

namespace bagua_hvd {

namespace nccl {

bool data_type(bagua_hvd::DataType t, DataType* out) {
  switch (t) {
    case bagua_hvd::DataType::UINT8:
      *out = kUint8;
      return true;
    case bagua_hvd::DataType::INT8:
      *out = kInt8;
      return true;
    case bagua_hvd::DataType::INT32:
      *out = kInt32;
      return true;
    case bagua_hvd::DataType::INT64:
      *out = kInt64;
      return true;
    case bagua_hvd::DataType::FLOAT16:
      *out = kFloat16;
      return true;
    case bagua_hvd::DataType::FLOAT32:
      *out = kFloat32;
      return true;
    case bagua_hvd::DataType::FLOAT64:
      *out = kFloat64;
      return true;
    case bagua_hvd::DataType::BFLOAT16:
      *out = kBfloat16;
      return true;
    default:
      return false;
  }
}

bool red_op(ReduceOp op, RedOp* out) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVERAGE:
      *out = kSum;
      return true;
    case ReduceOp::MIN:
      *out = kMin;
      return true;
    case ReduceOp::MAX:
      *out = kMax;
      return true;
    case ReduceOp::PRODUCT:
      *out = kProd;
      return true;
    default:
      return false;
  }
}

}  // namespace nccl

std::string nccl_version_text(int code) {
  // NCCL_VERSION_CODE is major*10000+minor*100+patch since 2.9,
  // major*1000+minor*100+patch before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

std::string NcclLibrary::error(nccl::Result r, nccl::Comm comm) const {
  std::string text = "NCCL error " + std::to_string(r);
  if (get_error_string) text += std::string(" (") + get_error_string(r) + ")";
  if (get_last_error) {
    const char* last = get_last_error(comm);
    if (last && *last) text += std::string(": ") + last;
  }
  return text;
}

namespace {

template <typename F>
bool bind(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

// Opens `path` and binds every function; null with *why naming what failed. The
// handle stays open for the life of the process (communicators may outlive an
// hvd.shutdown()).
std::unique_ptr<NcclLibrary> open_nccl(const std::string& path, std::string* why) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = "cannot load " + path + ": " + (e ? e : "unknown dlopen error");
    return nullptr;
  }
  auto lib = std::make_unique<NcclLibrary>();
  lib->path = path;
  const char* missing = nullptr;
  auto need = [&](const char* name, auto* fn) {
    if (!bind(h, name, fn) && !missing) missing = name;
  };
  need("ncclGetVersion", &lib->get_version);
  need("ncclGetUniqueId", &lib->get_unique_id);
  need("ncclCommInitRank", &lib->comm_init_rank);
  need("ncclCommDestroy", &lib->comm_destroy);
  need("ncclCommAbort", &lib->comm_abort);
  need("ncclCommGetAsyncError", &lib->comm_get_async_error);
  need("ncclGetErrorString", &lib->get_error_string);
  need("ncclAllReduce", &lib->all_reduce);
  need("ncclBroadcast", &lib->broadcast);
  need("ncclAllGather", &lib->all_gather);
  need("ncclReduceScatter", &lib->reduce_scatter);
  need("ncclSend", &lib->send);
  need("ncclRecv", &lib->recv);
  need("ncclGroupStart", &lib->group_start);
  need("ncclGroupEnd", &lib->group_end);
  bind(h, "ncclGetLastError", &lib->get_last_error);  // NCCL >= 2.13; optional
  if (missing) {
    *why = path + " is not a usable NCCL: it has no " + missing;
    return nullptr;
  }
  if (lib->get_version(&lib->version) != nccl::kSuccess || lib->version <= 0) {
    *why = path + ": ncclGetVersion failed";
    return nullptr;
  }
  // ncclSend/ncclRecv (2.7), ncclCommGetAsyncError with ncclCommAbort from
  // another thread (2.4).
  if (lib->version < 2700) {
    *why = path + " is NCCL " + nccl_version_text(lib->version) +
           "; bagua_hvd needs NCCL 2.7 or newer";
    return nullptr;
  }
  return lib;
}

std::mutex g_mu;
bool g_tried = false;
std::unique_ptr<NcclLibrary> g_lib;
std::string g_why;

}  // namespace

const NcclLibrary* load_nccl(const std::string& library, const std::string& fallback,
                             std::string* why) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_tried) {
    g_tried = true;
    std::vector<std::string> tried;
    std::vector<std::string> candidates;
    if (!library.empty()) {
      candidates = {library};  // the user's choice, and only it
    } else {
      // A libnccl mapped into the process already (torch loads the wheel's with RTLD_GLOBAL;
      // a framework may load its own RTLD_LOCAL): one NCCL per process.
      for (const auto& mapped : mapped_libraries("libnccl.so")) candidates.push_back(mapped);
      if (!fallback.empty()) candidates.push_back(fallback);
      candidates.push_back("libnccl.so.2");
    }
    for (const auto& path : candidates) {
      std::string reason;
      g_lib = open_nccl(path, &reason);
      if (g_lib) break;
      tried.push_back(reason);
    }
    if (!g_lib) {
      g_why = "NCCL not found";
      for (size_t i = 0; i < tried.size(); ++i) g_why += (i ? "; " : " (") + tried[i];
      g_why += tried.empty() ? "" : ")";
    }
  }
  if (!g_lib && why) *why = g_why;
  return g_lib.get();
}

const NcclLibrary* loaded_nccl() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_lib.get();
}

}  // namespace bagua_hvd
