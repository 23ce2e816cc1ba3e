#include "core/runtime.h"

#include "core/async_average.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>

#include "collectives/collectives.h"
#include "compression/minmax_uint8.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BHVD_CPU_RELAX() _mm_pause()
#else
#define BHVD_CPU_RELAX() std::this_thread::yield()
#endif

namespace bagua_hvd {

namespace {

const char* const kNotInitialized = "Horovod has not been initialized; use hvd.init().";
const char* const kShutDown =
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message.";
const char* const kDuplicateName =
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name.";

constexpr uint32_t kMaxControlFrame = 256u << 20;
// A response of this type with shutdown set carries the reason a rank gave up.
constexpr int32_t kAbortType = -1;

int64_t num_elements(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

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

std::string hex_decode(const std::string& hex) {
  std::string out;
  if (hex.size() % 2) return out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + i, "%2x", &v) != 1) return std::string();
    out.push_back(static_cast<char>(v));
  }
  return out;
}

int env_rank_var(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return std::atoi(v);
}

}  // namespace

Runtime& Runtime::get() {
  // Never destroyed: frontends may still call in from atexit handlers after static destructors.
  static Runtime* rt = new Runtime();  // NOLINT: intentional leak of a process-wide singleton
  return *rt;
}

Status Runtime::init(const std::vector<std::vector<int32_t>>& static_sets, bool dynamic_sets) {
  if (initialized_) return Status::OK();
  ++epoch_;
  BootstrapConfig cfg;
  cfg.epoch = epoch_;
  cfg.timeout_s = env_double("GLOO_TIMEOUT_SECONDS", 30);
  if (const char* t = std::getenv("BAGUA_HVD_TIMEOUT_SECONDS"); t && *t) cfg.timeout_s = atof(t);
  const char* addr = std::getenv("HOROVOD_GLOO_RENDEZVOUS_ADDR");
  fusion_threshold_ = env_int("FUSION_THRESHOLD", int64_t(128) << 20);
  cycle_time_s_ = env_double("CYCLE_TIME", 1.0) / 1000.0;
  CoordinatorParams cp;
  cp.fusion_threshold = fusion_threshold_;
  cp.cycle_time_s = cycle_time_s_;
  cp.cache_capacity = env_int("CACHE_CAPACITY", 1024);
  cp.no_fuse_bytes = env_int("NO_FUSE_BYTES", int64_t(1) << 20);
  cp.stall_warning_s =
      env_bool("STALL_CHECK_DISABLE", false) ? 0 : env_double("STALL_CHECK_TIME_SECONDS", 60);
  cp.stall_shutdown_s = env_double("STALL_SHUTDOWN_TIME_SECONDS", 0);
  spin_ = std::chrono::microseconds(env_int("SPIN_US", 1000));

  try {
    if (!addr || !*addr) {
      cfg = BootstrapConfig{};
      cfg.epoch = epoch_;
      transport_ = make_self_transport();
    } else {
      cfg.rank = env_rank_var("HOROVOD_RANK", 0);
      cfg.size = env_rank_var("HOROVOD_SIZE", 1);
      cfg.local_rank = env_rank_var("HOROVOD_LOCAL_RANK", cfg.rank);
      cfg.local_size = env_rank_var("HOROVOD_LOCAL_SIZE", cfg.size);
      cfg.cross_rank = env_rank_var("HOROVOD_CROSS_RANK", 0);
      cfg.cross_size = env_rank_var("HOROVOD_CROSS_SIZE", 1);
      if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
        return Status::InvalidArgument("Horovod initialization failed: HOROVOD_RANK=" +
                                       std::to_string(cfg.rank) + " is not in [0, HOROVOD_SIZE=" +
                                       std::to_string(cfg.size) + ")");
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      cfg.hostname = env_str("HOSTNAME", host);
      cfg.store_host = addr;
      cfg.store_port = env_rank_var("HOROVOD_GLOO_RENDEZVOUS_PORT", 0);
      const char* secret = std::getenv("BAGUA_HVD_SECRET");
      if (!secret || !*secret)
        return Status::InvalidArgument(
            "Horovod initialization failed: BAGUA_HVD_SECRET is not set; start the job with "
            "bagua-run, which creates the per-job secret");
      cfg.secret = hex_decode(secret);
      if (cfg.secret.empty())
        return Status::InvalidArgument(
            "Horovod initialization failed: BAGUA_HVD_SECRET must be a non-empty hex string");
      const char* job = std::getenv("BAGUA_HVD_JOB_ID");
      cfg.job_id = job && *job ? job : ("job" + std::to_string(cfg.store_port));
      const char* tr = std::getenv("BAGUA_HVD_TRANSPORT");
      cfg.force_tcp = tr && std::string(tr) == "tcp";
      cfg.iface = env_str("GLOO_IFACE", "");
      store_ = connect_tcp_store(cfg.store_host, cfg.store_port, cfg.secret, cfg.timeout_s);
      transport_ = connect_transport(cfg, *store_);
      store_.reset();  // only needed to bootstrap
    }
  } catch (const std::exception& e) {
    store_.reset();
    transport_.reset();
    return Status::Aborted(std::string("Horovod initialization failed: ") + e.what());
  }
  cfg_ = cfg;

  std::map<int32_t, std::vector<int32_t>> sets;
  std::vector<int32_t> all(cfg_.size);
  for (int i = 0; i < cfg_.size; ++i) all[i] = i;
  sets[0] = all;
  int32_t id = 1;
  for (auto ranks : static_sets) {
    std::sort(ranks.begin(), ranks.end());
    for (auto r : ranks) {
      if (r < 0 || r >= cfg_.size) {
        transport_.reset();
        return Status::InvalidArgument("Horovod initialization failed: process set rank " +
                                       std::to_string(r) + " is not in [0, " +
                                       std::to_string(cfg_.size) + ")");
      }
    }
    sets[id++] = ranks;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sets_.clear();
    comms_.clear();
    hierarchies_.clear();
    for (auto& kv : sets) {
      sets_[kv.first] = kv.second;
      comms_[kv.first] = std::make_unique<Comm>(*transport_, kv.second);
    }
    table_.clear();
    reserved_.clear();
    queue_.clear();
    urgent_queue_.clear();
    shutdown_requested_ = false;
    stopped_ = false;
    stop_status_ = Status::OK();
    barrier_counter_.clear();
    internal_counter_ = 0;
    // Unnamed ops are named after their handle: every rank restarts the count together.
    handles_.clear();
    next_handle_ = 1;
  }
  dynamic_sets_ = dynamic_sets;
  cache_.clear();
  cache_names_.clear();
  acked_seq_ = 0;
  sent_shutdown_ = false;
  oversubscribed_ =
      cfg_.local_size > static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  inbox_.assign(cfg_.size, std::string());
  inbox_error_.assign(cfg_.size, std::string());
  coordinator_.reset();
  if (cfg_.rank == 0) coordinator_ = std::make_unique<Coordinator>(cfg_.size, sets_, cp);
  initialized_ = true;
  thread_ = std::thread([this] { loop(); });
  return Status::OK();
}

