"""Framework-neutral operation layer over the C API: enqueue, wait, poll, read core-allocated
outputs, and map core statuses to Python exceptions.

Frontends describe tensors as ``(data_pointer, dtype_enum, shape_tuple)`` triples and keep the
memory alive until the handle is released. Everything torch- or TF-specific stays in the
frontend; everything else lives here, once.

Per-call cost matters (the target is < 100 us end to end for a 4 KiB allreduce), so the hot path
avoids re-parsing C types, allocates one shape array per request and waits in one C call when
the result is already there.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from typing import Any, Callable, List, Sequence, Tuple

from bagua_hvd.common import _native, config, exceptions
from bagua_hvd.common.exceptions import HorovodInternalError

# The C header's enums (read from c_api.h through cffi: the header is the one source).
_STATUS = _native.enum("bhvd_status", "BHVD_")
OK = _STATUS["OK"]
UNKNOWN_ERROR = _STATUS["UNKNOWN_ERROR"]
PRECONDITION_ERROR = _STATUS["PRECONDITION_ERROR"]
ABORTED = _STATUS["ABORTED"]
INVALID_ARGUMENT = _STATUS["INVALID_ARGUMENT"]
IN_PROGRESS = _STATUS["IN_PROGRESS"]
TIMED_OUT = _STATUS["TIMED_OUT"]
NOT_IMPLEMENTED = _STATUS["NOT_IMPLEMENTED"]
NOT_INITIALIZED = _STATUS["NOT_INITIALIZED"]

_DTYPE = _native.enum("bhvd_dtype", "BHVD_")
UINT8, INT8, UINT16, INT16 = _DTYPE["UINT8"], _DTYPE["INT8"], _DTYPE["UINT16"], _DTYPE["INT16"]
INT32, INT64, BOOL = _DTYPE["INT32"], _DTYPE["INT64"], _DTYPE["BOOL"]
FLOAT16, FLOAT32, FLOAT64 = _DTYPE["FLOAT16"], _DTYPE["FLOAT32"], _DTYPE["FLOAT64"]
BFLOAT16 = _DTYPE["BFLOAT16"]
DTYPE_NAMES = {code: name.lower() for name, code in _DTYPE.items()}

_OP = _native.enum("bhvd_op_type", "BHVD_OP_")
OP_ALLREDUCE = _OP["ALLREDUCE"]
OP_ALLGATHER = _OP["ALLGATHER"]
OP_BROADCAST = _OP["BROADCAST"]
OP_JOIN = _OP["JOIN"]
OP_ADASUM = _OP["ADASUM"]
OP_ALLTOALL = _OP["ALLTOALL"]
OP_BARRIER = _OP["BARRIER"]
OP_REDUCESCATTER = _OP["REDUCESCATTER"]
# BAGUA's primitives, each with its parameter struct (c_api.h; built by common/primitives.py).
OP_HIERARCHICAL_ALLREDUCE = _OP["HIERARCHICAL_ALLREDUCE"]
OP_COMPRESSED_ALLREDUCE = _OP["COMPRESSED_ALLREDUCE"]
OP_PEER_AVERAGE = _OP["PEER_AVERAGE"]
OP_LP_DECENTRALIZED_INIT = _OP["LP_DECENTRALIZED_INIT"]
OP_LP_DECENTRALIZED_STEP = _OP["LP_DECENTRALIZED_STEP"]
OP_LP_DECENTRALIZED_EXCHANGE = _OP["LP_DECENTRALIZED_EXCHANGE"]

_COMPRESSION = _native.enum("bhvd_compression", "BHVD_COMPRESSION_")
COMPRESSION_MINMAX_UINT8 = _COMPRESSION["MINMAX_UINT8"]
PEER_MODES = {
    name.lower(): code for name, code in _native.enum("bhvd_peer_mode", "BHVD_PEER_").items()
}

# Reduce ops: Horovod's values (hvd.Average == 0, ...).
_REDUCE = _native.enum("bhvd_reduce_op", "BHVD_")
Average = _REDUCE["AVERAGE"]
Sum = _REDUCE["SUM"]
Adasum = _REDUCE["ADASUM"]
Min = _REDUCE["MIN"]
Max = _REDUCE["MAX"]
Product = _REDUCE["PRODUCT"]
REDUCE_OP_NAMES = {code: name.title() for name, code in _REDUCE.items()}

NOT_INITIALIZED_ERROR = exceptions.NOT_INITIALIZED_ERROR

# A tensor as the core sees it: (data pointer or 0, dtype enum, shape).
TensorDesc = Tuple[int, int, Tuple[int, ...]]

_WAIT_SLICE_MS = 100  # wait in slices so that Ctrl-C is handled promptly


def exception_for_status(status: int, message: str) -> Exception:
    """The Python exception for a failed core status (Horovod's torch mapping).

    INVALID_ARGUMENT and NOT_INITIALIZED -> ValueError, NOT_IMPLEMENTED -> NotImplementedError,
    everything else (precondition, aborted, unknown, timed out) -> HorovodInternalError (a
    RuntimeError).
    """
    if status == INVALID_ARGUMENT or status == NOT_INITIALIZED:
        return ValueError(message)
    if status == NOT_IMPLEMENTED:
        return NotImplementedError(message)
    return HorovodInternalError(message)


class _Native:
    """Cached core entry points and C types: resolved once, on first use.

    ``newp``/``cast`` are cffi's backend functions, called with pre-resolved types: this skips
    the type-string parsing and Python wrappers of ``ffi.new``/``ffi.cast`` on the hot path.
    """

    __slots__ = (
        "lib",
        "ffi",
        "newp",
        "cast",
        "req_t",
        "tensors_t",
        "i64_t",
        "i32_t",
        "i64p_t",
        "char_t",
        "voidp",
        "null",
        "empty",
        "empty_buf",
    )

    def __init__(self) -> None:
        self.lib = _native.lib()  # also runs ffi.cdef
        ffi = _native.ffi
        self.ffi = ffi
        self.newp = ffi._backend.newp
        self.cast = ffi._backend.cast
        self.req_t = ffi.typeof("bhvd_request *")
        self.tensors_t = ffi.typeof("bhvd_tensor[]")
        self.i64_t = ffi.typeof("int64_t[]")
        self.i32_t = ffi.typeof("int32_t[]")
        self.i64p_t = ffi.typeof("int64_t *")
        self.char_t = ffi.typeof("char[]")
        self.voidp = ffi.typeof("void *")
        self.null = ffi.NULL
        # Empty tensors may have a NULL data pointer; the core gets a valid (unused) address.
        self.empty_buf = ffi.new("int64_t[2]")
        self.empty = ffi.cast(self.voidp, self.empty_buf)


_n: _Native | None = None

_SCRATCH_DIMS = 32  # shape entries of the reusable single-tensor request


class _Scratch(threading.local):
    """Per-thread request structs reused by single-tensor enqueues.

    The core copies the request (name, shapes, splits) inside bhvd_enqueue and keeps only the
    tensor data pointers, so the structs may be rewritten by the next call on this thread.
    """

    def __init__(self) -> None:
        n = native()
        self.req = n.newp(n.req_t, None)
        self.tin = n.newp(n.tensors_t, 1)
        self.tout = n.newp(n.tensors_t, 1)
        self.shapes = n.newp(n.i64_t, 2 * _SCRATCH_DIMS)
        self.out_shape = self.shapes + _SCRATCH_DIMS
        self.hout = n.newp(n.i64p_t, None)
        self.req.inputs = self.tin
        self.tin[0].shape = self.shapes


_scratch: _Scratch | None = None


# Set in a process forked from one whose core was running (a DataLoader worker, a
# multiprocessing pool with the fork start method): the core's background thread and connections
# do not exist there, so an op would wait forever. Holds the parent's pid.
_forked_from: int | None = None


def _after_fork_in_child() -> None:
    global _forked_from
    lib = _native._lib
    if lib is not None and (_forked_from is not None or lib.bhvd_is_initialized()):
        _forked_from = _forked_from or os.getppid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_not_forked() -> None:
    """Raises RuntimeError in a process forked from one that had initialized bagua_hvd, whose
    collectives cannot run there (they would wait forever)."""
    if _forked_from is not None:
        raise RuntimeError(
            f"bagua_hvd: this process (pid {os.getpid()}) was forked from process "
            f"{_forked_from}, which had called hvd.init() (a DataLoader worker with "
            "num_workers > 0, or a multiprocessing pool using fork?). Horovod collectives "
            "cannot run in a forked child: the background thread and the connections to the "
            "other ranks exist only in the process that called hvd.init(). Call collectives "
            "in that process (for example on the batches the DataLoader returns)."
        )


def native() -> _Native:
    """The cached native entry points (loads the core library on first call)."""
    global _n
    if _n is None:
        _n = _Native()
    return _n


def enqueue(
    op_type: int,
    inputs: Sequence[TensorDesc],
    outputs: Sequence[TensorDesc] | None = None,
    *,
    name: str | None = None,
    process_set_id: int = 0,
    reduce_op: int = Sum,
    root_rank: int = 0,
    device: int = -1,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    splits: Sequence[int] | None = None,
    urgent: bool = False,
    params: Any = None,
    status_error: Callable[[int, str], Exception] = exception_for_status,
    stream: int = 0,
) -> Tuple[int, Any]:
    """Queues one request (grouped when ``len(inputs) > 1``) and returns ``(handle, keepalive)``.

    ``name`` is the full core name (``"allreduce.grad0"``) or None for ``"<op>.noname.<handle>"``.
    ``keepalive`` holds C structs that must outlive the call (None when there are none); the
    caller keeps the tensors' memory alive until :func:`release`. ``params``: the cdata pointer
    to the parameter struct of BAGUA's primitive ``op_type`` (c_api.h, built by
    :mod:`bagua_hvd.common.primitives`; the core copies it during the call), None for the others.
    ``stream``: with ``device >= 0``, the address of the CUDA stream that produces the inputs
    (0: the legacy default stream).
    A failed core status raises ``status_error(status, message)`` (by default
    :func:`exception_for_status`: ValueError, NotImplementedError or HorovodInternalError); the
    checks made here before the core raise ValueError.
    """
    global _scratch
    if _forked_from is not None:
        check_not_forked()
    n = _n if _n is not None else native()
    newp = n.newp
    if len(inputs) == 1 and splits is None:
        # Hot path: one tensor, reusable structs, no allocation but the name.
        s = _scratch if _scratch is not None else _init_scratch()
        req = s.req
        ptr, dtype, shape = inputs[0]
        nd = len(shape)
        if nd <= _SCRATCH_DIMS and (outputs is None or len(outputs[0][2]) <= _SCRATCH_DIMS):
            t = s.tin[0]
            t.data = n.cast(n.voidp, ptr) if ptr else n.empty
            t.dtype = dtype
            t.ndim = nd
            s.shapes[0:nd] = shape
            if outputs is None:
                req.outputs = n.null
            else:
                optr, odtype, oshape = outputs[0]
                ond = len(oshape)
                o = s.tout[0]
                o.data = n.cast(n.voidp, optr) if optr else n.empty
                o.dtype = odtype
                o.ndim = ond
                s.out_shape[0:ond] = oshape
                o.shape = s.out_shape
                req.outputs = s.tout
            _set_scalars(
                req,
                op_type,
                process_set_id,
                reduce_op,
                root_rank,
                device,
                prescale_factor,
                postscale_factor,
                urgent,
                stream,
            )
            req.params = n.null if params is None else params
            req.num_tensors = 1
            req.splits = n.null
            req.num_splits = 0
            if name is None:
                req.name = n.null
                status = n.lib.bhvd_enqueue(req, s.hout)
            else:
                cname = newp(n.char_t, name.encode("utf-8"))
                req.name = cname
                status = n.lib.bhvd_enqueue(req, s.hout)
                req.name = n.null
            req.params = n.null  # the caller's struct may go now
            if status != OK:
                raise status_error(status, _native.last_error())
            return s.hout[0], None

    req = newp(n.req_t, None)
    num = len(inputs)
    keep: List[Any] = [req]
    if num:
        ndims = 0
        for d in inputs:
            ndims += len(d[2])
        if outputs is not None:
            for d in outputs:
                ndims += len(d[2])
        shapes = newp(n.i64_t, ndims or 1)
        keep.append(shapes)
        req.inputs = tin = _fill(n, newp(n.tensors_t, num), inputs, shapes, 0)
        keep.append(tin)
        if outputs is not None:
            off = 0
            for d in inputs:
                off += len(d[2])
            req.outputs = tout = _fill(n, newp(n.tensors_t, num), outputs, shapes, off)
            keep.append(tout)
    if name is not None:
        cname = newp(n.char_t, name.encode("utf-8"))
        keep.append(cname)
        req.name = cname
    _set_scalars(
        req,
        op_type,
        process_set_id,
        reduce_op,
        root_rank,
        device,
        prescale_factor,
        postscale_factor,
        urgent,
        stream,
    )
    req.num_tensors = num
    if params is not None:
        req.params = params
    if splits is not None:
        csplits = newp(n.i32_t, list(splits) or [0])
        keep.append(csplits)
        req.splits = csplits
        req.num_splits = len(splits)
    handle_out = newp(n.i64p_t, None)
    status = n.lib.bhvd_enqueue(req, handle_out)
    if status != OK:
        raise status_error(status, _native.last_error())
    return handle_out[0], keep


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def check_root_rank(root_rank: int) -> None:
    """A root rank the core's 32-bit field cannot hold is as invalid as any other bad root:
    the core's ValueError text, not cffi's OverflowError."""
    if not _INT32_MIN <= root_rank <= _INT32_MAX:
        raise ValueError(
            f"broadcast received invalid root rank {root_rank} for provided process set"
        )


def check_scale_factors(prescale: float, postscale: float) -> None:
    """NaN or infinite factors are refused at the call (the core refuses them too)."""
    for what, f in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if not math.isfinite(f):
            raise ValueError(f"{what} must be a finite number, got {f!r}")


def _set_scalars(
    req: Any,
    op_type: int,
    process_set_id: int,
    reduce_op: int,
    root_rank: int,
    device: int,
    prescale: float,
    postscale: float,
    urgent: bool,
    stream: int,
) -> None:
    """The request's fields shared by the single-tensor fast path and the general path."""
    if root_rank:
        check_root_rank(root_rank)
    if prescale != 1.0 or postscale != 1.0:
        check_scale_factors(prescale, postscale)
    req.op_type = op_type
    req.process_set_id = process_set_id
    req.reduce_op = reduce_op
    req.root_rank = root_rank
    req.device = device
    req.prescale_factor = prescale
    req.postscale_factor = postscale
    req.urgent = 1 if urgent else 0
    n = native()
    req.stream = n.cast(n.voidp, stream) if stream else n.null


