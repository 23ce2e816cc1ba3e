/*
 * bagua_hvd C API: the only boundary between the Python package and the C++ core.
 *
 * The Python side loads this header with cffi in ABI mode (no compiler needed at import), so the
 * header must stay plain C and free of preprocessor logic other than the include guard and the
 * extern "C" block: cffi's cdef parser reads everything between the BHVD_CDEF markers.
 *
 * Conventions
 *  - Every function that can fail returns an int status (BHVD_OK == 0); the message of the last
 *    failure on the calling thread is returned by bhvd_last_error().
 *  - Tensors are described by a pointer, a dtype and a shape. The caller keeps input and output
 *    memory alive until the handle completes (bhvd_poll/bhvd_wait) and is released.
 *  - Handles are int64 > 0. A handle must be released with bhvd_release() once its result has
 *    been consumed.
 */
#ifndef BAGUA_HVD_C_API_H
#define BAGUA_HVD_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* BHVD_CDEF_BEGIN */

/* Status codes. 0-5 are Horovod's StatusType values; TIMED_OUT, NOT_IMPLEMENTED and
 * NOT_INITIALIZED are bagua_hvd's. Each frontend chooses its error class by this code (never by
 * the message text). */
enum bhvd_status {
  BHVD_OK = 0,
  BHVD_UNKNOWN_ERROR = 1,
  BHVD_PRECONDITION_ERROR = 2, /* cross-rank mismatch: HorovodInternalError */
  BHVD_ABORTED = 3,            /* shut down, peer lost: HorovodInternalError */
  BHVD_INVALID_ARGUMENT = 4,   /* bad input at enqueue: ValueError */
  BHVD_IN_PROGRESS = 5,
  BHVD_TIMED_OUT = 6,
  BHVD_NOT_IMPLEMENTED = 7, /* NotImplementedError */
  BHVD_NOT_INITIALIZED = 8  /* a call that needs hvd.init() before it (or after hvd.shutdown()),
                               with Horovod's text; Horovod reports it as a PRECONDITION_ERROR.
                               torch: ValueError, TensorFlow: FailedPreconditionError, as
                               Horovod's frontends raise it */
};

/* Data types; values follow Horovod's DataType, bfloat16 added. */
enum bhvd_dtype {
  BHVD_UINT8 = 0,
  BHVD_INT8 = 1,
  BHVD_UINT16 = 2,
  BHVD_INT16 = 3,
  BHVD_INT32 = 4,
  BHVD_INT64 = 5,
  BHVD_FLOAT16 = 6,
  BHVD_FLOAT32 = 7,
  BHVD_FLOAT64 = 8,
  BHVD_BOOL = 9,
  BHVD_BFLOAT16 = 10
};

/* Reduce ops; values are Horovod's (hvd.Average == 0 ...). */
enum bhvd_reduce_op {
  BHVD_AVERAGE = 0,
  BHVD_SUM = 1,
  BHVD_ADASUM = 2,
  BHVD_MIN = 3,
  BHVD_MAX = 4,
  BHVD_PRODUCT = 5
};

/* Request types. 0-7 are Horovod's Request::RequestType values; the others are BAGUA's
 * primitives (docs/algorithms.md), one op type each. An op type with parameters beyond the
 * common ones of bhvd_request takes them in its own struct (bhvd_request.params, below); the
 * others take params = NULL. */