Status Runtime::shutdown() {
  if (!initialized_) return Status::OK();
  // Background averaging rounds need the runtime: stop them first, on every rank together.
  auto averagers = AsyncRegistry::get().stop_all(static_cast<int64_t>(cfg_.timeout_s * 1000));
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
    transport_->notify();
  }
  if (thread_.joinable()) thread_.join();
  fail_all(Status::Aborted(kShutDown));
  averagers.clear();  // their threads' last collectives have failed by now: they end
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.clear();
    hierarchies_.clear();
    table_.clear();
    reserved_.clear();
    queue_.clear();
    urgent_queue_.clear();
    coordinator_.reset();
    transport_.reset();
    stopped_ = true;
    stop_status_ = Status::Aborted(kShutDown);
    initialized_ = false;
  }
  std::vector<unsigned char>().swap(fusion_);
  stats_.fusion_buffer_bytes = 0;
  return Status::OK();
}

// ---- frontend side ------------------------------------------------------------------------

namespace {

int64_t tensor_elements(const bhvd_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape ? t.shape[d] : 0;
  return n;
}

bool compressible(int32_t dtype) {
  return dtype == BHVD_FLOAT32 || dtype == BHVD_FLOAT16 || dtype == BHVD_BFLOAT16;
}

}  // namespace

