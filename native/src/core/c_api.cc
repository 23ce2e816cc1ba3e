// The C API: thin wrappers that translate between C types and the runtime. Every entry point
// runs through guarded()/guarded_value() (core/c_api_guard.h): no exception escapes into C.
#pragma GCC visibility push(default)
#include "bagua_hvd/c_api.h"
#pragma GCC visibility pop

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "base/wire_stats.h"
#include "collectives/collectives.h"
#include "collectives/trace.h"
#include "core/async_average.h"
#include "core/async_impl.h"
#include "core/bucket_plan.h"
#include "core/c_api_guard.h"
#include "core/lp_ring.h"
#include "core/runtime.h"
#include "core/validate.h"
#include "engines/device_engine.h"
#include "engines/nccl_library.h"

using bagua_hvd::Runtime;
using bagua_hvd::Status;

namespace {

thread_local std::string g_last_error;
thread_local std::string g_handle_error;
std::mutex g_init_mu;  // init and shutdown may race from different frontend threads

}  // namespace

namespace bagua_hvd {

int c_api_report(const Status& s) noexcept {
  if (!s.ok()) {
    try {
      g_last_error = s.reason;
    } catch (...) {  // out of memory for the message: the status still tells
    }
  }
  return static_cast<int>(s.type);
}

int c_api_report_exception(const char* what) noexcept {
  try {
    g_last_error = what;
  } catch (...) {
  }
  return BHVD_UNKNOWN_ERROR;
}

}  // namespace bagua_hvd

namespace {
int report(const Status& s) { return bagua_hvd::c_api_report(s); }
}  // namespace

using bagua_hvd::guarded;
using bagua_hvd::guarded_value;

