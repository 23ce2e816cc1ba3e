"""BAGUA's core primitives, one typed function each, over buffer descriptors.

Every call of a core primitive that the algorithms make lives here (docs/algorithms.md): the
bucketed allreduce (compressed or not, hierarchical or not, with error-feedback residuals),
the decentralized peer average, the low-precision decentralized step (its replica
initialisation, its blocking hierarchical form, and its split form: a local half on the
caller's thread and an exchange half in the core), asynchronous model averaging (a small class
that releases the core's averager) and the sizes the algorithms allocate by.

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

from typing import Any, List, NamedTuple, Optional, Sequence

from bagua_hvd.common import _native
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
    "lp_init",
    "lp_step",
    "lp_local_half",
    "lp_exchange_half",
    "compression_group_size",
    "compressed_size",
    "AsyncAverager",
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
    see :func:`compression_group_size`) for error feedback; within each host first when
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


def _lp_replicas(
    c_type: str, op_type: int, replicas: Sequence[Buffer], hierarchical: bool, keep: List[Any]
) -> Any:
    """The parameters of the ring's INIT and STEP: ``replicas`` = (self, left, right)."""
    own, left, right = replicas
    params = _params(c_type, op_type, keep)
    params.hierarchical = int(hierarchical)
    params.self = _state(own, keep)
    params.left = _state(left, keep)
    params.right = _state(right, keep)
    return params


def lp_init(
    buf: Buffer,
    replicas: Sequence[Buffer],
    name: str,
    process_set_id: int,
    *,
    hierarchical: bool = False,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """Low-precision decentralized: ``replicas`` (self, left, right) = this rank's and its ring
    neighbours' ``buf``."""
    _placed(buf, *replicas)
    keep: List[Any] = []
    op_type = _ops.OP_LP_DECENTRALIZED_INIT
    params = _lp_replicas("bhvd_lp_init_params", op_type, replicas, hierarchical, keep)
    return _submit(op_type, buf, buf, name, process_set_id, errors, params)


def lp_step(
    buf: Buffer,
    replicas: Sequence[Buffer],
    name: str,
    process_set_id: int,
    *,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """Low-precision decentralized: the whole hierarchical step of ``buf`` in the core (the
    flat step is split: :func:`lp_local_half`, :func:`lp_exchange_half`)."""
    _placed(buf, *replicas)
    keep: List[Any] = []
    op_type = _ops.OP_LP_DECENTRALIZED_STEP
    params = _lp_replicas("bhvd_lp_step_params", op_type, replicas, True, keep)
    return _submit(op_type, buf, buf, name, process_set_id, errors, params)


def lp_local_half(
    x: Buffer,
    own: Buffer,
    left: Buffer,
    right: Buffer,
    diff: Buffer,
    *,
    errors: Errors = PYTHON_ERRORS,
) -> None:
    """The local half of the split low-precision step, on this thread: ``diff`` (uint8,
    :func:`compressed_size` bytes) = MinMaxUInt8(x + left/3 + right/3 - 5/3 own); own +=
    decompress(diff); x = own."""
    _host(
        x,
        own,
        left,
        right,
        diff,
        message=(
            "the split low-precision step runs its local half on the host: CUDA buckets take "
            "lp_step (the engine chooses it for them)"
        ),
    )
    n = _ops.native()
    cast, voidp = n.cast, n.voidp
    status = n.lib.bhvd_lp_decentralized_local(
        cast(voidp, x.ptr),
        cast(voidp, own.ptr),
        cast(voidp, left.ptr),
        cast(voidp, right.ptr),
        x.dtype,
        x.numel,
        n.ffi.cast("uint8_t *", diff.ptr),
    )
    if status != _ops.OK:
        raise errors.status(status, _native.last_error() or "core call failed")


def lp_exchange_half(
    diff: Buffer,
    left: Buffer,
    right: Buffer,
    name: str,
    process_set_id: int,
    *,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """The exchange half of the split step: ``diff`` to both neighbours, theirs decompressed
    into the ``left`` and ``right`` replicas."""
    _placed(diff, left, right)
    keep: List[Any] = []
    op_type = _ops.OP_LP_DECENTRALIZED_EXCHANGE
    params = _params("bhvd_lp_exchange_params", op_type, keep)
    params.left = _state(left, keep)
    params.right = _state(right, keep)
    return _submit(op_type, diff, diff, name, process_set_id, errors, params)


def compression_group_size(process_set_id: int, hierarchical: bool) -> int:
    """How many ranks share a compressed allreduce's chunks (the residuals are sized by it)."""
    return int(_ops.native().lib.bhvd_compression_group_size(process_set_id, int(hierarchical)))


def compressed_size(dtype: int, numel: int) -> int:
    """Bytes of ``numel`` elements compressed by MinMaxUInt8 as one chunk."""
    return int(_ops.native().lib.bhvd_minmax_uint8_size(dtype, numel, 1))


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
        ffi = n.ffi
        self.errors = errors
        tensors = ffi.new("bhvd_tensor[]", len(weights))
        shapes = []
        for i, w in enumerate(weights):
            shape = ffi.new("int64_t[]", [w.numel])
            shapes.append(shape)
            tensors[i].data = n.cast(n.voidp, w.ptr) if w.numel else n.empty
            tensors[i].dtype = w.dtype
            tensors[i].ndim = 1
            tensors[i].shape = shape
        out = ffi.new("int64_t *")
        status = n.lib.bhvd_async_start(
            name.encode(), tensors, len(weights), self.device, process_set_id, int(interval_ms), out
        )
        if status != _ops.OK:
            raise errors.status(status, _native.last_error() or "async averaging failed")
        self.id: Optional[int] = int(out[0])
        self._keep = (tensors, shapes)

    def step(self, stream: int = 0) -> None:
        """A step boundary: merges a finished round into the weights or snapshots them (CUDA
        weights: queued on ``stream``, the address of the caller's stream; 0: the legacy default
        stream)."""
        n = _ops.native()
        status = n.lib.bhvd_async_step(self.id, n.cast(n.voidp, stream) if stream else n.null)
        if status != _ops.OK:
            raise self.errors.status(status, _native.last_error() or "async averaging failed")

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