// Arguments of BAGUA's primitives: compression, peer mode and state buffers.
Status Runtime::check_algorithm_request(const bhvd_request& req, const std::string& title) {
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
  const int64_t size = std::max(1, group_size_locked(req.process_set_id, req.hierarchical != 0));
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

Status Runtime::enqueue(const bhvd_request& req, int64_t* handle_out) {
  if (!initialized_) return Status::InvalidArgument(kNotInitialized);
  const int32_t t = req.op_type;
  if (t < BHVD_OP_ALLREDUCE || t > BHVD_OP_LP_DECENTRALIZED)
    return Status::InvalidArgument("unknown operation type " + std::to_string(t));
  const std::string title = op_title(t);
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

  std::unique_lock<std::mutex> lock(mu_);
  if (stopped_) return stop_status_.ok() ? Status::Aborted(kShutDown) : stop_status_;
  auto sit = sets_.find(req.process_set_id);
  if (sit == sets_.end())
    return Status::InvalidArgument(title +
                                   ": Process set provided does not exist, or has not been "
                                   "registered.");
  const auto& ranks = sit->second;
  auto pos = std::lower_bound(ranks.begin(), ranks.end(), cfg_.rank);
  if (pos == ranks.end() || *pos != cfg_.rank)
    return Status::InvalidArgument(title + ": Rank " + std::to_string(cfg_.rank) +
                                   " is not a member of the provided process set.");
  const int set_size = static_cast<int>(ranks.size());
  if (Status s = check_algorithm_request(req, title); !s.ok()) return s;
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

  const int64_t id = next_handle_;  // consumed only if the request is accepted
  const int n = tensor_op ? req.num_tensors : 0;
  std::vector<Request> reqs;
  std::string base;
  if (t == BHVD_OP_JOIN) {
    base = "join";
  } else if (t == BHVD_OP_BARRIER) {
    base = "barrier." + std::to_string(req.process_set_id) + "." +
           std::to_string(barrier_counter_[req.process_set_id]);
  } else if (req.name && *req.name) {
    base = req.name;
  } else {
    base = op_prefix(t, n > 1) + ".noname." + std::to_string(id);
  }
  for (int i = 0; i < std::max(n, 1); ++i) {
    Request r;
    r.rank = cfg_.rank;
    r.type = t;
    r.name = n > 1 ? base + "_" + std::to_string(i) : base;
    r.process_set_id = t == BHVD_OP_JOIN ? 0 : req.process_set_id;  // join is global
    r.reduce_op = static_cast<ReduceOp>(req.reduce_op);
    r.root_rank = req.root_rank;
    r.device = req.device;
    r.prescale = req.prescale_factor;
    r.postscale = req.postscale_factor;
    r.urgent = req.urgent != 0;
    r.compression = req.compression;
    r.peer_mode = req.peer_mode;
    r.step = req.step;
    r.hierarchical = req.hierarchical;
    if (tensor_op) {
      const bhvd_tensor& in = req.inputs[i];
      if (!dtype_valid(in.dtype))
        return Status::InvalidArgument(title + ": unsupported data type " +
                                       std::to_string(in.dtype));
      r.dtype = static_cast<DataType>(in.dtype);
      if (in.ndim < 0 || (in.ndim > 0 && !in.shape))
        return Status::InvalidArgument(title + ": invalid tensor shape");
      r.shape.assign(in.shape, in.shape + in.ndim);
      for (auto d : r.shape)
        if (d < 0) return Status::InvalidArgument(title + ": negative dimension in tensor shape");
      if (num_elements(r.shape) > 0 && !in.data)
        return Status::InvalidArgument(title + ": tensor data pointer is NULL");
      const bool needs_output = t == BHVD_OP_ALLREDUCE || t == BHVD_OP_BROADCAST ||
                                t == BHVD_OP_REDUCESCATTER || t == BHVD_OP_DECENTRALIZED ||
                                t == BHVD_OP_LP_DECENTRALIZED;
      // A reducescatter output can be empty on this rank while the input is not.
      if (needs_output && (!req.outputs || (!req.outputs[i].data && num_elements(r.shape) > 0 &&
                                            t != BHVD_OP_REDUCESCATTER)))
        return Status::InvalidArgument(title + ": output tensor is required");
      if (t == BHVD_OP_ALLTOALL) {
        int64_t dim0 = r.shape.empty() ? 0 : r.shape[0];
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
          r.splits.assign(req.splits, req.splits + req.num_splits);
        } else if (!r.shape.empty()) {
          if (dim0 % set_size != 0)
            return Status::InvalidArgument(
                "splits not provided, but first dimension of tensor is not an even multiple of "
                "the number of workers.");
          r.splits.assign(set_size, static_cast<int32_t>(dim0 / set_size));
        }
      }
    }
    if (reserved_.count(tensor_key(r.process_set_id, r.name)))
      return Status::InvalidArgument(kDuplicateName);
    for (const auto& o : reqs)
      if (o.name == r.name) return Status::InvalidArgument(kDuplicateName);
    reqs.push_back(std::move(r));
  }
  if (t == BHVD_OP_BARRIER) ++barrier_counter_[req.process_set_id];
  ++next_handle_;

  auto h = std::make_shared<Handle>();
  h->id = id;
  h->remaining = static_cast<int>(reqs.size());
  h->urgent = req.urgent != 0;
  h->outputs.resize(reqs.size());
  h->output_shapes.resize(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Entry e;
    e.handle = h;
    e.index = static_cast<int>(i);
    if (tensor_op) {
      e.input = req.inputs[i].data;
      e.output = req.outputs ? req.outputs[i].data : nullptr;
      for (int a = 0; a < req.num_aux; ++a) e.aux.push_back(req.aux[a].data);
      if (req.num_aux > 0) {
        e.aux_count = static_cast<size_t>(tensor_elements(req.aux[0]));
        e.aux_dtype = static_cast<DataType>(req.aux[0].dtype);
      }
    }
    const std::string key = tensor_key(reqs[i].process_set_id, reqs[i].name);
    h->names.push_back(key);
    e.request = std::move(reqs[i]);
    queue_.push_back(key);
    table_.emplace(key, std::move(e));
    reserved_.insert(key);
  }
  handles_[id] = h;
  *handle_out = id;
  transport_->notify();
  return Status::OK();
}

Status Runtime::run_internal(int32_t type, std::vector<int32_t> args, int32_t* result) {
  if (!initialized_) return Status::InvalidArgument(kNotInitialized);
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return stop_status_.ok() ? Status::Aborted(kShutDown) : stop_status_;
    id = next_handle_++;
    Request r;
    r.rank = cfg_.rank;
    r.type = type;
    r.dtype = DataType::INT32;
    r.name = "__process_set_change." + std::to_string(internal_counter_++);
    r.process_set_id = 0;
    r.splits = std::move(args);
    r.urgent = true;
    auto h = std::make_shared<Handle>();
    h->id = id;
    h->remaining = 1;
    h->urgent = true;
    h->outputs.resize(1);
    h->output_shapes.resize(1);
    const std::string key = tensor_key(0, r.name);
    h->names.push_back(key);
    Entry e;
    e.handle = h;
    e.request = std::move(r);
    queue_.push_back(key);
    table_.emplace(key, std::move(e));
    handles_[id] = h;
    transport_->notify();
  }
  Status s = wait(id, -1);
  auto h = find(id);
  if (s.ok() && h) *result = h->result;
  release(id);
  return s;
}

std::shared_ptr<Handle> Runtime::find(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second;
}

int Runtime::poll(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return -1;
  if (!it->second->done) return 0;
  mark_seen_locked(*it->second);
  return 1;
}

Status Runtime::wait(int64_t handle, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end())
    return Status::InvalidArgument("unknown handle " + std::to_string(handle));
  auto h = it->second;
  if (!h->done && !h->urgent) {
    // The caller blocks now: nothing is gained by holding its tensors back for fusion.
    h->urgent = true;
    for (const auto& name : h->names) {
      auto e = table_.find(name);
      if (e == table_.end()) continue;
      e->second.request.urgent = true;  // still queued: it goes out urgent
      if (std::find(queue_.begin(), queue_.end(), name) == queue_.end())
        urgent_queue_.push_back(name);  // already sent: tell the coordinator
    }
    if (transport_) transport_->notify();
  }
  auto pred = [&] { return h->done; };
  struct Waiting {  // counts callers blocked in wait(), which lets the background thread poll
    std::atomic<int>& n;
    explicit Waiting(std::atomic<int>& c) : n(c) { n.fetch_add(1); }
    ~Waiting() { n.fetch_sub(1); }
  } waiting(waiters_);
  if (timeout_ms < 0) {
    h->cv.wait(lock, pred);
  } else if (!h->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), pred)) {
    return Status::Error(StatusType::TIMED_OUT, "timed out waiting for handle");
  }
  mark_seen_locked(*h);
  return h->status;
}

