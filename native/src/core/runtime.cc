// The runtime (core/runtime.h): init and shutdown, enqueue and the handles, the background
// loop. One negotiation cycle: core/negotiation.cc; the execution of a response:
// core/dispatch.cc.
#include "core/runtime.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include "core/async_average.h"
#include "core/async_impl.h"
#include "core/config.h"
#include "core/lp_ring.h"
#include "core/validate.h"
#include "engines/device_engine.h"
#include "engines/nccl_library.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BHVD_CPU_RELAX() _mm_pause()
#else
#define BHVD_CPU_RELAX() std::this_thread::yield()
#endif

namespace bagua_hvd {

Runtime& Runtime::get() {
  // Never destroyed: frontends may still call in from atexit handlers after static destructors.
  static Runtime* rt = new Runtime();  // NOLINT: intentional leak of a process-wide singleton
  return *rt;
}

Status Runtime::init(const std::vector<std::vector<int32_t>>& static_sets, bool dynamic_sets) {
  if (initialized_) return Status::OK();
  ++epoch_;
  Config config;
  if (Status st = load_config(epoch_, &config); !st.ok()) return st;
  BootstrapConfig cfg = config.bootstrap;
  spin_ = std::chrono::microseconds(config.spin_us);
  hierarchical_allreduce_ = config.hierarchical_allreduce;
  timeline_enabled_ = !config.timeline.empty();
  mpi_engine_.reset();
  if (config.cpu_operations_mpi && cfg.size > 1) {
    // Before the rendezvous: a rank that cannot use MPI fails at once, not after the others.
    std::string why;
    mpi_engine_ = make_mpi_engine(cfg.rank, cfg.size, &mpi_facts_, &why);
    if (!mpi_engine_)
      return Status::InvalidArgument(
          "Horovod initialization failed: HOROVOD_CPU_OPERATIONS=mpi, but " + why +
          ". Start the job with mpirun (or bagua-run --mpi) and mpi4py installed, or unset "
          "HOROVOD_CPU_OPERATIONS to use bagua_hvd's own transports");
    if (!mpi_facts_.threads_multiple && cfg.rank == 0)
      BHVD_LOG(WARNING,
               "MPI has not been initialised with MPI_THREAD_MULTIPLE; calling MPI "
               "from the training program while Horovod runs may cause problems");
  }

  try {
    if (!config.distributed) {
      transport_ = make_self_transport();
    } else {
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
    if (std::string e = process_set_ranks_error(ranks, cfg_.size); !e.empty()) {
      transport_.reset();
      return Status::InvalidArgument("Horovod initialization failed: " + e);
    }
    std::sort(ranks.begin(), ranks.end());
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
    // Every rank restarts the numbering of unnamed ops together.
    unnamed_counter_.clear();
    handles_.clear();
    next_handle_ = 1;
  }
  dynamic_sets_ = dynamic_sets;
  cache_.clear();
  acked_seq_ = 0;
  sent_shutdown_ = false;
  ended_by_shutdown_ = false;
  oversubscribed_ =
      cfg_.local_size > static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ctrl_ = std::make_unique<ControlChannel>(*transport_, cfg_.timeout_s);
  heard_.assign(cfg_.size, Clock::now());
  last_keepalive_ = Clock::time_point{};
  transport_->set_heartbeat([this] {
    // Only the loop's own thread owns the control channel (the async averaging thread also runs
    // collectives).
    if (std::this_thread::get_id() == loop_thread_id_) send_keepalives(Clock::now());
  });
  transport_->set_finished_probe([this](int peer) {
    if (std::this_thread::get_id() != loop_thread_id_ || !ctrl_) return false;
    // Its data connection closed: its bye may still be on the way (the ctrl connection is
    // another stream), so only a ctrl channel that closed without one says it failed.
    return ctrl_->said_bye(peer) != ControlChannel::Bye::kNot;
  });
  coordinator_.reset();
  if (cfg_.rank == 0) {
    coordinator_ = std::make_unique<Coordinator>(cfg_.size, sets_, config.coordinator, &timeline_);
    if (timeline_enabled_ && config.timeline != "DYNAMIC") {
      // As Horovod: a file that cannot be written is logged, the job runs without a timeline.
      if (Status s = timeline_.start(config.timeline, config.timeline_mark_cycles); !s.ok())
        BHVD_LOG(ERROR, s.reason);
    }
  }
  response_log_.reset();
  if (!config.response_log.empty()) {
    const std::string path = config.response_log + "/rank." + std::to_string(cfg_.rank) + ".log";
    response_log_ = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::app);
    if (!response_log_->good()) {
      BHVD_LOG(WARNING, "BAGUA_HVD_RESPONSE_LOG: cannot write " + path);
      response_log_.reset();
    }
  }
  reset_wire_stats();  // hvd.communication_stats() counts from init()
  initialized_ = true;
  thread_ = std::thread([this] { loop(); });
  name_thread(thread_, "bhvd_core");
  return Status::OK();
}

Status Runtime::shutdown() {
  if (!initialized_) return Status::OK();
  // Background averaging rounds need the runtime: stop them first, on every rank together.
  auto averagers = AsyncRegistry::get().stop_all(static_cast<int64_t>(cfg_.timeout_s * 1000));
  // The frontends' implementations start the next job's averagers anew (restarts from 0).
  AsyncImpls::get().end_job();
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
    transport_->notify();
  }
  autotuner_.stop();  // rank 0's tuner thread returns
  if (thread_.joinable()) thread_.join();
  response_log_.reset();
  timeline_.shutdown();  // the file is complete once hvd.shutdown() returns
  mpi_engine_.reset();   // its communicators, once the background thread no longer uses them
  // NCCL communicators belong to this job: the next init (an elastic reset) makes new ones.
  release_device_communicators(cfg_.timeout_s);
  fail_all(Status::Aborted(kShutDown));
  // The low-precision rings belong to this job: their exchanges have failed now; the frontends
  // start new ones in the next (bhvd_lp_ring_* on an old id: unknown).
  LpRings::get().remove_all();
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
    ctrl_.reset();
    transport_.reset();
    stopped_ = true;
    stop_status_ = Status::Aborted(kShutDown);
    initialized_ = false;
  }
  fusion_.release();
  return Status::OK();
}