namespace {
// The weights of num_buckets buckets as the ring's segments; false for an invalid description.
bool lp_segments(const bhvd_lp_weights* w, int32_t num_buckets,
                 std::vector<bagua_hvd::LpRing::Segments>* out) {
  if (num_buckets < 0 || (num_buckets > 0 && !w)) return false;
  out->assign(static_cast<size_t>(num_buckets), {});
  for (int32_t b = 0; b < num_buckets; ++b) {
    if (w[b].num_segments < 0 || (w[b].num_segments > 0 && (!w[b].data || !w[b].counts)))
      return false;
    for (int32_t i = 0; i < w[b].num_segments; ++i) {
      if (w[b].counts[i] < 0 || (w[b].counts[i] > 0 && !w[b].data[i])) return false;
      (*out)[b].push_back({w[b].data[i], static_cast<size_t>(w[b].counts[i])});
    }
  }
  return true;
}

Status unknown_ring(int64_t id) {
  return Status::InvalidArgument("unknown low-precision ring " + std::to_string(id) +
                                 " (rings end with their job: hvd.shutdown() or an elastic reset)");
}

// The ring's access to the runtime: enqueue, wait and release as a frontend does; a device
// request's stream then waits for the operation, as a frontend's synchronize makes it wait.
bagua_hvd::LpRing::Ops lp_ring_ops(bagua_hvd::DeviceEngine* engine) {
  bagua_hvd::LpRing::Ops ops;
  ops.enqueue = [](const bhvd_request& r, int64_t* h) { return Runtime::get().enqueue(r, h); };
  ops.wait = [](int64_t h, int64_t timeout_ms) { return Runtime::get().wait(h, timeout_ms); };
  ops.release = [](int64_t h) { Runtime::get().release(h); };
  ops.stream_wait = [engine](int64_t h, void* stream) {
    auto handle = Runtime::get().find(h);
    if (engine && handle && handle->done_event) engine->stream_wait(stream, handle->done_event);
  };
  ops.local = [engine](const bagua_hvd::LpRing::Bucket& k, void* x, void* stream) {
    if (!engine || !k.work || !k.diff)
      return Status::InvalidArgument(
          "low-precision decentralized: the split step on device weights needs device buffers "
          "for the compressed difference");
    try {
      engine->lp_local(x, k.self, k.left, k.right, static_cast<size_t>(k.count), k.dtype, k.diff,
                       k.work.get(), stream);
    } catch (const std::exception& e) {
      return Status::InvalidArgument(e.what());
    }
    return Status::OK();
  };
  return ops;
}

// bhvd_async_start's checks and its averager (not yet registered).
Status new_averager(const char* name, const bhvd_tensor* weights, int32_t num_tensors,
                    int32_t device, int32_t process_set_id, int64_t interval_ms,
                    std::shared_ptr<bagua_hvd::AsyncAverager>* out) {
  using bagua_hvd::AsyncAverager;
  auto& rt = Runtime::get();
  if (!rt.initialized()) return Status::NotInitialized();
  if (!name || !*name) return Status::InvalidArgument("async model averaging: a name is required");
  if (num_tensors < 1 || !weights)
    return Status::InvalidArgument("async model averaging: no weight buffers");
  if (interval_ms < 0)
    return Status::InvalidArgument("async model averaging: sync_interval_ms must be >= 0");
  auto sets = rt.process_sets();
  auto it = sets.find(process_set_id);
  if (it == sets.end() ||
      !std::binary_search(it->second.begin(), it->second.end(), rt.config().rank))
    return Status::InvalidArgument(
        "async model averaging: this rank is not a member of process set " +
        std::to_string(process_set_id));
  bagua_hvd::DeviceEngine* engine = nullptr;
  if (device >= 0) {
    std::string why;
    engine = bagua_hvd::device_engine(device, &why);
    if (!engine) return Status::InvalidArgument("async model averaging: " + why);
  }
  std::vector<AsyncAverager::Weights> ws;
  for (int32_t i = 0; i < num_tensors; ++i) {
    const bhvd_tensor& t = weights[i];
    if (t.dtype != BHVD_FLOAT32 && t.dtype != BHVD_FLOAT16 && t.dtype != BHVD_BFLOAT16 &&
        t.dtype != BHVD_FLOAT64)
      return Status::InvalidArgument(
          "async model averaging: weights must be float32, float16, bfloat16 or float64");
    if (t.ndim < 0 || (t.ndim > 0 && !t.shape))
      return Status::InvalidArgument("async model averaging: invalid tensor shape");
    std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
    int64_t n = 1;
    for (auto d : shape) n *= d;
    if (n > 0 && !t.data)
      return Status::InvalidArgument("async model averaging: null weight buffer");
    ws.push_back({t.data, static_cast<bagua_hvd::DataType>(t.dtype), std::move(shape)});
  }
  // Through negotiation like a frontend's request: enqueue, wait, release; a device request's
  // stream then waits for the operation, as a frontend's synchronize makes its stream wait.
  auto run = [engine](const bhvd_request& req) {
    int64_t h = 0;
    Status s = Runtime::get().enqueue(req, &h);
    if (!s.ok()) return s;
    s = Runtime::get().wait(h, -1);
    if (s.ok() && req.device >= 0 && engine) {
      auto handle = Runtime::get().find(h);
      if (handle && handle->done_event) engine->stream_wait(req.stream, handle->done_event);
    }
    Runtime::get().release(h);
    return s;
  };
  *out = std::make_shared<AsyncAverager>(run, name, std::move(ws), process_set_id,
                                         static_cast<int>(it->second.size()), interval_ms, device,
                                         engine);
  return Status::OK();
}

// An implementation's access to the runtime: bhvd_async_start's averagers, device copies on the
// caller's stream.
bagua_hvd::AsyncImpl::Ops async_impl_ops() {
  bagua_hvd::AsyncImpl::Ops ops;
  ops.start = [](const std::string& name, const bagua_hvd::AsyncImpl::Step& s,
                 std::shared_ptr<bagua_hvd::AsyncAverager>* out) {
    return new_averager(name.c_str(), s.weights, s.num_tensors, s.device, s.set_id, s.interval_ms,
                        out);
  };
  ops.device_copy = [](int device, void* dst, const void* src, size_t bytes, void* stream) {
    std::string why;
    auto* engine = bagua_hvd::device_engine(device, &why);
    if (engine) engine->copy_on(dst, src, bytes, stream);
  };
  return ops;
}

Status unknown_impl(int64_t id) {
  return Status::InvalidArgument("unknown async model averaging implementation " +
                                 std::to_string(id));
}
}  // namespace

