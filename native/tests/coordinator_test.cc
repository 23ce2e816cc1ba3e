// The coordinator's negotiation table (core/coordinator.cc): requests of N simulated ranks in,
// responses or Horovod's error texts out; readiness, validation, fusion grouping, cache ids.
#include "core/coordinator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace bagua_hvd {
namespace {

Request req(const std::string& name, int32_t type, DataType dtype, std::vector<int64_t> shape) {
  Request r;
  r.name = name;
  r.type = type;
  r.dtype = dtype;
  r.shape = std::move(shape);
  r.reduce_op = ReduceOp::SUM;
  return r;
}

Request allreduce(const std::string& name, std::vector<int64_t> shape,
                  DataType dtype = DataType::FLOAT32) {
  return req(name, BHVD_OP_ALLREDUCE, dtype, std::move(shape));
}

class Negotiation : public ::testing::Test {
 protected:
  explicit Negotiation(int n = 3) : n_(n) {
    std::vector<int32_t> all;
    for (int r = 0; r < n; ++r) all.push_back(r);
    sets_[0] = all;
    params_.cycle_time_s = 0;     // flush as soon as something is ready
    params_.stall_warning_s = 0;  // no stall inspector in these tests
    params_.fusion_threshold = 1 << 20;
    params_.no_fuse_bytes = 1 << 16;
  }
  void start() { coord_ = std::make_unique<Coordinator>(n_, sets_, params_); }
  void submit(int rank, const Request& r) {
    RequestList l;
    l.requests.push_back(r);
    coord_->add(l, rank);
  }
  void submit_all(const Request& r) {
    for (int k = 0; k < n_; ++k) submit(k, r);
  }
  ResponseList build() {
    Clock::time_point wake;
    return coord_->build(Clock::now(), &wake);
  }
  // The error of the single response of the next build.
  std::string error() {
    ResponseList out = build();
    EXPECT_EQ(out.responses.size(), 1u);
    if (out.responses.empty()) return "";
    EXPECT_EQ(out.responses[0].kind, Response::ERROR);
    return out.responses[0].error;
  }

  int n_;
  std::map<int32_t, std::vector<int32_t>> sets_;
  CoordinatorParams params_;
  std::unique_ptr<Coordinator> coord_;
};

TEST_F(Negotiation, ReadyOnlyWhenEveryRankSubmitted) {
  start();
  submit(0, allreduce("a", {4}));
  EXPECT_TRUE(build().responses.empty());
  submit(2, allreduce("a", {4}));
  EXPECT_TRUE(build().responses.empty());
  submit(1, allreduce("a", {4}));
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 1u);
  const Response& r = out.responses[0];
  EXPECT_EQ(r.kind, Response::OP);
  EXPECT_EQ(r.type, BHVD_OP_ALLREDUCE);
  EXPECT_EQ(r.names, std::vector<std::string>{"a"});
  EXPECT_EQ(r.shapes, (std::vector<std::vector<int64_t>>{{4}}));
  EXPECT_GT(out.seq, 0u);
  EXPECT_TRUE(build().responses.empty());  // answered once
}

TEST_F(Negotiation, ProcessSetNeedsOnlyItsMembers) {
  sets_[1] = {0, 2};
  start();
  Request r = allreduce("s", {2});
  r.process_set_id = 1;
  submit(0, r);
  EXPECT_TRUE(build().responses.empty());
  submit(2, r);
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].process_set_id, 1);
  EXPECT_EQ(out.responses[0].kind, Response::OP);
}

TEST_F(Negotiation, MismatchedShapes) {
  start();
  submit(0, allreduce("a", {2, 3}));
  submit(1, allreduce("a", {2, 3}));
  submit(2, allreduce("a", {3, 2}));
  EXPECT_EQ(error(),
            "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [2, 3], but "
            "another rank sent a tensor of shape [3, 2].");
}

TEST_F(Negotiation, MismatchedDataTypes) {
  start();
  submit(0, allreduce("a", {2}, DataType::FLOAT32));
  submit(1, allreduce("a", {2}, DataType::INT32));
  submit(2, allreduce("a", {2}, DataType::FLOAT32));
  EXPECT_EQ(error(),
            "Mismatched data types: One rank had type float32, but another rank had type int32.");
}

