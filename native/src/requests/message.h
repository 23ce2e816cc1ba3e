// Negotiation messages between ranks and the coordinator, and their wire encoding.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "base/common.h"

namespace bagua_hvd {

// Internal request types beyond the public ones: process-set changes are negotiated like ops so
// every rank applies them at the same point of the global order.
constexpr int32_t kOpAddProcessSet = 100;
constexpr int32_t kOpRemoveProcessSet = 101;

// The parameters of BAGUA's primitives that every rank must agree on: c_api.h's
// bhvd_*_params without their buffers (this rank's state, requests/handle.h), one struct per kind.
struct CompressedAllreduceParams {  // BHVD_OP_COMPRESSED_ALLREDUCE
  int32_t compression = BHVD_COMPRESSION_MINMAX_UINT8;
  bool hierarchical = false;
  bool operator==(const CompressedAllreduceParams& o) const {
    return compression == o.compression && hierarchical == o.hierarchical;
  }
};
struct PeerAverageParams {  // BHVD_OP_PEER_AVERAGE
  int32_t peer_mode = BHVD_PEER_ALL;
  int64_t step = 0;
  bool hierarchical = false;
  bool operator==(const PeerAverageParams& o) const {
    return peer_mode == o.peer_mode && step == o.step && hierarchical == o.hierarchical;
  }
};
struct LpRingParams {  // BHVD_OP_LP_DECENTRALIZED_INIT and _STEP
  bool hierarchical = false;
  bool operator==(const LpRingParams& o) const { return hierarchical == o.hierarchical; }
};
// std::monostate for the op types without parameters.
using OpParams =
    std::variant<std::monostate, CompressedAllreduceParams, PeerAverageParams, LpRingParams>;

// The (default) parameters an op type takes: the alternative of OpParams it must hold.
OpParams params_for_type(int32_t type);
// Whether the op runs over the set's host hierarchy (when the set has one).
bool runs_hierarchical(int32_t type, const OpParams& params);
// "compression 1, hierarchical 0", ... for error messages.
std::string describe(const OpParams& params);

// One tensor (or control action) a rank wants to run.
struct Request {
  int32_t rank = 0;  // global rank of the submitter
  int32_t type = 0;  // OpType value or kOp*
  DataType dtype = DataType::FLOAT32;
  std::string name;
  int32_t process_set_id = 0;
  ReduceOp reduce_op = ReduceOp::SUM;
  int32_t root_rank = 0;
  int32_t device = -1;
  double prescale = 1.0, postscale = 1.0;
  std::vector<int64_t> shape;
  std::vector<int32_t> splits;  // alltoall: per set rank; add/remove process set: the ranks / id
  bool urgent = false;
  OpParams params;  // the alternative params_for_type(type)

  // True when two requests carry the same parameters (everything but rank and urgency).
  bool same_params(const Request& o) const;
};

// What the coordinator decided for one or more tensors (several when fused).
struct Response {
  enum Kind : int32_t { OP = 0, ERROR = 1 };
  Kind kind = OP;
  int32_t type = 0;  // OpType or kOp*
  int32_t process_set_id = 0;
  DataType dtype = DataType::FLOAT32;
  ReduceOp reduce_op = ReduceOp::SUM;
  int32_t root_rank = 0;
  int32_t device = -1;
  double prescale = 1.0, postscale = 1.0;
  OpParams params;  // the alternative params_for_type(type)
  std::string error;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;  // per tensor (joined ranks need them for zeros)
  // Per tensor, one value per set rank: allgather dim0 sizes; alltoall the row-major n x n
  // splits matrix (sender-major) flattened.
  std::vector<std::vector<int64_t>> per_rank;
  std::vector<int32_t> cache_ids;  // per tensor, -1 when not cached
  int32_t last_joined_rank = -1;   // JOIN
  int32_t new_set_id = -1;         // add/remove process set
  std::vector<int32_t> set_ranks;  // add process set
};

// Worker -> coordinator; as a failure notice (failure set), a worker -> every peer.
struct RequestList {
  uint64_t acked_seq = 0;             // last ResponseList applied
  bool shutdown = false;              // this rank is shutting down
  std::vector<Request> requests;      // full requests
  std::vector<int32_t> cached;        // cache ids of requests identical to a cached one
  std::vector<int32_t> cached_urgent; // urgency flag per cached entry
  std::vector<std::string> urgent;    // names already sent whose caller now blocks
  // Non-empty only in the failure notice of a rank whose communication failed (the reason it
  // raises), sent to every peer before it stops: see Runtime::relayed_failure.
  std::string failure;
};

// Coordinator -> every worker.
struct ResponseList {
  uint64_t seq = 0;
  bool shutdown = false;
  std::vector<Response> responses;
  std::vector<int32_t> evicted;  // cache ids dropped by the coordinator
  // The autotuner's hierarchical allreduce (core/autotune.h) from this list on: 0 or 1; -1:
  // unchanged. In the list, so that every rank switches at the same point of the order.
  int8_t hierarchical_allreduce = -1;
};

// Names are unique within a process set (as in Horovod, where every set has its own queue):
// the core keys its tables by set and name.
inline std::string tensor_key(int32_t set_id, const std::string& name) {
  return std::to_string(set_id) + ":" + name;
}
inline std::string key_name(const std::string& key) { return key.substr(key.find(':') + 1); }

std::string encode(const RequestList& m);
std::string encode(const ResponseList& m);
// Throw TransportError on malformed input (a peer sending garbage must not crash us).
RequestList decode_request_list(const std::string& bytes);
ResponseList decode_response_list(const std::string& bytes);

}  // namespace bagua_hvd