Status Runtime::on_done(int64_t handle, std::function<void(const Status&)> fn) {
  Status final_status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end())
      return Status::InvalidArgument("unknown handle " + std::to_string(handle));
    auto& h = *it->second;
    if (h.on_done) return Status::InvalidArgument("handle " + std::to_string(handle) +
                                                  " already has a completion callback");
    if (!h.done) {
      // Counted like a blocked caller while pending, so that the background thread keeps
      // polling for the reply rather than sleeping.
      callbacks_pending_.fetch_add(1);
      h.on_done = [this, fn = std::move(fn)](const Status& s) {
        callbacks_pending_.fetch_sub(1);
        fn(s);
      };
      if (transport_) transport_->notify();
      return Status::OK();
    }
    final_status = h.status;
    mark_seen_locked(h);
  }
  fn(final_status);
  return Status::OK();
}

void Runtime::release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return;
  mark_seen_locked(*it->second);  // a pending request keeps its name in table_ until it ends
  handles_.erase(it);
}

std::map<int32_t, std::vector<int32_t>> Runtime::process_sets() {
  std::lock_guard<std::mutex> lock(mu_);
  return sets_;
}

const char* Runtime::transport_kind(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!transport_ || peer < 0 || peer >= cfg_.size) return "";
  return transport_->kind_to(peer);
}

// ---- background thread --------------------------------------------------------------------

void Runtime::loop() {
  Clock::time_point idle_since = Clock::now();
  Clock::time_point last_liveness = Clock::now();
  Clock::time_point shutdown_deadline = Clock::time_point::max();
  try {
    while (true) {
      bool active = false;
      if (coordinator_)
        loop_once_coordinator(&active);
      else
        loop_once_worker(&active);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopped_) break;
      }
      auto now = Clock::now();
      if (sent_shutdown_ && shutdown_deadline == Clock::time_point::max())
        shutdown_deadline = now + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(cfg_.timeout_s));
      if (now > shutdown_deadline) {
        BHVD_LOG(WARNING, "rank 0 did not confirm shutdown within " +
                              std::to_string(cfg_.timeout_s) + " s; shutting down anyway");
        fail_all(Status::Aborted(kShutDown));
        break;
      }
      if (active) {
        idle_since = now;
        continue;
      }
      // Poll before sleeping: replies usually follow within microseconds, and waking a sleeping
      // thread (an idle vCPU, in a VM) costs tens of microseconds per hop. Poll long
      // (BAGUA_HVD_SPIN_US, default 1000) only while a caller is blocked on us, since its core
      // is then free; otherwise briefly, so that frontend threads computing keep their cores.
      const bool caller_blocked = waiters_.load(std::memory_order_relaxed) > 0 ||
                                  callbacks_pending_.load(std::memory_order_relaxed) > 0;
      if (now - idle_since < (caller_blocked ? spin_ : std::chrono::microseconds(200))) {
        // More busy pollers than cores would starve the one that has work: yield instead.
        if (oversubscribed_)
          std::this_thread::yield();
        else
          for (int i = 0; i < 64; ++i) BHVD_CPU_RELAX();
        continue;
      }
      auto timeout = std::chrono::microseconds(100000);
      if (coordinator_ && wake_at_ != Clock::time_point::max()) {
        auto until = std::chrono::duration_cast<std::chrono::microseconds>(wake_at_ - now);
        if (until < timeout) timeout = std::max(until, std::chrono::microseconds(0));
      }
      if (timeout.count() > 0) transport_->wait(timeout);
      if (Clock::now() - last_liveness > std::chrono::milliseconds(200)) {
        last_liveness = Clock::now();
        if (coordinator_) {
          for (int r = 1; r < cfg_.size; ++r) transport_->ctrl(r).check_alive();
        } else if (cfg_.size > 1) {
          transport_->ctrl(0).check_alive();
        }
      }
    }
  } catch (const std::exception& e) {
    std::string reason = std::string("Horovod is shut down because communication failed: ") +
                         e.what();
    BHVD_LOG(ERROR, reason);
    // Tell the others (best effort) so that ranks not talking to the failed peer stop too.
    if (coordinator_) {
      ResponseList abort;
      abort.seq = 0;
      abort.shutdown = true;
      Response r;
      r.kind = Response::ERROR;
      r.type = kAbortType;
      r.error = reason;
      abort.responses.push_back(r);
      std::string payload = encode(abort);
      for (int w = 1; w < cfg_.size; ++w) {
        try {
          uint32_t len = static_cast<uint32_t>(payload.size());
          std::string frame(reinterpret_cast<const char*>(&len), 4);
          frame += payload;
          transport_->ctrl(w).try_send(frame.data(), frame.size());
        } catch (const std::exception&) {
        }
      }
    }
    fail_all(Status::Aborted(reason));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
}

