// Logging (base/common.cc): HOROVOD_LOG_LEVEL holds for every line, also from a caller that calls
// log_message directly instead of through BHVD_LOG (the CUDA engine's device line was printed
// at DEBUG under the default level, on every GPU job).
#include <gtest/gtest.h>

#include <string>

#include "base/common.h"

namespace bagua_hvd {
namespace {

std::string printed(LogLevel level, const std::string& msg) {
  testing::internal::CaptureStderr();
  log_message(level, msg);
  return testing::internal::GetCapturedStderr();
}

TEST(Log, LinesBelowTheLevelAreDroppedAndTheRestPrinted) {
  const LogLevel level = log_level();  // warning unless the environment says otherwise
  const std::string at = printed(level, "a line at the level");
  EXPECT_NE(at.find("a line at the level"), std::string::npos) << at;
  EXPECT_NE(at.find("bagua_hvd"), std::string::npos) << at;
  if (level != LogLevel::TRACE) {
    const auto below = static_cast<LogLevel>(static_cast<int>(level) - 1);
    EXPECT_EQ(printed(below, "a line below the level"), "");
  }
  if (level != LogLevel::FATAL) {
    const auto above = static_cast<LogLevel>(static_cast<int>(level) + 1);
    EXPECT_NE(printed(above, "a line above").find("a line above"), std::string::npos);
  }
}

}  // namespace
}  // namespace bagua_hvd
