"""BAGUA's core primitives, one typed function each, over buffer descriptors.

Every call of a core primitive that the algorithms make lives here (docs/algorithms.md): the
bucketed allreduce (compressed or not, hierarchical or not, with error-feedback residuals),
the decentralized peer average, the low-precision decentralized ring (the core's ring object:
its replicas' initialisation, its steps, split or whole, and its exchanges left in flight,
behind ``bhvd_lp_ring_*``), asynchronous model averaging (a small class that releases the
core's averager) and the sizes the algorithms allocate by.

Each primitive is its own op type of the core with its own parameter struct (c_api.h:
``bhvd_compressed_allreduce_params``, ``bhvd_peer_average_params``, ``bhvd_lp_*_params``), built
here and nowhere else. A buffer is described by a :class:`Buffer`: address, dtype code, element
count, device and stream (device -1 and stream 0 for host memory). CUDA buffers go to a core
built with CUDA, which runs the primitives on the device engine's stream after ``stream``'s
work (docs/gpu.md); :meth:`Request.wait` then makes ``stream`` wait for the results. The
caller keeps the memory alive until the request it was given to completes; the
:class:`Request` objects returned here hold what the core's C structs need.

Failures are reported through an :class:`Errors` object, so that each frontend raises its own
exception classes (Python's for torch, ``tf.errors`` for TensorFlow) from the same code.
This module imports no framework and no numpy.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from bagua_hvd.common import _native
from bagua_hvd.common import config as _config
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.exceptions import HorovodInternalError

__all__ = [
    "Buffer",
    "Errors",
    "PYTHON_ERRORS",
    "Request",
    "wait_all",
    "allreduce",
    "peer_average",
    "lp_ring_start",
    "lp_ring_step",
    "lp_ring_flush",
    "lp_ring_pending",
    "lp_ring_release",
    "lp_rings_settle",
    "residual_sizes",
    "compressed_size",
    "AsyncAverager",
    "AsyncState",
    "async_impl_create",
    "async_impl_step",
    "async_impl_abort",
    "async_impl_resume",
    "async_impl_state",
    "async_impl_release",
]

_GPU_MESSAGE = (
    "BAGUA's algorithms run on CPU tensors in this build of bagua_hvd (built without nvcc): "
    "GPU buckets need a build with CUDA"
)


class Buffer(NamedTuple):
    """A contiguous buffer as the core sees it."""

    ptr: int  #: address of the first element (0 allowed when ``numel == 0``)
    dtype: int  #: the core's dtype code (``bagua_hvd.common.ops.FLOAT32``, ...)
    numel: int  #: number of elements
    device: int = -1  #: -1: host memory; else the accelerator's index
    stream: int = 0  #: the stream that produces the memory (0: none, host memory)

    def desc(self) -> _ops.TensorDesc:
        """The ``(pointer, dtype, shape)`` triple of :func:`bagua_hvd.common.ops.enqueue`."""
        return (self.ptr if self.numel else 0, self.dtype, (self.numel,))


class Errors:
    """How a frontend reports a failure of the core (the default: Python's exceptions, as
    the torch frontend raises them)."""

    def enqueue(self, error: ValueError) -> Exception:
        """The exception for ``error``, a ValueError of the checks made before the core while a
        request was submitted."""
        return error

    def enqueue_status(self, status: int, message: str) -> Exception:
        """The exception for a core status that refused a request at submission."""
        return _ops.exception_for_status(status, message)

    def status(self, status: int, message: str) -> Exception:
        """The exception for a failed core status."""
        return _ops.exception_for_status(status, message)

    def timeout(self, error: HorovodInternalError) -> Exception:
        """The exception when ``BAGUA_HVD_OP_TIMEOUT_SECONDS`` ran out during a wait."""
        return error

    def failed(self, what: str, status: int) -> str:
        """The message of a failure the core gave no message for."""
        return f"{what} failed (status {status})"


PYTHON_ERRORS = Errors()

# Requests whose wait was interrupted (KeyboardInterrupt): the core may still write into their
# buffers, so they are never freed.
_abandoned: List[Request] = []


class Request:
    """One submitted primitive: its core handle, its name and what must outlive it."""

    __slots__ = ("handle", "name", "keep", "hold", "errors", "done", "stream")

    def __init__(
        self, handle: int, name: str, keep: Any, errors: Errors, stream: Optional[int] = None
    ) -> None:
        self.handle = handle
        self.name = name
        self.keep = keep  # the C structs of the request
        self.hold: Any = None  # the caller's buffers, when the caller wants them kept here
        self.errors = errors
        self.done = False  # waited for and released
        self.stream = stream  # CUDA buffers: the caller's stream, which waits for the results

    def wait(self) -> None:
        """Blocks until the request completes, releases it, and raises its failure."""
        if self.done:
            return
        try:
            status = _ops.wait_status(self.handle, self.name)
        except KeyboardInterrupt:
            _abandoned.append(self)  # still in flight: keep its memory alive
            raise
        except HorovodInternalError as e:  # BAGUA_HVD_OP_TIMEOUT_SECONDS ran out
            self.release()
            raise self.errors.timeout(e) from None
        if status != _ops.OK:
            message = _ops.failure_message(self.handle, self.errors.failed(self.name, status))
            self.release()
            raise self.errors.status(status, message)
        if self.stream is not None:
            _ops.stream_wait(self.handle, self.stream)
        self.release()

    def settle(self, timeout_s: Optional[float] = None) -> bool:
        """Blocks until the request completes (at most ``timeout_s`` seconds when given),
        without raising or releasing it (a later :meth:`wait` reports its outcome). Returns
        False when ``timeout_s`` ran out first."""
        if self.done:
            return True
        if timeout_s is not None:
            return _ops.wait_until(self.handle, timeout_s)
        try:
            _ops.wait_status(self.handle, self.name)
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001  (reported by wait())
            pass
        return True

    def release(self) -> None:
        if not self.done:
            self.done = True
            _ops.release(self.handle)
            self.keep = self.hold = None


def wait_all(requests: Sequence[Request]) -> None:
    """Waits for every request (all of them, even after a failure) and raises the first
    failure."""
    error: Optional[BaseException] = None
    for r in requests:
        try:
            r.wait()
        except KeyboardInterrupt:
            _abandoned.extend(x for x in requests if not x.done)
            raise
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        raise error


def _placed(*buffers: Buffer) -> None:
    """Host buffers, or CUDA buffers of one device for a core that runs them; else raises."""
    devices = {b.device for b in buffers}
    if devices == {-1}:
        return
    if not _ops.device_pointers_supported():
        raise NotImplementedError(_GPU_MESSAGE)
    if len(devices) > 1:
        raise ValueError(
            "the buffers of one primitive (bucket, residuals, replicas) must be on one device; "
            f"got devices {sorted(devices)} (-1: host memory)"
        )


def _host(*buffers: Buffer, message: str = _GPU_MESSAGE) -> None:
    for b in buffers:
        if b.device >= 0:
            raise NotImplementedError(message)


def _submit(
    op_type: int,
    buf: Buffer,
    out: Buffer,
    name: str,
    process_set_id: int,
    errors: Errors,
    params: Any = None,
    **kwargs: Any,
) -> Request:
    desc = buf.desc()
    try:
        handle, keep = _ops.enqueue(
            op_type,
            (desc,),
            (desc if out is buf else out.desc(),),
            name=name,
            process_set_id=process_set_id,
            urgent=True,
            params=params,
            status_error=errors.enqueue_status,
            device=buf.device,
            stream=buf.stream,
            **kwargs,
        )
    except ValueError as e:  # the checks made before the core
        raise errors.enqueue(e) from None
    return Request(handle, name, keep, errors, buf.stream if buf.device >= 0 else None)


def _params(c_type: str, op_type: int, keep: List[Any]) -> Any:
    """A zeroed parameter struct of ``c_type`` for ``op_type`` (its first field), kept alive in
    ``keep`` until the enqueue returns."""
    p = _ops.native().ffi.new(f"{c_type} *")
    p.op_type = op_type
    keep.append(p)
    return p


def _state(b: Buffer, keep: List[Any]) -> Any:
    """A ``bhvd_tensor *`` describing state buffer ``b`` (kept alive in ``keep``)."""
    n = _ops.native()
    t = n.ffi.new("bhvd_tensor *")
    shape = n.newp(n.i64_t, [b.numel])
    t.data = n.cast(n.voidp, b.ptr) if b.numel else n.empty
    t.dtype = b.dtype
    t.ndim = 1
    t.shape = shape
    keep += (t, shape)
    return t


def allreduce(
    buf: Buffer,
    name: str,
    process_set_id: int,
    *,
    reduce_op: int,
    compressed: bool = False,
    residuals: Sequence[Buffer] = (),
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    hierarchical: bool = False,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """The allreduce of one bucket, in place: MinMaxUInt8-compressed (ByteGrad) when
    ``compressed``, with ``residuals`` = (residual of the first quantization, of the second;
    see :func:`residual_sizes`) for error feedback; within each host first when
    ``hierarchical``. Uncompressed: Horovod's allreduce, or the hierarchical allreduce op."""
    _placed(buf, *residuals)
    keep: List[Any] = []
    params = None
    if compressed:
        op_type = _ops.OP_COMPRESSED_ALLREDUCE
        params = _params("bhvd_compressed_allreduce_params", op_type, keep)
        params.compression = _ops.COMPRESSION_MINMAX_UINT8
        params.hierarchical = int(hierarchical)
        if residuals:
            worker, server = residuals
            params.residual_worker = _state(worker, keep)
            params.residual_server = _state(server, keep)
    else:
        if residuals:
            raise ValueError("error-feedback residuals belong to the compressed allreduce")
        op_type = _ops.OP_HIERARCHICAL_ALLREDUCE if hierarchical else _ops.OP_ALLREDUCE
    return _submit(
        op_type,
        buf,
        buf,
        name,
        process_set_id,
        errors,
        params,
        reduce_op=reduce_op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def peer_average(
    buf: Buffer,
    out: Buffer,
    name: str,
    process_set_id: int,
    *,
    peer_selection_mode: str,
    step: int,
    hierarchical: bool = False,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """Decentralized SGD's average of ``buf`` with the peers of round ``step`` into ``out``."""
    _placed(buf, out)
    keep: List[Any] = []
    params = _params("bhvd_peer_average_params", _ops.OP_PEER_AVERAGE, keep)
    params.peer_mode = _ops.PEER_MODES[peer_selection_mode]
    params.step = step
    params.hierarchical = int(hierarchical)
    return _submit(_ops.OP_PEER_AVERAGE, buf, out, name, process_set_id, errors, params)


def _lp_weights(weights: Sequence[Sequence[Buffer]], keep: List[Any]) -> Any:
    """``bhvd_lp_weights[]``: per bucket its segments (kept alive in ``keep``)."""
    n = _ops.native()
    ffi = n.ffi
    out = ffi.new("bhvd_lp_weights[]", len(weights))
    keep.append(out)
    for i, segments in enumerate(weights):
        data = ffi.new(
            "void *[]", [n.cast(n.voidp, s.ptr) if s.numel else n.empty for s in segments]
        )
        counts = ffi.new("int64_t[]", [s.numel for s in segments])
        keep += (data, counts)
        out[i].data = data
        out[i].counts = counts
        out[i].num_segments = len(segments)
    return out


def _lp_status(status: int, errors: Errors) -> None:
    if status != _ops.OK:
        raise errors.status(status, _native.last_error() or "low-precision ring failed")


def lp_ring_start(
    weights: Sequence[Sequence[Buffer]],
    replicas: Sequence[Sequence[Buffer]],
    diffs: Sequence[Optional[Buffer]],
    names: Sequence[Tuple[str, str, str]],
    process_set_id: int,
    *,
    hierarchical: bool = False,
    errors: Errors = PYTHON_ERRORS,
) -> int:
    """Starts the core's low-precision decentralized ring (c_api.h ``bhvd_lp_ring_start``) and
    returns its id: per bucket its weights' segments, its replicas (self, left, right), its
    compressed difference (uint8, :func:`compressed_size` bytes, on the bucket's device; None:
    no split step) and its op names (init, whole step, exchange). The replicas start
    from the weights (blocking). The caller keeps the buffers alive until
    :func:`lp_ring_release` returns."""
    _ops.check_not_forked()
    state = [b for reps in replicas for b in reps] + [d for d in diffs if d is not None]
    _placed(*(s for segs in weights for s in segs), *state)
    first = next((s for segs in weights for s in segs), None)
    n = _ops.native()
    ffi = n.ffi
    keep: List[Any] = []
    buckets = ffi.new("bhvd_lp_bucket[]", len(weights))
    for i, ((own, left, right), diff, bucket_names) in enumerate(zip(replicas, diffs, names)):
        b = buckets[i]
        encoded = [ffi.new("char[]", name.encode()) for name in bucket_names]
        keep += encoded
        b.init_name, b.step_name, b.exchange_name = encoded
        b.dtype = own.dtype
        b.count = own.numel
        b.self, b.left, b.right = (
            n.cast(n.voidp, r.ptr) if r.numel else n.empty for r in (own, left, right)
        )
        b.diff = ffi.cast("uint8_t *", diff.ptr) if diff is not None and diff.numel else n.null
    params = ffi.new("bhvd_lp_ring_params *")
    params.process_set_id = process_set_id
    params.hierarchical = int(hierarchical)
    params.device = first.device if first is not None else -1
    params.num_buckets = len(weights)
    params.buckets = buckets
    params.weights = _lp_weights(weights, keep)
    params.stream = n.cast(n.voidp, first.stream) if first is not None and first.stream else n.null
    params.op_timeout_s = _config.op_timeout_seconds()
    params.wait_warning_s = _config.wait_warning_seconds()
    out = ffi.new("int64_t *")
    _lp_status(n.lib.bhvd_lp_ring_start(params, out), errors)
    return int(out[0])


def lp_ring_step(
    ring: int, weights: Sequence[Sequence[Buffer]], *, errors: Errors = PYTHON_ERRORS
) -> None:
    """The ring's step after a communicating step's update, on ``weights`` (per bucket its
    segments, the start's layout) in place: split (the local half here, the exchange left in
    flight) or whole (blocking), as the core decides for the job."""
    _ops.check_not_forked()
    first = next((s for segs in weights for s in segs), None)
    n = _ops.native()
    keep: List[Any] = []
    stream = n.cast(n.voidp, first.stream) if first is not None and first.stream else n.null
    _lp_status(
        n.lib.bhvd_lp_ring_step(ring, _lp_weights(weights, keep), len(weights), stream), errors
    )


def lp_ring_flush(ring: int, *, errors: Errors = PYTHON_ERRORS) -> None:
    """Waits for the ring's exchanges in flight (raising their failure) and every other ring's
    (``ring`` 0: every ring's, no failure raised)."""
    _ops.check_not_forked()
    _lp_status(_ops.native().lib.bhvd_lp_ring_flush(ring), errors)


def lp_ring_pending(ring: int) -> Optional[int]:
    """The ring's exchanges started and not yet waited for; None for a ring the core does not
    know (released, or ended with its job)."""
    n = int(_ops.native().lib.bhvd_lp_ring_pending(ring))
    return None if n < 0 else n


def lp_ring_release(ring: int) -> None:
    """Forgets the ring once its exchanges in flight have completed (blocks until then):
    afterwards its buffers may be freed. An unknown ring (its job ended) is a no-op."""
    _ops.native().lib.bhvd_lp_ring_release(ring)


def lp_rings_settle(timeout_s: float) -> int:
    """At shutdown: waits up to ``timeout_s`` in all for every ring's exchanges in flight (the
    TensorFlow kernels' too); returns how many were still in flight then."""
    n = _ops.native()
    late = n.ffi.new("int64_t *")
    n.lib.bhvd_lp_rings_settle(float(timeout_s), late)
    return int(late[0])


def residual_sizes(
    process_set_id: int, hierarchical: bool, numel: int, *, errors: Errors = PYTHON_ERRORS
) -> Tuple[int, int]:
    """Error feedback's residuals for a compressed allreduce of ``numel`` elements: the
    worker's and the server's element counts (c_api.h ``bhvd_compression_residuals``)."""
    n = _ops.native()
    worker, server = n.ffi.new("int64_t *"), n.ffi.new("int64_t *")
    status = n.lib.bhvd_compression_residuals(
        process_set_id, int(hierarchical), numel, worker, server
    )
    if status != _ops.OK:
        raise errors.status(status, _native.last_error() or "error feedback failed")
    return int(worker[0]), int(server[0])


def compressed_size(dtype: int, numel: int) -> int:
    """Bytes of ``numel`` elements compressed by MinMaxUInt8 as one chunk."""
    return int(_ops.native().lib.bhvd_minmax_uint8_size(dtype, numel, 1))


def _async_status(status: int, errors: Errors) -> None:
    if status != _ops.OK:
        raise errors.status(status, _native.last_error() or "async averaging failed")


def _tensors(buffers: Sequence[Buffer], keep: List[Any]) -> Any:
    """1-D ``bhvd_tensor``s of ``buffers`` (``keep`` holds their memory)."""
    n = _ops.native()
    tensors = n.ffi.new("bhvd_tensor[]", len(buffers))
    keep.append(tensors)
    for i, b in enumerate(buffers):
        shape = n.ffi.new("int64_t[]", [b.numel])
        keep.append(shape)
        tensors[i].data = n.cast(n.voidp, b.ptr) if b.numel else n.empty
        tensors[i].dtype = b.dtype
        tensors[i].ndim = 1
        tensors[i].shape = shape
    return tensors


class AsyncAverager:
    """The core's background averaging of weight buffers (asynchronous model averaging).

    ``close()`` (or leaving a ``with`` block) stops the rounds (on every rank) and releases the
    averager; until then the core writes into the buffers, so the caller keeps them alive.
    """

    def __init__(
        self,
        name: str,
        weights: Sequence[Buffer],
        process_set_id: int,
        interval_ms: int,
        errors: Errors = PYTHON_ERRORS,
    ) -> None:
        _placed(*weights)
        self.device = weights[0].device if weights else -1
        n = _ops.native()
        self.errors = errors
        self._keep: List[Any] = []
        tensors = _tensors(weights, self._keep)
        out = n.ffi.new("int64_t *")
        status = n.lib.bhvd_async_start(
            name.encode(), tensors, len(weights), self.device, process_set_id, int(interval_ms), out
        )
        _async_status(status, errors)
        self.id: Optional[int] = int(out[0])

    def step(self, stream: int = 0) -> None:
        """A step boundary: merges a finished round into the weights or snapshots them (CUDA
        weights: queued on ``stream``, the address of the caller's stream; 0: the legacy default
        stream)."""
        n = _ops.native()
        status = n.lib.bhvd_async_step(self.id, n.cast(n.voidp, stream) if stream else n.null)
        _async_status(status, self.errors)

    def rounds(self) -> int:
        """Rounds merged so far."""
        return int(_ops.native().lib.bhvd_async_rounds(self.id)) if self.id is not None else 0

    def __enter__(self) -> AsyncAverager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stops the rounds on every rank, waits for this rank's, and releases the averager."""
        if self.id is None:
            return
        lib = _ops.native().lib
        status = lib.bhvd_async_abort(self.id, -1)
        lib.bhvd_async_release(self.id)
        self.id = None
        if status not in (_ops.OK, _ops.ABORTED):
            raise self.errors.status(status, _native.last_error() or "async averaging failed")


class AsyncState(NamedTuple):
    """An implementation's asynchronous averaging (c_api.h ``bhvd_async_impl_info``)."""

    aborted: bool  #: between abort and resume: steps do nothing
    restarts: int  #: resumes in this job
    averager: int  #: the running averager's id (0: none runs)
    rounds: int  #: the rounds it merged so far


def async_impl_create() -> int:
    """A new implementation of asynchronous model averaging in the core (needs no init)."""
    n = _ops.native()
    out = n.ffi.new("int64_t *")
    _async_status(n.lib.bhvd_async_impl_create(out), PYTHON_ERRORS)
    return int(out[0])


def async_impl_step(
    impl: int,
    name_prefix: str,
    weights: Sequence[Buffer],
    staged: Sequence[Buffer],
    process_set_id: int,
    interval_ms: int,
    errors: Errors = PYTHON_ERRORS,
) -> bool:
    """A step boundary past the warm-up (c_api.h ``bhvd_async_impl_step``): the core starts an
    averager over ``weights`` where none runs, else copies ``staged`` into them; True when a
    round was merged into ``weights``. The caller keeps ``weights`` alive while it runs."""
    _placed(*weights, *staged)
    n = _ops.native()
    ffi = n.ffi
    keep: List[Any] = []
    args = ffi.new("bhvd_async_impl_step_args *")
    prefix = ffi.new("char[]", name_prefix.encode())
    args.name_prefix = prefix
    args.process_set_id = process_set_id
    args.interval_ms = int(interval_ms)
    args.device = weights[0].device if weights else -1
    stream = weights[0].stream if weights else 0
    args.stream = n.cast(n.voidp, stream) if stream else n.null
    args.num_tensors = len(weights)
    args.weights = _tensors(weights, keep)
    args.staged = _tensors(staged, keep)
    merged = ffi.new("int32_t *")
    _async_status(n.lib.bhvd_async_impl_step(impl, args, merged), errors)
    return bool(merged[0])


def async_impl_abort(impl: int, errors: Errors = PYTHON_ERRORS) -> None:
    """Stops the rounds on every rank, waits for this rank's, releases the averager."""
    _async_status(_ops.native().lib.bhvd_async_impl_abort(impl), errors)


def async_impl_resume(impl: int) -> None:
    """The next step starts a new averager (the next restart's name)."""
    _async_status(_ops.native().lib.bhvd_async_impl_resume(impl), PYTHON_ERRORS)


def async_impl_state(impl: int) -> AsyncState:
    n = _ops.native()
    info = n.ffi.new("bhvd_async_impl_info *")
    _async_status(n.lib.bhvd_async_impl_state(impl, info), PYTHON_ERRORS)
    return AsyncState(bool(info.aborted), info.restarts, info.averager, info.rounds)


def async_impl_release(impl: int) -> None:
    """Forgets an implementation (a running averager is stopped first)."""
    _ops.native().lib.bhvd_async_impl_release(impl)
