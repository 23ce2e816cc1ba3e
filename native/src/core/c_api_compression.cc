// C API of the MinMaxUInt8 CPU kernels (bhvd_minmax_uint8_*, c_api.h).
#pragma GCC visibility push(default)
#include "bagua_hvd/c_api.h"
#pragma GCC visibility pop

#include <exception>
#include <stdexcept>
#include <string>

#include "base/common.h"
#include "compression/minmax_uint8.h"
#include "core/c_api_guard.h"

namespace {

using bagua_hvd::DataType;
using bagua_hvd::Status;
using bagua_hvd::c_api_report;

// Validates the C arguments (negative values included) and converts them.
Status check(int32_t dtype, int64_t n, int32_t n_chunks) {
  if (n < 0) return Status::InvalidArgument("MinMaxUInt8 compression: negative n " +
                                            std::to_string(n));
  if (n_chunks < 1) {
    return Status::InvalidArgument("MinMaxUInt8 compression needs n_chunks >= 1, got " +
                                   std::to_string(n_chunks));
  }
  try {
    bagua_hvd::minmax_uint8_check_args(static_cast<DataType>(dtype), static_cast<size_t>(n),
                                       static_cast<size_t>(n_chunks));
  } catch (const std::invalid_argument& e) {
    return Status::InvalidArgument(e.what());
  }
  return Status::OK();
}

// Runs f after checking the arguments; exceptions become statuses (c_api_guard.h).
template <typename F>
int checked(int32_t dtype, int64_t n, int32_t n_chunks, bool null_pointer, F&& f) noexcept {
  return bagua_hvd::guarded([&]() -> int {
    Status s = check(dtype, n, n_chunks);
    if (s.ok() && null_pointer) s = Status::InvalidArgument("MinMaxUInt8 compression: NULL buffer");
    if (!s.ok()) return c_api_report(s);
    f(static_cast<DataType>(dtype), static_cast<size_t>(n), static_cast<size_t>(n_chunks));
    return c_api_report(Status::OK());
  });
}

}  // namespace

extern "C" {

int64_t bhvd_minmax_uint8_size(int32_t dtype, int64_t n, int32_t n_chunks) {
  return bagua_hvd::guarded_value<int64_t>(-1, [&]() -> int64_t {
    const Status s = check(dtype, n, n_chunks);
    if (!s.ok()) {
      c_api_report(s);
      return -1;
    }
    return static_cast<int64_t>(bagua_hvd::minmax_uint8_bytes(
        static_cast<DataType>(dtype), static_cast<size_t>(n), static_cast<size_t>(n_chunks)));
  });
}

int bhvd_minmax_uint8_compress(const void* in, int32_t dtype, int64_t n, int32_t n_chunks,
                               uint8_t* out) {
  return checked(dtype, n, n_chunks, in == nullptr || out == nullptr,
                 [&](DataType t, size_t nn, size_t k) {
                   bagua_hvd::minmax_uint8_compress(in, t, nn, k, out);
                 });
}

int bhvd_minmax_uint8_decompress(const uint8_t* in, int32_t dtype, int64_t n, int32_t n_chunks,
                                 void* out) {
  return checked(dtype, n, n_chunks, in == nullptr || out == nullptr,
                 [&](DataType t, size_t nn, size_t k) {
                   bagua_hvd::minmax_uint8_decompress(in, t, nn, k, out);
                 });
}

}  // extern "C"
