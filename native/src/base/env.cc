// The environment's readers (base/env.h) and the log settings (base/common.h). The core's one
// getenv.
#include "base/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "base/common.h"

namespace bagua_hvd {

const char* env_raw(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Horovod's name first, then the BAGUA_HVD_ alias.
const char* env_lookup(const char* suffix) {
  if (const char* v = env_raw((std::string("HOROVOD_") + suffix).c_str())) return v;
  return env_raw((std::string("BAGUA_HVD_") + suffix).c_str());
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
  const char* rank = env_raw("HOROVOD_RANK");
  return rank ? rank : "0";
}

}  // namespace bagua_hvd
