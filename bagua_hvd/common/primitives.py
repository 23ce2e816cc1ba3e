"""BAGUA's core primitives, one typed function each, over buffer descriptors.

Every call of a core primitive that the algorithms make lives here (docs/algorithms.md): the
bucketed allreduce (compressed or not, hierarchical or not, with error-feedback residuals),
the decentralized peer average, the low-precision decentralized step (its replica
initialisation, its blocking hierarchical form, and its split form: a local half on the
caller's thread and an exchange half in the core), asynchronous model averaging (a small class
that releases the core's averager) and the sizes the algorithms allocate by.

A buffer is described by a :class:`Buffer`: address, dtype code, element count, device and
stream (device -1 and stream 0 for host memory, the only memory the primitives accept
today). The caller keeps the memory alive until the request it was given to completes; the
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
    "BAGUA's algorithms run on CPU tensors in this build of bagua_hvd; GPU buckets are not "
    "supported yet"
)

# peer_mode values of BHVD_OP_LP_DECENTRALIZED: the step (hierarchical), the replicas'
# initialisation, the exchange half of the split step.
_LP_STEP, _LP_INIT, _LP_EXCHANGE = 0, 1, 2


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

    def enqueue(self, error: Exception) -> Exception:
        """The exception for ``error`` (ValueError, NotImplementedError,
        HorovodInternalError) raised while a request was submitted."""
        return error

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

    __slots__ = ("handle", "name", "keep", "hold", "errors", "done")

    def __init__(self, handle: int, name: str, keep: Any, errors: Errors) -> None:
        self.handle = handle
        self.name = name
        self.keep = keep  # the C structs of the request
        self.hold: Any = None  # the caller's buffers, when the caller wants them kept here
        self.errors = errors
        self.done = False  # waited for and released

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
        self.release()

    def settle(self) -> None:
        """Blocks until the request completes, without raising or releasing it (a later
        :meth:`wait` reports its outcome)."""
        if self.done:
            return
        try:
            _ops.wait_status(self.handle, self.name)
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001  (reported by wait())
            pass

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


def _host(*buffers: Buffer) -> None:
    for b in buffers:
        if b.device >= 0:
            raise NotImplementedError(_GPU_MESSAGE)


def _submit(
    op_type: int,
    buf: Buffer,
    out: Buffer,
    name: str,
    process_set_id: int,
    errors: Errors,
    aux: Sequence[Buffer] = (),
    **kwargs: Any,
) -> Request:
    _host(buf, out, *aux)
    desc = buf.desc()
    try:
        handle, keep = _ops.enqueue(
            op_type,
            (desc,),
            (desc if out is buf else out.desc(),),
            name=name,
            process_set_id=process_set_id,
            urgent=True,
            aux=[a.desc() for a in aux] or None,
            **kwargs,
        )
    except (ValueError, NotImplementedError, HorovodInternalError) as e:
        raise errors.enqueue(e) from None
    return Request(handle, name, keep, errors)


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
    ``hierarchical``."""
    return _submit(
        _ops.OP_ALLREDUCE,
        buf,
        buf,
        name,
        process_set_id,
        errors,
        residuals,
        reduce_op=reduce_op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        compression=_ops.COMPRESSION_MINMAX_UINT8 if compressed else _ops.COMPRESSION_NONE,
        hierarchical=hierarchical,
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
    return _submit(
        _ops.OP_DECENTRALIZED,
        buf,
        out,
        name,
        process_set_id,
        errors,
        peer_mode=_ops.PEER_MODES[peer_selection_mode],
        step=step,
        hierarchical=hierarchical,
    )


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
    return _submit(
        _ops.OP_LP_DECENTRALIZED,
        buf,
        buf,
        name,
        process_set_id,
        errors,
        replicas,
        peer_mode=_LP_INIT,
        hierarchical=hierarchical,
    )


def lp_step(
    buf: Buffer,
    replicas: Sequence[Buffer],
    name: str,
    process_set_id: int,
    *,
    errors: Errors = PYTHON_ERRORS,
) -> Request:
    """Low-precision decentralized: the whole (hierarchical) step of ``buf`` in the core."""
    return _submit(
        _ops.OP_LP_DECENTRALIZED,
        buf,
        buf,
        name,
        process_set_id,
        errors,
        replicas,
        peer_mode=_LP_STEP,
        hierarchical=True,
    )


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
    _host(x, own, left, right, diff)
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
    return _submit(
        _ops.OP_LP_DECENTRALIZED,
        diff,
        diff,
        name,
        process_set_id,
        errors,
        (left, right),
        peer_mode=_LP_EXCHANGE,
    )


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
        _host(*weights)
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
            name.encode(), tensors, len(weights), process_set_id, int(interval_ms), out
        )
        if status != _ops.OK:
            raise errors.status(status, _native.last_error() or "async averaging failed")
        self.id: Optional[int] = int(out[0])
        self._keep = (tensors, shapes)

    def step(self) -> None:
        """A step boundary: merges a finished round into the weights or snapshots them."""
        status = _ops.native().lib.bhvd_async_step(self.id)
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
