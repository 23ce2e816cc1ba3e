#include "requests/message.h"

#include <cstring>
#include <type_traits>

namespace bagua_hvd {

OpParams params_for_type(int32_t type) {
  switch (type) {
    case BHVD_OP_COMPRESSED_ALLREDUCE: return CompressedAllreduceParams{};
    case BHVD_OP_PEER_AVERAGE: return PeerAverageParams{};
    case BHVD_OP_LP_DECENTRALIZED_INIT:
    case BHVD_OP_LP_DECENTRALIZED_STEP: return LpRingParams{};
  }
  return std::monostate{};
}

bool runs_hierarchical(int32_t type, const OpParams& params) {
  if (type == BHVD_OP_HIERARCHICAL_ALLREDUCE) return true;
  if (auto* p = std::get_if<CompressedAllreduceParams>(&params)) return p->hierarchical;
  if (auto* p = std::get_if<PeerAverageParams>(&params)) return p->hierarchical;
  if (auto* p = std::get_if<LpRingParams>(&params)) return p->hierarchical;
  return false;
}

std::string describe(const OpParams& params) {
  auto flag = [](bool b) { return std::string(b ? "1" : "0"); };
  if (auto* p = std::get_if<CompressedAllreduceParams>(&params))
    return "compression " + std::to_string(p->compression) + ", hierarchical " +
           flag(p->hierarchical);
  if (auto* p = std::get_if<PeerAverageParams>(&params))
    return "peer mode " + std::to_string(p->peer_mode) + ", step " + std::to_string(p->step) +
           ", hierarchical " + flag(p->hierarchical);
  if (auto* p = std::get_if<LpRingParams>(&params)) return "hierarchical " + flag(p->hierarchical);
  return "no parameters";
}

bool Request::same_params(const Request& o) const {
  return type == o.type && dtype == o.dtype && name == o.name &&
         process_set_id == o.process_set_id && reduce_op == o.reduce_op &&
         root_rank == o.root_rank && device == o.device && prescale == o.prescale &&
         postscale == o.postscale && shape == o.shape && splits == o.splits &&
         params == o.params;
}

namespace {

// Little-endian host assumed (x86-64, aarch64): the wire format is the in-memory one.
class Writer {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable<T>::value, "POD only");
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<uint32_t>(static_cast<uint32_t>(v.size()));
    if (!v.empty()) out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : p_(s.data()), end_(s.data() + s.size()) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_str() {
    uint32_t n = get<uint32_t>();
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  template <typename T>
  std::vector<T> get_vec() {
    uint32_t n = get<uint32_t>();
    need(static_cast<size_t>(n) * sizeof(T));
    std::vector<T> v(n);
    if (n) std::memcpy(v.data(), p_, n * sizeof(T));
    p_ += n * sizeof(T);
    return v;
  }
  void finish() const {
    if (p_ != end_) throw TransportError("malformed negotiation message: trailing bytes");
  }

 private:
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n)
      throw TransportError("malformed negotiation message: truncated");
  }
  const char* p_;
  const char* end_;
};

// The op's parameters, shared by Request and Response: the alternative's index, then its
// fields. The index must be the one the op type takes.
void put_params(Writer& w, const OpParams& params) {
  w.put<uint8_t>(static_cast<uint8_t>(params.index()));
  if (auto* p = std::get_if<CompressedAllreduceParams>(&params)) {
    w.put<int32_t>(p->compression);
    w.put<uint8_t>(p->hierarchical ? 1 : 0);
  } else if (auto* p = std::get_if<PeerAverageParams>(&params)) {
    w.put<int32_t>(p->peer_mode);
    w.put<int64_t>(p->step);
    w.put<uint8_t>(p->hierarchical ? 1 : 0);
  } else if (auto* p = std::get_if<LpRingParams>(&params)) {
    w.put<uint8_t>(p->hierarchical ? 1 : 0);
  }
}

OpParams get_params(Reader& rd, int32_t type) {
  OpParams params = params_for_type(type);
  if (rd.get<uint8_t>() != params.index())
    throw TransportError("malformed negotiation message: parameters of another op type");
  if (auto* p = std::get_if<CompressedAllreduceParams>(&params)) {
    p->compression = rd.get<int32_t>();
    p->hierarchical = rd.get<uint8_t>() != 0;
  } else if (auto* p = std::get_if<PeerAverageParams>(&params)) {
    p->peer_mode = rd.get<int32_t>();
    p->step = rd.get<int64_t>();
    p->hierarchical = rd.get<uint8_t>() != 0;
  } else if (auto* p = std::get_if<LpRingParams>(&params)) {
    p->hierarchical = rd.get<uint8_t>() != 0;
  }
  return params;
}

constexpr uint32_t kRequestListMagic = 0x42485251;   // "BHRQ"
constexpr uint32_t kResponseListMagic = 0x42485253;  // "BHRS"

void put_request(Writer& w, const Request& r) {
  w.put<int32_t>(r.rank);
  w.put<int32_t>(r.type);
  w.put<int32_t>(static_cast<int32_t>(r.dtype));
  w.put_str(r.name);
  w.put<int32_t>(r.process_set_id);
  w.put<int32_t>(static_cast<int32_t>(r.reduce_op));
  w.put<int32_t>(r.root_rank);
  w.put<int32_t>(r.device);
  w.put<double>(r.prescale);
  w.put<double>(r.postscale);
  w.put_vec(r.shape);
  w.put_vec(r.splits);
  w.put<uint8_t>(r.urgent ? 1 : 0);
  put_params(w, r.params);
}