def _init_scratch() -> _Scratch:
    global _scratch
    _scratch = _Scratch()
    return _scratch


def _fill(n: _Native, arr: Any, descs: Sequence[TensorDesc], shapes: Any, off: int) -> Any:
    cast, voidp, empty = n.cast, n.voidp, n.empty
    for i, (ptr, dtype, shape) in enumerate(descs):
        t = arr[i]
        t.data = cast(voidp, ptr) if ptr else empty
        t.dtype = dtype
        nd = len(shape)
        t.ndim = nd
        shapes[off : off + nd] = shape
        t.shape = shapes + off
        off += nd
    return arr


def wait(handle: int, what: str = "operation") -> None:
    """Blocks until ``handle`` completes; raises the mapped exception if it failed.

    Waits in short slices so that KeyboardInterrupt is handled. After
    ``BAGUA_HVD_OP_TIMEOUT_SECONDS`` (default 0: no limit, like Horovod, whose stall inspector
    only warns) it raises HorovodInternalError; a warning naming the op is printed every
    ``BAGUA_HVD_WAIT_WARNING_SECONDS`` (default 60) while it waits.
    """
    if _forked_from is not None:
        check_not_forked()
    n = _n if _n is not None else native()
    wait_c = n.lib.bhvd_wait
    status = wait_c(handle, _WAIT_SLICE_MS)
    if status == TIMED_OUT:
        status = _wait_long(n, handle, what)
    if status != OK:
        raise _handle_exception(n, handle, status, what)