enum bhvd_op_type {
  BHVD_OP_ALLREDUCE = 0,
  BHVD_OP_ALLGATHER = 1,
  BHVD_OP_BROADCAST = 2,
  BHVD_OP_JOIN = 3,
  BHVD_OP_ADASUM = 4,
  BHVD_OP_ALLTOALL = 5,
  BHVD_OP_BARRIER = 6,
  BHVD_OP_REDUCESCATTER = 7,
  /* An allreduce within each host, then among one leader per host, then back within each host
   * (flat when the set does not span several hosts or no host has several of its ranks); one
   * tensor, never fused. Same fields as BHVD_OP_ALLREDUCE; params NULL. */
  BHVD_OP_HIERARCHICAL_ALLREDUCE = 8,
  /* ByteGrad's MinMaxUInt8-compressed allreduce of one tensor (a bucket), in place or into the
   * output: compressed alltoall, mean, compressed allgather. reduce_op Average or Sum, scale
   * factors as for BHVD_OP_ALLREDUCE. params: bhvd_compressed_allreduce_params. */
  BHVD_OP_COMPRESSED_ALLREDUCE = 9,
  /* Decentralized SGD's average of one weight buffer (input) with the peers of a round into the
   * output. params: bhvd_peer_average_params. */
  BHVD_OP_PEER_AVERAGE = 10,
  /* Low-precision decentralized SGD on the ring (W = 1/3), one weight buffer x per request
   * (input == output; float32, float16 or bfloat16) and its replicas:
   * INIT: self = x, left/right = the ring neighbours' x. params: bhvd_lp_init_params.
   * STEP: the whole step, in place: d = x + left/3 + right/3 - 5/3 self, c = MinMaxUInt8(d) to
   *   both neighbours, self += decompress(c), left/right += the neighbours' decompressed c,
   *   x = self. params: bhvd_lp_step_params.
   * EXCHANGE: the exchange half of a step split around bhvd_lp_decentralized_local: the input
   *   is this rank's c (uint8, bhvd_minmax_uint8_size(dtype, count, 1) bytes), sent to both
   *   neighbours; theirs are decompressed into left and right. Never hierarchical.
   *   params: bhvd_lp_exchange_params. */
  BHVD_OP_LP_DECENTRALIZED_INIT = 11,
  BHVD_OP_LP_DECENTRALIZED_STEP = 12,
  BHVD_OP_LP_DECENTRALIZED_EXCHANGE = 13
};

/* Compression of BHVD_OP_COMPRESSED_ALLREDUCE. */
enum bhvd_compression {
  BHVD_COMPRESSION_MINMAX_UINT8 = 1 /* 8 bits per element, per chunk min and max
                                       (docs/compression.md) */
};

/* Peer selection of BHVD_OP_PEER_AVERAGE. */
enum bhvd_peer_mode {
  BHVD_PEER_ALL = 0,       /* every rank of the set */
  BHVD_PEER_SHIFT_ONE = 1, /* one peer per round, the pairing shifted by the round `step` */
  BHVD_PEER_RING = 2       /* the two ring neighbours */
};

typedef struct bhvd_tensor {
  void* data;    /* NULL allowed for outputs the core allocates (allgather, alltoall) */
  int32_t dtype; /* enum bhvd_dtype */
  int32_t ndim;
  const int64_t* shape; /* ndim entries */
} bhvd_tensor;

typedef struct bhvd_request {
  int32_t op_type; /* enum bhvd_op_type */
  const char*
      name; /* full name, e.g. "allreduce.grad0"; NULL: the core names it "<op>.noname.<handle>" */
  int32_t process_set_id; /* 0: global */
  int32_t reduce_op;      /* enum bhvd_reduce_op (allreduces, reducescatter) */
  int32_t root_rank;      /* broadcast: a GLOBAL rank */
  int32_t device;         /* -1: CPU, >= 0: CUDA device ordinal */
  double prescale_factor;
  double postscale_factor;
  int32_t num_tensors; /* > 1 for grouped ops: members are fused together */
  const bhvd_tensor* inputs;
  const bhvd_tensor* outputs; /* allreduces, broadcast, reducescatter, BAGUA's primitives:
                                 caller-allocated (may alias inputs) */
  const int32_t* splits;      /* alltoall: one entry per process-set rank, or NULL */
  int32_t num_splits;
  int32_t urgent;     /* the caller blocks on this handle at once: do not hold it for
                         fusion */
  const void* params; /* the parameter struct of op_type (named at enum bhvd_op_type),
                         whose first field repeats op_type; NULL for op types without
                         one. Copied by bhvd_enqueue like the rest of the request. */
  void* stream;       /* device >= 0: the caller's cudaStream_t that produces the inputs (NULL:
                         the legacy default stream); the core's stream waits for what it has
                         queued so far. Ignored for host tensors. */
} bhvd_request;

/* Parameters of BAGUA's primitives, one struct per op type. Each starts with the op type it
 * belongs to, which the core checks against bhvd_request.op_type. Buffers are this rank's
 * algorithm state: same dtype as the request's tensor (except where said), kept alive by the
 * caller until the handle completes; they are not negotiated. `hierarchical` (where present):
 * 1 to run within each host first, then among one leader per host, then back within each host
 * (when the set spans several hosts and some host has several of its ranks; else flat), 0 flat;
 * every rank must pass the same value. */

