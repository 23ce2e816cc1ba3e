#include "base/common.h"

#include <unistd.h>
#if defined(__linux__)
#include <pthread.h>
#endif

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <mutex>

namespace bagua_hvd {

size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::UINT8:
    case DataType::INT8:
    case DataType::BOOL:
      return 1;
    case DataType::UINT16:
    case DataType::INT16:
    case DataType::FLOAT16:
    case DataType::BFLOAT16:
      return 2;
    case DataType::INT32:
    case DataType::FLOAT32:
      return 4;
    case DataType::INT64:
    case DataType::FLOAT64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::UINT8: return "uint8";
    case DataType::INT8: return "int8";
    case DataType::UINT16: return "uint16";
    case DataType::INT16: return "int16";
    case DataType::INT32: return "int32";
    case DataType::INT64: return "int64";
    case DataType::FLOAT16: return "float16";
    case DataType::FLOAT32: return "float32";
    case DataType::FLOAT64: return "float64";
    case DataType::BOOL: return "bool";
    case DataType::BFLOAT16: return "bfloat16";
  }
  return "unknown";
}

bool dtype_valid(int32_t t) { return t >= BHVD_UINT8 && t <= BHVD_BFLOAT16; }

const char* op_type_name(OpType t) {
  switch (t) {
    case OpType::ALLREDUCE: return "ALLREDUCE";
    case OpType::ALLGATHER: return "ALLGATHER";
    case OpType::BROADCAST: return "BROADCAST";
    case OpType::JOIN: return "JOIN";
    case OpType::ADASUM: return "ADASUM";
    case OpType::ALLTOALL: return "ALLTOALL";
    case OpType::BARRIER: return "BARRIER";
    case OpType::REDUCESCATTER: return "REDUCESCATTER";
    case OpType::HIERARCHICAL_ALLREDUCE: return "HIERARCHICAL_ALLREDUCE";
    case OpType::COMPRESSED_ALLREDUCE: return "COMPRESSED_ALLREDUCE";
    case OpType::PEER_AVERAGE: return "PEER_AVERAGE";
    case OpType::LP_DECENTRALIZED_INIT: return "LP_DECENTRALIZED_INIT";
    case OpType::LP_DECENTRALIZED_STEP: return "LP_DECENTRALIZED_STEP";
    case OpType::LP_DECENTRALIZED_EXCHANGE: return "LP_DECENTRALIZED_EXCHANGE";
  }
  return "UNKNOWN";
}

// ---- logging ------------------------------------------------------------------------------
void log_message(LogLevel level, const std::string& msg) {
  if (level < log_level()) return;  // HOROVOD_LOG_LEVEL holds for every caller, BHVD_LOG or not
  static const char* names[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"};
  static std::mutex mu;
  static const bool hide_time = log_hide_time();
  const std::string rank = log_rank();
  std::lock_guard<std::mutex> lock(mu);
  if (hide_time) {
    std::fprintf(stderr, "[bagua_hvd %s rank %s] %s\n", names[static_cast<int>(level)],
                 rank.c_str(), msg.c_str());
  } else {
    std::time_t now = std::time(nullptr);
    char ts[32];
    std::strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
    std::fprintf(stderr, "[%s bagua_hvd %s rank %s] %s\n", ts, names[static_cast<int>(level)],
                 rank.c_str(), msg.c_str());
  }
  std::fflush(stderr);
}

}  // namespace bagua_hvd

namespace bagua_hvd {

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s > 0 ? s : 0.0);
  return buf;
}

void name_thread(std::thread& t, const char* name) {
#if defined(__linux__)
  pthread_setname_np(t.native_handle(), name);
#else
  (void)t;
  (void)name;
#endif
}

std::vector<std::string> mapped_libraries(const std::string& prefix) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::vector<std::string> found;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    const std::string base = path.substr(path.rfind('/') + 1);
    if (base.rfind(prefix, 0) != 0 || base.find(".so") == std::string::npos) continue;
    if (std::find(found.begin(), found.end(), path) == found.end()) found.push_back(path);
  }
  return found;
}

}  // namespace bagua_hvd