def stream_wait(handle: int, stream: int) -> None:
    """After :func:`wait`: the CUDA ``stream`` (its address; 0: the legacy default stream)
    waits on the device for the results of ``handle``'s operation on CUDA tensors."""
    n = _n if _n is not None else native()
    status = n.lib.bhvd_handle_stream_wait(handle, n.cast(n.voidp, stream) if stream else n.null)
    if status != OK:
        raise exception_for_status(status, _native.last_error())


def wait_status(handle: int, what: str = "operation") -> int:
    """Blocks until ``handle`` completes and returns its status (:func:`wait`'s slices,
    warnings and ``BAGUA_HVD_OP_TIMEOUT_SECONDS``, which raises HorovodInternalError)."""
    if _forked_from is not None:
        check_not_forked()
    n = _n if _n is not None else native()
    status = n.lib.bhvd_wait(handle, _WAIT_SLICE_MS)
    if status == TIMED_OUT:
        status = _wait_long(n, handle, what)
    return status


def wait_until(handle: int, timeout_s: float) -> bool:
    """Blocks until ``handle`` completes or ``timeout_s`` seconds have passed (in slices, so
    that Ctrl-C is handled); True when it completed."""
    if _forked_from is not None:
        check_not_forked()
    n = _n if _n is not None else native()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if n.lib.bhvd_wait(handle, max(0, min(_WAIT_SLICE_MS, left_ms))) != TIMED_OUT:
            return True
        if left_ms <= _WAIT_SLICE_MS:
            return False