TEST_F(Negotiation, MismatchedOperations) {
  start();
  submit(0, allreduce("a", {2}));
  submit(1, req("a", BHVD_OP_BROADCAST, DataType::FLOAT32, {2}));
  submit(2, allreduce("a", {2}));
  EXPECT_EQ(error(),
            "Mismatched operations: One rank did an ALLREDUCE, but another rank did an "
            "BROADCAST.");
}

TEST_F(Negotiation, MismatchedRootRanks) {
  start();
  Request b = req("b", BHVD_OP_BROADCAST, DataType::FLOAT32, {2});
  submit(0, b);
  submit(1, b);
  b.root_rank = 1;
  submit(2, b);
  EXPECT_EQ(error(),
            "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank "
            "specified root rank 1.");
}

TEST_F(Negotiation, MismatchedReduceOps) {
  start();
  Request a = allreduce("a", {2});
  submit(0, a);
  submit(1, a);
  a.reduce_op = ReduceOp::MAX;
  submit(2, a);
  EXPECT_EQ(error(),
            "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent "
            "reduction op 4.");
}

TEST_F(Negotiation, AllgatherCollectsEveryRanksFirstDimension) {
  start();
  for (int k = 0; k < 3; ++k) submit(k, req("g", BHVD_OP_ALLGATHER, DataType::INT64, {k + 1, 5}));
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].kind, Response::OP);
  EXPECT_EQ(out.responses[0].per_rank, (std::vector<std::vector<int64_t>>{{1, 2, 3}}));
}

TEST_F(Negotiation, AllgatherMismatchedInnerDimension) {
  start();
  submit(0, req("g", BHVD_OP_ALLGATHER, DataType::INT64, {1, 5}));
  submit(1, req("g", BHVD_OP_ALLGATHER, DataType::INT64, {2, 5}));
  submit(2, req("g", BHVD_OP_ALLGATHER, DataType::INT64, {3, 4}));
  EXPECT_EQ(error(),
            "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to "
            "5, but another rank sent a tensor with dimension 1 equal to 4.");
}

TEST_F(Negotiation, FusesAllreducesWithEqualParametersUpToTheThreshold) {
  params_.fusion_threshold = 100;  // bytes: two float32 x 10 fit (80), three do not
  start();
  submit_all(allreduce("a", {10}));
  submit_all(allreduce("b", {10}));
  submit_all(allreduce("c", {10}));
  submit_all(allreduce("d", {3}, DataType::FLOAT64));  // another dtype: its own response
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 3u);
  EXPECT_EQ(out.responses[0].names, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(out.responses[0].shapes, (std::vector<std::vector<int64_t>>{{10}, {10}}));
  EXPECT_EQ(out.responses[0].cache_ids.size(), 2u);
  EXPECT_EQ(out.responses[1].names, (std::vector<std::string>{"c"}));
  EXPECT_EQ(out.responses[2].names, (std::vector<std::string>{"d"}));
}

TEST_F(Negotiation, LargeAndCompressedTensorsRunAlone) {
  start();
  submit_all(allreduce("small1", {4}));
  submit_all(allreduce("big", {1 << 15}));  // 128 KiB >= no_fuse_bytes (64 KiB)
  Request c = req("compressed", BHVD_OP_COMPRESSED_ALLREDUCE, DataType::FLOAT32, {4});
  c.params = CompressedAllreduceParams{BHVD_COMPRESSION_MINMAX_UINT8, false};
  submit_all(c);
  submit_all(req("hier1", BHVD_OP_HIERARCHICAL_ALLREDUCE, DataType::FLOAT32, {4}));
  submit_all(req("hier2", BHVD_OP_HIERARCHICAL_ALLREDUCE, DataType::FLOAT32, {4}));
  submit_all(allreduce("small2", {4}));
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 5u);
  EXPECT_EQ(out.responses[0].names, (std::vector<std::string>{"small1", "small2"}));
  EXPECT_EQ(out.responses[1].names, (std::vector<std::string>{"big"}));
  EXPECT_EQ(out.responses[2].names, (std::vector<std::string>{"compressed"}));
  EXPECT_EQ(out.responses[2].type, BHVD_OP_COMPRESSED_ALLREDUCE);
  EXPECT_TRUE(std::holds_alternative<CompressedAllreduceParams>(out.responses[2].params));
  EXPECT_EQ(out.responses[3].names, (std::vector<std::string>{"hier1"}));
  EXPECT_EQ(out.responses[4].names, (std::vector<std::string>{"hier2"}));
}

