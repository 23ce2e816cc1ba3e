// Request validation (core/validate.h).
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "compression/minmax_uint8.h"

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
    case BHVD_OP_DECENTRALIZED: return "Decentralized";
    case BHVD_OP_LP_DECENTRALIZED: return "Low-precision decentralized";
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
    case BHVD_OP_DECENTRALIZED: p = "decentralized"; break;
    case BHVD_OP_LP_DECENTRALIZED: p = "lp_decentralized"; break;
    default: p = "op"; break;
  }
  return grouped ? "grouped_" + p : p;
}

int64_t tensor_elements(const bhvd_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape ? t.shape[d] : 0;
  return n;
}

namespace {

bool compressible(int32_t dtype) {
  return dtype == BHVD_FLOAT32 || dtype == BHVD_FLOAT16 || dtype == BHVD_BFLOAT16;
}

// Arguments of BAGUA's primitives: compression, peer mode and state buffers.
Status check_algorithm_request(const bhvd_request& req, const std::string& title,
                               const std::function<int()>& group_size) {
  const int32_t t = req.op_type;
  if (req.hierarchical != 0 && req.hierarchical != 1)
    return Status::InvalidArgument(title + ": hierarchical must be 0 or 1");
  if (req.hierarchical && t != BHVD_OP_ALLREDUCE && t != BHVD_OP_DECENTRALIZED &&
      t != BHVD_OP_LP_DECENTRALIZED)
    return Status::InvalidArgument(title + ": has no hierarchical form");
  if (t == BHVD_OP_LP_DECENTRALIZED && (req.peer_mode < 0 || req.peer_mode > 2))
    return Status::InvalidArgument(title + ": peer_mode must be 0 (a step), 1 (initialise) or 2 "
                                           "(the exchange half of a step)");
  if (t == BHVD_OP_LP_DECENTRALIZED && req.peer_mode == 2) {
    // The exchange half: a uint8 buffer (the compressed difference) and the two replicas.
    if (req.hierarchical)
      return Status::InvalidArgument(title + ": the split step has no hierarchical form");
    if (req.num_tensors != 1 || !req.inputs || req.inputs[0].dtype != BHVD_UINT8 ||
        req.num_aux != 2 || !req.aux)
      return Status::InvalidArgument(title + ": the exchange takes the compressed difference "
                                             "(uint8) and 2 replica buffers (left, right)");
    const bhvd_tensor& l = req.aux[0];
    const bhvd_tensor& r = req.aux[1];
    const int64_t count = tensor_elements(l);
    if (!compressible(l.dtype) || r.dtype != l.dtype || tensor_elements(r) != count ||
        (count > 0 && (!l.data || !r.data)) ||
        tensor_elements(req.inputs[0]) !=
            static_cast<int64_t>(minmax_uint8_bytes(static_cast<DataType>(l.dtype),
                                                    static_cast<size_t>(count), 1)))
      return Status::InvalidArgument(title + ": the replicas and the compressed difference do "
                                             "not match in size or type");
    return Status::OK();
  }
  if (req.compression != BHVD_COMPRESSION_NONE) {
    if (req.compression != BHVD_COMPRESSION_MINMAX_UINT8)
      return Status::InvalidArgument(title + ": unknown compression " +
                                     std::to_string(req.compression));
    if (t != BHVD_OP_ALLREDUCE)
      return Status::InvalidArgument(title + ": MinMaxUInt8 compression applies to allreduce only");
    if (req.reduce_op != BHVD_AVERAGE && req.reduce_op != BHVD_SUM)
      return Status::InvalidArgument(
          "Compressed allreduce (ByteGrad) supports only op=Average and op=Sum.");
  }
  const bool algorithm_op = req.compression != BHVD_COMPRESSION_NONE ||
                            t == BHVD_OP_DECENTRALIZED || t == BHVD_OP_LP_DECENTRALIZED;
  if (!algorithm_op) {
    if (req.num_aux != 0)
      return Status::InvalidArgument(title + ": state buffers (aux) are only taken by BAGUA's "
                                             "algorithm operations");
    return Status::OK();
  }
  if (req.num_tensors != 1 || !req.inputs)
    return Status::InvalidArgument(title + ": takes exactly one tensor (a bucket), got " +
                                   std::to_string(req.num_tensors));
  const bhvd_tensor& in = req.inputs[0];
  if ((req.compression != BHVD_COMPRESSION_NONE || t == BHVD_OP_LP_DECENTRALIZED) &&
      !compressible(in.dtype))
    return Status::InvalidArgument(title + ": MinMaxUInt8 compression needs float32, float16 or "
                                           "bfloat16 data, got " +
                                   std::string(dtype_name(static_cast<DataType>(in.dtype))));
  if (t == BHVD_OP_DECENTRALIZED) {
    if (req.peer_mode < BHVD_PEER_ALL || req.peer_mode > BHVD_PEER_RING)
      return Status::InvalidArgument(title + ": unknown peer selection mode " +
                                     std::to_string(req.peer_mode));
    if (!compressible(in.dtype) && in.dtype != BHVD_FLOAT64)
      return Status::InvalidArgument(title + ": weights must be floating point");
    if (req.step < 0) return Status::InvalidArgument(title + ": negative step");
  }
  const int64_t n = tensor_elements(in);
  const int64_t size = std::max(1, group_size());
  const int64_t chunk = (n + size - 1) / size;
  std::vector<int64_t> want;  // required element counts of the aux buffers
  if (req.compression != BHVD_COMPRESSION_NONE) {
    if (req.num_aux != 0 && req.num_aux != 2)
      return Status::InvalidArgument(title + ": error feedback takes 2 residual buffers (worker, "
                                             "server), got " + std::to_string(req.num_aux));
    if (req.num_aux == 2) want = {chunk * size, chunk};
  } else if (t == BHVD_OP_LP_DECENTRALIZED) {
    if (req.num_aux != 3)
      return Status::InvalidArgument(title + ": takes 3 replica buffers (self, left, right), got " +
                                     std::to_string(req.num_aux));
    if (!req.outputs || req.outputs[0].data != in.data)
      return Status::InvalidArgument(title + ": updates the weights in place (output == input)");
    want = {n, n, n};
  } else if (req.num_aux != 0) {
    return Status::InvalidArgument(title + ": takes no state buffers");
  }
  for (size_t a = 0; a < want.size(); ++a) {
    const bhvd_tensor& x = req.aux[a];
    if (x.dtype != in.dtype || tensor_elements(x) != want[a] || (want[a] > 0 && !x.data))
      return Status::InvalidArgument(
          title + ": state buffer " + std::to_string(a) + " must hold " +
          std::to_string(want[a]) + " elements of " +
          dtype_name(static_cast<DataType>(in.dtype)) + ", got " +
          std::to_string(tensor_elements(x)) + " of " +
          (dtype_valid(x.dtype) ? dtype_name(static_cast<DataType>(x.dtype)) : "an unknown type"));
  }
  return Status::OK();
}

}  // namespace