def failure_message(handle: int, fallback: str) -> str:
    """The message of a failed handle: the core's, else ``fallback``."""
    return handle_error(handle) or _native.last_error() or fallback


def _wait_long(n: _Native, handle: int, what: str) -> int:
    limit = config.op_timeout_seconds()
    warn_every = config.wait_warning_seconds()
    start = time.monotonic()
    next_warning = start + warn_every if warn_every > 0 else float("inf")
    while True:
        status = n.lib.bhvd_wait(handle, _WAIT_SLICE_MS)
        if status != TIMED_OUT:
            return status
        now = time.monotonic()
        if limit > 0 and now - start >= limit:
            raise HorovodInternalError(
                f"{what} (handle {handle}) did not complete within "
                f"BAGUA_HVD_OP_TIMEOUT_SECONDS={limit:g} s: other ranks may not have submitted "
                "the same operation"
            )
        if now >= next_warning:
            warnings.warn(
                f"bagua_hvd: still waiting for {what} (handle {handle}) after "
                f"{now - start:.0f} s; other ranks may not have submitted the same operation",
                RuntimeWarning,
                stacklevel=3,
            )
            next_warning = now + warn_every


def _handle_exception(n: _Native, handle: int, status: int, what: str) -> Exception:
    if status == INVALID_ARGUMENT and n.lib.bhvd_poll(handle) < 0:
        return ValueError(f"Handle {handle} was not created or has been cleared.")
    return exception_for_status(status, failure_message(handle, f"{what} failed (status {status})"))


