// Request validation (core/validate.h).
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "compression/minmax_uint8.h"
#include "engines/device_engine.h"

namespace bagua_hvd {

// "Allreduce", "Allgather", ... as Horovod's per-op messages spell them.
std::string op_title(int32_t type) {
  switch (type) {
    case BHVD_OP_ALLREDUCE: return "Allreduce";
    case BHVD_OP_ALLGATHER: return "Allgather";
    case BHVD_OP_BROADCAST: return "Broadcast";
    case BHVD_OP_JOIN: return "Join";
    case BHVD_OP_ADASUM: return "Adasum";
    case BHVD_OP_ALLTOALL: return "Alltoall";
    case BHVD_OP_BARRIER: return "Barrier";
    case BHVD_OP_REDUCESCATTER: return "Reducescatter";
    case BHVD_OP_HIERARCHICAL_ALLREDUCE: return "Hierarchical allreduce";
    case BHVD_OP_COMPRESSED_ALLREDUCE: return "Compressed allreduce";
    case BHVD_OP_PEER_AVERAGE: return "Decentralized peer average";
    case BHVD_OP_LP_DECENTRALIZED_INIT: return "Low-precision decentralized initialisation";
    case BHVD_OP_LP_DECENTRALIZED_STEP: return "Low-precision decentralized step";
    case BHVD_OP_LP_DECENTRALIZED_EXCHANGE: return "Low-precision decentralized exchange";
  }
  return "Operation";
}

std::string op_prefix(int32_t type, bool grouped) {
  std::string p;
  switch (type) {
    case BHVD_OP_ALLREDUCE: p = "allreduce"; break;
    case BHVD_OP_ALLGATHER: p = "allgather"; break;
    case BHVD_OP_BROADCAST: p = "broadcast"; break;
    case BHVD_OP_ALLTOALL: p = "alltoall"; break;
    case BHVD_OP_REDUCESCATTER: p = "reducescatter"; break;
    case BHVD_OP_ADASUM: p = "adasum"; break;
    case BHVD_OP_HIERARCHICAL_ALLREDUCE: p = "hierarchical_allreduce"; break;
    case BHVD_OP_COMPRESSED_ALLREDUCE: p = "compressed_allreduce"; break;
    case BHVD_OP_PEER_AVERAGE: p = "peer_average"; break;
    case BHVD_OP_LP_DECENTRALIZED_INIT: p = "lp_decentralized_init"; break;
    case BHVD_OP_LP_DECENTRALIZED_STEP: p = "lp_decentralized_step"; break;
    case BHVD_OP_LP_DECENTRALIZED_EXCHANGE: p = "lp_decentralized_exchange"; break;
    default: p = "op"; break;
  }
  return grouped ? "grouped_" + p : p;
}

int64_t tensor_elements(const bhvd_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape ? t.shape[d] : 0;
  return n;
}

ResidualSizes residual_sizes(int64_t count, int group) {
  const int64_t size = std::max(1, group);  // sized by the ranks sharing the chunks
  const int64_t chunk = (count + size - 1) / size;
  return {chunk * size, chunk};
}

namespace {

bool compressible(int32_t dtype) {
  return dtype == BHVD_FLOAT32 || dtype == BHVD_FLOAT16 || dtype == BHVD_BFLOAT16;
}

std::string type_text(int32_t dtype) {
  return dtype_valid(dtype) ? dtype_name(static_cast<DataType>(dtype)) : "an unknown type";
}

// The op's parameter struct: present, and tagged with the request's op type.
template <typename P>
Status params_of(const bhvd_request& req, const std::string& title, const char* struct_name,
                 const P** out) {
  const auto* p = static_cast<const P*>(req.params);
  if (!p) return Status::InvalidArgument(title + ": params must point to a " + struct_name);
  if (p->op_type != req.op_type)
    return Status::InvalidArgument(title + ": params must point to a " + struct_name +
                                   " (its op_type is " + std::to_string(p->op_type) + ")");
  *out = p;
  return Status::OK();
}

Status check_hierarchical(int32_t hierarchical, const std::string& title) {
  if (hierarchical != 0 && hierarchical != 1)
    return Status::InvalidArgument(title + ": hierarchical must be 0 or 1");
  return Status::OK();
}

// BAGUA's primitives run on one bucket each.
Status check_one_tensor(const bhvd_request& req, const std::string& title) {
  if (req.num_tensors != 1)
    return Status::InvalidArgument(title + ": takes exactly one tensor (a bucket), got " +
                                   std::to_string(req.num_tensors));
  return Status::OK();
}

Status check_compressible(int32_t dtype, const std::string& title) {
  if (!compressible(dtype))
    return Status::InvalidArgument(title + ": MinMaxUInt8 compression needs float32, float16 or "
                                           "bfloat16 data, got " + type_text(dtype));
  return Status::OK();
}

// A state buffer of `count` elements of `dtype`.
Status state_buffer(const bhvd_tensor* b, const char* what, int32_t dtype, int64_t count,
                    const std::string& title, void** out) {
  if (!b) return Status::InvalidArgument(title + ": the " + what + " buffer is required");
  if (b->dtype != dtype || tensor_elements(*b) != count || (count > 0 && !b->data))
    return Status::InvalidArgument(title + ": the " + what + " buffer must hold " +
                                   std::to_string(count) + " elements of " + type_text(dtype) +
                                   ", got " + std::to_string(tensor_elements(*b)) + " of " +
                                   type_text(b->dtype));
  *out = b->data;
  return Status::OK();
}

Status validate_compressed_allreduce(const bhvd_request& req, const std::string& title,
                                     const std::function<int(bool)>& group_size,
                                     OpParams* params, StateBuffers* state) {
  const bhvd_compressed_allreduce_params* p = nullptr;
  if (Status s = params_of(req, title, "bhvd_compressed_allreduce_params", &p); !s.ok()) return s;
  if (p->compression != BHVD_COMPRESSION_MINMAX_UINT8)
    return Status::InvalidArgument(title + ": unknown compression " +
                                   std::to_string(p->compression));
  if (Status s = check_hierarchical(p->hierarchical, title); !s.ok()) return s;
  if (req.reduce_op != BHVD_AVERAGE && req.reduce_op != BHVD_SUM)
    return Status::InvalidArgument(
        "Compressed allreduce (ByteGrad) supports only op=Average and op=Sum.");
  if (Status s = check_one_tensor(req, title); !s.ok()) return s;
  const bhvd_tensor& in = req.inputs[0];
  if (Status s = check_compressible(in.dtype, title); !s.ok()) return s;
  Residuals residuals;
  if ((p->residual_worker == nullptr) != (p->residual_server == nullptr))
    return Status::InvalidArgument(title + ": error feedback takes 2 residual buffers (worker, "
                                           "server), got 1");
  if (p->residual_worker) {
    residuals.group = group_size(p->hierarchical != 0);
    const ResidualSizes n = residual_sizes(tensor_elements(in), residuals.group);
    if (Status s = state_buffer(p->residual_worker, "residual_worker", in.dtype, n.worker, title,
                                &residuals.worker);
        !s.ok())
      return s;
    if (Status s = state_buffer(p->residual_server, "residual_server", in.dtype, n.server, title,
                                &residuals.server);
        !s.ok())
      return s;
  }
  *params = CompressedAllreduceParams{p->compression, p->hierarchical != 0};
  *state = residuals;
  return Status::OK();
}

Status validate_peer_average(const bhvd_request& req, const std::string& title,
                             OpParams* params) {
  const bhvd_peer_average_params* p = nullptr;
  if (Status s = params_of(req, title, "bhvd_peer_average_params", &p); !s.ok()) return s;
  if (p->peer_mode < BHVD_PEER_ALL || p->peer_mode > BHVD_PEER_RING)
    return Status::InvalidArgument(title + ": unknown peer selection mode " +
                                   std::to_string(p->peer_mode));
  if (p->step < 0) return Status::InvalidArgument(title + ": negative step");
  if (Status s = check_hierarchical(p->hierarchical, title); !s.ok()) return s;
  if (Status s = check_one_tensor(req, title); !s.ok()) return s;
  const int32_t dtype = req.inputs[0].dtype;
  if (!compressible(dtype) && dtype != BHVD_FLOAT64)
    return Status::InvalidArgument(title + ": weights must be floating point");
  *params = PeerAverageParams{p->peer_mode, p->step, p->hierarchical != 0};
  return Status::OK();
}

// INIT and STEP: the weights in place and the three replicas.
template <typename P>
Status validate_lp_ring(const bhvd_request& req, const std::string& title,
                        const char* struct_name, OpParams* params, StateBuffers* state) {
  const P* p = nullptr;
  if (Status s = params_of(req, title, struct_name, &p); !s.ok()) return s;
  if (Status s = check_hierarchical(p->hierarchical, title); !s.ok()) return s;
  if (Status s = check_one_tensor(req, title); !s.ok()) return s;
  const bhvd_tensor& in = req.inputs[0];
  if (Status s = check_compressible(in.dtype, title); !s.ok()) return s;
  if (!req.outputs || req.outputs[0].data != in.data)
    return Status::InvalidArgument(title + ": updates the weights in place (output == input)");
  const int64_t n = tensor_elements(in);
  Replicas replicas;
  replicas.count = static_cast<size_t>(n);
  replicas.dtype = static_cast<DataType>(in.dtype);
  for (auto [buffer, what, out] : {std::tuple{p->self, "self", &replicas.self},
                                   std::tuple{p->left, "left", &replicas.left},
                                   std::tuple{p->right, "right", &replicas.right}}) {
    if (Status s = state_buffer(buffer, what, in.dtype, n, title, out); !s.ok()) return s;
  }
  *params = LpRingParams{p->hierarchical != 0};
  *state = replicas;
  return Status::OK();
}

// EXCHANGE: this rank's compressed difference (uint8) and the neighbours' replicas.
Status validate_lp_exchange(const bhvd_request& req, const std::string& title,
                            StateBuffers* state) {
  const bhvd_lp_exchange_params* p = nullptr;
  if (Status s = params_of(req, title, "bhvd_lp_exchange_params", &p); !s.ok()) return s;
  if (req.num_tensors != 1 || req.inputs[0].dtype != BHVD_UINT8 || !p->left || !p->right)
    return Status::InvalidArgument(title + ": takes the compressed difference (uint8) and 2 "
                                           "replica buffers (left, right)");
  const bhvd_tensor& l = *p->left;
  const bhvd_tensor& r = *p->right;
  const int64_t count = tensor_elements(l);
  if (!compressible(l.dtype) || r.dtype != l.dtype || tensor_elements(r) != count ||
      (count > 0 && (!l.data || !r.data)) ||
      tensor_elements(req.inputs[0]) !=
          static_cast<int64_t>(minmax_uint8_bytes(static_cast<DataType>(l.dtype),
                                                  static_cast<size_t>(count), 1)))
    return Status::InvalidArgument(title + ": the replicas and the compressed difference do "
                                           "not match in size or type");
  Replicas replicas;
  replicas.left = l.data;
  replicas.right = r.data;
  replicas.count = static_cast<size_t>(count);
  replicas.dtype = static_cast<DataType>(l.dtype);
  *state = replicas;
  return Status::OK();
}

// The parameter struct of BAGUA's primitives into the negotiated parameters and this rank's
// state buffers; every other op type takes none.
Status validate_params(const bhvd_request& req, const std::string& title,
                       const std::function<int(bool)>& group_size, OpParams* params,
                       StateBuffers* state) {
  *params = std::monostate{};
  *state = std::monostate{};
  switch (req.op_type) {
    case BHVD_OP_COMPRESSED_ALLREDUCE:
      return validate_compressed_allreduce(req, title, group_size, params, state);
    case BHVD_OP_PEER_AVERAGE:
      return validate_peer_average(req, title, params);
    case BHVD_OP_LP_DECENTRALIZED_INIT:
      return validate_lp_ring<bhvd_lp_init_params>(req, title, "bhvd_lp_init_params", params,
                                                   state);
    case BHVD_OP_LP_DECENTRALIZED_STEP:
      return validate_lp_ring<bhvd_lp_step_params>(req, title, "bhvd_lp_step_params", params,
                                                   state);
    case BHVD_OP_LP_DECENTRALIZED_EXCHANGE:
      return validate_lp_exchange(req, title, state);
  }
  if (req.params)
    return Status::InvalidArgument(title + ": takes no parameter struct (params must be NULL)");
  return Status::OK();
}

}  // namespace

Status validate_request(const bhvd_request& req, const std::string& title) {
  const int32_t t = req.op_type;
  if (t < BHVD_OP_ALLREDUCE || t > BHVD_OP_LP_DECENTRALIZED_EXCHANGE)
    return Status::InvalidArgument("unknown operation type " + std::to_string(t));
  const bool tensor_op = t != BHVD_OP_JOIN && t != BHVD_OP_BARRIER;
  if (tensor_op && (req.num_tensors < 1 || !req.inputs))
    return Status::InvalidArgument(title + ": at least one tensor is required");
  if (t == BHVD_OP_ADASUM)
    return Status::InvalidArgument(title + ": an Adasum is requested as BHVD_OP_ALLREDUCE with "
                                           "reduce_op BHVD_ADASUM");
  // Horovod refuses it with an error its torch frontend raises as RuntimeError (which
  // NotImplementedError is).
  if (t == BHVD_OP_REDUCESCATTER && req.reduce_op == BHVD_ADASUM)
    return Status::Error(StatusType::NOT_IMPLEMENTED,
                         "Reducescatter currently only supports AVERAGE and SUM.");
  if (req.reduce_op == BHVD_ADASUM && is_allreduce(t) && t != BHVD_OP_ALLREDUCE)
    return Status::InvalidArgument(title + ": Adasum runs as a plain allreduce only (not " +
                                   op_type_name(static_cast<OpType>(t)) + ")");
  if (t == BHVD_OP_ALLREDUCE && req.reduce_op == BHVD_ADASUM) {
    if (req.process_set_id != 0)
      return Status::Error(StatusType::NOT_IMPLEMENTED,
                           "Adasum does not support non-global process sets yet.");
    for (int32_t i = 0; i < req.num_tensors; ++i) {
      const auto dt = static_cast<DataType>(req.inputs[i].dtype);
      if (dt != DataType::FLOAT16 && dt != DataType::FLOAT32 && dt != DataType::FLOAT64)
        return Status::InvalidArgument(title + ": Adasum reduces float16, float32 and float64 "
                                               "tensors, not " + dtype_name(dt));
    }
  }
  if (is_allreduce(t) && (req.reduce_op < BHVD_AVERAGE || req.reduce_op > BHVD_PRODUCT))
    return Status::InvalidArgument(title + ": unknown reduce op " + std::to_string(req.reduce_op));
  if (t == BHVD_OP_REDUCESCATTER && req.reduce_op != BHVD_SUM && req.reduce_op != BHVD_AVERAGE)
    return Status::InvalidArgument("Reducescatter currently only supports AVERAGE and SUM.");
  if (req.device >= 0 && !device_engines_built())
    return Status::InvalidArgument(
        title + ": this build of bagua_hvd has no CUDA support (built without nvcc); move the "
                "tensor to the CPU");
  return Status::OK();
}

Status validate_for_set(const bhvd_request& req, const std::string& title,
                        const std::vector<int32_t>& ranks, int me,
                        const std::function<int(bool hierarchical)>& group_size,
                        OpParams* params, StateBuffers* state) {
  const int32_t t = req.op_type;
  auto pos = std::lower_bound(ranks.begin(), ranks.end(), me);
  if (pos == ranks.end() || *pos != me)
    return Status::InvalidArgument(title + ": Rank " + std::to_string(me) +
                                   " is not a member of the provided process set.");
  if (Status s = validate_params(req, title, group_size, params, state); !s.ok()) return s;
  const size_t n = ranks.size();
  // CUDA tensors: the runtime checks them (Horovod's GPU Adasum has its rule on the hosts).
  if (t == BHVD_OP_ALLREDUCE && req.reduce_op == BHVD_ADASUM && req.device < 0)
    if (Status s = validate_adasum_ranks(n); !s.ok()) return s;
  // A NaN factor would also never match itself in negotiation: refuse it here, on every path.
  for (auto [what, f] : {std::pair<const char*, double>{"prescale_factor", req.prescale_factor},
                         {"postscale_factor", req.postscale_factor}}) {
    if (!std::isfinite(f))
      return Status::InvalidArgument(std::string(what) + " must be a finite number, got " +
                                     (std::isnan(f) ? "nan" : (f > 0 ? "inf" : "-inf")));
  }
  if (t == BHVD_OP_BROADCAST && !std::binary_search(ranks.begin(), ranks.end(), req.root_rank))
    return Status::InvalidArgument("broadcast received invalid root rank " +
                                   std::to_string(req.root_rank) + " for provided process set");
  return Status::OK();
}

Status validate_tensor(const bhvd_request& req, int i, const std::string& title, int set_size,
                       Request* r) {
  const int32_t t = req.op_type;
  const bhvd_tensor& in = req.inputs[i];
  if (!dtype_valid(in.dtype))
    return Status::InvalidArgument(title + ": unsupported data type " +
                                   std::to_string(in.dtype));
  r->dtype = static_cast<DataType>(in.dtype);
  if (in.ndim < 0 || (in.ndim > 0 && !in.shape))
    return Status::InvalidArgument(title + ": invalid tensor shape");
  r->shape.assign(in.shape, in.shape + in.ndim);
  for (auto d : r->shape)
    if (d < 0) return Status::InvalidArgument(title + ": negative dimension in tensor shape");
  if (num_elements(r->shape) > 0 && !in.data)
    return Status::InvalidArgument(title + ": tensor data pointer is NULL");
  const bool needs_output = t != BHVD_OP_ALLGATHER && t != BHVD_OP_ALLTOALL;
  // A reducescatter output can be empty on this rank while the input is not.
  if (needs_output && (!req.outputs || (!req.outputs[i].data && num_elements(r->shape) > 0 &&
                                        t != BHVD_OP_REDUCESCATTER)))
    return Status::InvalidArgument(title + ": output tensor is required");
  if (t == BHVD_OP_ALLTOALL) {
    int64_t dim0 = r->shape.empty() ? 0 : r->shape[0];
    if (req.splits) {
      if (req.num_splits != set_size)
        return Status::InvalidArgument(
            "Number of entries in splits does not equal number of workers.");
      int64_t sum = 0;
      for (int k = 0; k < req.num_splits; ++k) {
        if (req.splits[k] < 0)
          return Status::InvalidArgument("alltoall expects non-negative splits.");
        sum += req.splits[k];
      }
      if (sum > dim0)
        return Status::InvalidArgument(
            "Sum of splits entries is greater than the first dimension of tensor.");
      r->splits.assign(req.splits, req.splits + req.num_splits);
    } else if (!r->shape.empty()) {
      if (dim0 % set_size != 0)
        return Status::InvalidArgument(
            "splits not provided, but first dimension of tensor is not an even multiple of "
            "the number of workers.");
      r->splits.assign(set_size, static_cast<int32_t>(dim0 / set_size));
    }
  }
  return Status::OK();
}

Status validate_adasum_ranks(size_t ranks) {
  if ((ranks & (ranks - 1)) != 0)
    return Status::Error(StatusType::NOT_IMPLEMENTED,
                         "Running Adasum with non-power of 2 ranks is not supported yet.");
  return Status::OK();
}

Status validate_device_adasum(const std::vector<int>& ranks_per_host) {
  for (int n : ranks_per_host)
    if (n != ranks_per_host.front())
      return Status::Error(StatusType::NOT_IMPLEMENTED,
                           "Running GPU Adasum on heterogeneous cluster is not supported yet.");
  const size_t hosts = ranks_per_host.size();
  if ((hosts & (hosts - 1)) != 0)
    return Status::Error(StatusType::NOT_IMPLEMENTED,
                         "Running GPU Adasum with non-power of 2 nodes is not supported yet.");
  return Status::OK();
}

}  // namespace bagua_hvd
