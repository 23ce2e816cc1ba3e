// For C API functions outside c_api.cc: records a failed status as this thread's
// bhvd_last_error() and returns its code.
#pragma once

#include "common.h"

namespace bagua_hvd {
int c_api_report(const Status& s);
}  // namespace bagua_hvd