def poll(handle: int) -> bool:
    """True when the handle has completed (successfully or not)."""
    n = _n if _n is not None else native()
    r = n.lib.bhvd_poll(handle)
    if r < 0:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return r == 1


def release(handle: int) -> None:
    """Frees the core's record of a completed handle."""
    n = _n if _n is not None else native()
    n.lib.bhvd_release(handle)


def handle_error(handle: int) -> str:
    """The failure message of a completed handle ("" when it succeeded)."""
    n = _n if _n is not None else native()
    p = n.lib.bhvd_handle_error(handle)
    return "" if p == n.ffi.NULL else n.ffi.string(p).decode("utf-8", "replace")


def output_shape(handle: int, index: int = 0) -> Tuple[int, ...]:
    """Shape of the core-allocated output ``index`` (allgather, alltoall) of a done handle."""
    n = _n if _n is not None else native()
    nd = n.lib.bhvd_output_ndim(handle, index)
    if nd < 0:
        raise HorovodInternalError(
            f"handle {handle} has no core-allocated output {index}: {_native.last_error()}"
        )
    buf = n.newp(n.i64_t, nd or 1)
    status = n.lib.bhvd_output_shape(handle, index, buf)
    if status != OK:
        raise HorovodInternalError(
            f"reading the shape of output {index} of handle {handle}: {_native.last_error()}"
        )
    return tuple(buf[0:nd])