extern "C" {

int bhvd_init(const int32_t* set_ranks, const int32_t* set_sizes, int32_t num_sets,
              int32_t dynamic_process_sets) {
  return guarded([&]() -> int {
    std::lock_guard<std::mutex> lock(g_init_mu);
    std::vector<std::vector<int32_t>> sets;
    const int32_t* p = set_ranks;
    for (int32_t i = 0; i < num_sets; ++i) {
      if (set_sizes[i] < 0) return report(Status::InvalidArgument("negative process set size"));
      sets.emplace_back(p, p + set_sizes[i]);
      p += set_sizes[i];
    }
    return report(Runtime::get().init(sets, dynamic_process_sets != 0));
  });
}

int bhvd_shutdown(void) {
  return guarded([&]() -> int {
    std::lock_guard<std::mutex> lock(g_init_mu);
    return report(Runtime::get().shutdown());
  });
}

int bhvd_start_timeline(const char* path, int32_t mark_cycles) {
  return guarded([&]() -> int {
    if (!path || !*path) return report(Status::InvalidArgument("start_timeline: empty file path"));
    return report(Runtime::get().start_timeline(path, mark_cycles != 0));
  });
}

int bhvd_stop_timeline(void) {
  return guarded([&]() -> int { return report(Runtime::get().stop_timeline()); });
}

int bhvd_log(int32_t level, const char* message) {
  return guarded_value<int>(0, [&]() -> int {
    const auto lv = static_cast<bagua_hvd::LogLevel>(std::clamp(level, 0, 5));
    if (!message || lv < bagua_hvd::log_level()) return 0;
    bagua_hvd::log_message(lv, message);
    return 1;
  });
}

int bhvd_autotune_start(int32_t steps_per_sample) {
  return guarded([&]() -> int {
    Runtime& rt = Runtime::get();
    if (!rt.initialized()) return report(Status::NotInitialized());
    if (rt.config().rank != 0)
      return report(Status::InvalidArgument("autotune: only rank 0 samples and decides"));
    return report(rt.autotuner().start(steps_per_sample));
  });
}

int bhvd_autotune_next_score(double* score, int64_t timeout_ms, int32_t* got) {
  return guarded([&]() -> int {
    if (!score || !got) return report(Status::InvalidArgument("autotune: null output"));
    *got = 0;
    const int r = Runtime::get().autotuner().next_score(score, timeout_ms);
    if (r < 0) return report(Status::Aborted("autotune: the job has stopped"));
    *got = r;
    return BHVD_OK;
  });
}

int bhvd_autotune_propose(const bhvd_autotune_params* p, int32_t active) {
  return guarded([&]() -> int {
    if (!p) return report(Status::InvalidArgument("autotune: null parameters"));
    if (!(p->cycle_time_ms >= 0) || p->fusion_threshold < 0)
      return report(Status::InvalidArgument(
          "autotune: the cycle time and fusion threshold must be >= 0, got " +
          std::to_string(p->cycle_time_ms) + " ms and " + std::to_string(p->fusion_threshold) +
          " bytes"));
    bagua_hvd::TunedParams t;
    t.hierarchical_allreduce = p->hierarchical_allreduce != 0;
    t.cache_enabled = p->cache_enabled != 0;
    t.cycle_time_ms = p->cycle_time_ms;
    t.fusion_threshold = p->fusion_threshold;
    Runtime::get().autotuner().propose(t, active != 0);
    return BHVD_OK;
  });
}

int bhvd_is_initialized(void) {
  return guarded_value<int>(0, [&]() -> int { return Runtime::get().initialized() ? 1 : 0; });
}
const char* bhvd_last_error(void) {
  return guarded_value<const char*>("", [&]() -> const char* { return g_last_error.c_str(); });
}
const char* bhvd_version(void) {
  return guarded_value<const char*>("", [&]() -> const char* { return BHVD_VERSION; });
}

int bhvd_rank(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().rank : -1;
  });
}
int bhvd_size(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().size : -1;
  });
}
int bhvd_local_rank(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().local_rank : -1;
  });
}
int bhvd_local_size(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().local_size : -1;
  });
}
int bhvd_cross_rank(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().cross_rank : -1;
  });
}
int bhvd_cross_size(void) {
  return guarded_value<int>(-1, [&]() -> int {
    return Runtime::get().initialized() ? Runtime::get().config().cross_size : -1;
  });
}
int bhvd_is_homogeneous(void) {
  return guarded_value<int>(-1, [&]() -> int {
    if (!Runtime::get().initialized()) return -1;
    const auto& c = Runtime::get().config();
    return c.local_size * c.cross_size == c.size ? 1 : 0;
  });
}

int bhvd_cuda_built(void) {
  return guarded_value<int>(0, [&]() -> int { return bagua_hvd::device_engines_built() ? 1 : 0; });
}
int bhvd_nccl_built(void) {
  return guarded_value<int>(0, [&]() -> int {
    const bagua_hvd::NcclLibrary* nccl = bagua_hvd::loaded_nccl();
    return bagua_hvd::device_engines_built() && nccl ? nccl->version : 0;
  });
}
int bhvd_nccl_load(const char* library, const char* fallback) {
  return guarded_value<int>(0, [&]() -> int {
    std::string why;
    const bagua_hvd::NcclLibrary* nccl =
        bagua_hvd::load_nccl(library ? library : "", fallback ? fallback : "", &why);
    if (!nccl) {
      report(Status::Error(bagua_hvd::StatusType::UNKNOWN_ERROR, why));
      return 0;
    }
    return nccl->version;
  });
}
int bhvd_device_pointers_supported(void) {
  return guarded_value<int>(0, [&]() -> int { return bagua_hvd::device_engines_built() ? 1 : 0; });
}
int bhvd_mpi_enabled(void) {
  return guarded_value<int>(
      0, [&]() -> int { return Runtime::get().initialized() && Runtime::get().mpi() ? 1 : 0; });
}
int bhvd_mpi_threads_supported(void) {
  return guarded_value<int>(-1, [&]() -> int {
    const bagua_hvd::MpiFacts* mpi = Runtime::get().initialized() ? Runtime::get().mpi() : nullptr;
    return mpi ? (mpi->threads_multiple ? 1 : 0) : -1;
  });
}

