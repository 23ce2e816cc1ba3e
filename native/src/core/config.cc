// Every environment variable hvd.init() reads, in one place (core/config.h), through the readers
// of base/env.h.
#include "core/config.h"

#include <strings.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/env.h"

namespace bagua_hvd {

namespace {

// A rank variable set by the launcher (exact name, no alias); atoi as Horovod does.
int env_rank_var(const char* name, int fallback) {
  const char* v = env_raw(name);
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

int64_t elastic_generation() {
  const char* v = env_raw("BAGUA_HVD_ELASTIC_GENERATION");
  const std::string space = " \t\n\r\f\v";
  std::string text = v ? v : "";
  const auto first = text.find_first_not_of(space);
  if (first == std::string::npos) return 0;
  text = text.substr(first, text.find_last_not_of(space) - first + 1);
  if (text.find_first_not_of("0123456789") != std::string::npos) return 0;
  return std::strtoll(text.c_str(), nullptr, 10);
}

Status load_config(int epoch, Config* out) {
  Config c;
  BootstrapConfig& b = c.bootstrap;
  // An elastic job's workers meet under the driver's generation, however many jobs each process
  // formed before (bagua_hvd/common/elastic.py).
  if (env_raw("BAGUA_HVD_ELASTIC_GENERATION")) epoch = static_cast<int>(elastic_generation());
  b.epoch = epoch;
  b.timeout_s = env_double("GLOO_TIMEOUT_SECONDS", 30);
  if (const char* t = env_raw("BAGUA_HVD_TIMEOUT_SECONDS")) b.timeout_s = std::atof(t);
  const char* addr = env_raw("HOROVOD_GLOO_RENDEZVOUS_ADDR");
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
  cp.hierarchical_allreduce = c.hierarchical_allreduce;
  c.timeline = env_str("TIMELINE", "");
  c.timeline_mark_cycles = env_bool("TIMELINE_MARK_CYCLES", false);
  if (const char* dir = env_raw("BAGUA_HVD_RESPONSE_LOG")) c.response_log = dir;
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
  const char* secret = env_raw("BAGUA_HVD_SECRET");
  if (!secret)
    return Status::InvalidArgument(
        "Horovod initialization failed: BAGUA_HVD_SECRET is not set; start the job with "
        "bagua-run, which creates the per-job secret");
  b.secret = hex_decode(secret);
  if (b.secret.empty())
    return Status::InvalidArgument(
        "Horovod initialization failed: BAGUA_HVD_SECRET must be a non-empty hex string");
  const char* job = env_raw("BAGUA_HVD_JOB_ID");
  b.job_id = job ? job : ("job" + std::to_string(b.store_port));
  const char* tr = env_raw("BAGUA_HVD_TRANSPORT");
  b.force_tcp = tr && std::string(tr) == "tcp";
  b.iface = env_str("GLOO_IFACE", "");
  b.shm_ring_bytes = env_int("SHM_RING_BYTES", 0);
  *out = std::move(c);
  return Status::OK();
}

}  // namespace bagua_hvd
