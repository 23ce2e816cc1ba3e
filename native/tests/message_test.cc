// Negotiation messages (requests/message.cc): encode/decode round trips, hand-picked and random
// (seeded), and the rejection of truncated, extended and corrupted frames.
#include "requests/message.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

namespace bagua_hvd {
namespace {

// Field by field, written here rather than through Request::same_params or the params'
// operator== (the code under test).
void expect_same(const OpParams& a, const OpParams& b) {
  ASSERT_EQ(a.index(), b.index());
  if (auto* p = std::get_if<CompressedAllreduceParams>(&a)) {
    const auto& q = std::get<CompressedAllreduceParams>(b);
    EXPECT_EQ(p->compression, q.compression);
    EXPECT_EQ(p->hierarchical, q.hierarchical);
  } else if (auto* p = std::get_if<PeerAverageParams>(&a)) {
    const auto& q = std::get<PeerAverageParams>(b);
    EXPECT_EQ(p->peer_mode, q.peer_mode);
    EXPECT_EQ(p->step, q.step);
    EXPECT_EQ(p->hierarchical, q.hierarchical);
  } else if (auto* p = std::get_if<LpRingParams>(&a)) {
    EXPECT_EQ(p->hierarchical, std::get<LpRingParams>(b).hierarchical);
  }
}

void expect_same(const Request& a, const Request& b) {
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.process_set_id, b.process_set_id);
  EXPECT_EQ(a.reduce_op, b.reduce_op);
  EXPECT_EQ(a.root_rank, b.root_rank);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(std::memcmp(&a.prescale, &b.prescale, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a.postscale, &b.postscale, sizeof(double)), 0);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.splits, b.splits);
  EXPECT_EQ(a.urgent, b.urgent);
  expect_same(a.params, b.params);
}

void expect_same(const Response& a, const Response& b) {
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.process_set_id, b.process_set_id);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.reduce_op, b.reduce_op);
  EXPECT_EQ(a.root_rank, b.root_rank);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(std::memcmp(&a.prescale, &b.prescale, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a.postscale, &b.postscale, sizeof(double)), 0);
  expect_same(a.params, b.params);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(a.names, b.names);
  EXPECT_EQ(a.shapes, b.shapes);
  EXPECT_EQ(a.per_rank, b.per_rank);
  EXPECT_EQ(a.cache_ids, b.cache_ids);
  EXPECT_EQ(a.last_joined_rank, b.last_joined_rank);
  EXPECT_EQ(a.new_set_id, b.new_set_id);
  EXPECT_EQ(a.set_ranks, b.set_ranks);
}

void expect_same(const RequestList& a, const RequestList& b) {
  EXPECT_EQ(a.acked_seq, b.acked_seq);
  EXPECT_EQ(a.shutdown, b.shutdown);
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) expect_same(a.requests[i], b.requests[i]);
  EXPECT_EQ(a.cached, b.cached);
  EXPECT_EQ(a.cached_urgent, b.cached_urgent);
  EXPECT_EQ(a.urgent, b.urgent);
  EXPECT_EQ(a.failure, b.failure);
}

void expect_same(const ResponseList& a, const ResponseList& b) {
  EXPECT_EQ(a.seq, b.seq);
  EXPECT_EQ(a.shutdown, b.shutdown);
  ASSERT_EQ(a.responses.size(), b.responses.size());
  for (size_t i = 0; i < a.responses.size(); ++i) expect_same(a.responses[i], b.responses[i]);
  EXPECT_EQ(a.evicted, b.evicted);
  EXPECT_EQ(a.hierarchical_allreduce, b.hierarchical_allreduce);
}

const DataType kTypes[] = {DataType::UINT8,   DataType::INT8,  DataType::UINT16,  DataType::INT16,
                           DataType::INT32,   DataType::INT64, DataType::FLOAT16, DataType::FLOAT32,
                           DataType::FLOAT64, DataType::BOOL,  DataType::BFLOAT16};