// ---- frontend side ------------------------------------------------------------------------

namespace {
// Horovod's text.
constexpr const char* kTimelineNotEnabled =
    "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.";
}  // namespace

Status Runtime::start_timeline(const std::string& path, bool mark_cycles) {
  if (!initialized_) return Status::NotInitialized();
  if (!timeline_enabled_) return Status::InvalidArgument(kTimelineNotEnabled);
  if (cfg_.rank != 0) return Status::OK();
  if (Status s = timeline_.start(path, mark_cycles); !s.ok()) BHVD_LOG(ERROR, s.reason);
  return Status::OK();
}

Status Runtime::stop_timeline() {
  if (!initialized_) return Status::NotInitialized();
  // As Horovod (horovod_stop_timeline): stopping a timeline that does not run is no error.
  if (!timeline_enabled_ || (cfg_.rank == 0 && !timeline_.active())) {
    BHVD_LOG(INFO, "Timeline is already stopped. Please start timeline before stopping it.");
    return Status::OK();
  }
  timeline_.stop();
  return Status::OK();
}

Status Runtime::enqueue(const bhvd_request& req, int64_t* handle_out) {
  if (!initialized_) return Status::NotInitialized();
  const int32_t t = req.op_type;
  const std::string title = op_title(t);
  if (Status s = validate_request(req, title); !s.ok()) return s;
  const bool tensor_op = t != BHVD_OP_JOIN && t != BHVD_OP_BARRIER;
  // CUDA tensors: what the caller's stream has queued so far produces them; the device
  // engine's stream waits for this event before reading them. Outside mu_: the first request
  // of a device creates its engine (a CUDA stream, NCCL loaded), which the background thread
  // must not wait for.
  std::shared_ptr<void> ready;
  if (tensor_op && req.device >= 0) {
    std::string why;
    DeviceEngine* engine = device_engine(req.device, &why);
    if (!engine) return Status::InvalidArgument(title + ": " + why);
    ready = engine->record(req.stream);
  }

  std::unique_lock<std::mutex> lock(mu_);
  if (stopped_) return stop_status_.ok() ? Status::Aborted(kShutDown) : stop_status_;
  auto sit = sets_.find(req.process_set_id);
  if (sit == sets_.end())
    return Status::InvalidArgument(title +
                                   ": Process set provided does not exist, or has not been "
                                   "registered.");
  const auto& ranks = sit->second;
  const int set_size = static_cast<int>(ranks.size());
  OpParams params;
  StateBuffers state;
  if (Status s = validate_for_set(
          req, title, ranks, cfg_.rank,
          [&](bool hierarchical) { return group_size_locked(req.process_set_id, hierarchical); },
          &params, &state);
      !s.ok())
    return s;
  if (t == BHVD_OP_ALLREDUCE && req.reduce_op == BHVD_ADASUM && req.device >= 0) {
    // Horovod's GPU Adasum needs NCCL; without it, Horovod copies CUDA tensors to the host and
    // runs its CPU Adasum, rule included (dispatch.cc decides the same way).
    if (Status s = loaded_nccl() ? validate_device_adasum(ranks_per_host(*transport_, ranks))
                                 : validate_adasum_ranks(ranks.size());
        !s.ok())
      return s;
  }

  const int64_t id = next_handle_;  // consumed only if the request is accepted
  const int n = tensor_op ? req.num_tensors : 0;
  std::vector<Request> reqs;
  std::string base;
  std::optional<std::pair<std::string, std::vector<int32_t>>> unnamed_key;  // counted if accepted
  if (t == BHVD_OP_JOIN) {
    base = "join";
  } else if (t == BHVD_OP_BARRIER) {
    base = "barrier." + std::to_string(req.process_set_id) + "." +
           std::to_string(barrier_counter_[req.process_set_id]);
  } else if (req.name && *req.name) {
    base = req.name;
  } else {
    // Numbered per op kind and process set, counting the caller's unnamed requests only: the
    // algorithms' own (named) requests, whose number differs between ranks (asynchronous
    // averaging rounds), must not shift the names a user's unnamed ops get on each rank. Keyed
    // by the set's ranks, not its id: a removed set's id is given again to other ranks.
    unnamed_key.emplace(op_prefix(t, n > 1), ranks);
    base = unnamed_key->first + ".noname." + std::to_string(unnamed_counter_[*unnamed_key] + 1);
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
    r.params = params;
    if (tensor_op) {
      if (Status s = validate_tensor(req, i, title, set_size, &r); !s.ok()) return s;
    }
    if (reserved_.count(tensor_key(r.process_set_id, r.name)))
      return Status::InvalidArgument(kDuplicateName);
    for (const auto& o : reqs)
      if (o.name == r.name) return Status::InvalidArgument(kDuplicateName);
    reqs.push_back(std::move(r));
  }
  if (t == BHVD_OP_BARRIER) ++barrier_counter_[req.process_set_id];
  if (unnamed_key) ++unnamed_counter_[*unnamed_key];
  ++next_handle_;

  auto h = std::make_shared<Handle>();
  h->id = id;
  h->device = tensor_op ? req.device : -1;
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
      e.state = state;  // BAGUA's primitives take one tensor: one entry
      e.ready = ready;
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
  if (!initialized_) return Status::NotInitialized();
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
      // A sent request is no longer ours to write: the background thread reads it, unlocked,
      // while it executes (ThreadSanitizer found the race).
      if (std::find(queue_.begin(), queue_.end(), name) != queue_.end())
        e->second.request.urgent = true;  // still queued: it goes out urgent
      else
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
    if (h.on_done)
      return Status::InvalidArgument("handle " + std::to_string(handle) +
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
  loop_thread_id_ = std::this_thread::get_id();
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
        const auto previous = last_liveness;
        last_liveness = Clock::now();
        check_peers(last_liveness, last_liveness - previous);
      }
    }
    if (ended_by_shutdown_) farewell();
  } catch (const std::exception& e) {
    const auto* te = dynamic_cast<const TransportError*>(&e);
    const std::string reason = failure_reason(e.what(), te ? te->peer() : -1);
    BHVD_LOG(ERROR, reason);
    send_failure_notices(reason);
    fail_all(Status::Aborted(reason));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
}