def output_copy(handle: int, index: int, dst: int, stream: int = 0) -> None:
    """Copies core-allocated output ``index`` into memory at address ``dst``; CUDA outputs on
    ``stream`` (its address; 0: the legacy default stream), after :func:`stream_wait`."""
    n = _n if _n is not None else native()
    status = n.lib.bhvd_output_copy(
        handle, index, n.cast(n.voidp, dst), n.cast(n.voidp, stream) if stream else n.null
    )
    if status != OK:
        raise HorovodInternalError(
            f"copying output {index} of handle {handle}: {_native.last_error()}"
        )


def received_splits(handle: int) -> List[int]:
    """Alltoall: the number of rows this rank received from each process-set rank."""
    n = _n if _n is not None else native()
    count = n.lib.bhvd_received_splits(handle, n.null, 0)
    if count < 0:
        raise HorovodInternalError(
            f"reading the received splits of handle {handle}: unknown handle"
        )
    buf = n.newp(n.i32_t, max(count, 1))
    n.lib.bhvd_received_splits(handle, buf, count)
    return list(buf[0:count])


def join_result(handle: int) -> int:
    """Join: the global rank that joined last."""
    n = _n if _n is not None else native()
    return int(n.lib.bhvd_join_result(handle))


def process_set_size(process_set_id: int) -> int:
    """Size of a registered process set (-1 when unknown)."""
    n = _n if _n is not None else native()
    return int(n.lib.bhvd_process_set_ranks(process_set_id, n.ffi.NULL, 0))


def process_set_rank(process_set_id: int) -> int:
    """This process's rank in the set; -1 not a member, -2 unknown set."""
    n = _n if _n is not None else native()
    return int(n.lib.bhvd_process_set_rank(process_set_id))


def device_pointers_supported() -> bool:
    """Whether the core accepts device (GPU) pointers in requests."""
    n = _n if _n is not None else native()
    return bool(n.lib.bhvd_device_pointers_supported())


def process_set_id(process_set: Any) -> int:
    """The core's id of a ``ProcessSet``; -1 for an unregistered or removed set (the core then
    answers with Horovod's "does not exist" error)."""
    ps_id = process_set.process_set_id
    return -1 if ps_id is None else ps_id


def reducescatter_rows(dim0: int, set_size: int, set_rank: int) -> int:
    """Rows of dimension 0 that ``set_rank`` receives from a reducescatter (Horovod's split)."""
    return dim0 // set_size + (1 if set_rank < dim0 % set_size else 0)


def op_name(prefix: str, name: str | None) -> str | None:
    """The core's name for an op: ``"<prefix>.<name>"``, or None for an unnamed op."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"name must be a str, got {type(name).__name__}")
    return f"{prefix}.{name}"