TEST_F(Negotiation, ResponsesCarryTheAgreedParameters) {
  start();
  Request a = req("avg", BHVD_OP_PEER_AVERAGE, DataType::FLOAT32, {8});
  a.params = PeerAverageParams{BHVD_PEER_RING, 12, true};
  submit_all(a);
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 1u);
  ASSERT_EQ(out.responses[0].kind, Response::OP);
  const auto& p = std::get<PeerAverageParams>(out.responses[0].params);
  EXPECT_EQ(p.peer_mode, BHVD_PEER_RING);
  EXPECT_EQ(p.step, 12);
  EXPECT_TRUE(p.hierarchical);
}

TEST_F(Negotiation, MismatchedAlgorithmParameters) {
  start();
  Request a = req("avg", BHVD_OP_PEER_AVERAGE, DataType::FLOAT32, {8});
  a.params = PeerAverageParams{BHVD_PEER_SHIFT_ONE, 3, false};
  submit(0, a);
  submit(1, a);
  a.params = PeerAverageParams{BHVD_PEER_SHIFT_ONE, 4, false};
  submit(2, a);
  EXPECT_EQ(error(),
            "Mismatched PEER_AVERAGE algorithm parameters: One rank sent (peer mode 1, step 3, "
            "hierarchical 0), but another rank sent (peer mode 1, step 4, hierarchical 0): every "
            "rank must use the same algorithm and step.");
  Request s = req("lp", BHVD_OP_LP_DECENTRALIZED_STEP, DataType::FLOAT32, {8});
  s.params = LpRingParams{true};
  submit(0, s);
  submit(1, s);
  s.params = LpRingParams{false};
  submit(2, s);
  EXPECT_EQ(error(),
            "Mismatched LP_DECENTRALIZED_STEP algorithm parameters: One rank sent (hierarchical "
            "1), but another rank sent (hierarchical 0): every rank must use the same algorithm "
            "and step.");
}

TEST_F(Negotiation, ACompressedAndAPlainAllreduceAreDifferentOperations) {
  start();
  Request c = req("g", BHVD_OP_COMPRESSED_ALLREDUCE, DataType::FLOAT32, {8});
  c.params = CompressedAllreduceParams{};
  submit(0, c);
  submit(1, allreduce("g", {8}));
  submit(2, c);
  EXPECT_EQ(error(),
            "Mismatched operations: One rank did an COMPRESSED_ALLREDUCE, but another rank did an "
            "ALLREDUCE.");
}

TEST_F(Negotiation, MismatchedScaleFactorsOfAHierarchicalAllreduce) {
  start();
  Request h = req("h", BHVD_OP_HIERARCHICAL_ALLREDUCE, DataType::FLOAT32, {2});
  submit(0, h);
  submit(1, h);
  h.postscale = 0.5;
  submit(2, h);
  EXPECT_EQ(error(),
            "Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), but "
            "another rank sent factors (1, 0.5).");
}

TEST_F(Negotiation, NoFusionWithThresholdZero) {
  params_.fusion_threshold = 0;
  start();
  submit_all(allreduce("a", {4}));
  submit_all(allreduce("b", {4}));
  EXPECT_EQ(build().responses.size(), 2u);
}