const char* bhvd_transport_name(int32_t peer_rank) {
  return guarded_value<const char*>("", [&]() -> const char* {
    return Runtime::get().initialized() ? Runtime::get().transport_kind(peer_rank) : "";
  });
}

int bhvd_process_set_ids(int32_t* ids_out, int32_t capacity) {
  return guarded_value<int>(-1, [&]() -> int {
    auto sets = Runtime::get().process_sets();
    int32_t i = 0;
    for (const auto& kv : sets) {
      if (i < capacity) ids_out[i] = kv.first;
      ++i;
    }
    return i;
  });
}

int bhvd_process_set_ranks(int32_t id, int32_t* ranks_out, int32_t capacity) {
  return guarded_value<int>(-1, [&]() -> int {
    auto sets = Runtime::get().process_sets();
    auto it = sets.find(id);
    if (it == sets.end()) return -1;
    for (size_t i = 0; i < it->second.size() && static_cast<int32_t>(i) < capacity; ++i)
      ranks_out[i] = it->second[i];
    return static_cast<int>(it->second.size());
  });
}

int bhvd_process_set_rank(int32_t id) {
  return guarded_value<int>(-2, [&]() -> int {
    auto sets = Runtime::get().process_sets();
    auto it = sets.find(id);
    if (it == sets.end()) return -2;
    int me = Runtime::get().config().rank;
    for (size_t i = 0; i < it->second.size(); ++i)
      if (it->second[i] == me) return static_cast<int>(i);
    return -1;
  });
}

int bhvd_add_process_set(const int32_t* ranks, int32_t n, int32_t* id_out) {
  return guarded([&]() -> int {
    std::vector<int32_t> v(ranks, ranks + n);
    // Bad ranks are this caller's error (ValueError), found here on every rank; the coordinator
    // checks again what the ranks sent.
    Runtime& rt = Runtime::get();
    if (rt.initialized()) {
      if (std::string e = bagua_hvd::process_set_ranks_error(v, rt.config().size); !e.empty())
        return report(Status::InvalidArgument(e));
    }
    std::sort(v.begin(), v.end());
    return report(rt.run_internal(bagua_hvd::kOpAddProcessSet, v, id_out));
  });
}

int bhvd_remove_process_set(int32_t id) {
  return guarded([&]() -> int {
    int32_t out = -1;
    return report(Runtime::get().run_internal(bagua_hvd::kOpRemoveProcessSet, {id}, &out));
  });
}

int bhvd_enqueue(const bhvd_request* request, int64_t* handle_out) {
  return guarded([&]() -> int {
    if (!request || !handle_out) return report(Status::InvalidArgument("NULL request"));
    return report(Runtime::get().enqueue(*request, handle_out));
  });
}

int64_t bhvd_reducescatter_rows(int32_t process_set_id, int64_t dim0) {
  return guarded_value<int64_t>(int64_t{-1}, [&]() -> int64_t {
    const int size = bhvd_process_set_ranks(process_set_id, nullptr, 0);
    const int rank = bhvd_process_set_rank(process_set_id);
    if (size <= 0 || rank < 0) return -1;
    return bagua_hvd::reducescatter_rows(dim0, size, rank);
  });
}

int bhvd_poll(int64_t handle) {
  return guarded_value<int>(-1, [&]() -> int { return Runtime::get().poll(handle); });
}

int bhvd_wait(int64_t handle, int64_t timeout_ms) {
  return guarded([&]() -> int { return report(Runtime::get().wait(handle, timeout_ms)); });
}

int bhvd_handle_stream_wait(int64_t handle, void* stream) {
  return guarded([&]() -> int {
    auto h = Runtime::get().find(handle);
    if (!h) return report(Status::InvalidArgument("unknown handle"));
    if (h->device < 0 || !h->done_event) return BHVD_OK;
    std::string why;
    bagua_hvd::DeviceEngine* engine = bagua_hvd::device_engine(h->device, &why);
    if (!engine) return report(Status::InvalidArgument(why));
    engine->stream_wait(stream, h->done_event);
    return BHVD_OK;
  });
}

int bhvd_on_done(int64_t handle, bhvd_done_fn fn, void* arg) {
  return guarded([&]() -> int {
    if (!fn) return report(Status::InvalidArgument("NULL callback"));
    return report(Runtime::get().on_done(handle, [handle, fn, arg](const Status& s) {
      fn(handle, static_cast<int32_t>(s.type), arg);
    }));
  });
}