typedef struct bhvd_compressed_allreduce_params {
  int32_t op_type;      /* BHVD_OP_COMPRESSED_ALLREDUCE */
  int32_t compression;  /* enum bhvd_compression */
  int32_t hierarchical; /* 1: full precision within each host, compressed among the hosts */
  /* Error feedback (both or neither; NULL: none): the residuals of the first and the second
   * quantization, n * ceil(count / n) and ceil(count / n) elements for
   * n = bhvd_compression_group_size(process_set_id, hierarchical). */
  const bhvd_tensor* residual_worker;
  const bhvd_tensor* residual_server;
} bhvd_compressed_allreduce_params;

typedef struct bhvd_peer_average_params {
  int32_t op_type;      /* BHVD_OP_PEER_AVERAGE */
  int32_t peer_mode;    /* enum bhvd_peer_mode */
  int64_t step;         /* communication round k >= 0 (chooses the peer for shift_one) */
  int32_t hierarchical; /* 1: the hosts' averages are averaged among the hosts' leaders */
} bhvd_peer_average_params;

typedef struct bhvd_lp_init_params {
  int32_t op_type;          /* BHVD_OP_LP_DECENTRALIZED_INIT */
  int32_t hierarchical;     /* 1: the ring of the hosts' leaders (the others copy x) */
  const bhvd_tensor* self;  /* this rank's replica, as many elements as x */
  const bhvd_tensor* left;  /* the left neighbour's */
  const bhvd_tensor* right; /* the right neighbour's */
} bhvd_lp_init_params;

typedef struct bhvd_lp_step_params {
  int32_t op_type;      /* BHVD_OP_LP_DECENTRALIZED_STEP */
  int32_t hierarchical; /* 1: the host's average of x, the step among the hosts' leaders, the
                           result to the host */
  const bhvd_tensor* self;
  const bhvd_tensor* left;
  const bhvd_tensor* right;
} bhvd_lp_step_params;

typedef struct bhvd_lp_exchange_params {
  int32_t op_type;          /* BHVD_OP_LP_DECENTRALIZED_EXCHANGE */
  const bhvd_tensor* left;  /* float32, float16 or bfloat16: the replicas the compressed */
  const bhvd_tensor* right; /* difference decompresses for (the request's input is uint8) */
} bhvd_lp_exchange_params;

/* ---- lifecycle ---------------------------------------------------------------------------- */

/* Starts the background thread and connects to the peers found through the rendezvous named by
 * the environment (HOROVOD_RANK, HOROVOD_SIZE, ..., HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT,
 * BAGUA_HVD_SECRET). Without a rendezvous address the job has size 1.
 * process_sets: static process sets, flattened: num_sets sets, set i has set_sizes[i] ranks.
 * Calling it while initialized is a no-op returning BHVD_OK. */
int bhvd_init(const int32_t* set_ranks, const int32_t* set_sizes, int32_t num_sets,
              int32_t dynamic_process_sets);
int bhvd_shutdown(void);
int bhvd_is_initialized(void);
const char* bhvd_last_error(void);
const char* bhvd_version(void);

/* Horovod's timeline (hvd.start_timeline / hvd.stop_timeline): a Chrome-trace JSON written by
 * rank 0 (the other ranks accept and do nothing). Refused with BHVD_INVALID_ARGUMENT and
 * Horovod's text unless HOROVOD_TIMELINE was set at init (a file, or DYNAMIC to start none);
 * BHVD_NOT_INITIALIZED before init. start opens path (truncating; another open file is completed
 * first; the same path only changes mark_cycles); a file that cannot be opened is logged and no
 * timeline written, as Horovod does. stop returns once the file is complete (a valid JSON
 * array, every event closed). */
int bhvd_start_timeline(const char* path, int32_t mark_cycles);
int bhvd_stop_timeline(void);

/* Horovod's autotuner (HOROVOD_AUTOTUNE, docs/autotune.md): the core measures on rank 0 and
 * applies; rank 0's frontend decides. bhvd_autotune_start (rank 0 only, else
 * BHVD_INVALID_ARGUMENT; BHVD_NOT_INITIALIZED before init) starts sampling: a sample ends when a
 * tensor of the global set has been reduced steps_per_sample more times, and scores the bytes
 * reduced per microsecond since the last (Horovod's score); the median of five samples is the
 * score bhvd_autotune_next_score hands out (*got = 1; 0 after timeout_ms without one;
 * BHVD_ABORTED once the job stopped). Sampling then pauses until bhvd_autotune_propose: its
 * parameters hold from the next negotiation cycle on, on every rank at the same point of the
 * order, and sampling resumes with them (active = 1) or ends (active = 0: tuning is done, these
 * are the best). */
