// BAGUA's bucket plan (core/bucket_plan.cc) through the C API, against layouts worked out by
// hand from the rule: per group, fill the open bucket up to the cap; a bigger tensor alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bagua_hvd/c_api.h"

namespace {

struct Plan {
  int status;
  std::vector<int64_t> bucket_of;
  int64_t buckets;
};

Plan layout(const std::vector<int64_t>& bytes, const std::vector<int32_t>& group,
            const std::vector<int64_t>& order, int64_t cap) {
  Plan p{0, std::vector<int64_t>(order.size(), -1), -1};
  p.status = bhvd_bucket_layout(bytes.data(), group.data(), static_cast<int64_t>(bytes.size()),
                                order.data(), static_cast<int64_t>(order.size()), cap,
                                p.bucket_of.data(), &p.buckets);
  return p;
}

TEST(BucketPlan, FillsTheOpenBucketOfEachGroupUpToTheCap) {
  // Reverse order, one group: 3 and 2 fill the first bucket (8 bytes), 1 and 0 the second.
  auto p = layout({4, 4, 4, 4}, {0, 0, 0, 0}, {3, 2, 1, 0}, 8);
  ASSERT_EQ(p.status, BHVD_OK);
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(p.buckets, 2);
  // Two groups interleaved: each has its own open bucket; group 0's third tensor opens bucket 2.
  p = layout({4, 4, 4, 4, 4}, {0, 1, 0, 1, 0}, {0, 1, 2, 3, 4}, 8);
  ASSERT_EQ(p.status, BHVD_OK);
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{0, 1, 0, 1, 2}));
  EXPECT_EQ(p.buckets, 3);
}

TEST(BucketPlan, ABiggerTensorGetsABucketOfItsOwn) {
  auto p = layout({2, 100, 2, 3}, {0, 0, 0, 0}, {0, 1, 2, 3}, 10);
  ASSERT_EQ(p.status, BHVD_OK);
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{0, 1, 2, 2}));
  // Cap 0: one bucket per tensor, in order.
  p = layout({2, 100, 2}, {0, 1, 0}, {2, 0, 1}, 0);
  ASSERT_EQ(p.status, BHVD_OK);
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(p.buckets, 3);
  p = layout({}, {}, {}, 10);
  ASSERT_EQ(p.status, BHVD_OK);
  EXPECT_EQ(p.buckets, 0);
}

TEST(BucketPlan, RefusesBadArgumentsWithTheirReason) {
  auto p = layout({4, 4}, {0, 0}, {0, 2}, 8);
  EXPECT_EQ(p.status, BHVD_INVALID_ARGUMENT);
  EXPECT_STREQ(bhvd_last_error(), "bucket layout: order[1] = 2 is not a tensor index below 2");
  p = layout({4, -1}, {0, 0}, {0, 1}, 8);
  EXPECT_EQ(p.status, BHVD_INVALID_ARGUMENT);
  EXPECT_STREQ(bhvd_last_error(), "bucket layout: tensor 1 has negative bytes");
  p = layout({4}, {0}, {0}, -1);
  EXPECT_EQ(p.status, BHVD_INVALID_ARGUMENT);
}

}  // namespace