Request get_request(Reader& rd) {
  Request r;
  r.rank = rd.get<int32_t>();
  r.type = rd.get<int32_t>();
  int32_t dt = rd.get<int32_t>();
  if (!dtype_valid(dt)) throw TransportError("malformed negotiation message: bad dtype");
  r.dtype = static_cast<DataType>(dt);
  r.name = rd.get_str();
  r.process_set_id = rd.get<int32_t>();
  r.reduce_op = static_cast<ReduceOp>(rd.get<int32_t>());
  r.root_rank = rd.get<int32_t>();
  r.device = rd.get<int32_t>();
  r.prescale = rd.get<double>();
  r.postscale = rd.get<double>();
  r.shape = rd.get_vec<int64_t>();
  r.splits = rd.get_vec<int32_t>();
  r.urgent = rd.get<uint8_t>() != 0;
  r.params = get_params(rd, r.type);
  return r;
}

}  // namespace

std::string encode(const RequestList& m) {
  Writer w;
  w.put<uint32_t>(kRequestListMagic);
  w.put<uint64_t>(m.acked_seq);
  w.put<uint8_t>(m.shutdown ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(m.requests.size()));
  for (const auto& r : m.requests) put_request(w, r);
  w.put_vec(m.cached);
  w.put_vec(m.cached_urgent);
  w.put<uint32_t>(static_cast<uint32_t>(m.urgent.size()));
  for (const auto& s : m.urgent) w.put_str(s);
  w.put_str(m.failure);
  return w.take();
}

RequestList decode_request_list(const std::string& bytes) {
  Reader rd(bytes);
  if (rd.get<uint32_t>() != kRequestListMagic)
    throw TransportError("malformed negotiation message: bad request-list magic");
  RequestList m;
  m.acked_seq = rd.get<uint64_t>();
  m.shutdown = rd.get<uint8_t>() != 0;
  uint32_t n = rd.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) m.requests.push_back(get_request(rd));
  m.cached = rd.get_vec<int32_t>();
  m.cached_urgent = rd.get_vec<int32_t>();
  uint32_t nu = rd.get<uint32_t>();
  for (uint32_t i = 0; i < nu; ++i) m.urgent.push_back(rd.get_str());
  m.failure = rd.get_str();
  rd.finish();
  return m;
}

std::string encode(const ResponseList& m) {
  Writer w;
  w.put<uint32_t>(kResponseListMagic);
  w.put<uint64_t>(m.seq);
  w.put<uint8_t>(m.shutdown ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(m.responses.size()));
  for (const auto& r : m.responses) {
    w.put<int32_t>(r.kind);
    w.put<int32_t>(r.type);
    w.put<int32_t>(r.process_set_id);
    w.put<int32_t>(static_cast<int32_t>(r.dtype));
    w.put<int32_t>(static_cast<int32_t>(r.reduce_op));
    w.put<int32_t>(r.root_rank);
    w.put<int32_t>(r.device);
    w.put<double>(r.prescale);
    w.put<double>(r.postscale);
    put_params(w, r.params);
    w.put_str(r.error);
    w.put<uint32_t>(static_cast<uint32_t>(r.names.size()));
    for (size_t i = 0; i < r.names.size(); ++i) {
      w.put_str(r.names[i]);
      w.put_vec(r.shapes[i]);
      w.put_vec(r.per_rank[i]);
      w.put<int32_t>(r.cache_ids[i]);
    }
    w.put<int32_t>(r.last_joined_rank);
    w.put<int32_t>(r.new_set_id);
    w.put_vec(r.set_ranks);
  }
  w.put_vec(m.evicted);
  w.put<int8_t>(m.hierarchical_allreduce);
  return w.take();
}

ResponseList decode_response_list(const std::string& bytes) {
  Reader rd(bytes);
  if (rd.get<uint32_t>() != kResponseListMagic)
    throw TransportError("malformed negotiation message: bad response-list magic");
  ResponseList m;
  m.seq = rd.get<uint64_t>();
  m.shutdown = rd.get<uint8_t>() != 0;
  uint32_t n = rd.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    Response r;
    r.kind = static_cast<Response::Kind>(rd.get<int32_t>());
    r.type = rd.get<int32_t>();
    r.process_set_id = rd.get<int32_t>();
    int32_t dt = rd.get<int32_t>();
    if (!dtype_valid(dt)) throw TransportError("malformed negotiation message: bad dtype");
    r.dtype = static_cast<DataType>(dt);
    r.reduce_op = static_cast<ReduceOp>(rd.get<int32_t>());
    r.root_rank = rd.get<int32_t>();
    r.device = rd.get<int32_t>();
    r.prescale = rd.get<double>();
    r.postscale = rd.get<double>();
    r.params = get_params(rd, r.type);
    r.error = rd.get_str();
    uint32_t k = rd.get<uint32_t>();
    for (uint32_t j = 0; j < k; ++j) {
      r.names.push_back(rd.get_str());
      r.shapes.push_back(rd.get_vec<int64_t>());
      r.per_rank.push_back(rd.get_vec<int64_t>());
      r.cache_ids.push_back(rd.get<int32_t>());
    }
    r.last_joined_rank = rd.get<int32_t>();
    r.new_set_id = rd.get<int32_t>();
    r.set_ranks = rd.get_vec<int32_t>();
    m.responses.push_back(std::move(r));
  }
  m.evicted = rd.get_vec<int32_t>();
  m.hierarchical_allreduce = rd.get<int8_t>();
  if (m.hierarchical_allreduce < -1 || m.hierarchical_allreduce > 1)
    throw TransportError("malformed negotiation message: bad hierarchical allreduce setting");
  rd.finish();
  return m;
}

}  // namespace bagua_hvd
