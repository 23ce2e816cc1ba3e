#include "core/async_average.h"

#include <cstring>

#include "collectives/collectives.h"

namespace bagua_hvd {

namespace {
std::shared_ptr<void> host_memory(size_t bytes) {
  auto v = std::make_shared<std::vector<unsigned char>>(bytes);
  return std::shared_ptr<void>(v, v->data());
}
}  // namespace

AsyncAverager::AsyncAverager(RunRequest run_request, std::string name, std::vector<Weights> weights,
                             int32_t set_id, int set_size, int64_t interval_ms, int device,
                             DeviceEngine* engine)
    : run_(std::move(run_request)),
      name_(std::move(name)),
      set_id_(set_id),
      interval_(interval_ms),
      set_size_(set_size),
      device_(engine ? device : -1),
      engine_(engine) {
  if (engine_) stream_ = engine_->make_stream();
  for (auto& w : weights) {
    Buffer b;
    b.count = 1;
    for (auto d : w.shape) b.count *= static_cast<size_t>(d);
    b.bytes = b.count * dtype_size(w.dtype);
    b.snapshot = engine_ ? engine_->device_memory(b.bytes) : host_memory(b.bytes);
    b.sum = engine_ ? engine_->device_memory(b.bytes) : host_memory(b.bytes);
    b.w = std::move(w);
    buffers_.push_back(std::move(b));
  }
  thread_ = std::thread([this] { run(); });
  name_thread(thread_, "bhvd_async_avg");
}

AsyncAverager::~AsyncAverager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abort_ = true;
  }
  cv_.notify_all();
  // The thread ends once its collectives do: they complete, or fail when the runtime stops.
  if (thread_.joinable()) thread_.join();
}

Status AsyncAverager::allreduce(const std::string& name, void* in, void* out, DataType dtype,
                                const std::vector<int64_t>& shape, int32_t reduce_op) {
  bhvd_tensor ti{in, static_cast<int32_t>(dtype), static_cast<int32_t>(shape.size()),
                 shape.data()};
  bhvd_tensor to{out, ti.dtype, ti.ndim, shape.data()};
  bhvd_request req{};
  req.op_type = BHVD_OP_ALLREDUCE;
  req.name = name.c_str();
  req.process_set_id = set_id_;
  req.reduce_op = reduce_op;
  // The weights' device (the "go" flag is host memory): the core's stream waits for ours, which
  // waited for the snapshot, and ours waits for the allreduce (run_request).
  const bool on_device = device_ >= 0 && dtype != DataType::INT32;
  req.device = on_device ? device_ : -1;
  req.stream = on_device ? stream_.get() : nullptr;
  req.prescale_factor = 1.0;
  req.postscale_factor = 1.0;
  req.num_tensors = 1;
  req.inputs = &ti;
  req.outputs = &to;
  return run_(req);  // bounded by the core: peers failing or the runtime stopping end it
}

void AsyncAverager::run() {
  auto next = std::chrono::steady_clock::now() + interval_;
  Status status;
  for (int64_t round = 0;; ++round) {
    int32_t go;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, next, [&] { return abort_; });
      go = abort_ ? 0 : 1;
    }
    // Every rank goes on only if every rank does: a rank that aborted stops them all.
    int32_t all_go = 0;
    status = allreduce(name_ + ".go", &go, &all_go, DataType::INT32, {1}, BHVD_MIN);
    if (!status.ok() || all_go == 0) break;
    {
      std::unique_lock<std::mutex> lock(mu_);
      phase_ = Phase::WANT_SNAPSHOT;
      cv_.wait(lock, [&] { return phase_ != Phase::WANT_SNAPSHOT || abort_; });
      if (phase_ == Phase::WANT_SNAPSHOT) snapshot_locked(stream_.get());  // aborting: no step
      phase_ = Phase::REDUCING;
    }
    for (size_t i = 0; i < buffers_.size() && status.ok(); ++i) {
      Buffer& b = buffers_[i];
      status = allreduce(name_ + ".w" + std::to_string(i), b.snapshot.get(), b.sum.get(),
                         b.w.dtype, b.w.shape, BHVD_SUM);
    }
    if (!status.ok()) break;
    {
      std::unique_lock<std::mutex> lock(mu_);
      phase_ = Phase::WANT_MERGE;
      cv_.wait(lock, [&] { return phase_ != Phase::WANT_MERGE || abort_; });
      if (phase_ == Phase::WANT_MERGE) merge_locked(stream_.get());
      phase_ = Phase::IDLE;
    }
    next = std::chrono::steady_clock::now() + interval_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.ok()) error_ = status;
  phase_ = Phase::STOPPED;
  cv_.notify_all();
}