typedef struct bhvd_autotune_params {
  int32_t hierarchical_allreduce; /* 0 or 1: HOROVOD_HIERARCHICAL_ALLREDUCE's meaning */
  int32_t cache_enabled;          /* 0: the response cache off; 1: HOROVOD_CACHE_CAPACITY */
  double cycle_time_ms;           /* >= 0: HOROVOD_CYCLE_TIME's meaning */
  int64_t fusion_threshold;       /* bytes, >= 0: HOROVOD_FUSION_THRESHOLD's meaning */
} bhvd_autotune_params;
int bhvd_autotune_start(int32_t steps_per_sample);
int bhvd_autotune_next_score(double* score, int64_t timeout_ms, int32_t* got);
int bhvd_autotune_propose(const bhvd_autotune_params* params, int32_t active);
/* One line in the core's log, as the core writes its own (HOROVOD_LOG_LEVEL, HOROVOD_LOG_HIDE_TIME;
 * levels 0 trace .. 5 fatal, as Horovod's): the frontends' messages that Horovod's core logs.
 * Returns 1 when written, 0 when below the level. */
int bhvd_log(int32_t level, const char* message);

int bhvd_rank(void);
int bhvd_size(void);
int bhvd_local_rank(void);
int bhvd_local_size(void);
int bhvd_cross_rank(void);
int bhvd_cross_size(void);
int bhvd_is_homogeneous(void);

/* ---- build and runtime facts ---------------------------------------------------------------- */
/* 1 when this build runs collectives on CUDA memory (compiled with nvcc): requests with
 * device >= 0 are accepted, and run through NCCL or, where NCCL cannot serve, through pinned
 * host memory (docs/gpu.md). bhvd_device_pointers_supported() is the same fact. */
int bhvd_cuda_built(void);
int bhvd_device_pointers_supported(void);
/* NCCL_VERSION_CODE of the NCCL bhvd_nccl_load() loaded, in a build with CUDA; else 0. */
int bhvd_nccl_built(void);
/* Loads NCCL once per process (later calls return the first outcome): `library` when not NULL
 * or empty (it alone), else a libnccl the process has loaded already, else `fallback` when not
 * NULL or empty, else libnccl.so.2 from the loader's search path. Returns NCCL_VERSION_CODE, or
 * 0 with the reason in bhvd_last_error(). Needs no GPU. */
int bhvd_nccl_load(const char* library, const char* fallback);
/* After bhvd_wait succeeded on a handle of CUDA tensors: `stream` (a cudaStream_t; NULL: the
 * legacy default stream) waits on the device until the operation's results are written. The
 * host does not wait. Nothing to do for host tensors. */
int bhvd_handle_stream_wait(int64_t handle, void* stream);
/* 1 when the collectives run through the process's MPI library (HOROVOD_CPU_OPERATIONS=mpi in
 * a job MPI started), 0 otherwise (also before init). */
int bhvd_mpi_enabled(void);
/* 1 when that MPI provides MPI_THREAD_MULTIPLE, 0 when it does not, -1 when MPI is not enabled. */
int bhvd_mpi_threads_supported(void);
/* Name of the transport used between two ranks of the global set: "self", "shm" or "tcp". */
const char* bhvd_transport_name(int32_t peer_rank);

/* ---- process sets ------------------------------------------------------------------------- */
/* Number of registered sets (the global set included) and their ids. */
int bhvd_process_set_ids(int32_t* ids_out, int32_t capacity);
/* Ranks of set id into ranks_out (capacity entries); returns the set size or -1 if unknown. */
int bhvd_process_set_ranks(int32_t id, int32_t* ranks_out, int32_t capacity);
/* This process's rank in set id, -1 if not a member, -2 if the set is unknown. */
int bhvd_process_set_rank(int32_t id);
/* Collective over all ranks (HOROVOD_DYNAMIC_PROCESS_SETS=1): registers ranks as a new set. */
int bhvd_add_process_set(const int32_t* ranks, int32_t n, int32_t* id_out);
int bhvd_remove_process_set(int32_t id);

/* ---- operations --------------------------------------------------------------------------- */
/* Queues an operation; returns BHVD_OK and a handle, or BHVD_INVALID_ARGUMENT etc. at once.
 * The request struct, its name, shapes and splits are copied: the caller may reuse them as soon as
 * this returns (tensor data must stay alive until the handle completes). A rejected request does
 * not consume a handle id, so unnamed ops stay aligned across ranks. */