TEST_F(Negotiation, CachedRequestsAreAnsweredFromTheTemplate) {
  start();
  submit_all(allreduce("a", {6}));
  ResponseList first = build();
  ASSERT_EQ(first.responses.size(), 1u);
  const int32_t id = first.responses[0].cache_ids[0];
  ASSERT_GE(id, 0);
  // Every rank now sends only the id.
  for (int k = 0; k < 3; ++k) {
    RequestList l;
    l.acked_seq = first.seq;
    l.cached = {id};
    l.cached_urgent = {0};
    coord_->add(l, k);
  }
  ResponseList again = build();
  ASSERT_EQ(again.responses.size(), 1u);
  EXPECT_EQ(again.responses[0].kind, Response::OP);
  EXPECT_EQ(again.responses[0].names, std::vector<std::string>{"a"});
  EXPECT_EQ(again.responses[0].shapes, (std::vector<std::vector<int64_t>>{{6}}));
  EXPECT_EQ(again.responses[0].cache_ids, std::vector<int32_t>{id});
  // An id nobody was given is garbage on the channel.
  RequestList bad;
  bad.cached = {id + 100};
  EXPECT_THROW(coord_->add(bad, 1), TransportError);
}

TEST_F(Negotiation, CacheCapacityEvictsTheLeastRecentlyUsed) {
  params_.cache_capacity = 1;
  start();
  submit_all(allreduce("a", {2}));
  ResponseList r1 = build();
  submit_all(allreduce("b", {2}));
  ResponseList r2 = build();
  ASSERT_EQ(r2.responses.size(), 1u);
  EXPECT_EQ(r2.evicted, std::vector<int32_t>{r1.responses[0].cache_ids[0]});
}

TEST_F(Negotiation, TheAutotunersParametersHoldFromTheNextBuild) {
  params_.fusion_threshold = 100;
  start();
  // A larger threshold fuses what did not fit; the hierarchical setting goes out once, in the
  // next list, even a list without responses.
  TunedParams p;
  p.fusion_threshold = 1000;
  p.hierarchical_allreduce = true;
  p.cache_enabled = true;
  p.cycle_time_ms = 0;
  coord_->tune(p);
  ResponseList flag = build();
  EXPECT_TRUE(flag.responses.empty());
  EXPECT_EQ(flag.hierarchical_allreduce, 1);
  EXPECT_GT(flag.seq, 0u);
  for (const char* name : {"a", "b", "c"}) submit_all(allreduce(name, {10}));
  ResponseList fused = build();
  ASSERT_EQ(fused.responses.size(), 1u);
  EXPECT_EQ(fused.responses[0].names, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(fused.hierarchical_allreduce, -1);  // unchanged since
  // The cache off: every cached id is evicted, no new one given.
  p.cache_enabled = false;
  coord_->tune(p);
  submit_all(allreduce("d", {10}));
  ResponseList uncached = build();
  ASSERT_EQ(uncached.responses.size(), 1u);
  EXPECT_EQ(uncached.responses[0].cache_ids, std::vector<int32_t>{-1});
  std::vector<int32_t> evicted = uncached.evicted;
  std::sort(evicted.begin(), evicted.end());
  std::vector<int32_t> ids = fused.responses[0].cache_ids;
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(evicted, ids);
}

// ---- requests no real rank sends (found by native/fuzz/coordinator_fuzz.cc) -------------------

// A shape that no tensor has is garbage on the channel, like an unknown cache id: build() and
// fusion multiplied it out, a signed overflow (native/fuzz/regressions/coordinator/).
TEST_F(Negotiation, ARequestWhoseShapeNoTensorHasIsRefused) {
  const int64_t big = int64_t(1) << 62;
  const std::vector<std::vector<int64_t>> bad = {
      {-1},
      {4, -3},
      {-281474976710654, 16492674416639},  // the fuzzer's input
      {big, 2},                            // 2^63 elements
      {big / 2, 1, 2, 2},                  // 2^62 elements of 4 bytes
      {big, big, 0},                       // empty, but its dimensions overflow before the 0
  };
  for (const auto& shape : bad) {
    start();
    RequestList l;
    l.requests.push_back(allreduce("a", shape));
    EXPECT_THROW(coord_->add(l, 1), TransportError) << ::testing::PrintToString(shape);
  }
  start();
  submit_all(allreduce("ok", {big / 8, 2}, DataType::UINT8));  // 2^60 bytes still count
  submit_all(allreduce("empty", {0, big}));
  EXPECT_EQ(build().responses.size(), 2u);
}

// A new process set with a rank outside the job, or a rank twice, is an error for every rank: the
// coordinator indexed its tables by those ranks once the set was registered (hvd.add_process_set
// does not check them; native/fuzz/regressions/coordinator/process-set-rank-out-of-range).
// Horovod's texts and order (process_set.cc: duplicates first, in sorted order, then the range).
TEST_F(Negotiation, AProcessSetWithARankOutsideTheJobIsRefused) {
  Request add = req("__process_set_change.0", kOpAddProcessSet, DataType::INT32, {});
  const std::vector<std::pair<std::vector<int32_t>, std::string>> bad = {
      {{0, 5}, "Tried to register process set with invalid rank: 5"},
      {{-1, 0}, "Tried to register process set with invalid rank: -1"},
      {{3}, "Tried to register process set with invalid rank: 3"},
      {{1, 1}, "Tried to register process set with duplicate rank: 1"},
      {{7, 7, 2}, "Tried to register process set with duplicate rank: 7"},
  };
  for (const auto& [ranks, text] : bad) {
    start();
    add.splits = ranks;
    submit_all(add);
    const std::string e = error();
    EXPECT_NE(e.find(text), std::string::npos) << e;
  }
  start();
  add.splits = {0, 2};
  submit_all(add);
  ResponseList out = build();
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].kind, Response::OP);
  EXPECT_EQ(out.responses[0].set_ranks, (std::vector<int32_t>{0, 2}));
}

