// Request validation (core/validate.cc) of BAGUA's primitives: each op type's parameter struct
// into the negotiated parameters and this rank's state buffers, and the refusals (texts written
// here by hand).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "compression/minmax_uint8.h"
#include "core/validate.h"

namespace bagua_hvd {
namespace {

// One float buffer of n elements as the C API describes it.
struct Buf {
  explicit Buf(int64_t n, int32_t dtype = BHVD_FLOAT32)
      : data(static_cast<size_t>(n) * 4 + 4), shape{n}, t{data.data(), dtype, 1, shape} {}
  std::vector<unsigned char> data;
  int64_t shape[1];
  bhvd_tensor t;
};

// A one-tensor request on the global set of 3 ranks (this is rank 1), in place.
struct Call {
  Call(int32_t op_type, const void* params, Buf& x) {
    req.op_type = op_type;
    req.params = params;
    req.reduce_op = BHVD_AVERAGE;
    req.device = -1;
    req.prescale_factor = req.postscale_factor = 1.0;
    req.num_tensors = 1;
    req.inputs = &x.t;
    req.outputs = &x.t;
  }
  // The status of validate_request then validate_for_set, group size 3 (2 hierarchical).
  Status run() {
    const std::string title = op_title(req.op_type);
    if (Status s = validate_request(req, title); !s.ok()) return s;
    return validate_for_set(
        req, title, {0, 1, 2}, 1, [](bool hierarchical) { return hierarchical ? 2 : 3; },
        &params, &state);
  }
  bhvd_request req{};
  OpParams params;
  StateBuffers state;
};

TEST(Validate, CompressedAllreduceWithErrorFeedback) {
  Buf x(10), worker(12), server(4);  // 3 ranks: chunks of ceil(10 / 3) = 4
  bhvd_compressed_allreduce_params p{};
  p.op_type = BHVD_OP_COMPRESSED_ALLREDUCE;
  p.compression = BHVD_COMPRESSION_MINMAX_UINT8;
  p.residual_worker = &worker.t;
  p.residual_server = &server.t;
  Call c(BHVD_OP_COMPRESSED_ALLREDUCE, &p, x);
  ASSERT_TRUE(c.run().ok()) << c.run().reason;
  const auto& got = std::get<CompressedAllreduceParams>(c.params);
  EXPECT_EQ(got.compression, BHVD_COMPRESSION_MINMAX_UINT8);
  EXPECT_FALSE(got.hierarchical);
  EXPECT_EQ(std::get<Residuals>(c.state).worker, worker.t.data);
  EXPECT_EQ(std::get<Residuals>(c.state).server, server.t.data);
  // Hierarchical: 2 ranks share the chunks (ceil(10 / 2) = 5), so the same buffers are wrong.
  p.hierarchical = 1;
  EXPECT_EQ(c.run().reason,
            "Compressed allreduce: the residual_worker buffer must hold 10 elements of float32, "
            "got 12 of float32");
  p.hierarchical = 0;
  p.residual_server = nullptr;
  EXPECT_EQ(c.run().reason,
            "Compressed allreduce: error feedback takes 2 residual buffers (worker, server), got 1");
  p.residual_worker = nullptr;
  ASSERT_TRUE(c.run().ok());
  EXPECT_EQ(std::get<Residuals>(c.state).worker, nullptr);
  c.req.reduce_op = BHVD_MAX;
  EXPECT_EQ(c.run().reason, "Compressed allreduce (ByteGrad) supports only op=Average and op=Sum.");
  c.req.reduce_op = BHVD_SUM;
  p.compression = 0;
  EXPECT_EQ(c.run().reason, "Compressed allreduce: unknown compression 0");
}

TEST(Validate, ParameterStructsAreCheckedAgainstTheOpType) {
  Buf x(8);
  bhvd_peer_average_params avg{};
  avg.op_type = BHVD_OP_PEER_AVERAGE;
  // A primitive without its struct.
  Call none(BHVD_OP_PEER_AVERAGE, nullptr, x);
  EXPECT_EQ(none.run().type, StatusType::INVALID_ARGUMENT);
  EXPECT_EQ(none.run().reason,
            "Decentralized peer average: params must point to a bhvd_peer_average_params");
  // Another op type's struct.
  Call other(BHVD_OP_LP_DECENTRALIZED_STEP, &avg, x);
  EXPECT_EQ(other.run().reason,
            "Low-precision decentralized step: params must point to a bhvd_lp_step_params (its "
            "op_type is 10)");
  // Horovod's ops and the hierarchical allreduce take none.
  for (int32_t t : {BHVD_OP_ALLREDUCE, BHVD_OP_HIERARCHICAL_ALLREDUCE, BHVD_OP_BROADCAST}) {
    Call extra(t, &avg, x);
    EXPECT_EQ(extra.run().reason,
              op_title(t) + ": takes no parameter struct (params must be NULL)");
    Call plain(t, nullptr, x);
    EXPECT_TRUE(plain.run().ok()) << op_title(t);
    EXPECT_TRUE(std::holds_alternative<std::monostate>(plain.params));
  }
}

TEST(Validate, PeerAverage) {
  Buf x(8);
  bhvd_peer_average_params p{};
  p.op_type = BHVD_OP_PEER_AVERAGE;
  p.peer_mode = BHVD_PEER_SHIFT_ONE;
  p.step = 7;
  p.hierarchical = 1;
  Call c(BHVD_OP_PEER_AVERAGE, &p, x);
  ASSERT_TRUE(c.run().ok());
  const auto& got = std::get<PeerAverageParams>(c.params);
  EXPECT_EQ(got.peer_mode, BHVD_PEER_SHIFT_ONE);
  EXPECT_EQ(got.step, 7);
  EXPECT_TRUE(got.hierarchical);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(c.state));
  p.peer_mode = 3;
  EXPECT_EQ(c.run().reason, "Decentralized peer average: unknown peer selection mode 3");
  p.peer_mode = BHVD_PEER_RING;
  p.step = -1;
  EXPECT_EQ(c.run().reason, "Decentralized peer average: negative step");
  p.step = 0;
  p.hierarchical = 2;
  EXPECT_EQ(c.run().reason, "Decentralized peer average: hierarchical must be 0 or 1");
  p.hierarchical = 0;
  Buf ints(8, BHVD_INT32);
  Call i(BHVD_OP_PEER_AVERAGE, &p, ints);
  EXPECT_EQ(i.run().reason, "Decentralized peer average: weights must be floating point");
}

TEST(Validate, LowPrecisionRingNamesItsReplicas) {
  Buf x(6), own(6), left(6), right(6), short_right(5);
  bhvd_lp_step_params p{};
  p.op_type = BHVD_OP_LP_DECENTRALIZED_STEP;
  p.hierarchical = 1;
  p.self = &own.t;
  p.left = &left.t;
  p.right = &right.t;
  Call c(BHVD_OP_LP_DECENTRALIZED_STEP, &p, x);
  ASSERT_TRUE(c.run().ok());
  EXPECT_TRUE(std::get<LpRingParams>(c.params).hierarchical);
  const auto& rep = std::get<Replicas>(c.state);
  EXPECT_EQ(rep.self, own.t.data);
  EXPECT_EQ(rep.left, left.t.data);
  EXPECT_EQ(rep.right, right.t.data);
  EXPECT_EQ(rep.count, 6u);
  p.right = &short_right.t;
  EXPECT_EQ(c.run().reason,
            "Low-precision decentralized step: the right buffer must hold 6 elements of float32, "
            "got 5 of float32");
  p.right = nullptr;
  EXPECT_EQ(c.run().reason, "Low-precision decentralized step: the right buffer is required");
  p.right = &right.t;
  Buf elsewhere(6);
  c.req.outputs = &elsewhere.t;
  EXPECT_EQ(c.run().reason,
            "Low-precision decentralized step: updates the weights in place (output == input)");

  bhvd_lp_init_params init{};
  init.op_type = BHVD_OP_LP_DECENTRALIZED_INIT;
  init.self = &own.t;
  init.left = &left.t;
  init.right = &right.t;
  Call i(BHVD_OP_LP_DECENTRALIZED_INIT, &init, x);
  ASSERT_TRUE(i.run().ok());
  EXPECT_FALSE(std::get<LpRingParams>(i.params).hierarchical);
  EXPECT_EQ(std::get<Replicas>(i.state).self, own.t.data);
}

TEST(Validate, LowPrecisionExchangeTakesTheCompressedDifference) {
  Buf left(100), right(100);
  const auto bytes = static_cast<int64_t>(minmax_uint8_bytes(DataType::FLOAT32, 100, 1));
  Buf diff(bytes, BHVD_UINT8);
  bhvd_lp_exchange_params p{};
  p.op_type = BHVD_OP_LP_DECENTRALIZED_EXCHANGE;
  p.left = &left.t;
  p.right = &right.t;
  Call c(BHVD_OP_LP_DECENTRALIZED_EXCHANGE, &p, diff);
  ASSERT_TRUE(c.run().ok()) << c.run().reason;
  EXPECT_TRUE(std::holds_alternative<std::monostate>(c.params));
  const auto& rep = std::get<Replicas>(c.state);
  EXPECT_EQ(rep.self, nullptr);
  EXPECT_EQ(rep.left, left.t.data);
  EXPECT_EQ(rep.count, 100u);
  EXPECT_EQ(rep.dtype, DataType::FLOAT32);
  Buf short_diff(bytes - 1, BHVD_UINT8);
  Call s(BHVD_OP_LP_DECENTRALIZED_EXCHANGE, &p, short_diff);
  EXPECT_EQ(s.run().reason,
            "Low-precision decentralized exchange: the replicas and the compressed difference do "
            "not match in size or type");
}

TEST(Validate, AllreduceKindsShareHorovodsChecks) {
  Buf x(4);
  bhvd_compressed_allreduce_params p{};
  p.op_type = BHVD_OP_COMPRESSED_ALLREDUCE;
  p.compression = BHVD_COMPRESSION_MINMAX_UINT8;
  for (auto [t, params] : {std::pair<int32_t, const void*>{BHVD_OP_ALLREDUCE, nullptr},
                           {BHVD_OP_HIERARCHICAL_ALLREDUCE, nullptr},
                           {BHVD_OP_COMPRESSED_ALLREDUCE, &p}}) {
    Call c(t, params, x);
    c.req.reduce_op = BHVD_ADASUM;
    if (t == BHVD_OP_ALLREDUCE) {  // the set has 3 ranks
      EXPECT_EQ(c.run().type, StatusType::NOT_IMPLEMENTED);
      EXPECT_EQ(c.run().reason, "Running Adasum with non-power of 2 ranks is not supported yet.");
    } else {
      EXPECT_EQ(c.run().type, StatusType::INVALID_ARGUMENT) << t;
      EXPECT_EQ(c.run().reason, op_title(t) + ": Adasum runs as a plain allreduce only (not " +
                                    op_type_name(static_cast<OpType>(t)) + ")");
    }
    c.req.reduce_op = 9;
    EXPECT_EQ(c.run().reason, op_title(t) + ": unknown reduce op 9");
  }
}

TEST(Validate, AdasumTakesFloatingPointHostTensorsOnAPowerOf2OfRanks) {
  Buf x(4), ints(4, BHVD_INT32);
  auto run = [](Call& c, std::vector<int32_t> ranks) {
    const std::string title = op_title(c.req.op_type);
    if (Status s = validate_request(c.req, title); !s.ok()) return s;
    return validate_for_set(
        c.req, title, ranks, 1, [&](bool) { return static_cast<int>(ranks.size()); }, &c.params,
        &c.state);
  };
  Call ok(BHVD_OP_ALLREDUCE, nullptr, x);
  ok.req.reduce_op = BHVD_ADASUM;
  EXPECT_TRUE(run(ok, {0, 1}).ok());
  EXPECT_TRUE(run(ok, {0, 1, 2, 3}).ok());
  EXPECT_EQ(run(ok, {0, 1, 2, 3, 4, 5}).reason,
            "Running Adasum with non-power of 2 ranks is not supported yet.");
  Call bad(BHVD_OP_ALLREDUCE, nullptr, ints);
  bad.req.reduce_op = BHVD_ADASUM;
  EXPECT_EQ(run(bad, {0, 1}).type, StatusType::INVALID_ARGUMENT);
  EXPECT_EQ(run(bad, {0, 1}).reason,
            "Allreduce: Adasum reduces float16, float32 and float64 tensors, not int32");
  // CUDA tensors: no rule on the number of ranks (validate_device_adasum has the hosts').
  ok.req.device = 0;
  EXPECT_TRUE(validate_for_set(
                  ok.req, "Allreduce", {0, 1, 2, 3, 4, 5}, 1, [](bool) { return 6; }, &ok.params,
                  &ok.state)
                  .ok());
  Call rs(BHVD_OP_REDUCESCATTER, nullptr, x);
  rs.req.reduce_op = BHVD_ADASUM;
  EXPECT_EQ(run(rs, {0, 1}).type, StatusType::NOT_IMPLEMENTED);
  EXPECT_EQ(run(rs, {0, 1}).reason, "Reducescatter currently only supports AVERAGE and SUM.");
  Call on_a_set(BHVD_OP_ALLREDUCE, nullptr, x);  // Horovod: global set only, checked first
  on_a_set.req.reduce_op = BHVD_ADASUM;
  on_a_set.req.process_set_id = 1;
  EXPECT_EQ(run(on_a_set, {0, 1}).type, StatusType::NOT_IMPLEMENTED);
  EXPECT_EQ(run(on_a_set, {0, 1, 2}).reason, "Adasum does not support non-global process sets yet.");
  Call op4(BHVD_OP_ADASUM, nullptr, x);
  EXPECT_EQ(run(op4, {0, 1}).type, StatusType::INVALID_ARGUMENT);
}

TEST(Validate, GpuAdasumWantsAPowerOf2OfHostsWithAsManyRanksEach) {
  EXPECT_TRUE(validate_device_adasum({1}).ok());
  EXPECT_TRUE(validate_device_adasum({4}).ok());
  EXPECT_TRUE(validate_device_adasum({2, 2}).ok());
  EXPECT_TRUE(validate_device_adasum({3, 3, 3, 3}).ok());
  const Status uneven = validate_device_adasum({2, 1});
  EXPECT_EQ(uneven.type, StatusType::NOT_IMPLEMENTED);
  EXPECT_EQ(uneven.reason, "Running GPU Adasum on heterogeneous cluster is not supported yet.");
  const Status three = validate_device_adasum({2, 2, 2});
  EXPECT_EQ(three.type, StatusType::NOT_IMPLEMENTED);
  EXPECT_EQ(three.reason, "Running GPU Adasum with non-power of 2 nodes is not supported yet.");
}

}  // namespace
}  // namespace bagua_hvd