namespace {
const char kCommFailed[] = "Horovod is shut down because communication failed: ";
}

// What this rank raises. An error about one peer (its connection closed, it exited, it fell
// silent) may be the echo of another failure: that peer stopped because a third rank failed, and
// its exit closed the connection this rank was waiting on. A failing rank tells every peer why
// before it stops (send_failure_notices), so the reason is taken from the peer's notice when there
// is one: the first failure is named on every rank, whoever it closed on.
std::string Runtime::failure_reason(const std::string& what, int peer) {
  if (what.rfind(kCommFailed, 0) == 0) return what;  // already a relayed reason
  if (peer >= 0 && peer != cfg_.rank && peer < cfg_.size && ctrl_) {
    std::string relayed = relayed_failure(peer);
    if (!relayed.empty()) return relayed;
  }
  return kCommFailed + what;
}

// The failure notice peer sent before it stopped, with who saw it; "" if none. A peer that
// exits closes its ctrl connection after the notice, so the frames it sent are read until that
// close or its death (or 250 ms: a silent peer shows neither).
std::string Runtime::relayed_failure(int peer) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(250);
  std::string msg;
  try {
    while (Clock::now() < deadline) {
      if (!ctrl_->poll(peer, &msg)) {
        // A dead peer's frames are all read: done (shared memory reports the death only here).
        transport_->ctrl(peer).check_alive();
        transport_->wait(std::chrono::milliseconds(5));
        continue;
      }
      if (ControlChannel::is_bye(msg)) return "";  // it finished normally: no notice follows
      std::string notice;
      if (peer == 0 && !coordinator_) {  // the coordinator's ResponseLists
        for (const auto& r : decode_response_list(msg).responses)
          if (r.kind == Response::ERROR && r.type == kAbortType) notice = r.error;
      } else if (!msg.empty()) {
        notice = decode_request_list(msg).failure;
      }
      if (!notice.empty()) return with_witness(notice, peer);
    }
  } catch (const std::exception&) {  // closed (after its frames), or garbage: no notice
  }
  return "";
}