// Set ids as Horovod gives them (process_set.cc, ProcessSetTable::RegisterProcessSet): a removed
// set's id is given again, the oldest freed first, before a new id; 0 is the global set's.
TEST_F(Negotiation, RemovedProcessSetIdsAreGivenAgainOldestFirst) {
  start();
  int change = 0;
  const auto apply = [&](int32_t type, std::vector<int32_t> splits) {
    Request r = req("__process_set_change." + std::to_string(change++), type, DataType::INT32, {});
    r.splits = std::move(splits);
    submit_all(r);
    ResponseList out = build();
    EXPECT_EQ(out.responses.size(), 1u);
    if (out.responses.empty()) return -1;
    EXPECT_EQ(out.responses[0].kind, Response::OP) << out.responses[0].error;
    const int32_t id = out.responses[0].new_set_id;
    if (type == kOpAddProcessSet)
      sets_[id] = out.responses[0].set_ranks;  // as the runtime registers it
    else
      sets_.erase(id);
    return static_cast<int>(id);
  };
  EXPECT_EQ(apply(kOpAddProcessSet, {0}), 1);
  EXPECT_EQ(apply(kOpAddProcessSet, {1, 2}), 2);
  EXPECT_EQ(apply(kOpAddProcessSet, {0, 2}), 3);
  EXPECT_EQ(apply(kOpRemoveProcessSet, {2}), 2);
  EXPECT_EQ(apply(kOpRemoveProcessSet, {1}), 1);
  EXPECT_EQ(apply(kOpAddProcessSet, {2}), 2);     // freed first
  EXPECT_EQ(apply(kOpAddProcessSet, {1}), 1);
  EXPECT_EQ(apply(kOpAddProcessSet, {0, 1}), 4);  // none free: a new id
}

// Ready tensors whose sizes sum past int64 (each one counts): the sum decides when to stop holding
// them for fusion, and must not wrap around to "nothing to flush yet".
TEST_F(Negotiation, ReadyTensorsSummingPastInt64AreFlushed) {
  params_.cycle_time_s = 1000;  // only the fusion threshold flushes
  start();
  const int64_t half = int64_t(1) << 62;  // bytes of uint8: two sum to 2^63
  submit_all(allreduce("a", {half}, DataType::UINT8));
  submit_all(allreduce("b", {half}, DataType::UINT8));
  EXPECT_EQ(build().responses.size(), 2u);
}

// ---- the stall inspector (Horovod's stall_inspector.cc; messages checked against its text) ----