int bhvd_enqueue(const bhvd_request* request, int64_t* handle_out);
/* Rows of dimension 0 this rank receives from a reducescatter of dim0 rows over the set
 * (Horovod's split); -1 for an unknown set or a non-member. */
int64_t bhvd_reducescatter_rows(int32_t process_set_id, int64_t dim0);
/* 1 when done (successfully or not), 0 while in flight, -1 for an unknown handle. */
int bhvd_poll(int64_t handle);
/* Blocks up to timeout_ms (< 0: no limit) and returns the handle's final status, BHVD_TIMED_OUT,
 * or BHVD_INVALID_ARGUMENT for an unknown handle. Releases no resources. */
int bhvd_wait(int64_t handle, int64_t timeout_ms);
/* Completion callback of bhvd_on_done: the handle and its final status (enum bhvd_status). */
typedef void (*bhvd_done_fn)(int64_t handle, int32_t status, void* arg);
/* Calls fn(handle, status, arg) once the handle completes, instead of a wait: on the core's
 * background thread, or on the calling thread before this returns if it already has. fn must
 * not block (other operations complete on the same thread); it may call bhvd_handle_error,
 * bhvd_output_* and bhvd_release on the handle, and enqueue. One callback per handle. Returns
 * BHVD_INVALID_ARGUMENT for an unknown handle or a second callback. */
int bhvd_on_done(int64_t handle, bhvd_done_fn fn, void* arg);
/* The handle's error message ("" when it succeeded). */
const char* bhvd_handle_error(int64_t handle);
/* For outputs the core allocated (allgather, alltoall): the shape of output `index`. */
int bhvd_output_ndim(int64_t handle, int32_t index);
int bhvd_output_shape(int64_t handle, int32_t index, int64_t* shape_out);
/* Copies output `index` into dst, which holds at least the output's bytes (device memory for
 * a request with device >= 0). stream: for such a request, the caller's CUDA stream (a
 * cudaStream_t; NULL: the legacy default stream), on which the copy is queued after
 * bhvd_handle_stream_wait; ignored for host memory. */
int bhvd_output_copy(int64_t handle, int32_t index, void* dst, void* stream);
/* Alltoall: the splits this rank received, one per process-set rank. */
int bhvd_received_splits(int64_t handle, int32_t* splits_out, int32_t capacity);
/* Join: the last rank to join (global rank). */
int bhvd_join_result(int64_t handle);
int bhvd_release(int64_t handle);

/* ---- asynchronous model averaging (docs/algorithms.md) ------------------------------------------
 */
/* Starts background averaging of num_tensors weight buffers over a process set: rounds at least
 * interval_ms apart, each an allreduce per buffer under the names "<name>.go" and "<name>.w<i>"
 * (name: the same on every rank, unique in the job). device: where every buffer is, -1 host
 * memory, else that CUDA device (a build with CUDA). */
int bhvd_async_start(const char* name, const bhvd_tensor* weights, int32_t num_tensors,
                     int32_t device, int32_t process_set_id, int64_t interval_ms,
                     int64_t* id_out);
/* A step boundary of the training thread: merges a finished round into the weights or snapshots
 * them for the next one. Never waits for other ranks (nor, for CUDA weights, for the device:
 * the work is queued on `stream`, the caller's cudaStream_t, NULL: the legacy default stream). */
int bhvd_async_step(int64_t id, void* stream);
/* Stops the rounds on every rank (after the current one) and waits up to timeout_ms (< 0: no
 * limit) for this rank's to end; BHVD_TIMED_OUT with a message otherwise. */
int bhvd_async_abort(int64_t id, int64_t timeout_ms);
/* Forgets an averager (stopping it first if needed). */
int bhvd_async_release(int64_t id);
/* Rounds merged so far, -1 for an unknown id. */
int64_t bhvd_async_rounds(int64_t id);

/* Asynchronous model averaging inside one frontend implementation (AsyncModelAverage in one
 * optimizer): the core keeps its state (its averager, aborted or not, its restarts) and names its
 * averagers "<name_prefix>.<elastic generation>.<restarts>" (BAGUA_HVD_ELASTIC_GENERATION, 0
 * outside elastic jobs), alike on every rank, a worker that just joined an elastic job included.
 * The caller owns the weight buffers and keeps them alive while an averager runs over them (from
 * the step that starts it until bhvd_async_impl_abort, bhvd_shutdown or the release). An
 * averager belongs to its job: bhvd_shutdown stops it and the next job's first step starts a new
 * one, restarts from 0; aborted or not outlives the job. */
