// Reading the environment: the core's one getenv is in base/env.cc. What hvd.init() reads is
// core/config.cc (validated once into a Config); the log settings, which hold before hvd.init(),
// are read here on first use (log_level, log_hide_time, log_rank: base/common.h). Below every
// other folder, so logging needs nothing above base/.
#pragma once

#include <cstdint>
#include <string>

namespace bagua_hvd {

// The variable `name` exactly (no alias); null when unset or empty.
const char* env_raw(const char* name);
// Horovod's name first, then the BAGUA_HVD_ alias: env_lookup("FUSION_THRESHOLD") reads
// HOROVOD_FUSION_THRESHOLD, then BAGUA_HVD_FUSION_THRESHOLD.
const char* env_lookup(const char* suffix);
std::string env_str(const char* suffix, const std::string& fallback);
// A value that does not parse is ignored with a warning (fallback).
int64_t env_int(const char* suffix, int64_t fallback);
double env_double(const char* suffix, double fallback);
// 1/true/yes/on, 0/false/no/off (any case); anything else: fallback.
bool env_bool(const char* suffix, bool fallback);

}  // namespace bagua_hvd
