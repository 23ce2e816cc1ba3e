#include "core/lp_ring.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "collectives/trace.h"
#include "compression/minmax_uint8.h"

namespace bagua_hvd {

namespace {
// Memory of empty buffers: the core wants a non-null pointer for them.
unsigned char kEmpty[1];

void* or_empty(void* p) { return p ? p : kEmpty; }

// The parameters of INIT and STEP (the same fields): replicas self, left, right.
template <typename P>
P replica_params(int32_t op_type, bool hierarchical, const bhvd_tensor* reps) {
  P p{};
  p.op_type = op_type;
  p.hierarchical = hierarchical ? 1 : 0;
  p.self = &reps[0];
  p.left = &reps[1];
  p.right = &reps[2];
  return p;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}
}  // namespace

bool lp_ring_splits(bool hierarchical, int group_size, int set_size) {
  return !hierarchical || group_size == set_size;
}

LpRing::LpRing(Ops ops, Params params, std::vector<Bucket> buckets)
    : ops_(std::move(ops)), params_(params), buckets_(std::move(buckets)) {
  flats_.resize(buckets_.size());
}

bhvd_request LpRing::request(int32_t op_type, const std::string& name, const bhvd_tensor* t,
                             const void* params, void* stream) const {
  bhvd_request r{};
  r.op_type = op_type;
  r.name = name.c_str();
  r.process_set_id = params_.set_id;
  const bool on_device = params_.device >= 0;
  r.device = on_device ? params_.device : -1;
  r.stream = on_device ? stream : nullptr;
  r.prescale_factor = 1.0;
  r.postscale_factor = 1.0;
  r.num_tensors = 1;
  r.inputs = t;
  r.outputs = t;  // in place
  r.urgent = 1;   // waited for at once (the exchange: by the next step): not held for fusion
  r.params = params;
  return r;
}

Status LpRing::check(const std::vector<Segments>& x) const {
  if (x.size() != buckets_.size())
    return Status::InvalidArgument("bagua_hvd: the low-precision layout changed");
  for (size_t b = 0; b < x.size(); ++b) {
    int64_t n = 0;
    for (const auto& s : x[b]) n += static_cast<int64_t>(s.count);
    if (n != buckets_[b].count)
      return Status::InvalidArgument("bagua_hvd: the low-precision layout changed");
  }
  return Status::OK();
}

Status LpRing::flat(size_t b, const Segments& x, void** out) {
  if (x.size() == 1) {
    *out = or_empty(x[0].data);
    return Status::OK();
  }
  if (params_.device >= 0)
    return Status::InvalidArgument(
        "low-precision decentralized: a bucket of device weights must be one buffer");
  const size_t es = dtype_size(buckets_[b].dtype);
  auto& f = flats_[b];
  f.resize(static_cast<size_t>(buckets_[b].count) * es);
  unsigned char* dst = f.data();
  for (const auto& s : x) {
    if (s.count) std::memcpy(dst, s.data, s.count * es);
    dst += s.count * es;
  }
  *out = or_empty(f.data());
  return Status::OK();
}

Status LpRing::wait_bounded(int64_t handle, const std::string& name) {
  const auto start = Clock::now();
  auto since = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  double next_warning = params_.wait_warning_s > 0 ? params_.wait_warning_s : -1;
  for (;;) {
    // Until the next warning or the limit, whichever comes first (-1: no limit).
    double until = -1;
    if (next_warning > 0) until = next_warning;
    if (params_.op_timeout_s > 0 && (until < 0 || params_.op_timeout_s < until))
      until = params_.op_timeout_s;
    const int64_t slice_ms =
        until < 0 ? -1 : std::max<int64_t>(0, static_cast<int64_t>((until - since()) * 1000));
    Status s = ops_.wait(handle, slice_ms);
    if (s.type != StatusType::TIMED_OUT || slice_ms < 0) return s;
    const double elapsed = since();
    if (params_.op_timeout_s > 0 && elapsed >= params_.op_timeout_s)
      return Status::Error(StatusType::TIMED_OUT,
                           name + " (handle " + std::to_string(handle) +
                               ") did not complete within BAGUA_HVD_OP_TIMEOUT_SECONDS=" +
                               seconds_text(params_.op_timeout_s) +
                               " s: other ranks may not have submitted the same operation");
    if (next_warning > 0 && elapsed >= next_warning) {
      BHVD_LOG(WARNING, "bagua_hvd: still waiting for " + name + " (handle " +
                            std::to_string(handle) + ") after " +
                            std::to_string(std::llround(elapsed)) +
                            " s; other ranks may not have submitted the same operation");
      next_warning += params_.wait_warning_s;
    }
  }
}

Status LpRing::wait_release(const Pending& p, void* stream) {
  Status s = wait_bounded(p.handle, p.name);
  if (s.ok() && params_.device >= 0) ops_.stream_wait(p.handle, stream);
  if (s.reason.empty() && !s.ok()) s.reason = p.name + " failed";
  ops_.release(p.handle);
  return s;
}

Status LpRing::init(const std::vector<Segments>& x, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Status s = check(x);
  return s.ok() ? run_buckets(x, true, stream) : s;
}

Status LpRing::run_buckets(const std::vector<Segments>& x, bool init, void* stream) {
  std::vector<void*> data(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Status s = flat(b, x[b], &data[b]);
    if (!s.ok()) return s;
  }
  Status failed;
  std::vector<Pending> started;
  for (size_t b = 0; b < buckets_.size() && failed.ok(); ++b) {
    const Bucket& k = buckets_[b];
    const int64_t n = k.count;
    const int32_t dtype = static_cast<int32_t>(k.dtype);
    bhvd_tensor t{data[b], dtype, 1, &n};
    const bhvd_tensor reps[3] = {{or_empty(k.self), dtype, 1, &n},
                                 {or_empty(k.left), dtype, 1, &n},
                                 {or_empty(k.right), dtype, 1, &n}};
    // The whole step runs with the hierarchy in play: hierarchical as the algorithm says.
    const auto ip = replica_params<bhvd_lp_init_params>(BHVD_OP_LP_DECENTRALIZED_INIT,
                                                        params_.hierarchical, reps);
    const auto sp = replica_params<bhvd_lp_step_params>(BHVD_OP_LP_DECENTRALIZED_STEP,
                                                        params_.hierarchical, reps);
    const std::string& name = init ? k.init_name : k.step_name;
    int64_t h = 0;
    failed = init ? ops_.enqueue(request(ip.op_type, name, &t, &ip, stream), &h)
                  : ops_.enqueue(request(sp.op_type, name, &t, &sp, stream), &h);
    if (failed.ok()) started.push_back({h, name});
  }
  for (const auto& p : started) {  // all of them, even after a failure
    Status s = wait_release(p, stream);
    if (failed.ok()) failed = s;
  }
  return failed;
}

Status LpRing::step(const std::vector<Segments>& x, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Status s = check(x);
  if (!s.ok()) return s;
  return params_.split ? split_step(x, stream) : whole_step(x, stream);
}

Status LpRing::split_step(const std::vector<Segments>& x, void* stream) {
  // Bucket by bucket: the previous round's exchange of bucket b (which wrote its replicas and
  // read its difference) is waited for, its local half runs on the weights in place and its new
  // exchange starts, which then overlaps the next buckets' local halves. Each bucket's math is
  // the same as when all local halves ran first on one packed bucket: the same bits.
  std::vector<Pending> old;
  old.swap(pending_);
  Status failed;
  size_t waited = 0;
  for (size_t b = 0; b < buckets_.size() && failed.ok(); ++b) {
    const Bucket& k = buckets_[b];
    if (b < old.size()) {
      failed = wait_release(old[b]);
      trace_mark(TraceOp::kLpRingWaited, k.count);
      waited = b + 1;
      if (!failed.ok()) break;
    }
    if (!k.diff) {
      failed = Status::InvalidArgument(
          "low-precision decentralized: the split step needs the compressed difference buffers");
      break;
    }
    if (params_.device >= 0) {
      void* data = nullptr;
      failed = flat(b, x[b], &data);  // one buffer (device weights are not packed)
      if (failed.ok()) failed = ops_.local(k, data, stream);
      if (!failed.ok()) break;
    } else {
      try {
        lp_decentralized_local(x[b].data(), x[b].size(), or_empty(k.self), or_empty(k.left),
                               or_empty(k.right), k.dtype, k.diff);
      } catch (const std::exception& e) {
        failed = Status::InvalidArgument(e.what());
        break;
      }
    }
    const int64_t bytes =
        static_cast<int64_t>(minmax_uint8_bytes(k.dtype, static_cast<size_t>(k.count), 1));
    const int64_t n = k.count;
    bhvd_tensor c{k.diff, BHVD_UINT8, 1, &bytes};
    bhvd_tensor left{or_empty(k.left), static_cast<int32_t>(k.dtype), 1, &n},
        right{or_empty(k.right), left.dtype, 1, &n};
    bhvd_lp_exchange_params p{};
    p.op_type = BHVD_OP_LP_DECENTRALIZED_EXCHANGE;
    p.left = &left;
    p.right = &right;
    int64_t h = 0;
    trace_mark(TraceOp::kLpRingLaunch, k.count);  // before: the core may begin it at once
    // Device weights: the exchange waits for `stream`, which waits for the local half.
    failed = ops_.enqueue(request(p.op_type, k.exchange_name, &c, &p, stream), &h);
    if (failed.ok()) pending_.push_back({h, k.exchange_name});  // written into after we return
  }
  // Every exchange of the previous round completes before the error surfaces; those started
  // here are waited for by the next step or flush.
  for (size_t b = waited; b < old.size(); ++b) wait_release(old[b]);
  return failed;
}

Status LpRing::whole_step(const std::vector<Segments>& x, void* stream) {
  // The host average needs communication first: one blocking op per bucket.
  Status failed = run_buckets(x, false, stream);
  if (!failed.ok()) return failed;
  for (size_t b = 0; b < buckets_.size(); ++b) {  // packed buckets: the new weights, in place
    if (x[b].size() == 1) continue;
    const size_t es = dtype_size(buckets_[b].dtype);
    const unsigned char* src = flats_[b].data();
    for (const auto& s : x[b]) {
      if (s.count) std::memcpy(s.data, src, s.count * es);
      src += s.count * es;
    }
  }
  return failed;
}

Status LpRing::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Pending> pending;
  pending.swap(pending_);
  Status failed;
  for (const auto& p : pending) {
    Status s = wait_release(p);
    if (failed.ok()) failed = s;
  }
  return failed;
}

int64_t LpRing::settle(const Clock::time_point* deadline) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return 0;  // busy in its own step (another thread): it waits there
  int64_t late = 0;
  for (const auto& p : pending_) {
    if (deadline) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
      if (ops_.wait(p.handle, std::max<int64_t>(0, left.count())).type == StatusType::TIMED_OUT)
        ++late;
    } else if (wait_bounded(p.handle, p.name).type == StatusType::TIMED_OUT) {
      ++late;
    }
  }
  return late;
}

int64_t LpRing::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(pending_.size());
}

void LpRing::drop() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& p : pending_) {
    ops_.wait(p.handle, -1);
    ops_.release(p.handle);
  }
  pending_.clear();
}

LpRings& LpRings::get() {
  static LpRings r;
  return r;
}

void LpRings::settle_others(const LpRing* own) {
  for (auto& ring : all())
    if (ring.get() != own) ring->settle(nullptr);
}

int64_t LpRings::settle_all(double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  int64_t late = 0;
  for (auto& ring : all()) late += ring->settle(&deadline);
  return late;
}

}  // namespace bagua_hvd