typedef struct bhvd_async_impl_step_args {
  const char* name_prefix; /* the averagers' names (above) */
  int32_t process_set_id;
  int64_t interval_ms; /* rounds at least this far apart */
  int32_t device;      /* -1: every buffer is host memory, else that CUDA device's */
  void* stream;        /* device: the caller's cudaStream_t (NULL: the default) */
  int32_t num_tensors;
  const bhvd_tensor* weights; /* the buffers the averager runs over: the step that starts one
                                 starts it over them; while it runs, the same buffers */
  const bhvd_tensor* staged;  /* NULL, or num_tensors: the weights now, copied into `weights`
                                 first where they are other buffers (same dtype and size) */
} bhvd_async_impl_step_args;

typedef struct bhvd_async_impl_info {
  int32_t aborted;  /* 1 between bhvd_async_impl_abort and bhvd_async_impl_resume */
  int64_t restarts; /* resumes in this job (the last part of the averagers' names) */
  int64_t averager; /* the running averager's id (bhvd_async_rounds' id), 0: none runs */
  int64_t rounds;   /* the rounds it merged so far, 0: none runs */
} bhvd_async_impl_info;

/* A new implementation: not aborted, no averager. Needs no bhvd_init. */
int bhvd_async_impl_create(int64_t* id_out);
/* A step boundary after the update of a step past the warm-up: starts an averager over
 * a->weights where none runs (bhvd_async_start's checks), else copies a->staged in; then
 * bhvd_async_step. *merged: 1 when a round was merged into a->weights. Nothing while aborted. */
int bhvd_async_impl_step(int64_t id, const bhvd_async_impl_step_args* a, int32_t* merged);
/* Stops the rounds on every rank (after the current one), waits for this rank's, releases the
 * averager; steps do nothing until bhvd_async_impl_resume, whose next step starts a new averager
 * under the next restart's name. A round ended by bhvd_shutdown is no failure. */
int bhvd_async_impl_abort(int64_t id);
int bhvd_async_impl_resume(int64_t id);
int bhvd_async_impl_state(int64_t id, bhvd_async_impl_info* out);
/* Forgets an implementation (a running averager is stopped first); an unknown id is a no-op. */
int bhvd_async_impl_release(int64_t id);

/* ---- low-precision decentralized ring (docs/algorithms.md) -------------------------------------
 * One ring per frontend implementation (LowPrecisionDecentralized): the core orchestrates its
 * primitives (BHVD_OP_LP_DECENTRALIZED_*); the caller owns the weights and the state buffers
 * and keeps the state buffers alive until bhvd_lp_ring_release returns. The step splits (the
 * local half on the weights in place: host weights on the caller's thread, device weights
 * queued on the device after the caller's stream, which then waits for it; the exchange left in
 * flight, waited for by the next step or bhvd_lp_ring_flush) for a flat ring, or a hierarchical
 * one whose compression group is the whole set (one host); otherwise the core runs the whole
 * step of each bucket, blocking. A name stays taken until its handle is seen
 * complete: start, step (split) and flush first wait for every other ring's exchanges in flight,
 * whose failures stay with their own ring. Rings belong to the job: after bhvd_shutdown their
 * ids are unknown (BHVD_INVALID_ARGUMENT), and the frontend starts new ones. */
typedef struct bhvd_lp_weights {
  void* const* data;     /* num_segments buffers, in order */
  const int64_t* counts; /* their element counts */
  int32_t num_segments;  /* host weights: any number; device weights: 1 */
} bhvd_lp_weights;

typedef struct bhvd_lp_bucket {
  const char* init_name;     /* BHVD_OP_LP_DECENTRALIZED_INIT's name */
  const char* step_name;     /* BHVD_OP_LP_DECENTRALIZED_STEP's (the whole step) */
  const char* exchange_name; /* BHVD_OP_LP_DECENTRALIZED_EXCHANGE's (the split step) */
  int32_t dtype;             /* float32, float16 or bfloat16 */
  int64_t count;             /* elements of the weights, and of each replica */
  void* self;                /* the replicas (count elements each) */
  void* left;
  void* right;
  uint8_t* diff; /* the compressed difference, bhvd_minmax_uint8_size(dtype, count, 1) bytes,
                    in the weights' memory (host or the device's); NULL: no split step */
} bhvd_lp_bucket;