const char* bhvd_handle_error(int64_t handle) {
  return guarded_value<const char*>("", [&]() -> const char* {
    auto h = Runtime::get().find(handle);
    g_handle_error = h ? h->status.reason : std::string("unknown handle");
    return g_handle_error.c_str();
  });
}

int bhvd_output_ndim(int64_t handle, int32_t index) {
  return guarded_value<int>(-1, [&]() -> int {
    auto h = Runtime::get().find(handle);
    if (!h || index < 0 || index >= static_cast<int32_t>(h->output_shapes.size())) return -1;
    return static_cast<int>(h->output_shapes[index].size());
  });
}

int bhvd_output_shape(int64_t handle, int32_t index, int64_t* shape_out) {
  return guarded([&]() -> int {
    auto h = Runtime::get().find(handle);
    if (!h || index < 0 || index >= static_cast<int32_t>(h->output_shapes.size()))
      return report(Status::InvalidArgument("unknown handle or output index"));
    const auto& s = h->output_shapes[index];
    std::copy(s.begin(), s.end(), shape_out);
    return BHVD_OK;
  });
}

int bhvd_output_copy(int64_t handle, int32_t index, void* dst, void* stream) {
  return guarded([&]() -> int {
    auto h = Runtime::get().find(handle);
    if (!h || index < 0 || index >= static_cast<int32_t>(h->outputs.size()))
      return report(Status::InvalidArgument("unknown handle or output index"));
    const bagua_hvd::Output& o = h->outputs[index];
    if (!o.bytes) return BHVD_OK;
    if (o.device >= 0 || h->device >= 0) {
      std::string why;
      bagua_hvd::DeviceEngine* engine =
          bagua_hvd::device_engine(o.device >= 0 ? o.device : h->device, &why);
      if (!engine) return report(Status::InvalidArgument(why));
      if (o.device >= 0)
        engine->copy_output(dst, o, stream);
      else
        engine->copy_from_host(dst, o.data.get(), o.bytes);
    } else {
      std::memcpy(dst, o.data.get(), o.bytes);
    }
    return BHVD_OK;
  });
}

int bhvd_received_splits(int64_t handle, int32_t* splits_out, int32_t capacity) {
  return guarded_value<int>(-1, [&]() -> int {
    auto h = Runtime::get().find(handle);
    if (!h) return -1;
    int32_t n = static_cast<int32_t>(h->received_splits.size());
    for (int32_t i = 0; i < n && i < capacity; ++i) splits_out[i] = h->received_splits[i];
    return n;
  });
}

int bhvd_join_result(int64_t handle) {
  return guarded_value<int>(-1, [&]() -> int {
    auto h = Runtime::get().find(handle);
    return h ? h->result : -1;
  });
}

int bhvd_release(int64_t handle) {
  return guarded([&]() -> int {
    Runtime::get().release(handle);
    return BHVD_OK;
  });
}

int64_t bhvd_stat(const char* key) {
  return guarded_value<int64_t>(int64_t{-1}, [&]() -> int64_t {
    auto& s = Runtime::get().stats();
    std::string k = key ? key : "";
    if (k == "responses") return s.responses;
    if (k == "fused_tensors") return s.fused_tensors;
    if (k == "cycles") return s.cycles;
    if (k == "cache_hits") return s.cache_hits;
    if (k == "fusion_buffer_bytes") return s.fusion_buffer_bytes;
    if (k == "exec_ns") return s.exec_ns;
    if (k == "bytes_sent") return bagua_hvd::wire_bytes_sent(false);
    if (k == "bytes_sent_remote") return bagua_hvd::wire_bytes_sent(true);
    if (k == "mpi_calls") return bagua_hvd::mpi_engine_calls();
    if (k == "nccl_calls") return bagua_hvd::device_stats().nccl_calls;
    if (k == "device_staged_calls") return bagua_hvd::device_stats().staged_calls;
    if (k == "device_staged_bytes") return bagua_hvd::device_stats().staged_bytes;
    return -1;
  });
}

int bhvd_communication_stats(bhvd_comm_stat* out, int32_t cap, int32_t* n) {
  return guarded([&]() -> int {
    if (!n || cap < 0 || (cap > 0 && !out))
      return report(Status::InvalidArgument("bhvd_communication_stats: invalid output"));
    if (!Runtime::get().initialized()) return report(Status::NotInitialized());
    int32_t count = 0;
    for (int slot = 0; slot < bagua_hvd::kWireSlots; ++slot) {
      const bagua_hvd::WireCounts c = bagua_hvd::wire_counts(slot);
      if (c.calls == 0 && c.within_host == 0 && c.between_hosts == 0) continue;
      if (count < cap)
        out[count] = bhvd_comm_stat{bagua_hvd::wire_slot_name(slot), c.calls, c.within_host,
                                    c.between_hosts};
      ++count;
    }
    *n = count;
    return BHVD_OK;
  });
}