void AsyncAverager::snapshot_locked(void* stream) {
  if (engine_) {
    // On the stream that wrote the weights; the round's allreduces (our stream) come after.
    for (auto& b : buffers_) engine_->copy_on(b.snapshot.get(), b.w.data, b.bytes, stream);
    if (stream != stream_.get()) engine_->stream_wait(stream_.get(), engine_->record(stream));
    return;
  }
  for (auto& b : buffers_) std::memcpy(b.snapshot.get(), b.w.data, b.bytes);
}

void AsyncAverager::merge_locked(void* stream) {
  // x += sum / n - snapshot: keeps the local progress made since the snapshot.
  if (engine_) {
    // After the round's allreduces (our stream waited for them), before the caller's next use.
    if (stream != stream_.get()) engine_->stream_wait(stream, engine_->record(stream_.get()));
    for (auto& b : buffers_)
      engine_->async_merge(b.w.data, b.sum.get(), b.snapshot.get(), b.count, b.w.dtype, set_size_,
                           stream);
    ++rounds_;
    return;
  }
  const float inv = 1.0f / static_cast<float>(set_size_);
  for (auto& b : buffers_) {
    if (b.w.dtype == DataType::FLOAT64) {
      auto* x = static_cast<double*>(b.w.data);
      const auto* s = static_cast<const double*>(b.sum.get());
      const auto* p = static_cast<const double*>(b.snapshot.get());
      const double dn = static_cast<double>(set_size_);
      for (size_t i = 0; i < b.count; ++i) x[i] = x[i] + s[i] / dn - p[i];
      continue;
    }
    constexpr size_t kBlock = 1 << 14;  // float32 staging, a block at a time
    std::vector<float> x(kBlock), s(kBlock), p(kBlock);
    const size_t es = dtype_size(b.w.dtype);
    auto* xd = static_cast<unsigned char*>(b.w.data);
    for (size_t off = 0; off < b.count; off += kBlock) {
      const size_t m = std::min(kBlock, b.count - off);
      to_float(xd + off * es, b.w.dtype, m, x.data());
      to_float(static_cast<const unsigned char*>(b.sum.get()) + off * es, b.w.dtype, m, s.data());
      to_float(static_cast<const unsigned char*>(b.snapshot.get()) + off * es, b.w.dtype, m,
               p.data());
      for (size_t i = 0; i < m; ++i) x[i] = (x[i] + s[i] * inv) - p[i];
      from_float(x.data(), b.w.dtype, m, xd + off * es);
    }
  }
  ++rounds_;
}

void AsyncAverager::step(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::WANT_MERGE) {
    merge_locked(stream);
    phase_ = Phase::IDLE;
    cv_.notify_all();
  } else if (phase_ == Phase::WANT_SNAPSHOT) {
    snapshot_locked(stream);
    phase_ = Phase::REDUCING;
    cv_.notify_all();
  }
}

Status AsyncAverager::abort(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  abort_ = true;
  cv_.notify_all();
  auto done = [&] { return phase_ == Phase::STOPPED; };
  if (timeout_ms < 0) {
    cv_.wait(lock, done);
  } else if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
    return Status::Error(StatusType::TIMED_OUT,
                         "async model averaging '" + name_ + "': its last round did not finish "
                         "within " + std::to_string(timeout_ms) + " ms (waiting for the other "
                         "ranks of the process set to join the round)");
  }
  return error_;
}

int64_t AsyncAverager::rounds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rounds_;
}

bool AsyncAverager::stopped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_ == Phase::STOPPED;
}

AsyncRegistry& AsyncRegistry::get() {
  static AsyncRegistry r;
  return r;
}

void AsyncRegistry::release(int64_t id) {
  auto a = remove(id);
  a.reset();  // joins outside the registry lock
}

std::map<int64_t, std::shared_ptr<AsyncAverager>> AsyncRegistry::stop_all(int64_t timeout_ms) {
  auto items = remove_all();
  for (auto& kv : items) {
    Status s = kv.second->abort(timeout_ms);
    if (!s.ok()) BHVD_LOG(WARNING, s.reason);
  }
  return items;
}

}  // namespace bagua_hvd