typedef struct bhvd_lp_ring_params {
  int32_t process_set_id;
  int32_t hierarchical; /* 1: BAGUA's hierarchical ring (the hosts' leaders) */
  int32_t device;       /* -1: every buffer is host memory, else that CUDA device's */
  int32_t num_buckets;
  const bhvd_lp_bucket* buckets;
  const bhvd_lp_weights* weights; /* num_buckets: the weights the replicas start from */
  void* stream;                   /* device: the caller's cudaStream_t (NULL: the default) */
  double op_timeout_s;   /* BAGUA_HVD_OP_TIMEOUT_SECONDS: a wait fails (BHVD_TIMED_OUT) after
                            this long; 0: no limit */
  double wait_warning_s; /* BAGUA_HVD_WAIT_WARNING_SECONDS: a wait still blocked logs a warning
                            every this long; 0: never */
} bhvd_lp_ring_params;

/* Starts a ring: settles every ring's exchanges in flight, then initialises the replicas of
 * every bucket from p->weights (self = x, left/right = the ring neighbours' x), blocking, each
 * initialisation waited for even after a failure; returns the first failure (no ring then). */
int bhvd_lp_ring_start(const bhvd_lp_ring_params* p, int64_t* id_out);
/* The ring's step after a communicating step's update: weights (num_buckets entries, the
 * layout of the start) are read and written in place; stream: device weights' cudaStream_t. */
int bhvd_lp_ring_step(int64_t id, const bhvd_lp_weights* weights, int32_t num_buckets,
                      void* stream);
/* Waits for the ring's exchanges in flight (their first failure) and settles every other
 * ring's; id 0: every ring's, no failure reported. Afterwards the replicas are final. */
int bhvd_lp_ring_flush(int64_t id);
/* Exchanges the ring has started and not yet waited for; -1 for an unknown id. */
int64_t bhvd_lp_ring_pending(int64_t id);
/* Forgets a ring: blocks until its exchanges in flight complete (a lost peer fails them) and
 * releases them; the caller may then free its buffers. An unknown id is a no-op. */
int bhvd_lp_ring_release(int64_t id);
/* At shutdown: waits up to timeout_s in all for every ring's exchanges in flight; *late: how
 * many were still in flight then (they stay). */
int bhvd_lp_rings_settle(double timeout_s, int64_t* late);

/* ---- diagnostics -------------------------------------------------------------------------- */
/* Counters for tests and benchmarks: key is one of "responses", "fused_tensors", "cycles",
 * "cache_hits", "fusion_buffer_bytes", "exec_ns" (time the background thread spent executing
 * operations), "bytes_sent" (payload bytes sent to other ranks), "bytes_sent_remote" (of those,
 * to ranks on other hosts), "mpi_calls" (MPI functions the MPI engine called), "nccl_calls"
 * (NCCL calls of the device engines), "device_staged_calls" and "device_staged_bytes" (their calls
 * staged through host memory, and the bytes those copied between device and host, both ways).
 * Returns -1 for an unknown key. */
int64_t bhvd_stat(const char* key);
/* Bytes on the wire of one op type since hvd.init() (bhvd_communication_stats). */
typedef struct bhvd_comm_stat {
  const char* op_type;               /* "allreduce", "allgather", "broadcast", "adasum",
                                        "alltoall", "reducescatter", "hierarchical_allreduce",
                                        "compressed_allreduce", "peer_average",
                                        "lp_decentralized_init", "lp_decentralized_step",
                                        "lp_decentralized_exchange", or "other" (bytes sent
                                        outside any response); static storage */
  int64_t calls;                     /* responses of this type executed on this rank */
  int64_t within_host_bytes_sent;    /* payload bytes sent to ranks with this HOROVOD_HOSTNAME */
  int64_t between_hosts_bytes_sent;  /* payload bytes sent to ranks on other hosts */
} bhvd_comm_stat;
/* This rank's bytes on the wire per op type since hvd.init(): *n = the number of op types with
 * a call or a byte counted, of which the first min(cap, *n) are written to out, in BHVD_OP_
 * order ("other" last). Counted: every payload byte of a collective this rank sent to another
 * rank over the core's shared-memory and TCP transports; NCCL's (CUDA tensors) only as far as
 * a device engine reports them (count_bytes_sent, base/wire_stats.h; the CUDA engine does not
 * yet). Not counted: negotiation and other control messages, bytes to itself, the MPI engine's
 * collectives (HOROVOD_CPU_OPERATIONS=mpi). bhvd_stat's "bytes_sent" and "bytes_sent_remote"
 * are the sums of this table's bytes (so they too count from init). A request of reduce op
 * Adasum counts as "adasum", as on the timeline. BHVD_NOT_INITIALIZED before hvd.init();
 * BHVD_INVALID_ARGUMENT for a null n, a negative cap, or a null out with cap > 0. */