int bhvd_trace_enable(int on) {
  return guarded_value<int>(0, [&]() -> int { return bagua_hvd::trace_enable(on != 0) ? 1 : 0; });
}

int bhvd_trace_read(int64_t* out, int max_events) {
  return guarded_value<int>(0, [&]() -> int { return bagua_hvd::trace_read(out, max_events); });
}

int bhvd_lp_decentralized_local(void* x, void* self, const void* left, const void* right,
                                int32_t dtype, int64_t count, uint8_t* c_out) {
  return guarded([&]() -> int {
    if (!bagua_hvd::dtype_valid(dtype) || count < 0 ||
        (count > 0 && (!x || !self || !left || !right || !c_out)))
      return report(Status::InvalidArgument("low-precision decentralized: invalid buffers"));
    try {
      bagua_hvd::lp_decentralized_local(x, self, left, right, static_cast<size_t>(count),
                                        static_cast<bagua_hvd::DataType>(dtype), c_out);
    } catch (const std::exception& e) {
      return report(Status::InvalidArgument(e.what()));
    }
    return BHVD_OK;
  });
}

int bhvd_lp_decentralized_local_segments(void* const* xs, const int64_t* counts,
                                         int32_t num_segments, void* self, const void* left,
                                         const void* right, int32_t dtype, uint8_t* c_out) {
  return guarded([&]() -> int {
    if (!bagua_hvd::dtype_valid(dtype) || num_segments < 0 ||
        (num_segments > 0 && (!xs || !counts)))
      return report(Status::InvalidArgument("low-precision decentralized: invalid segments"));
    std::vector<bagua_hvd::XSegment> segs;
    segs.reserve(static_cast<size_t>(num_segments));
    for (int32_t i = 0; i < num_segments; ++i) {
      if (counts[i] < 0 || (counts[i] > 0 && !xs[i]))
        return report(Status::InvalidArgument("low-precision decentralized: invalid segments"));
      if (counts[i] > 0) segs.push_back({xs[i], static_cast<size_t>(counts[i])});
    }
    if (!segs.empty() && (!self || !left || !right || !c_out))
      return report(Status::InvalidArgument("low-precision decentralized: invalid buffers"));
    try {
      bagua_hvd::lp_decentralized_local(segs.data(), segs.size(), self, left, right,
                                        static_cast<bagua_hvd::DataType>(dtype), c_out);
    } catch (const std::exception& e) {
      return report(Status::InvalidArgument(e.what()));
    }
    return BHVD_OK;
  });
}

int bhvd_compression_group_size(int32_t process_set_id, int32_t hierarchical) {
  return guarded_value<int>(-1, [&]() -> int {
    if (!Runtime::get().initialized()) return -1;
    return Runtime::get().group_size(process_set_id, hierarchical != 0);
  });
}

int bhvd_compression_residuals(int32_t process_set_id, int32_t hierarchical, int64_t count,
                               int64_t* worker, int64_t* server) {
  return guarded([&]() -> int {
    if (!Runtime::get().initialized()) return report(Status::NotInitialized());
    const int n = Runtime::get().group_size(process_set_id, hierarchical != 0);
    if (n < 1 || count < 0 || !worker || !server)
      return report(Status::InvalidArgument("error feedback's residuals: unknown process set " +
                                            std::to_string(process_set_id) + " or invalid count"));
    const auto sizes = bagua_hvd::residual_sizes(count, n);
    *worker = sizes.worker;
    *server = sizes.server;
    return BHVD_OK;
  });
}

int bhvd_bucket_layout(const int64_t* bytes, const int32_t* group, int64_t n,
                       const int64_t* order, int64_t m, int64_t cap, int64_t* bucket_of,
                       int64_t* num_buckets) {
  return guarded([&]() -> int {
    auto invalid = [](const std::string& why) {
      return report(Status::InvalidArgument("bucket layout: " + why));
    };
    if (n < 0 || m < 0 || cap < 0 || (n > 0 && (!bytes || !group)) ||
        (m > 0 && (!order || !bucket_of)) || !num_buckets)
      return invalid("negative count or cap, or a missing array");
    for (int64_t i = 0; i < n; ++i)
      if (bytes[i] < 0) return invalid("tensor " + std::to_string(i) + " has negative bytes");
    for (int64_t k = 0; k < m; ++k)
      if (order[k] < 0 || order[k] >= n)
        return invalid("order[" + std::to_string(k) + "] = " + std::to_string(order[k]) +
                       " is not a tensor index below " + std::to_string(n));
    const auto out = bagua_hvd::bucket_layout(std::vector<int64_t>(bytes, bytes + n),
                                              std::vector<int32_t>(group, group + n),
                                              std::vector<int64_t>(order, order + m), cap);
    std::copy(out.begin(), out.end(), bucket_of);
    *num_buckets = out.empty() ? 0 : *std::max_element(out.begin(), out.end()) + 1;
    return BHVD_OK;
  });
}