void Runtime::drain_local(RequestList* out, bool* any) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& name : queue_) {
    auto it = table_.find(name);
    if (it == table_.end()) continue;
    const Request& r = it->second.request;
    auto c = cache_.find(name);
    if (c != cache_.end() && c->second.second.same_params(r)) {
      out->cached.push_back(c->second.first);
      out->cached_urgent.push_back(r.urgent ? 1 : 0);
      stats_.cache_hits++;
    } else {
      out->requests.push_back(r);
    }
    *any = true;
  }
  queue_.clear();
  if (!urgent_queue_.empty()) {
    out->urgent = std::move(urgent_queue_);
    urgent_queue_.clear();
    *any = true;
  }
  if (shutdown_requested_ && !sent_shutdown_) {
    out->shutdown = true;
    sent_shutdown_ = true;
    *any = true;
  }
}

void Runtime::loop_once_coordinator(bool* active) {
  RequestList own;
  bool any = false;
  drain_local(&own, &any);
  if (any) {
    coordinator_->add(own, 0);
    *active = true;
  }
  std::string msg;
  for (int w = 1; w < cfg_.size; ++w) {
    while (poll_message(w, &msg)) {
      coordinator_->add(decode_request_list(msg), w);
      *active = true;
    }
  }
  ResponseList out = coordinator_->build(Clock::now(), &wake_at_);
  if (out.responses.empty() && !out.shutdown && out.evicted.empty()) return;
  std::string payload = encode(out);
  for (int w = 1; w < cfg_.size; ++w) send_message(w, payload);
  apply(out);
  *active = true;
}

void Runtime::loop_once_worker(bool* active) {
  RequestList rl;
  bool any = false;
  drain_local(&rl, &any);
  if (any) {
    rl.acked_seq = acked_seq_;
    send_message(0, encode(rl));
    *active = true;
  }
  std::string msg;
  while (poll_message(0, &msg)) {
    apply(decode_response_list(msg));
    *active = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
  }
}

void Runtime::apply(const ResponseList& list) {
  for (int32_t id : list.evicted) {
    auto n = cache_names_.find(id);
    if (n == cache_names_.end()) continue;
    auto c = cache_.find(n->second);
    if (c != cache_.end() && c->second.first == id) cache_.erase(c);
    cache_names_.erase(n);
  }
  std::string abort_reason;
  for (const auto& r : list.responses) {
    if (r.kind == Response::ERROR && r.type == kAbortType) {
      abort_reason = r.error;
      continue;
    }
    execute(r);
  }
  stats_.cycles++;
  if (list.seq) acked_seq_ = list.seq;
  if (list.shutdown) {
    fail_all(Status::Aborted(abort_reason.empty() ? kShutDown : abort_reason));
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (!abort_reason.empty()) stop_status_ = Status::Aborted(abort_reason);
  }
}

Comm* Runtime::comm_for(int32_t set_id) {
  auto it = comms_.find(set_id);
  return it == comms_.end() ? nullptr : it->second.get();
}

void Runtime::register_set(int32_t id, std::vector<int32_t> ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  std::sort(ranks.begin(), ranks.end());
  sets_[id] = ranks;
  comms_[id] = std::make_unique<Comm>(*transport_, ranks);
}

unsigned char* Runtime::fusion(size_t bytes) {
  if (fusion_.size() < bytes) {
    fusion_.resize(bytes);
    stats_.fusion_buffer_bytes = static_cast<int64_t>(fusion_.size());
  }
  return fusion_.data();
}

void Runtime::execute(const Response& r) {
  stats_.responses++;
  if (r.names.size() > 1) stats_.fused_tensors += static_cast<int64_t>(r.names.size());
  std::vector<std::string> keys;
  for (const auto& name : r.names) keys.push_back(tensor_key(r.process_set_id, name));
  if (r.kind == Response::ERROR) {
    for (const auto& key : keys) finish(key, Status::Precondition(r.error));
    return;
  }
  auto set_result = [&](const std::string& key, int32_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(key);
    if (it != table_.end()) it->second.handle->result = value;
  };
  switch (r.type) {
    case BHVD_OP_JOIN:
      set_result(tensor_key(0, "join"), r.last_joined_rank);
      finish(tensor_key(0, "join"), Status::OK());
      return;
    case BHVD_OP_BARRIER:
      finish(keys[0], Status::OK());
      return;
    case kOpAddProcessSet:
      register_set(r.new_set_id, r.set_ranks);
      if (coordinator_) coordinator_->set_next_set_id(std::max(coordinator_->next_set_id(),
                                                               r.new_set_id + 1));
      set_result(keys[0], r.new_set_id);
      finish(keys[0], Status::OK());
      return;
    case kOpRemoveProcessSet: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        sets_.erase(r.new_set_id);
        comms_.erase(r.new_set_id);
        hierarchies_.erase(r.new_set_id);
      }
      set_result(keys[0], r.new_set_id);
      finish(keys[0], Status::OK());
      return;
    }
    default:
      break;
  }
  Comm* comm = comm_for(r.process_set_id);
  if (!comm || comm->rank() < 0) return;  // not a member of the set
  std::vector<Entry*> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& key : keys) {
      auto it = table_.find(key);
      entries.push_back(it == table_.end() ? nullptr : &it->second);
    }
  }
  const auto started = Clock::now();
  switch (r.type) {
    case BHVD_OP_ALLREDUCE: execute_allreduce(r, *comm, entries); break;
    case BHVD_OP_ALLGATHER: execute_allgather(r, *comm, entries); break;
    case BHVD_OP_BROADCAST: execute_broadcast(r, *comm, entries); break;
    case BHVD_OP_ALLTOALL: execute_alltoall(r, *comm, entries); break;
    case BHVD_OP_REDUCESCATTER: execute_reducescatter(r, *comm, entries); break;
    case BHVD_OP_DECENTRALIZED:
    case BHVD_OP_LP_DECENTRALIZED: execute_decentralized(r, *comm, entries); break;
    default:
      for (const auto& key : keys)
        finish(key, Status::Error(StatusType::UNKNOWN_ERROR, "unsupported response type"));
      return;
  }
  stats_.exec_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - started)
                        .count();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (r.cache_ids[i] >= 0 && entries[i]) {
      if (auto old = cache_.find(keys[i]); old != cache_.end()) cache_names_.erase(old->second.first);
      cache_[keys[i]] = {r.cache_ids[i], entries[i]->request};
      cache_names_[r.cache_ids[i]] = keys[i];
    }
    finish(keys[i], Status::OK());
  }
}