// "(seen by rank N)" on a relayed reason that names no witness yet: the rank that saw the
// failure first, when the message reaches ranks that never talked to the failed one.
std::string Runtime::with_witness(const std::string& reason, int rank) {
  if (reason.find(" (seen by rank ") != std::string::npos) return reason;
  return reason + " (seen by rank " + std::to_string(rank) + ")";
}

// Best effort, without blocking: the coordinator's abort to every worker (which stops ranks not
// talking to the failed one), a worker's notice to every peer (which names the failure on ranks
// whose wait was on this one).
void Runtime::send_failure_notices(const std::string& reason) {
  if (!ctrl_ || cfg_.size <= 1) return;
  std::string payload;
  if (coordinator_) {
    ResponseList abort;
    abort.shutdown = true;
    Response r;
    r.kind = Response::ERROR;
    r.type = kAbortType;
    r.error = reason;
    abort.responses.push_back(r);
    payload = encode(abort);
  } else {
    RequestList notice;
    notice.shutdown = true;
    notice.failure = reason;
    payload = encode(notice);
  }
  for (int p = 0; p < cfg_.size; ++p)
    if (p != cfg_.rank) ctrl_->send_best_effort(p, payload);
}

// A dead peer closes its connections (check_alive); a stopped (SIGSTOP) or hung one only falls
// silent, and a silent peer that owes this rank a negotiation message would be waited for forever.
// So every rank sends an empty frame (a keepalive) to those it negotiates with, the coordinator
// to every worker and a worker to the coordinator, at least every second, and a peer silent for
// longer than HOROVOD_GLOO_TIMEOUT_SECONDS fails the job naming it, as a silent peer inside a
// collective does. Silence counts only while this thread listens: after a gap (a long
// collective, a descheduled process), every peer gets a fresh window. Keepalives go out from
// inside collectives too (Transport::heartbeat), so that a rank busy in a long collective of a
// process set is not taken for a silent one by the ranks outside the set.
void Runtime::check_peers(Clock::time_point now, Clock::duration since_last) {
  // A device operation that makes no progress (an NCCL call some peer never joined) is
  // aborted: its kernels end, and the job fails with the reason, as a silent peer does.
  if (cfg_.timeout_s > 0 && device_engines_stalled(cfg_.timeout_s)) {
    release_device_communicators(0);
    throw TransportError("an operation on CUDA tensors made no progress for " +
                         format_seconds(cfg_.timeout_s) +
                         " s (HOROVOD_GLOO_TIMEOUT_SECONDS): its NCCL communicators were aborted");
  }
  if (cfg_.size <= 1) return;
  const bool fresh = since_last > std::chrono::seconds(1);
  auto check = [&](int peer) {
    transport_->ctrl(peer).check_alive();
    if (fresh) heard_[peer] = now;
    const double silent = std::chrono::duration<double>(now - heard_[peer]).count();
    if (cfg_.timeout_s > 0 && silent > cfg_.timeout_s)
      throw TransportError(
          "rank " + std::to_string(peer) + " sent nothing for " + format_seconds(silent) +
              " s (HOROVOD_GLOO_TIMEOUT_SECONDS): it is stopped, hung or unreachable",
          peer);
  };
  if (coordinator_) {
    for (int r = 1; r < cfg_.size; ++r) check(r);
  } else {
    check(0);
  }
  send_keepalives(now);
}

void Runtime::send_keepalives(Clock::time_point now) {
  if (cfg_.size <= 1) return;
  const double interval = std::min(1.0, cfg_.timeout_s / 4);
  if (std::chrono::duration<double>(now - last_keepalive_).count() < interval) return;
  last_keepalive_ = now;
  if (coordinator_) {
    for (int r = 1; r < cfg_.size; ++r) ctrl_->send(r, std::string());
  } else {
    ctrl_->send(0, std::string());
  }
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

}  // namespace bagua_hvd