int bhvd_async_start(const char* name, const bhvd_tensor* weights, int32_t num_tensors,
                     int32_t device, int32_t process_set_id, int64_t interval_ms,
                     int64_t* id_out) {
  return guarded([&]() -> int {
    std::shared_ptr<bagua_hvd::AsyncAverager> a;
    Status s = new_averager(name, weights, num_tensors, device, process_set_id, interval_ms, &a);
    if (!s.ok()) return report(s);
    *id_out = bagua_hvd::AsyncRegistry::get().add(std::move(a));
    return BHVD_OK;
  });
}

int bhvd_async_step(int64_t id, void* stream) {
  return guarded([&]() -> int {
    auto a = bagua_hvd::AsyncRegistry::get().find(id);
    if (!a) return report(Status::InvalidArgument("unknown async averager " + std::to_string(id)));
    a->step(stream);
    return BHVD_OK;
  });
}

int bhvd_async_abort(int64_t id, int64_t timeout_ms) {
  return guarded([&]() -> int {
    auto a = bagua_hvd::AsyncRegistry::get().find(id);
    if (!a) return BHVD_OK;  // already stopped and released (e.g. by shutdown)
    return report(a->abort(timeout_ms));
  });
}

int bhvd_async_release(int64_t id) {
  return guarded([&]() -> int {
    bagua_hvd::AsyncRegistry::get().release(id);
    return BHVD_OK;
  });
}

int64_t bhvd_async_rounds(int64_t id) {
  return guarded_value<int64_t>(int64_t{-1}, [&]() -> int64_t {
    auto a = bagua_hvd::AsyncRegistry::get().find(id);
    return a ? a->rounds() : -1;
  });
}

int bhvd_async_impl_create(int64_t* id_out) {
  return guarded([&]() -> int {
    if (!id_out) return report(Status::InvalidArgument("async model averaging: no id"));
    *id_out =
        bagua_hvd::AsyncImpls::get().add(std::make_shared<bagua_hvd::AsyncImpl>(async_impl_ops()));
    return BHVD_OK;
  });
}

int bhvd_async_impl_step(int64_t id, const bhvd_async_impl_step_args* a, int32_t* merged) {
  return guarded([&]() -> int {
    auto impl = bagua_hvd::AsyncImpls::get().find(id);
    if (!impl) return report(unknown_impl(id));
    if (!a || !merged || !a->name_prefix)
      return report(Status::InvalidArgument("async model averaging: invalid step arguments"));
    bagua_hvd::AsyncImpl::Step s;
    s.prefix = a->name_prefix;
    s.set_id = a->process_set_id;
    s.interval_ms = a->interval_ms;
    s.device = a->device;
    s.stream = a->stream;
    s.weights = a->weights;
    s.staged = a->staged;
    s.num_tensors = a->num_tensors;
    bool m = false;
    Status st = impl->step(s, &m);
    *merged = m ? 1 : 0;
    return report(st);
  });
}

int bhvd_async_impl_abort(int64_t id) {
  return guarded([&]() -> int {
    auto impl = bagua_hvd::AsyncImpls::get().find(id);
    return report(impl ? impl->abort() : unknown_impl(id));
  });
}

int bhvd_async_impl_resume(int64_t id) {
  return guarded([&]() -> int {
    auto impl = bagua_hvd::AsyncImpls::get().find(id);
    if (!impl) return report(unknown_impl(id));
    impl->resume();
    return BHVD_OK;
  });
}

int bhvd_async_impl_state(int64_t id, bhvd_async_impl_info* out) {
  return guarded([&]() -> int {
    auto impl = bagua_hvd::AsyncImpls::get().find(id);
    if (!impl || !out) return report(unknown_impl(id));
    const auto st = impl->state();
    out->aborted = st.aborted ? 1 : 0;
    out->restarts = st.restarts;
    out->averager = st.averager;
    out->rounds = st.rounds;
    return BHVD_OK;
  });
}

int bhvd_async_impl_release(int64_t id) {
  return guarded([&]() -> int {
    auto impl = bagua_hvd::AsyncImpls::get().remove(id);
    impl.reset();  // stops a running averager outside the registry's lock
    return BHVD_OK;
  });
}

