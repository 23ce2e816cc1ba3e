// The guard of every extern "C" entry point (core/c_api.cc, core/c_api_compression.cc):
// no C++ exception may cross into C, where it would terminate the process. An entry point runs
// its body through guarded() (status results) or guarded_value() (other results); an exception
// becomes a status and this thread's bhvd_last_error(), as any failure does.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "base/common.h"

namespace bagua_hvd {

// Records a failed status as this thread's bhvd_last_error() and returns its code.
int c_api_report(const Status& s) noexcept;
// An exception that reached an entry point: UNKNOWN_ERROR, its message as the error text.
int c_api_report_exception(const char* what) noexcept;

template <typename F>
int guarded(F&& body) noexcept {
  try {
    return std::forward<F>(body)();
  } catch (const std::exception& e) {
    return c_api_report_exception(e.what());
  } catch (...) {
    return c_api_report_exception("unknown C++ exception");
  }
}

// For results that are not a status: on_error on an exception (its message is recorded).
template <typename T, typename F>
T guarded_value(T on_error, F&& body) noexcept {
  try {
    return std::forward<F>(body)();
  } catch (const std::exception& e) {
    c_api_report_exception(e.what());
  } catch (...) {
    c_api_report_exception("unknown C++ exception");
  }
  return on_error;
}

}  // namespace bagua_hvd