class StallInspector : public Negotiation {
 protected:
  StallInspector() : Negotiation(3) {
    params_.stall_warning_s = 10;
    params_.stall_shutdown_s = 30;
  }
  // One build at `seconds` after now, rank 0's log of it in *log.
  ResponseList build_at(double seconds, std::string* log) {
    Clock::time_point wake = Clock::time_point::max();
    ::testing::internal::CaptureStderr();
    ResponseList out = coord_->build(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(seconds)),
                                     &wake);
    *log = ::testing::internal::GetCapturedStderr();
    return out;
  }
};

constexpr const char* kStallHead =
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks "
    "and are waiting for remainder of ranks for more than 10 seconds. This may indicate that "
    "different ranks are trying to submit different tensors or that only subset of ranks is "
    "submitting tensors, which will cause deadlock. \nMissing ranks:";

TEST_F(StallInspector, NamesTheMissingRanksAndTheirTensorsThenShutsDown) {
  start();
  // Rank 1 misses eight tensors (Horovod shows six, then " ..."), rank 2 one of them.
  for (const char* name : {"h", "g", "f", "e", "d", "c", "b", "a"}) submit(0, allreduce(name, {1}));
  for (const char* name : {"h", "g", "f", "e", "d", "c", "b"}) submit(2, allreduce(name, {1}));
  std::string log;
  EXPECT_FALSE(build_at(5, &log).shutdown);
  EXPECT_EQ(log, "");  // not stalled yet
  ResponseList out = build_at(11, &log);
  EXPECT_FALSE(out.shutdown);
  EXPECT_TRUE(out.responses.empty());
  EXPECT_NE(log.find(std::string(kStallHead) + "\n1: [a, b, c, d, e, f ...]\n2: [a]"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("Will shutdown"), std::string::npos) << log;
  build_at(15, &log);
  EXPECT_EQ(log, "");  // reported again only HOROVOD_STALL_CHECK_TIME_SECONDS later
  build_at(22, &log);
  EXPECT_NE(log.find("Missing ranks:"), std::string::npos) << log;
  out = build_at(31, &log);
  EXPECT_TRUE(out.shutdown);  // every rank shuts down
  EXPECT_NE(log.find(std::string(kStallHead) +
                     "\n1!: [a, b, c, d, e, f ...]\n2!: [a]\nOne or more rank (marked by \"!\") is "
                     "stalled for longer than 30 seconds. Will shutdown."),
            std::string::npos)
      << log;
}

TEST_F(StallInspector, ShutdownTimeBelowTheCheckTimeNeverShutsDown) {
  params_.stall_shutdown_s = 5;  // Horovod: warns once and never shuts down
  ::testing::internal::CaptureStderr();
  start();
  EXPECT_NE(::testing::internal::GetCapturedStderr().find(
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
                "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown."),
            std::string::npos);
  submit(0, allreduce("a", {1}));
  std::string log;
  ResponseList out = build_at(1000, &log);
  EXPECT_FALSE(out.shutdown);
  EXPECT_NE(log.find("\n1: [a]\n2: [a]"), std::string::npos) << log;
}

TEST_F(StallInspector, DisabledChecksNothingAndNeverShutsDown) {
  params_.stall_warning_s = 0;  // HOROVOD_STALL_CHECK_DISABLE=1
  start();
  submit(0, allreduce("a", {1}));
  std::string log;
  EXPECT_FALSE(build_at(1000, &log).shutdown);
  EXPECT_EQ(log, "");
}

TEST_F(StallInspector, ProcessSetMembersAreNamedByGlobalRank) {
  sets_[1] = {0, 2};
  start();
  Request r = allreduce("s", {1});
  r.process_set_id = 1;
  submit(0, r);  // set rank 1 (global rank 2) is missing
  submit(0, allreduce("a", {1}));
  submit(1, allreduce("a", {1}));
  std::string log;
  build_at(11, &log);
  EXPECT_NE(log.find("Missing ranks:\n2: [a, s]"), std::string::npos) << log;
  EXPECT_EQ(log.find("\n1: "), std::string::npos) << log;
}

}  // namespace
}  // namespace bagua_hvd
