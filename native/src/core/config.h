// The one place hvd.init() reads its environment: every variable, parsed and validated once per
// hvd.init() into a Config that the runtime, the coordinator and the transport take (so it sits
// above them, in core/). Horovod's name comes first, then the BAGUA_HVD_ alias
// (HOROVOD_FUSION_THRESHOLD, then BAGUA_HVD_FUSION_THRESHOLD), through base/env.h, which also
// reads the log settings. The Python side has its own one place (bagua_hvd/common/config.py).
#pragma once

#include <cstdint>
#include <string>

#include "base/common.h"
#include "core/coordinator.h"
#include "transport/transport.h"

namespace bagua_hvd {

struct Config {
  // False without HOROVOD_GLOO_RENDEZVOUS_ADDR: a job of size 1, bootstrap holds its defaults.
  bool distributed = false;
  BootstrapConfig bootstrap;      // rank, size, hosts, rendezvous, secret, timeout, transport
  CoordinatorParams coordinator;  // fusion, cycle time, response cache, stall inspector
  int64_t fusion_threshold = int64_t(128) << 20;  // HOROVOD_FUSION_THRESHOLD (bytes)
  double cycle_time_s = 1e-3;                     // HOROVOD_CYCLE_TIME (ms in the environment)
  int64_t spin_us = 1000;  // BAGUA_HVD_SPIN_US: poll this long before sleeping
  // HOROVOD_HIERARCHICAL_ALLREDUCE: allreduce within each host, among one leader per host,
  // then within the host again (flat where the set has one host, or one rank per host)
  bool hierarchical_allreduce = false;
  // HOROVOD_CPU_OPERATIONS=mpi: Horovod's collectives through the process's MPI library
  // (engines/mpi_engine.cc); gloo (the default): the core's own transports.
  bool cpu_operations_mpi = false;
  // HOROVOD_TIMELINE: the file rank 0 writes its timeline to (requests/timeline.h), "DYNAMIC" to
  // start none until hvd.start_timeline(); empty: off, and start_timeline refused.
  std::string timeline;
  bool timeline_mark_cycles = false;  // HOROVOD_TIMELINE_MARK_CYCLES
  // BAGUA_HVD_RESPONSE_LOG: a directory where each rank writes the responses it executes, in
  // order (rank.<r>.log): what two ranks ran differently shows there. Empty: off.
  std::string response_log;
};

// Reads and validates the environment (the messages are those hvd.init() raises). epoch goes
// into bootstrap.epoch. On error *out is unspecified.
Status load_config(int epoch, Config* out);

// The elastic driver's generation of the job (BAGUA_HVD_ELASTIC_GENERATION, 0 outside elastic
// jobs), read at each call as Python's config.elastic_generation reads it: digits, else 0.
int64_t elastic_generation();

// The log settings, which hold before hvd.init(), are base/env.cc's: log_level() and
// log_hide_time() (read on first use), log_rank() (HOROVOD_RANK, read at each call: log lines
// name the rank even before hvd.init()).

}  // namespace bagua_hvd