class Random {
 public:
  explicit Random(uint32_t seed) : g_(seed) {}
  int64_t num(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g_); }
  bool coin() { return num(0, 1) == 1; }
  double real() { return std::uniform_real_distribution<double>(-1e6, 1e6)(g_); }
  std::string text(int max_len) {
    std::string s(static_cast<size_t>(num(0, max_len)), '\0');
    for (auto& c : s) c = static_cast<char>(num(0, 255));  // any byte, NUL included
    return s;
  }
  template <typename T>
  std::vector<T> vec(int max_len, int64_t lo, int64_t hi) {
    std::vector<T> v(static_cast<size_t>(num(0, max_len)));
    for (auto& x : v) x = static_cast<T>(num(lo, hi));
    return v;
  }
  DataType dtype() { return kTypes[num(0, 10)]; }
  // An op type: one of the public ones (BAGUA's primitives among them) most of the time, else
  // anything (internal and unknown types carry no parameters).
  int32_t type(int32_t lo) {
    return coin() ? static_cast<int32_t>(num(BHVD_OP_ALLREDUCE, BHVD_OP_LP_DECENTRALIZED_EXCHANGE))
                  : static_cast<int32_t>(num(lo, 101));
  }
  // Random values of the parameters type takes.
  OpParams params(int32_t type) {
    OpParams p = params_for_type(type);
    if (auto* c = std::get_if<CompressedAllreduceParams>(&p)) {
      c->compression = static_cast<int32_t>(num(-(1 << 20), 1 << 20));
      c->hierarchical = coin();
    } else if (auto* a = std::get_if<PeerAverageParams>(&p)) {
      a->peer_mode = static_cast<int32_t>(num(-1, 2));
      a->step = num(0, int64_t(1) << 50);
      a->hierarchical = coin();
    } else if (auto* l = std::get_if<LpRingParams>(&p)) {
      l->hierarchical = coin();
    }
    return p;
  }

  Request request() {
    Request r;
    r.rank = static_cast<int32_t>(num(0, 1 << 20));
    r.type = type(0);
    r.dtype = dtype();
    r.name = text(40);
    r.process_set_id = static_cast<int32_t>(num(0, 1000));
    r.reduce_op = static_cast<ReduceOp>(num(0, 5));
    r.root_rank = static_cast<int32_t>(num(-1, 1 << 20));
    r.device = static_cast<int32_t>(num(-1, 7));
    r.prescale = real();
    r.postscale = real();
    r.shape = vec<int64_t>(6, 0, int64_t(1) << 40);
    r.splits = vec<int32_t>(9, 0, 1 << 30);
    r.urgent = coin();
    r.params = params(r.type);
    return r;
  }

  Response response() {
    Response r;
    r.kind = coin() ? Response::OP : Response::ERROR;
    r.type = type(-1);
    r.process_set_id = static_cast<int32_t>(num(0, 1000));
    r.dtype = dtype();
    r.reduce_op = static_cast<ReduceOp>(num(0, 5));
    r.root_rank = static_cast<int32_t>(num(0, 1 << 20));
    r.device = static_cast<int32_t>(num(-1, 7));
    r.prescale = real();
    r.postscale = real();
    r.params = params(r.type);
    r.error = text(80);
    const int tensors = static_cast<int>(num(0, 5));
    for (int i = 0; i < tensors; ++i) {
      r.names.push_back(text(30));
      r.shapes.push_back(vec<int64_t>(4, 0, 1 << 20));
      r.per_rank.push_back(vec<int64_t>(16, 0, 1 << 20));
      r.cache_ids.push_back(static_cast<int32_t>(num(-1, 5000)));
    }
    r.last_joined_rank = static_cast<int32_t>(num(-1, 64));
    r.new_set_id = static_cast<int32_t>(num(-1, 64));
    r.set_ranks = vec<int32_t>(8, 0, 64);
    return r;
  }

  RequestList request_list() {
    RequestList l;
    l.acked_seq = static_cast<uint64_t>(num(0, int64_t(1) << 60));
    l.shutdown = coin();
    for (int i = num(0, 6); i > 0; --i) l.requests.push_back(request());
    l.cached = vec<int32_t>(10, 0, 5000);
    l.cached_urgent = vec<int32_t>(10, 0, 1);
    for (int i = num(0, 3); i > 0; --i) l.urgent.push_back(text(20));
    return l;
  }

  ResponseList response_list() {
    ResponseList l;
    l.seq = static_cast<uint64_t>(num(0, int64_t(1) << 60));
    l.shutdown = coin();
    for (int i = num(0, 6); i > 0; --i) l.responses.push_back(response());
    l.evicted = vec<int32_t>(10, 0, 5000);
    l.hierarchical_allreduce = static_cast<int8_t>(num(-1, 1));
    return l;
  }

 private:
  std::mt19937 g_;
};