void Runtime::execute_allreduce(const Response& r, Comm& comm, std::vector<Entry*>& entries) {
  const size_t esize = dtype_size(r.dtype);
  if (r.compression == BHVD_COMPRESSION_MINMAX_UINT8) {
    // Never fused (coordinator): one tensor, this rank's entry.
    Entry* e = entries[0];
    if (!e) return;
    const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
    if (e->input != e->output && count) std::memcpy(e->output, e->input, count * esize);
    if (r.prescale != 1.0) scale_buffer(e->output, count, r.dtype, r.prescale);
    const bool average = r.reduce_op == ReduceOp::AVERAGE;
    void* ef_w = e->aux.size() > 0 ? e->aux[0] : nullptr;
    void* ef_s = e->aux.size() > 1 ? e->aux[1] : nullptr;
    if (Hierarchy* h = hierarchy_for(r, comm)) {
      // BAGUA's hierarchy: full precision within the host, compressed among the hosts.
      allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
      if (average) scale_buffer(e->output, count, r.dtype, 1.0 / h->intra->size());
      if (h->leader) allreduce_minmax_uint8(*h->leaders, e->output, count, r.dtype, average,
                                            ef_w, ef_s);
      broadcast(*h->intra, e->output, count * esize, 0);
    } else {
      allreduce_minmax_uint8(comm, e->output, count, r.dtype, average, ef_w, ef_s);
    }
    if (r.postscale != 1.0) scale_buffer(e->output, count, r.dtype, r.postscale);
    return;
  }
  if (Hierarchy* h = hierarchy_for(r, comm); h && entries.size() == 1 && entries[0]) {
    // Never fused (coordinator): within the host, among the hosts' leaders, back.
    Entry* e = entries[0];
    const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
    if (e->input != e->output && count) std::memcpy(e->output, e->input, count * esize);
    if (r.prescale != 1.0) scale_buffer(e->output, count, r.dtype, r.prescale);
    allreduce(*h->intra, e->output, count, r.dtype, r.reduce_op);
    if (h->leader) allreduce(*h->leaders, e->output, count, r.dtype, r.reduce_op);
    broadcast(*h->intra, e->output, count * esize, 0);
    double post = r.postscale;
    if (r.reduce_op == ReduceOp::AVERAGE) post /= comm.size();
    if (post != 1.0) scale_buffer(e->output, count, r.dtype, post);
    return;
  }
  std::vector<size_t> counts(r.names.size());
  size_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    counts[i] = static_cast<size_t>(num_elements(r.shapes[i]));
    total += counts[i];
  }
  unsigned char* buf;
  const bool direct = entries.size() == 1 && entries[0] && entries[0]->output;
  if (direct) {
    buf = static_cast<unsigned char*>(entries[0]->output);
    if (entries[0]->input != entries[0]->output && total)
      std::memcpy(buf, entries[0]->input, total * esize);
  } else {
    buf = fusion(total * esize);
    size_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      size_t bytes = counts[i] * esize;
      if (entries[i] && bytes)
        std::memcpy(buf + off, entries[i]->input, bytes);
      else if (bytes)
        std::memset(buf + off, 0, bytes);  // a joined rank contributes zeros
      off += bytes;
    }
  }
  if (r.prescale != 1.0) scale_buffer(buf, total, r.dtype, r.prescale);
  allreduce(comm, buf, total, r.dtype, r.reduce_op);
  double post = r.postscale;
  if (r.reduce_op == ReduceOp::AVERAGE) post /= comm.size();
  if (post != 1.0) scale_buffer(buf, total, r.dtype, post);
  if (!direct) {
    size_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      size_t bytes = counts[i] * esize;
      if (entries[i] && entries[i]->output && bytes)
        std::memcpy(entries[i]->output, buf + off, bytes);
      off += bytes;
    }
  }
}

void Runtime::execute_allgather(const Response& r, Comm& comm, std::vector<Entry*>& entries) {
  const size_t esize = dtype_size(r.dtype);
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = entries[i];
    const auto& shape = e ? e->request.shape : r.shapes[i];
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    std::vector<size_t> bytes(comm.size());
    size_t total = 0;
    int64_t rows = 0;
    for (int k = 0; k < comm.size(); ++k) {
      bytes[k] = static_cast<size_t>(r.per_rank[i][k] * row) * esize;
      total += bytes[k];
      rows += r.per_rank[i][k];
    }
    std::vector<unsigned char> out(total);
    allgatherv(comm, e ? e->input : nullptr, out.data(), bytes);
    if (e) {
      std::vector<int64_t> oshape = shape;
      oshape[0] = rows;
      std::lock_guard<std::mutex> lock(mu_);
      e->handle->outputs[e->index] = std::move(out);
      e->handle->output_shapes[e->index] = std::move(oshape);
    }
  }
}

