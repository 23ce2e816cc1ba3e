// Shared vocabulary of the core: data types, reduce ops, status, errors, logging.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bagua_hvd/c_api.h"

namespace bagua_hvd {

enum class DataType : int32_t {
  UINT8 = BHVD_UINT8,
  INT8 = BHVD_INT8,
  UINT16 = BHVD_UINT16,
  INT16 = BHVD_INT16,
  INT32 = BHVD_INT32,
  INT64 = BHVD_INT64,
  FLOAT16 = BHVD_FLOAT16,
  FLOAT32 = BHVD_FLOAT32,
  FLOAT64 = BHVD_FLOAT64,
  BOOL = BHVD_BOOL,
  BFLOAT16 = BHVD_BFLOAT16,
};

enum class ReduceOp : int32_t {
  AVERAGE = BHVD_AVERAGE,
  SUM = BHVD_SUM,
  ADASUM = BHVD_ADASUM,
  MIN = BHVD_MIN,
  MAX = BHVD_MAX,
  PRODUCT = BHVD_PRODUCT,
};

enum class OpType : int32_t {
  ALLREDUCE = BHVD_OP_ALLREDUCE,
  ALLGATHER = BHVD_OP_ALLGATHER,
  BROADCAST = BHVD_OP_BROADCAST,
  JOIN = BHVD_OP_JOIN,
  ADASUM = BHVD_OP_ADASUM,
  ALLTOALL = BHVD_OP_ALLTOALL,
  BARRIER = BHVD_OP_BARRIER,
  REDUCESCATTER = BHVD_OP_REDUCESCATTER,
  HIERARCHICAL_ALLREDUCE = BHVD_OP_HIERARCHICAL_ALLREDUCE,
  COMPRESSED_ALLREDUCE = BHVD_OP_COMPRESSED_ALLREDUCE,
  PEER_AVERAGE = BHVD_OP_PEER_AVERAGE,
  LP_DECENTRALIZED_INIT = BHVD_OP_LP_DECENTRALIZED_INIT,
  LP_DECENTRALIZED_STEP = BHVD_OP_LP_DECENTRALIZED_STEP,
  LP_DECENTRALIZED_EXCHANGE = BHVD_OP_LP_DECENTRALIZED_EXCHANGE,
};

// The allreduce op types (plain, hierarchical, compressed): the checks of Horovod's allreduce
// (reduce op, scale factors) apply to each.
// Horovod's request type of an op: an allreduce with reduce op Adasum is its own (ADASUM), which
// the timeline shows (NEGOTIATE_ADASUM, ADASUM).
inline int32_t horovod_request_type(int32_t type, int32_t reduce_op) {
  return type == BHVD_OP_ALLREDUCE && reduce_op == BHVD_ADASUM ? BHVD_OP_ADASUM : type;
}

inline bool is_allreduce(int32_t type) {
  return type == BHVD_OP_ALLREDUCE || type == BHVD_OP_HIERARCHICAL_ALLREDUCE ||
         type == BHVD_OP_COMPRESSED_ALLREDUCE;
}

// Size in bytes of one element; 0 for an unknown type.
size_t dtype_size(DataType t);
// Horovod's names: "uint8", ..., "float16", "float32", "float64", "bool", plus "bfloat16".
const char* dtype_name(DataType t);
bool dtype_valid(int32_t t);
// Horovod's request type names: "ALLREDUCE", "ALLGATHER", ...
const char* op_type_name(OpType t);

enum class StatusType : int32_t {
  OK = BHVD_OK,
  UNKNOWN_ERROR = BHVD_UNKNOWN_ERROR,
  PRECONDITION_ERROR = BHVD_PRECONDITION_ERROR,
  ABORTED = BHVD_ABORTED,
  INVALID_ARGUMENT = BHVD_INVALID_ARGUMENT,
  IN_PROGRESS = BHVD_IN_PROGRESS,
  TIMED_OUT = BHVD_TIMED_OUT,
  NOT_IMPLEMENTED = BHVD_NOT_IMPLEMENTED,
  NOT_INITIALIZED = BHVD_NOT_INITIALIZED,
};

struct Status {
  StatusType type = StatusType::OK;
  std::string reason;
  bool ok() const { return type == StatusType::OK; }
  static Status OK() { return {}; }
  static Status Error(StatusType t, std::string r) { return {t, std::move(r)}; }
  static Status Precondition(std::string r) {
    return {StatusType::PRECONDITION_ERROR, std::move(r)};
  }
  static Status InvalidArgument(std::string r) {
    return {StatusType::INVALID_ARGUMENT, std::move(r)};
  }
  static Status Aborted(std::string r) { return {StatusType::ABORTED, std::move(r)}; }
  static Status NotInitialized();  // kNotInitialized, below
};

// Raised by transports and collectives when a peer fails, times out or sends garbage. The
// background thread turns it into an ABORTED status on every pending handle. peer() is the global
// rank whose connection closed or that stayed silent (-1: none in particular): that peer may have
// stopped because of another rank's failure, and told us so first (Runtime::relayed_failure).
class TransportError : public std::runtime_error {
 public:
  explicit TransportError(const std::string& what, int peer = -1)
      : std::runtime_error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// ---- logging (HOROVOD_LOG_LEVEL / BAGUA_HVD_LOG_LEVEL; default warning) -------------------
enum class LogLevel : int { TRACE = 0, DEBUG = 1, INFO = 2, WARNING = 3, ERROR = 4, FATAL = 5 };
// The settings come from the environment, read by base/env.cc: HOROVOD_LOG_LEVEL,
// HOROVOD_LOG_HIDE_TIME, and HOROVOD_RANK for the rank a line names.
LogLevel log_level();
bool log_hide_time();
std::string log_rank();
void log_message(LogLevel level, const std::string& msg);
#define BHVD_LOG(level, msg)                                                   \
  do {                                                                         \
    if (::bagua_hvd::LogLevel::level >= ::bagua_hvd::log_level())              \
      ::bagua_hvd::log_message(::bagua_hvd::LogLevel::level, (msg));           \
  } while (0)

// The environment is read through base/env.h only; what hvd.init() reads: core/config.h.

// Horovod's text, the one "not initialized" message of the core, always with the status
// NOT_INITIALIZED (by which the frontends choose their error class).
inline constexpr const char* kNotInitialized = "Horovod has not been initialized; use hvd.init().";
inline Status Status::NotInitialized() { return {StatusType::NOT_INITIALIZED, kNotInitialized}; }

inline int64_t num_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

using Clock = std::chrono::steady_clock;
// Rows of dimension 0 that set rank k receives from a reducescatter of dim0 rows over n ranks
// (Horovod's split: the first dim0 % n ranks get one more).
inline int64_t reducescatter_rows(int64_t dim0, int n, int k) {
  return dim0 / n + (k < dim0 % n ? 1 : 0);
}

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Seconds in messages: one decimal ("2.5", "30.0"), never negative (a wait whose deadline had
// already passed waited 0 s, not -0.0 s).
std::string format_seconds(double s);

// The distinct files mapped into this process (/proc/self/maps) whose name starts with
// `prefix` and holds ".so", in mapping order: libraries another component already loaded
// (mpi4py's MPI, torch's NCCL), found without knowing where they were installed.
std::vector<std::string> mapped_libraries(const std::string& prefix);

// Names a thread (at most 15 characters; Linux only, a no-op elsewhere) so that top -H, gdb and
// py-spy tell the core's threads from the frameworks' (gloo and torch name theirs too). Called
// by the creator right after std::thread's constructor: the name holds once that returns, not
// only once the new thread has been scheduled.
void name_thread(std::thread& t, const char* name);

}  // namespace bagua_hvd
