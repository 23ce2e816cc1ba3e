// The autotuner's core half (core/autotune.h): Horovod's sampling (a sample ends when a tensor of
// the global set has been reduced steps_per_sample more times; the score, the median of five, is
// handed out once), the pause until the frontend proposes, and the end of tuning.
#include "core/autotune.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace bagua_hvd {
namespace {

ResponseList reduced(const std::vector<std::string>& names, int32_t set = 0,
                     int32_t type = BHVD_OP_ALLREDUCE) {
  Response r;
  r.type = type;
  r.process_set_id = set;
  r.names = names;
  r.shapes.assign(names.size(), {256});  // 1 KiB of float32 each
  ResponseList l;
  l.responses.push_back(r);
  return l;
}

TEST(Autotuner, AScoreAfterFiveSamplesOfTheGivenSteps) {
  Autotuner t;
  ASSERT_TRUE(t.start(2).ok());
  double score = 0;
  // A sample ends at the list where a tensor's count passes 2, 4, 6, 8, 10: the 11th list of
  // one tensor ends the fifth.
  for (int i = 0; i < 10; ++i) t.observe(reduced({"a"}));
  EXPECT_EQ(t.next_score(&score, 0), 0);
  t.observe(reduced({"a"}));
  ASSERT_EQ(t.next_score(&score, 0), 1);
  EXPECT_GT(score, 0);
  EXPECT_EQ(t.next_score(&score, 0), 0);  // handed out once
}

TEST(Autotuner, OnlyTheGlobalSetsReductionsCount) {
  Autotuner t;
  ASSERT_TRUE(t.start(1).ok());
  double score = 0;
  for (int i = 0; i < 20; ++i) {
    t.observe(reduced({"b"}, /*set=*/1));
    t.observe(reduced({"c"}, 0, BHVD_OP_ALLGATHER));
  }
  EXPECT_EQ(t.next_score(&score, 0), 0);
  for (int i = 0; i < 6; ++i) t.observe(reduced({"d"}, 0, BHVD_OP_COMPRESSED_ALLREDUCE));
  EXPECT_EQ(t.next_score(&score, 0), 1);
}

TEST(Autotuner, PausedUntilAProposalThenResumesOrEnds) {
  Autotuner t;
  ASSERT_TRUE(t.start(1).ok());
  double score = 0;
  for (int i = 0; i < 6; ++i) t.observe(reduced({"a"}));
  ASSERT_EQ(t.next_score(&score, 0), 1);
  for (int i = 0; i < 20; ++i) t.observe(reduced({"a"}));  // nothing measured while paused
  EXPECT_EQ(t.next_score(&score, 0), 0);
  TunedParams p;
  EXPECT_FALSE(t.take_proposal(&p));
  p.fusion_threshold = 12345;
  t.propose(p, /*active=*/true);
  TunedParams got;
  ASSERT_TRUE(t.take_proposal(&got));
  EXPECT_EQ(got.fusion_threshold, 12345);
  EXPECT_TRUE(t.running());
  for (int i = 0; i < 6; ++i) t.observe(reduced({"a"}));  // counted afresh
  ASSERT_EQ(t.next_score(&score, 0), 1);
  t.propose(p, /*active=*/false);
  ASSERT_TRUE(t.take_proposal(&got));
  EXPECT_FALSE(t.running());
  for (int i = 0; i < 20; ++i) t.observe(reduced({"a"}));
  EXPECT_EQ(t.next_score(&score, 0), 0);
}

TEST(Autotuner, StopEndsTheWait) {
  Autotuner t;
  ASSERT_TRUE(t.start(1).ok());
  t.stop();
  double score = 0;
  EXPECT_EQ(t.next_score(&score, 10000), -1);
  EXPECT_FALSE(t.start(0).ok());
}

}  // namespace
}  // namespace bagua_hvd