void Runtime::execute_broadcast(const Response& r, Comm& comm, std::vector<Entry*>& entries) {
  const size_t esize = dtype_size(r.dtype);
  const auto& ranks = comm.global_ranks();
  int root = static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), r.root_rank) -
                              ranks.begin());
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = entries[i];
    if (!e) continue;
    size_t bytes = static_cast<size_t>(num_elements(r.shapes[i])) * esize;
    if (comm.rank() == root && e->input != e->output && bytes)
      std::memcpy(e->output, e->input, bytes);
    broadcast(comm, e->output, bytes, root);
  }
}

void Runtime::execute_alltoall(const Response& r, Comm& comm, std::vector<Entry*>& entries) {
  const size_t esize = dtype_size(r.dtype);
  const int n = comm.size(), me = comm.rank();
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = entries[i];
    if (!e) continue;
    const auto& shape = e->request.shape;
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    const auto& m = r.per_rank[i];
    std::vector<size_t> send(n), recv(n);
    std::vector<int32_t> rsplits(n);
    size_t total = 0;
    int64_t rows = 0;
    for (int k = 0; k < n; ++k) {
      send[k] = static_cast<size_t>(m[me * n + k] * row) * esize;
      recv[k] = static_cast<size_t>(m[k * n + me] * row) * esize;
      rsplits[k] = static_cast<int32_t>(m[k * n + me]);
      total += recv[k];
      rows += m[k * n + me];
    }
    std::vector<unsigned char> out(total);
    alltoallv(comm, e->input, send, out.data(), recv);
    std::vector<int64_t> oshape = shape;
    oshape[0] = rows;
    std::lock_guard<std::mutex> lock(mu_);
    e->handle->outputs[e->index] = std::move(out);
    e->handle->output_shapes[e->index] = std::move(oshape);
    e->handle->received_splits = std::move(rsplits);
  }
}

void Runtime::execute_reducescatter(const Response& r, Comm& comm,
                                    std::vector<Entry*>& entries) {
  const size_t esize = dtype_size(r.dtype);
  const int n = comm.size();
  for (size_t i = 0; i < r.names.size(); ++i) {
    Entry* e = entries[i];
    if (!e) continue;
    const auto& shape = r.shapes[i];
    int64_t dim0 = shape.empty() ? 0 : shape[0];
    int64_t total = num_elements(shape);
    int64_t row = dim0 ? total / dim0 : 0;
    std::vector<size_t> counts(n);
    for (int k = 0; k < n; ++k)
      counts[k] = static_cast<size_t>(reducescatter_rows(dim0, n, k) * row);
    unsigned char* scratch = fusion(static_cast<size_t>(total) * esize);
    if (total) std::memcpy(scratch, e->input, static_cast<size_t>(total) * esize);
    if (r.prescale != 1.0) scale_buffer(scratch, total, r.dtype, r.prescale);
    reducescatterv(comm, scratch, e->output, counts, r.dtype, r.reduce_op);
    double post = r.postscale;
    if (r.reduce_op == ReduceOp::AVERAGE) post /= n;
    if (post != 1.0) scale_buffer(e->output, counts[comm.rank()], r.dtype, post);
  }
}

void Runtime::execute_decentralized(const Response& r, Comm& comm,
                                    std::vector<Entry*>& entries) {
  Entry* e = entries[0];
  if (!e) return;
  const size_t count = static_cast<size_t>(num_elements(r.shapes[0]));
  const size_t bytes = count * dtype_size(r.dtype);
  Hierarchy* h = hierarchy_for(r, comm);
  const bool lp = r.type == BHVD_OP_LP_DECENTRALIZED;
  if (lp && r.peer_mode == 2) {  // the exchange half of a split step (never hierarchical)
    lp_decentralized_exchange(comm, static_cast<const uint8_t*>(e->input), e->aux[0], e->aux[1],
                              e->aux_count, e->aux_dtype);
    return;
  }
  if (lp && r.peer_mode == 1) {  // replicas: among the hosts' leaders when hierarchical
    if (!h || h->leader) {
      lp_decentralized_init(h ? *h->leaders : comm, e->output, e->aux[0], e->aux[1], e->aux[2],
                            count, r.dtype);
    } else {  // only the leaders' replicas are used; the others keep plain copies
      for (void* a : e->aux) std::memcpy(a, e->output, bytes);
    }
    return;
  }
  if (h) {
    // The host's average, the algorithm among the hosts' leaders, the result back to the host.
    if (e->input != e->output && bytes) std::memcpy(e->output, e->input, bytes);
    allreduce(*h->intra, e->output, count, r.dtype, ReduceOp::SUM);
    scale_buffer(e->output, count, r.dtype, 1.0 / h->intra->size());
    if (h->leader) {
      if (lp)
        lp_decentralized(*h->leaders, e->output, e->aux[0], e->aux[1], e->aux[2], count, r.dtype);
      else
        decentralized_average(*h->leaders, e->output, e->output, count, r.dtype,
                              static_cast<PeerMode>(r.peer_mode), r.step);
    }
    broadcast(*h->intra, e->output, bytes, 0);
    return;
  }
  if (lp) {
    lp_decentralized(comm, e->output, e->aux[0], e->aux[1], e->aux[2], count, r.dtype);
  } else {
    decentralized_average(comm, e->input, e->output, count, r.dtype,
                          static_cast<PeerMode>(r.peer_mode), r.step);
  }
}

int Runtime::group_size(int32_t set_id, bool hierarchical) {
  std::lock_guard<std::mutex> lock(mu_);
  return group_size_locked(set_id, hierarchical);
}

int Runtime::group_size_locked(int32_t set_id, bool hierarchical) {
  auto it = sets_.find(set_id);
  if (it == sets_.end() || !transport_) return -1;
  const int n = static_cast<int>(it->second.size());
  if (!hierarchical) return n;
  std::map<std::string, int> per_host;
  for (int g : it->second) ++per_host[transport_->host_of(g)];
  bool crowded = false;
  for (const auto& kv : per_host) crowded = crowded || kv.second > 1;
  return per_host.size() > 1 && crowded ? static_cast<int>(per_host.size()) : n;
}