TEST(Message, TheAutotunersSettingOutsideItsValuesIsRejected) {
  ResponseList l;
  l.hierarchical_allreduce = 1;
  std::string bytes = encode(l);
  expect_same(decode_response_list(bytes), l);
  bytes.back() = 2;  // the setting is the last byte
  EXPECT_THROW(decode_response_list(bytes), TransportError);
}

TEST(Message, EmptyListsRoundTrip) {
  expect_same(decode_request_list(encode(RequestList{})), RequestList{});
  expect_same(decode_response_list(encode(ResponseList{})), ResponseList{});
}

TEST(Message, HandWrittenRequestRoundTrips) {
  RequestList l;
  l.acked_seq = 7;
  Request r;
  r.rank = 3;
  r.type = BHVD_OP_ALLTOALL;
  r.dtype = DataType::BFLOAT16;
  r.name = std::string("grad.w\0x", 8);  // an embedded NUL survives
  r.process_set_id = 2;
  r.shape = {4, 0, 3};
  r.splits = {1, 3};
  r.prescale = -0.0;
  r.postscale = 0.125;
  l.requests.push_back(r);
  l.cached = {0, 17};
  l.cached_urgent = {1, 0};
  l.urgent = {"0:a"};
  l.failure = "connection to rank 2 (10.0.0.2:4000) closed";
  const RequestList back = decode_request_list(encode(l));
  expect_same(back, l);
  EXPECT_EQ(back.requests[0].name.size(), 8u);
  EXPECT_TRUE(std::signbit(back.requests[0].prescale));
}

TEST(Message, EachPrimitivesParamsRoundTrip) {
  RequestList l;
  ResponseList rl;
  auto add = [&](int32_t type, OpParams params) {
    Request r;
    r.type = type;
    r.name = op_type_name(static_cast<OpType>(type));
    r.params = params;
    l.requests.push_back(r);
    Response s;
    s.type = type;
    s.params = params;
    rl.responses.push_back(s);
  };
  add(BHVD_OP_HIERARCHICAL_ALLREDUCE, std::monostate{});
  add(BHVD_OP_COMPRESSED_ALLREDUCE, CompressedAllreduceParams{BHVD_COMPRESSION_MINMAX_UINT8, true});
  add(BHVD_OP_PEER_AVERAGE, PeerAverageParams{BHVD_PEER_SHIFT_ONE, (int64_t(1) << 40) + 3, true});
  add(BHVD_OP_LP_DECENTRALIZED_INIT, LpRingParams{true});
  add(BHVD_OP_LP_DECENTRALIZED_STEP, LpRingParams{false});
  add(BHVD_OP_LP_DECENTRALIZED_EXCHANGE, std::monostate{});
  const RequestList back = decode_request_list(encode(l));
  expect_same(back, l);
  expect_same(decode_response_list(encode(rl)), rl);
  const auto& avg = std::get<PeerAverageParams>(back.requests[2].params);
  EXPECT_EQ(avg.peer_mode, BHVD_PEER_SHIFT_ONE);
  EXPECT_EQ(avg.step, (int64_t(1) << 40) + 3);
  EXPECT_TRUE(avg.hierarchical);
  EXPECT_TRUE(std::get<LpRingParams>(back.requests[3].params).hierarchical);
}