int bhvd_communication_stats(bhvd_comm_stat* out, int32_t cap, int32_t* n);
/* Timestamps of the core's collectives for bench/timeline.py: a ring buffer of the last 4096
 * begin/mark/end events, recorded only while enabled (off by default). bhvd_trace_enable turns
 * recording on (1) or off (0) and returns the previous setting. bhvd_trace_read moves up to
 * max_events events, oldest first, into out (4 int64 each: CLOCK_MONOTONIC nanoseconds, op,
 * phase, element count; ops and phases: native/src/collectives/trace.h) and returns how many. */
int bhvd_trace_enable(int on);
int bhvd_trace_read(int64_t* out, int max_events);

/* Ranks taking part in a BHVD_OP_COMPRESSED_ALLREDUCE of the set (set size, or with
 * hierarchical = 1 the number of hosts when the set spans several and one has several ranks):
 * the error-feedback residuals hold n * ceil(count / n) (worker) and ceil(count / n) (server)
 * elements for this n. -1 for an unknown set or before hvd.init(). */
int bhvd_compression_group_size(int32_t process_set_id, int32_t hierarchical);
/* Error feedback's residuals for a BHVD_OP_COMPRESSED_ALLREDUCE of `count` elements in the set:
 * *worker = n * ceil(count / n) and *server = ceil(count / n) elements for that n.
 * BHVD_NOT_INITIALIZED before hvd.init(), BHVD_INVALID_ARGUMENT for an unknown set. */
int bhvd_compression_residuals(int32_t process_set_id, int32_t hierarchical, int64_t count,
                               int64_t* worker, int64_t* server);

/* BAGUA's bucket plan, the first-guess layout of the frontends' gradient and weight buckets:
 * tensors order[0..m) (indices into bytes and group, n of each) are appended to the open bucket
 * of their group (one dtype and device); a bucket closes when the next tensor would take it
 * past cap bytes (a bigger tensor gets a bucket of its own); cap 0: one bucket per tensor.
 * Writes bucket_of[k], the bucket of tensor order[k] (buckets numbered in the order they open),
 * and *num_buckets. BHVD_INVALID_ARGUMENT for an index outside [0, n), negative bytes or cap.
 * Needs no hvd.init(). */
int bhvd_bucket_layout(const int64_t* bytes, const int32_t* group, int64_t n,
                       const int64_t* order, int64_t m, int64_t cap, int64_t* bucket_of,
                       int64_t* num_buckets);

/* The local half of a low-precision decentralized step, on the caller's thread (no
 * communication): d = x + left/3 + right/3 - 5/3 self, c_out = MinMaxUInt8(d) (1 chunk,
 * bhvd_minmax_uint8_size(dtype, count, 1) bytes), self += decompress(c_out), x = self. Its
 * exchange half is BHVD_OP_LP_DECENTRALIZED_EXCHANGE. */
int bhvd_lp_decentralized_local(void* x, void* self, const void* left, const void* right,
                                int32_t dtype, int64_t count, uint8_t* c_out);
/* The same with x in num_segments pieces (xs[i] of counts[i] elements; count elements in all,
 * in order), for weights that live in several buffers (a framework's variables, updated in place
 * rather than copied into one bucket and back): the same bits as one contiguous x. */
int bhvd_lp_decentralized_local_segments(void* const* xs, const int64_t* counts,
                                         int32_t num_segments, void* self, const void* left,
                                         const void* right, int32_t dtype, uint8_t* c_out);

/* ---- compression (MinMaxUInt8, docs/algorithms.md) ------------------------------------------- */
/* Bytes of the compressed form of n elements of dtype (float32, float16, bfloat16) in n_chunks
 * chunks; -1 if the dtype is not one of those, n_chunks < 1 or n is not a multiple of n_chunks. */
int64_t bhvd_minmax_uint8_size(int32_t dtype, int64_t n, int32_t n_chunks);
/* CPU kernels; return BHVD_OK or BHVD_INVALID_ARGUMENT (message in bhvd_last_error()). */
int bhvd_minmax_uint8_compress(const void* in, int32_t dtype, int64_t n, int32_t n_chunks,
                               uint8_t* out);
int bhvd_minmax_uint8_decompress(const uint8_t* in, int32_t dtype, int64_t n, int32_t n_chunks,
                                 void* out);

/* BHVD_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* BAGUA_HVD_C_API_H */