Runtime::Hierarchy* Runtime::hierarchy_for(const Response& r, Comm& comm) {
  if (!r.hierarchical) return nullptr;
  auto it = hierarchies_.find(r.process_set_id);
  if (it == hierarchies_.end()) {
    Hierarchy h;
    std::map<std::string, std::vector<int>> by_host;  // host -> sorted global ranks
    for (int g : comm.global_ranks()) by_host[transport_->host_of(g)].push_back(g);
    std::vector<int> leaders, mine;
    bool crowded = false;
    const std::string my_host = transport_->host_of(cfg_.rank);
    for (const auto& kv : by_host) {
      leaders.push_back(kv.second.front());
      crowded = crowded || kv.second.size() > 1;
      if (kv.first == my_host) mine = kv.second;
    }
    h.active = by_host.size() > 1 && crowded;
    if (h.active) {
      std::sort(leaders.begin(), leaders.end());
      h.leader = !mine.empty() && mine.front() == cfg_.rank;
      h.intra = std::make_unique<Comm>(*transport_, mine);
      h.leaders = std::make_unique<Comm>(*transport_, leaders);
    }
    it = hierarchies_.emplace(r.process_set_id, std::move(h)).first;
  }
  return it->second.active ? &it->second : nullptr;
}

void Runtime::complete_locked(Handle& h, std::vector<std::function<void()>>* callbacks) {
  if (h.done) return;
  h.done = true;
  h.cv.notify_all();
  if (h.on_done) {
    callbacks->push_back([fn = std::move(h.on_done), status = h.status] { fn(status); });
    h.on_done = nullptr;
    mark_seen_locked(h);  // the callback is its caller
  }
}

void Runtime::mark_seen_locked(Handle& h) {
  if (h.seen) return;
  h.seen = true;
  for (const auto& name : h.names) {
    if (!table_.count(name)) reserved_.erase(name);
  }
}

void Runtime::finish(const std::string& name, const Status& s) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(name);
    if (it == table_.end()) return;
    auto h = it->second.handle;
    table_.erase(it);
    if (h->seen) reserved_.erase(name);  // released while pending
    if (!s.ok() && h->status.ok()) h->status = s;
    if (--h->remaining <= 0) complete_locked(*h, &callbacks);
  }
  for (auto& cb : callbacks) cb();
}

void Runtime::fail_all(const Status& s) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : table_) {
      auto h = kv.second.handle;
      if (h->status.ok()) h->status = s;
      complete_locked(*h, &callbacks);
    }
    table_.clear();
    reserved_.clear();
    queue_.clear();
    urgent_queue_.clear();
    stopped_ = true;
    if (stop_status_.ok()) stop_status_ = s;
  }
  for (auto& cb : callbacks) cb();
}

// ---- control channel: length-prefixed frames over the ctrl pairs ------------------------------

void Runtime::fill_channel(int peer) {
  Pair& p = transport_->ctrl(peer);
  std::string& buf = inbox_[peer];
  if (!inbox_error_[peer].empty()) return;
  char tmp[65536];
  try {
    while (true) {
      size_t n = p.try_recv(tmp, sizeof(tmp));
      if (n == 0) break;
      buf.append(tmp, n);
    }
  } catch (const TransportError& e) {
    // A peer that exits right after its last message (shutdown) closes the channel: deliver
    // what it sent before reporting the closed connection.
    inbox_error_[peer] = e.what();
  }
}

bool Runtime::poll_message(int peer, std::string* out) {
  std::string& buf = inbox_[peer];
  if (buf.size() < 4 || [&] {
        uint32_t len;
        std::memcpy(&len, buf.data(), 4);
        return buf.size() < 4 + static_cast<size_t>(len);
      }())
    fill_channel(peer);
  auto pending_error = [&] {
    if (!inbox_error_[peer].empty()) throw TransportError(inbox_error_[peer]);
    return false;
  };
  if (buf.size() < 4) return pending_error();
  uint32_t len;
  std::memcpy(&len, buf.data(), 4);
  if (len > kMaxControlFrame)
    throw TransportError("rank " + std::to_string(peer) + " sent a negotiation frame of " +
                         std::to_string(len) + " bytes, over the limit: the control channel "
                         "carries garbage");
  if (buf.size() < 4 + static_cast<size_t>(len)) return pending_error();
  out->assign(buf, 4, len);
  buf.erase(0, 4 + static_cast<size_t>(len));
  return true;
}

void Runtime::send_message(int peer, const std::string& payload) {
  Pair& p = transport_->ctrl(peer);
  uint32_t len = static_cast<uint32_t>(payload.size());
  std::string frame(reinterpret_cast<const char*>(&len), 4);
  frame += payload;
  size_t off = 0;
  auto last = Clock::now();
  while (off < frame.size()) {
    size_t n = p.try_send(frame.data() + off, frame.size() - off);
    if (n) {
      off += n;
      last = Clock::now();
      continue;
    }
    // Keep draining what the peer sends us so two full channels cannot deadlock.
    fill_channel(peer);
    if (seconds_since(last) > cfg_.timeout_s)
      throw TransportError("timed out after " + format_seconds(cfg_.timeout_s) +
                           " s sending a negotiation message to rank " + std::to_string(peer));
    p.check_alive();
    transport_->wait(std::chrono::microseconds(1000));
  }
}

}  // namespace bagua_hvd
