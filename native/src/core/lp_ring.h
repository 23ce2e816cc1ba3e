// Low-precision decentralized SGD's ring (BAGUA's LowPrecisionDecentralized), one per frontend
// implementation: the orchestration of its primitives (BHVD_OP_LP_DECENTRALIZED_*), which the
// torch engine and the TensorFlow kernels share through the C API (bhvd_lp_ring_*). The caller
// owns the weights and the state buffers (replicas self, left, right and the compressed
// difference); the ring owns its exchanges still in flight. docs/algorithms.md.
//
// The split step (a flat ring, or a hierarchical one whose compression group is the whole set):
// bucket by bucket, the previous round's exchange of the bucket is waited for, the local half
// runs on the weights in place (host weights: on the caller's thread; device weights: queued on
// the device engine's stream, the caller's stream waiting for it, Ops::local), and the new
// exchange is left in flight, overlapping the next step. Otherwise (the host hierarchy in play)
// the whole step of each bucket runs in the core, blocking.
//
// A name stays taken until its handle is seen complete (docs/design-core.md): a ring's start
// and flush, and each split step, first wait for every other ring's exchanges in flight (the
// same point of the program on every rank); the failures stay with their own ring, whose next
// wait reports them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "base/common.h"
#include "core/id_registry.h"

namespace bagua_hvd {

class LpRing {
 public:
  // One bucket: the names of its ops, its dtype and element count, the caller's state buffers.
  struct Bucket {
    std::string init_name, step_name, exchange_name;
    DataType dtype = DataType::FLOAT32;
    int64_t count = 0;
    void* self = nullptr;
    void* left = nullptr;
    void* right = nullptr;
    uint8_t* diff = nullptr;  // minmax_uint8 bytes of count elements, 1 chunk; null: no split
    // Device weights that split: count elements of device memory for the local half.
    std::shared_ptr<void> work;
  };
  // The weights of one bucket: its segments in order (count elements in all).
  using Segments = std::vector<XSegment>;
  // What a ring needs from the runtime (the C API gives the runtime's; tests, a fake).
  struct Ops {
    std::function<Status(const bhvd_request&, int64_t*)> enqueue;
    // The handle's final status, or TIMED_OUT when timeout_ms (>= 0) ran out first.
    std::function<Status(int64_t handle, int64_t timeout_ms)> wait;
    std::function<void(int64_t handle)> release;
    // Device weights: `stream` waits on the device for the handle's results.
    std::function<void(int64_t handle, void* stream)> stream_wait;
    // Device weights: the local half of bucket k on x (one buffer), after and before the work
    // of `stream` (DeviceEngine::lp_local).
    std::function<Status(const Bucket& k, void* x, void* stream)> local;
  };
  struct Params {
    int32_t set_id = 0;
    bool hierarchical = false;  // the replicas' initialisation
    bool split = true;          // the step's form (decided for the job: lp_ring_splits)
    int device = -1;            // -1: host memory, else the CUDA device of every buffer
    double op_timeout_s = 0;    // a wait fails after this long (0: no limit)
    double wait_warning_s = 0;  // a wait still blocked warns every this long (0: never)
  };

  LpRing(Ops ops, Params params, std::vector<Bucket> buckets);
  LpRing(const LpRing&) = delete;
  LpRing& operator=(const LpRing&) = delete;

  // The replicas from x: blocking, every bucket's initialisation waited for even after a
  // failure; the first failure.
  Status init(const std::vector<Segments>& x, void* stream);
  // One step after the update of a communicating step: x is read and written in place.
  Status step(const std::vector<Segments>& x, void* stream);
  // Waits for this ring's exchanges in flight and releases them; the first failure.
  Status flush();
  // Waits (until `deadline`, or each at most the op timeout without one) for this ring's
  // exchanges without releasing them or reporting their failure (the ring's next wait does);
  // returns how many are still in flight. A ring busy on another thread is skipped.
  int64_t settle(const Clock::time_point* deadline);
  // Exchanges started and not yet waited for by the ring.
  int64_t pending();
  // Blocks until every exchange in flight has completed (no limit: they were enqueued on every
  // rank, and a lost peer fails them) and releases them: the caller may free its buffers.
  void drop();

 private:
  struct Pending {
    int64_t handle;
    std::string name;
  };
  bhvd_request request(int32_t op_type, const std::string& name, const bhvd_tensor* t,
                       const void* params, void* stream) const;
  // x of bucket b as one buffer: its segment, or the ring's packed copy (host memory).
  Status flat(size_t b, const Segments& x, void** out);
  Status check(const std::vector<Segments>& x) const;
  // Waits for the handle (op timeout, warnings) and releases it; its failure.
  Status wait_release(const Pending& p, void* stream = nullptr);
  Status wait_bounded(int64_t handle, const std::string& name);
  // INIT (init) or STEP of every bucket, each waited for even after a failure; the first.
  Status run_buckets(const std::vector<Segments>& x, bool init, void* stream);
  Status split_step(const std::vector<Segments>& x, void* stream);
  Status whole_step(const std::vector<Segments>& x, void* stream);

  Ops ops_;
  const Params params_;
  const std::vector<Bucket> buckets_;
  std::vector<std::vector<unsigned char>> flats_;  // packed buckets (several segments)
  std::mutex mu_;
  std::vector<Pending> pending_;
};

// Whether a ring of process set `set_id` splits its step: flat, or hierarchical where the
// compression group is every rank of the set (one host); host and device weights alike.
bool lp_ring_splits(bool hierarchical, int group_size, int set_size);

// The rings of this process, by id (the C API's); they belong to the job: the runtime's
// shutdown forgets them (their exchanges have failed by then).
class LpRings : public IdRegistry<LpRing> {
 public:
  static LpRings& get();
  // Waits for the exchanges in flight of every ring but `own` (see LpRing::settle).
  void settle_others(const LpRing* own);
  // At shutdown: waits up to timeout_s in all for every ring's exchanges; how many are late.
  int64_t settle_all(double timeout_s);
};

}  // namespace bagua_hvd