Status validate_request(const bhvd_request& req, const std::string& title) {
  const int32_t t = req.op_type;
  if (t < BHVD_OP_ALLREDUCE || t > BHVD_OP_LP_DECENTRALIZED)
    return Status::InvalidArgument("unknown operation type " + std::to_string(t));
  const bool tensor_op = t != BHVD_OP_JOIN && t != BHVD_OP_BARRIER;
  if (tensor_op && (req.num_tensors < 1 || !req.inputs))
    return Status::InvalidArgument(title + ": at least one tensor is required");
  if (t == BHVD_OP_ADASUM || ((t == BHVD_OP_ALLREDUCE || t == BHVD_OP_REDUCESCATTER) &&
                              req.reduce_op == BHVD_ADASUM))
    return Status::Error(StatusType::NOT_IMPLEMENTED,
                         "Adasum is not supported by bagua_hvd yet; use op=hvd.Average or "
                         "op=hvd.Sum.");
  if ((t == BHVD_OP_ALLREDUCE) && (req.reduce_op < BHVD_AVERAGE || req.reduce_op > BHVD_PRODUCT))
    return Status::InvalidArgument("Allreduce: unknown reduce op " +
                                   std::to_string(req.reduce_op));
  if (t == BHVD_OP_REDUCESCATTER && req.reduce_op != BHVD_SUM && req.reduce_op != BHVD_AVERAGE)
    return Status::InvalidArgument("Reducescatter currently only supports AVERAGE and SUM.");
  if (req.device >= 0)
    return Status::InvalidArgument(
        title + ": this build of bagua_hvd does not run collectives on GPU tensors yet; move the "
                "tensor to the CPU");
  return Status::OK();
}

Status validate_for_set(const bhvd_request& req, const std::string& title,
                        const std::vector<int32_t>& ranks, int me,
                        const std::function<int()>& group_size) {
  const int32_t t = req.op_type;
  auto pos = std::lower_bound(ranks.begin(), ranks.end(), me);
  if (pos == ranks.end() || *pos != me)
    return Status::InvalidArgument(title + ": Rank " + std::to_string(me) +
                                   " is not a member of the provided process set.");
  if (Status s = check_algorithm_request(req, title, group_size); !s.ok()) return s;
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
  const bool needs_output = t == BHVD_OP_ALLREDUCE || t == BHVD_OP_BROADCAST ||
                            t == BHVD_OP_REDUCESCATTER || t == BHVD_OP_DECENTRALIZED ||
                            t == BHVD_OP_LP_DECENTRALIZED;
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

}  // namespace bagua_hvd
