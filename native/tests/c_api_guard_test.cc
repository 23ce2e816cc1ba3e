// The extern "C" guard (core/c_api_guard.h), the core's one "not initialized" message through
// real entry points, and format_seconds (base/common.h).
#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <string>

#include "bagua_hvd/c_api.h"
#include "base/common.h"
#include "core/c_api_guard.h"

namespace bagua_hvd {
namespace {

const char* const kHorovodNotInitialized = "Horovod has not been initialized; use hvd.init().";

TEST(CApiGuard, ExceptionsBecomeStatusAndMessage) {
  EXPECT_EQ(guarded([]() -> int { throw std::runtime_error("boom"); }), BHVD_UNKNOWN_ERROR);
  EXPECT_STREQ(bhvd_last_error(), "boom");
  EXPECT_EQ(guarded([]() -> int { throw std::bad_alloc(); }), BHVD_UNKNOWN_ERROR);
  EXPECT_STREQ(bhvd_last_error(), std::bad_alloc().what());
  EXPECT_EQ(guarded([]() -> int { throw 42; }), BHVD_UNKNOWN_ERROR);
  EXPECT_STREQ(bhvd_last_error(), "unknown C++ exception");
}

TEST(CApiGuard, ValueResultsFallBack) {
  EXPECT_EQ(guarded_value<int64_t>(-1, []() -> int64_t { throw std::logic_error("bad"); }), -1);
  EXPECT_STREQ(bhvd_last_error(), "bad");
  EXPECT_STREQ(guarded_value<const char*>("", []() -> const char* { throw 1; }), "");
}

TEST(CApiGuard, PassesResultsThrough) {
  EXPECT_EQ(guarded([]() -> int { return BHVD_TIMED_OUT; }), BHVD_TIMED_OUT);
  EXPECT_EQ(guarded_value<int64_t>(-1, []() -> int64_t { return int64_t(1) << 40; }),
            int64_t(1) << 40);
  auto throws = []() -> int { throw 1; };
  static_assert(noexcept(guarded(throws)), "the guard never throws");
}

TEST(CApiGuard, NotInitializedIsOneMessage) {
  ASSERT_EQ(bhvd_is_initialized(), 0);
  bhvd_request req{};
  int64_t handle = 0;
  EXPECT_EQ(bhvd_enqueue(&req, &handle), BHVD_NOT_INITIALIZED);
  EXPECT_STREQ(bhvd_last_error(), kHorovodNotInitialized);
  float w = 0;
  int64_t shape = 1;
  bhvd_tensor t{&w, BHVD_FLOAT32, 1, &shape};
  int64_t id = 0;
  EXPECT_EQ(bhvd_async_start("avg", &t, 1, -1, 0, 10, &id), BHVD_NOT_INITIALIZED);
  EXPECT_STREQ(bhvd_last_error(), kHorovodNotInitialized);
  int32_t set_id = 0;
  const int32_t ranks[] = {0};
  EXPECT_EQ(bhvd_add_process_set(ranks, 1, &set_id), BHVD_NOT_INITIALIZED);
  EXPECT_STREQ(bhvd_last_error(), kHorovodNotInitialized);
  EXPECT_EQ(bhvd_remove_process_set(1), BHVD_NOT_INITIALIZED);
  EXPECT_EQ(bhvd_enqueue(nullptr, &handle), BHVD_INVALID_ARGUMENT);
  EXPECT_STREQ(bhvd_last_error(), "NULL request");
}

TEST(FormatSeconds, OneDecimalNeverNegative) {
  EXPECT_EQ(format_seconds(30), "30.0");
  EXPECT_EQ(format_seconds(2.5), "2.5");
  EXPECT_EQ(format_seconds(1.26), "1.3");
  EXPECT_EQ(format_seconds(59.94), "59.9");
  EXPECT_EQ(format_seconds(1e6), "1000000.0");
  EXPECT_EQ(format_seconds(0), "0.0");
  EXPECT_EQ(format_seconds(-0.0), "0.0");
  EXPECT_EQ(format_seconds(-3), "0.0");
  EXPECT_EQ(format_seconds(-0.04), "0.0");
}

}  // namespace
}  // namespace bagua_hvd
