// The low-precision ring's bookkeeping (core/lp_ring.cc) over a fake runtime: which op runs
// under which name, what is waited for before what (the previous round's exchange of a bucket
// before its new local half), what stays in flight, what a settle counts as late, and the
// split decision. The math is the collectives' (phased_test, the Python reference tests).
#include "core/lp_ring.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "compression/minmax_uint8.h"

namespace bagua_hvd {
namespace {

// Handles complete at once, unless held; every call is logged ("enqueue <name>", "wait <name>",
// "release <name>").
// A caller's stream, as the device ring passes it on (never dereferenced here).
void* const kCallerStream = reinterpret_cast<void*>(0x5157);

struct FakeRuntime {
  std::vector<std::string> log;
  std::map<int64_t, std::string> names;
  std::map<int64_t, bool> done;
  std::map<int64_t, int32_t> op_types;
  std::map<int64_t, bool> hierarchical;  // the step's and init's parameter
  std::map<int64_t, int32_t> devices;    // the request's device
  std::map<int64_t, void*> streams;      // and stream
  bool hold = false;                     // new handles stay in flight until completed by the test
  int64_t next = 1;

  LpRing::Ops ops() {
    LpRing::Ops o;
    o.enqueue = [this](const bhvd_request& r, int64_t* h) {
      *h = next++;
      names[*h] = r.name;
      done[*h] = !hold;
      op_types[*h] = r.op_type;
      devices[*h] = r.device;
      streams[*h] = r.stream;
      if (r.op_type == BHVD_OP_LP_DECENTRALIZED_STEP)
        hierarchical[*h] = static_cast<const bhvd_lp_step_params*>(r.params)->hierarchical != 0;
      if (r.op_type == BHVD_OP_LP_DECENTRALIZED_INIT)
        hierarchical[*h] = static_cast<const bhvd_lp_init_params*>(r.params)->hierarchical != 0;
      if (r.op_type == BHVD_OP_LP_DECENTRALIZED_STEP) {  // a "step" that adds 1 to x
        auto* x = static_cast<float*>(r.inputs[0].data);
        for (int64_t i = 0; i < r.inputs[0].shape[0]; ++i) x[i] += 1.0f;
      }
      log.push_back(std::string("enqueue ") + r.name);
      return Status::OK();
    };
    o.wait = [this](int64_t h, int64_t timeout_ms) {
      if (!done[h]) {
        EXPECT_GE(timeout_ms, 0) << "an unbounded wait for a handle that never completes";
        return Status::Error(StatusType::TIMED_OUT, "timed out waiting for handle");
      }
      log.push_back("wait " + names[h]);
      return Status::OK();
    };
    o.release = [this](int64_t h) { log.push_back("release " + names[h]); };
    o.stream_wait = [](int64_t, void*) {};
    o.local = [this](const LpRing::Bucket& k, void*, void* stream) {
      log.push_back("local " + k.exchange_name);
      EXPECT_EQ(stream, kCallerStream);
      return Status::OK();
    };
    return o;
  }
};

struct Bucket {
  explicit Bucket(int64_t n, const std::string& label)
      : x(n, 1.0f),
        self(n, 0.5f),
        left(n, 0.25f),
        right(n, 0.75f),
        diff(minmax_uint8_bytes(DataType::FLOAT32, static_cast<size_t>(n), 1)) {
    spec.init_name = "lpdec.init." + label;
    spec.step_name = "lpdec." + label;
    spec.exchange_name = "lpdec.x." + label;
    spec.count = n;
    spec.self = self.data();
    spec.left = left.data();
    spec.right = right.data();
    spec.diff = diff.data();
  }
  LpRing::Segments segments() { return {{x.data(), x.size()}}; }
  std::vector<float> x, self, left, right;
  std::vector<uint8_t> diff;
  LpRing::Bucket spec;
};

struct Ring {
  explicit Ring(bool split, double op_timeout_s = 0, bool hierarchical = false, int device = -1) {
    buckets.emplace_back(5, "a");
    buckets.emplace_back(3, "b");
    LpRing::Params p;
    p.split = split;
    p.op_timeout_s = op_timeout_s;
    p.hierarchical = hierarchical;
    p.device = device;
    ring = std::make_unique<LpRing>(rt.ops(), p,
                                    std::vector<LpRing::Bucket>{buckets[0].spec, buckets[1].spec});
  }
  std::vector<LpRing::Segments> x() { return {buckets[0].segments(), buckets[1].segments()}; }
  FakeRuntime rt;
  std::vector<Bucket> buckets;
  std::unique_ptr<LpRing> ring;
};

TEST(LpRing, InitRunsEveryBucketAndWaitsForAll) {
  Ring r(true);
  ASSERT_TRUE(r.ring->init(r.x(), nullptr).ok());
  EXPECT_EQ(r.rt.log, (std::vector<std::string>{"enqueue lpdec.init.a", "enqueue lpdec.init.b",
                                                "wait lpdec.init.a", "release lpdec.init.a",
                                                "wait lpdec.init.b", "release lpdec.init.b"}));
  EXPECT_EQ(r.ring->pending(), 0);
}

TEST(LpRing, SplitStepWaitsForEachBucketsPreviousExchangeFirst) {
  Ring r(true);
  ASSERT_TRUE(r.ring->step(r.x(), nullptr).ok());
  EXPECT_EQ(r.rt.log, (std::vector<std::string>{"enqueue lpdec.x.a", "enqueue lpdec.x.b"}));
  EXPECT_EQ(r.ring->pending(), 2);  // left in flight
  r.rt.log.clear();
  ASSERT_TRUE(r.ring->step(r.x(), nullptr).ok());
  EXPECT_EQ(r.rt.log,
            (std::vector<std::string>{"wait lpdec.x.a", "release lpdec.x.a", "enqueue lpdec.x.a",
                                      "wait lpdec.x.b", "release lpdec.x.b", "enqueue lpdec.x.b"}));
  r.rt.log.clear();
  ASSERT_TRUE(r.ring->flush().ok());
  EXPECT_EQ(r.rt.log, (std::vector<std::string>{"wait lpdec.x.a", "release lpdec.x.a",
                                                "wait lpdec.x.b", "release lpdec.x.b"}));
  EXPECT_EQ(r.ring->pending(), 0);
}

TEST(LpRing, SplitStepIsTheLocalHalfInPlace) {
  Ring r(true);
  std::vector<float> x = r.buckets[0].x, self = r.buckets[0].self;
  std::vector<uint8_t> c(r.buckets[0].diff.size());
  lp_decentralized_local(x.data(), self.data(), r.buckets[0].left.data(), r.buckets[0].right.data(),
                         x.size(), DataType::FLOAT32, c.data());
  // The bucket in two segments: the same bits.
  std::vector<LpRing::Segments> segs = r.x();
  segs[0] = {{r.buckets[0].x.data(), 2}, {r.buckets[0].x.data() + 2, 3}};
  ASSERT_TRUE(r.ring->step(segs, nullptr).ok());
  EXPECT_EQ(r.buckets[0].x, x);
  EXPECT_EQ(r.buckets[0].self, self);
  EXPECT_EQ(r.buckets[0].diff, c);
}

TEST(LpRing, WholeStepBlocksAndPacksSegments) {
  Ring r(false);
  // The fake "step" adds 1 to the packed copy, which must come back into the segments.
  std::vector<LpRing::Segments> segs = r.x();
  segs[0] = {{r.buckets[0].x.data(), 2}, {r.buckets[0].x.data() + 2, 3}};
  ASSERT_TRUE(r.ring->step(segs, nullptr).ok());
  EXPECT_EQ(r.rt.log,
            (std::vector<std::string>{"enqueue lpdec.a", "enqueue lpdec.b", "wait lpdec.a",
                                      "release lpdec.a", "wait lpdec.b", "release lpdec.b"}));
  EXPECT_EQ(r.ring->pending(), 0);
  EXPECT_EQ(r.buckets[0].x, std::vector<float>(5, 2.0f));
  EXPECT_EQ(r.buckets[1].x, std::vector<float>(3, 2.0f));
}

TEST(LpRing, WholeStepIsHierarchicalAsTheAlgorithmSays) {
  // Device buckets always take the whole step: with hierarchical=False it must be the flat ring,
  // whatever the hosts (the core's hierarchy would otherwise run it among the hosts' leaders).
  for (bool hierarchical : {false, true}) {
    Ring r(false, 0, hierarchical);
    ASSERT_TRUE(r.ring->init(r.x(), nullptr).ok());
    ASSERT_TRUE(r.ring->step(r.x(), nullptr).ok());
    ASSERT_EQ(r.rt.hierarchical.size(), 4u);
    for (const auto& kv : r.rt.hierarchical)
      EXPECT_EQ(kv.second, hierarchical) << r.rt.names[kv.first];
  }
}

TEST(LpRing, DeviceSplitStepQueuesTheLocalHalfBeforeItsExchange) {
  // Device weights: the local half goes to the device engine (Ops::local) with the caller's
  // stream, after the bucket's previous exchange was waited for, and the exchange is a device
  // request on the same stream (which waits for the local half), left in flight.
  Ring r(true, 0, false, 0);
  ASSERT_TRUE(r.ring->step(r.x(), kCallerStream).ok());
  EXPECT_EQ(r.rt.log, (std::vector<std::string>{"local lpdec.x.a", "enqueue lpdec.x.a",
                                                "local lpdec.x.b", "enqueue lpdec.x.b"}));
  EXPECT_EQ(r.ring->pending(), 2);
  for (const auto& kv : r.rt.devices) EXPECT_EQ(kv.second, 0) << r.rt.names[kv.first];
  for (const auto& kv : r.rt.streams) EXPECT_EQ(kv.second, kCallerStream) << r.rt.names[kv.first];
  EXPECT_EQ(r.buckets[0].x, std::vector<float>(5, 1.0f));  // the host kernels did not run
  r.rt.log.clear();
  ASSERT_TRUE(r.ring->step(r.x(), kCallerStream).ok());
  EXPECT_EQ(r.rt.log,
            (std::vector<std::string>{"wait lpdec.x.a", "release lpdec.x.a", "local lpdec.x.a",
                                      "enqueue lpdec.x.a", "wait lpdec.x.b", "release lpdec.x.b",
                                      "local lpdec.x.b", "enqueue lpdec.x.b"}));
}

TEST(LpRing, LayoutChangeIsRefused) {
  Ring r(true);
  std::vector<LpRing::Segments> segs = r.x();
  segs[1] = {{r.buckets[1].x.data(), 2}};
  Status s = r.ring->step(segs, nullptr);
  EXPECT_EQ(s.type, StatusType::INVALID_ARGUMENT);
  EXPECT_EQ(s.reason, "bagua_hvd: the low-precision layout changed");
  EXPECT_TRUE(r.rt.log.empty());
}

TEST(LpRing, SettleCountsLateExchangesAndKeepsThem) {
  Ring r(true);
  r.rt.hold = true;
  ASSERT_TRUE(r.ring->step(r.x(), nullptr).ok());
  const auto deadline = Clock::now() + std::chrono::milliseconds(1);
  EXPECT_EQ(r.ring->settle(&deadline), 2);
  EXPECT_EQ(r.ring->pending(), 2);
  for (auto& kv : r.rt.done) kv.second = true;
  EXPECT_EQ(r.ring->settle(&deadline), 0);
  EXPECT_EQ(r.ring->pending(), 2);  // settled, not released: the ring's own wait reports them
  r.ring->drop();
  EXPECT_EQ(r.ring->pending(), 0);
  EXPECT_EQ(r.rt.log.back(), "release lpdec.x.b");
}

TEST(LpRing, OwnWaitFailsAfterTheOpTimeout) {
  Ring r(true, 0.05);
  r.rt.hold = true;
  ASSERT_TRUE(r.ring->step(r.x(), nullptr).ok());
  Status s = r.ring->flush();
  EXPECT_EQ(s.type, StatusType::TIMED_OUT);
  EXPECT_EQ(s.reason,
            "lpdec.x.a (handle 1) did not complete within BAGUA_HVD_OP_TIMEOUT_SECONDS=0.05 s: "
            "other ranks may not have submitted the same operation");
}

TEST(LpRing, SplitDecision) {
  EXPECT_TRUE(lp_ring_splits(false, 2, 4));  // flat ring (host or device weights)
  EXPECT_FALSE(lp_ring_splits(true, 2, 4));  // the host hierarchy in play
  EXPECT_TRUE(lp_ring_splits(true, 4, 4));   // hierarchical on one host: flat
}

}  // namespace
}  // namespace bagua_hvd