TEST(Message, ParamsOfAnotherOpTypeAreRejected) {
  // Encoded as sent; the receiver knows which parameters each op type takes.
  for (auto [type, params] : {std::pair<int32_t, OpParams>{BHVD_OP_PEER_AVERAGE, std::monostate{}},
                              {BHVD_OP_ALLREDUCE, CompressedAllreduceParams{}},
                              {BHVD_OP_LP_DECENTRALIZED_STEP, PeerAverageParams{}},
                              {BHVD_OP_COMPRESSED_ALLREDUCE, LpRingParams{}}}) {
    RequestList l;
    Request r;
    r.type = type;
    r.params = params;
    l.requests.push_back(r);
    EXPECT_THROW(decode_request_list(encode(l)), TransportError) << type;
    ResponseList rl;
    Response s;
    s.type = type;
    s.params = params;
    rl.responses.push_back(s);
    EXPECT_THROW(decode_response_list(encode(rl)), TransportError) << type;
  }
}

TEST(Message, RandomRequestListsRoundTrip) {
  Random rnd(12345);
  for (int i = 0; i < 500; ++i) {
    const RequestList l = rnd.request_list();
    expect_same(decode_request_list(encode(l)), l);
  }
}

TEST(Message, RandomResponseListsRoundTrip) {
  Random rnd(54321);
  for (int i = 0; i < 500; ++i) {
    const ResponseList l = rnd.response_list();
    expect_same(decode_response_list(encode(l)), l);
  }
}

TEST(Message, EveryTruncationIsRejected) {
  Random rnd(7);
  for (int i = 0; i < 20; ++i) {
    const std::string req = encode(rnd.request_list());
    for (size_t n = 0; n < req.size(); ++n)
      EXPECT_THROW(decode_request_list(req.substr(0, n)), TransportError) << "length " << n;
    const std::string resp = encode(rnd.response_list());
    for (size_t n = 0; n < resp.size(); ++n)
      EXPECT_THROW(decode_response_list(resp.substr(0, n)), TransportError) << "length " << n;
  }
}

TEST(Message, TrailingBytesAreRejected) {
  Random rnd(8);
  EXPECT_THROW(decode_request_list(encode(rnd.request_list()) + '\0'), TransportError);
  EXPECT_THROW(decode_response_list(encode(rnd.response_list()) + "x"), TransportError);
}

TEST(Message, CorruptedFramesAreRejected) {
  RequestList l;
  Request r;
  r.name = "t";
  r.dtype = DataType::FLOAT32;
  l.requests.push_back(r);
  const std::string good = encode(l);
  // The magic: any change of the first 4 bytes.
  for (int b = 0; b < 4; ++b) {
    std::string bad = good;
    bad[b] = static_cast<char>(bad[b] ^ 0x5a);
    EXPECT_THROW(decode_request_list(bad), TransportError) << "byte " << b;
  }
  // The two kinds of list are told apart.
  EXPECT_THROW(decode_response_list(good), TransportError);
  EXPECT_THROW(decode_request_list(encode(ResponseList{})), TransportError);
  // A length field claiming more than the frame holds: find the name's length (1) followed by
  // 't' and make it huge.
  const std::string len1("\x01\x00\x00\x00t", 5);
  const size_t at = good.find(len1);
  ASSERT_NE(at, std::string::npos);
  std::string huge = good;
  huge[at + 3] = '\x7f';
  EXPECT_THROW(decode_request_list(huge), TransportError);
  // A data type that does not exist.
  Random rnd(9);
  int rejected = 0;
  for (int v : {-1, 11, 99, 1 << 20}) {
    RequestList one;
    Request q;
    q.name = "dtype";
    q.dtype = static_cast<DataType>(v);
    one.requests.push_back(q);
    try {
      decode_request_list(encode(one));
    } catch (const TransportError&) {
      ++rejected;
    }
  }
  EXPECT_EQ(rejected, 4);
}

}  // namespace
}  // namespace bagua_hvd
