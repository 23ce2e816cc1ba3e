// Every environment variable the core reads, in one place (config.h). Nothing else in native/
// calls getenv.
#include "core/config.h"

#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace bagua_hvd {

namespace {

const char* raw(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Horovod's name first, then the BAGUA_HVD_ alias.
const char* env_lookup(const char* suffix) {
  if (const char* v = raw((std::string("HOROVOD_") + suffix).c_str())) return v;
  return raw((std::string("BAGUA_HVD_") + suffix).c_str());
}

std::string env_str(const char* suffix, const std::string& fallback) {
  const char* v = env_lookup(suffix);
  return v ? std::string(v) : fallback;
}

int64_t env_int(const char* suffix, int64_t fallback) {
  const char* v = env_lookup(suffix);
  if (!v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (end == v) {
    BHVD_LOG(WARNING, std::string("ignoring non-integer value '") + v + "' of " + suffix);
    return fallback;
  }
  return x;
}

double env_double(const char* suffix, double fallback) {
  const char* v = env_lookup(suffix);
  if (!v) return fallback;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (end == v) {
    BHVD_LOG(WARNING, std::string("ignoring non-numeric value '") + v + "' of " + suffix);
    return fallback;
  }
  return x;
}

bool env_bool(const char* suffix, bool fallback) {
  const char* v = env_lookup(suffix);
  if (!v) return fallback;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  return fallback;
}

// A rank variable set by the launcher (exact name, no alias); atoi as Horovod does.
int env_rank_var(const char* name, int fallback) {
  const char* v = raw(name);
  return v ? std::atoi(v) : fallback;
}

std::string hex_decode(const std::string& hex) {
  std::string out;
  if (hex.size() % 2) return out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + i, "%2x", &v) != 1) return std::string();
    out.push_back(static_cast<char>(v));
  }
  return out;
}

}  // namespace

Status load_config(int epoch, Config* out) {
  Config c;
  BootstrapConfig& b = c.bootstrap;
  // An elastic job's workers meet under the driver's generation, however many jobs each process
  // formed before (bagua_hvd/common/elastic.py).
  if (const char* g = raw("BAGUA_HVD_ELASTIC_GENERATION")) epoch = std::atoi(g);
  b.epoch = epoch;
  b.timeout_s = env_double("GLOO_TIMEOUT_SECONDS", 30);
  if (const char* t = raw("BAGUA_HVD_TIMEOUT_SECONDS")) b.timeout_s = std::atof(t);
  const char* addr = raw("HOROVOD_GLOO_RENDEZVOUS_ADDR");
  c.fusion_threshold = env_int("FUSION_THRESHOLD", int64_t(128) << 20);
  c.cycle_time_s = env_double("CYCLE_TIME", 1.0) / 1000.0;
  CoordinatorParams& cp = c.coordinator;
  cp.fusion_threshold = c.fusion_threshold;
  cp.cycle_time_s = c.cycle_time_s;
  cp.cache_capacity = env_int("CACHE_CAPACITY", 1024);
  cp.no_fuse_bytes = env_int("NO_FUSE_BYTES", int64_t(1) << 20);
  cp.stall_warning_s =
      env_bool("STALL_CHECK_DISABLE", false) ? 0 : env_double("STALL_CHECK_TIME_SECONDS", 60);
  cp.stall_shutdown_s = env_double("STALL_SHUTDOWN_TIME_SECONDS", 0);
  c.spin_us = env_int("SPIN_US", 1000);
  c.hierarchical_allreduce = env_bool("HIERARCHICAL_ALLREDUCE", false);
  c.timeline = env_str("TIMELINE", "");
  c.timeline_mark_cycles = env_bool("TIMELINE_MARK_CYCLES", false);
  if (const char* ops = env_lookup("CPU_OPERATIONS")) {
    if (strcasecmp(ops, "mpi") == 0) {
      c.cpu_operations_mpi = true;
    } else if (strcasecmp(ops, "ccl") == 0) {
      return Status::InvalidArgument(
          "Horovod initialization failed: HOROVOD_CPU_OPERATIONS=ccl: bagua_hvd has no oneCCL; "
          "use gloo (its own transports, the default) or mpi");
    } else if (strcasecmp(ops, "gloo") != 0) {
      return Status::InvalidArgument(
          "Unsupported CPU operation type, only MPI, oneCCL, and Gloo are supported");
    }
  }

  c.distributed = addr != nullptr;
  if (!c.distributed) {
    // A job of size 1: the bootstrap defaults (the timeout included), whatever is set.
    b = BootstrapConfig{};
    b.epoch = epoch;
    *out = std::move(c);
    return Status::OK();
  }
  b.rank = env_rank_var("HOROVOD_RANK", 0);
  b.size = env_rank_var("HOROVOD_SIZE", 1);
  b.local_rank = env_rank_var("HOROVOD_LOCAL_RANK", b.rank);
  b.local_size = env_rank_var("HOROVOD_LOCAL_SIZE", b.size);
  b.cross_rank = env_rank_var("HOROVOD_CROSS_RANK", 0);
  b.cross_size = env_rank_var("HOROVOD_CROSS_SIZE", 1);
  if (b.size < 1 || b.rank < 0 || b.rank >= b.size)
    return Status::InvalidArgument(
        "Horovod initialization failed: HOROVOD_RANK=" + std::to_string(b.rank) +
        " is not in [0, HOROVOD_SIZE=" + std::to_string(b.size) + ")");
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  b.hostname = env_str("HOSTNAME", host);
  b.store_host = addr;
  b.store_port = env_rank_var("HOROVOD_GLOO_RENDEZVOUS_PORT", 0);
  const char* secret = raw("BAGUA_HVD_SECRET");
  if (!secret)
    return Status::InvalidArgument(
        "Horovod initialization failed: BAGUA_HVD_SECRET is not set; start the job with "
        "bagua-run, which creates the per-job secret");
  b.secret = hex_decode(secret);
  if (b.secret.empty())
    return Status::InvalidArgument(
        "Horovod initialization failed: BAGUA_HVD_SECRET must be a non-empty hex string");
  const char* job = raw("BAGUA_HVD_JOB_ID");
  b.job_id = job ? job : ("job" + std::to_string(b.store_port));
  const char* tr = raw("BAGUA_HVD_TRANSPORT");
  b.force_tcp = tr && std::string(tr) == "tcp";
  b.iface = env_str("GLOO_IFACE", "");
  b.shm_ring_bytes = env_int("SHM_RING_BYTES", 0);
  *out = std::move(c);
  return Status::OK();
}

LogLevel log_level() {
  static const LogLevel level = [] {
    std::string s = env_str("LOG_LEVEL", "warning");
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    if (s == "trace") return LogLevel::TRACE;
    if (s == "debug") return LogLevel::DEBUG;
    if (s == "info") return LogLevel::INFO;
    if (s == "error") return LogLevel::ERROR;
    if (s == "fatal") return LogLevel::FATAL;
    return LogLevel::WARNING;
  }();
  return level;
}

bool log_hide_time() {
  static const bool hide = env_bool("LOG_HIDE_TIME", false);
  return hide;
}

std::string log_rank() {
  const char* rank = std::getenv("HOROVOD_RANK");
  return rank ? rank : "0";
}

}  // namespace bagua_hvd