int bhvd_lp_ring_start(const bhvd_lp_ring_params* p, int64_t* id_out) {
  return guarded([&]() -> int {
    using bagua_hvd::LpRing;
    auto& rt = Runtime::get();
    if (!rt.initialized()) return report(Status::NotInitialized());
    if (!p || !id_out || p->num_buckets < 0 || (p->num_buckets > 0 && !p->buckets))
      return report(Status::InvalidArgument("low-precision ring: invalid parameters"));
    std::vector<LpRing::Segments> x;
    if (!lp_segments(p->weights, p->num_buckets, &x))
      return report(Status::InvalidArgument("low-precision ring: invalid weights"));
    const int set_size = bhvd_process_set_ranks(p->process_set_id, nullptr, 0);
    const int group = rt.group_size(p->process_set_id, true);
    if (set_size <= 0 || group <= 0)
      return report(Status::InvalidArgument("low-precision ring: unknown process set " +
                                            std::to_string(p->process_set_id)));
    bagua_hvd::DeviceEngine* engine = nullptr;
    if (p->device >= 0) {
      std::string why;
      engine = bagua_hvd::device_engine(p->device, &why);
      if (!engine) return report(Status::InvalidArgument("low-precision ring: " + why));
    }
    std::vector<LpRing::Bucket> buckets;
    for (int32_t b = 0; b < p->num_buckets; ++b) {
      const bhvd_lp_bucket& k = p->buckets[b];
      if (!k.init_name || !k.step_name || !k.exchange_name || !bagua_hvd::dtype_valid(k.dtype) ||
          k.count < 0 || (k.count > 0 && (!k.self || !k.left || !k.right)))
        return report(Status::InvalidArgument("low-precision ring: invalid bucket"));
      LpRing::Bucket bucket;
      bucket.init_name = k.init_name;
      bucket.step_name = k.step_name;
      bucket.exchange_name = k.exchange_name;
      bucket.dtype = static_cast<bagua_hvd::DataType>(k.dtype);
      bucket.count = k.count;
      bucket.self = k.self;
      bucket.left = k.left;
      bucket.right = k.right;
      bucket.diff = k.diff;
      // The split step's local half on the device needs scratch there (count elements).
      if (engine && k.diff && k.count > 0)
        bucket.work = engine->device_memory(static_cast<size_t>(k.count) *
                                            bagua_hvd::dtype_size(bucket.dtype));
      buckets.push_back(std::move(bucket));
    }
    LpRing::Params params;
    params.set_id = p->process_set_id;
    params.hierarchical = p->hierarchical != 0;
    params.split = bagua_hvd::lp_ring_splits(params.hierarchical, group, set_size);
    params.device = p->device;
    params.op_timeout_s = p->op_timeout_s;
    params.wait_warning_s = p->wait_warning_s;
    auto ring = std::make_shared<LpRing>(lp_ring_ops(engine), params, std::move(buckets));
    bagua_hvd::LpRings::get().settle_others(nullptr);  // an earlier ring's last exchanges
    if (int rc = report(ring->init(x, p->stream)); rc != BHVD_OK) return rc;
    *id_out = bagua_hvd::LpRings::get().add(std::move(ring));
    return BHVD_OK;
  });
}

int bhvd_lp_ring_step(int64_t id, const bhvd_lp_weights* weights, int32_t num_buckets,
                      void* stream) {
  return guarded([&]() -> int {
    auto ring = bagua_hvd::LpRings::get().find(id);
    if (!ring) return report(unknown_ring(id));
    std::vector<bagua_hvd::LpRing::Segments> x;
    if (!lp_segments(weights, num_buckets, &x))
      return report(Status::InvalidArgument("low-precision ring: invalid weights"));
    bagua_hvd::LpRings::get().settle_others(ring.get());  // as flush does
    return report(ring->step(x, stream));
  });
}

int bhvd_lp_ring_flush(int64_t id) {
  return guarded([&]() -> int {
    auto ring = id == 0 ? nullptr : bagua_hvd::LpRings::get().find(id);
    if (id != 0 && !ring) return report(unknown_ring(id));
    Status s = ring ? ring->flush() : Status::OK();
    bagua_hvd::LpRings::get().settle_others(ring.get());
    return report(s);
  });
}

int64_t bhvd_lp_ring_pending(int64_t id) {
  return guarded_value<int64_t>(int64_t{-1}, [&]() -> int64_t {
    auto ring = bagua_hvd::LpRings::get().find(id);
    return ring ? ring->pending() : -1;
  });
}

int bhvd_lp_ring_release(int64_t id) {
  return guarded([&]() -> int {
    auto ring = bagua_hvd::LpRings::get().remove(id);
    if (ring) ring->drop();
    return BHVD_OK;
  });
}

int bhvd_lp_rings_settle(double timeout_s, int64_t* late) {
  return guarded([&]() -> int {
    const int64_t n = bagua_hvd::LpRings::get().settle_all(timeout_s);
    if (late) *late = n;
    return BHVD_OK;
  });
}

}  // extern "C"
