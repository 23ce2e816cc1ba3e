"""BAGUA's algorithms, implemented once for every frontend (docs/algorithms.md).

A declaration of :mod:`bagua_hvd.common.algorithms` says what an algorithm communicates and
when; this module does it, over the primitives of :mod:`bagua_hvd.common.primitives`, for the
tensors of any frontend. A frontend hands the engine its buffers (torch tensors, numpy arrays,
later TF tensors in a kernel) together with a :class:`TensorAdapter` that maps them to buffer
descriptors and performs the few tensor operations the engine needs; the frontend decides when
in its training step each part runs (a torch optimizer's hooks, a TF tape's callbacks).

What lives here, once:

* bucketing (:func:`bucket_layout`) and the bucket names on the wire (:class:`LabelledNames`,
  :class:`NumberedNames`);
* the gradient path (:class:`GradientPath`): the QAdam stage, the choice between Horovod's
  allreduce and BAGUA's (compressed / hierarchical) one, error feedback's residuals (sized by
  the core);
* the weight averaging of :class:`PeerAverage` (Decentralized), :class:`LowPrecisionRing`
  (LowPrecisionDecentralized: the buffers of the core's ring, which decides the split and
  keeps the exchanges left running in the background) and :class:`AsyncAveraging`
  (AsyncModelAverage: the buffers of the core's averagers, whose steps, names, abort and resume
  the core keeps), chosen by the declaration's ``weight_averaging``.

This module imports no framework and no numpy.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from bagua_hvd.common import _native
from bagua_hvd.common import basics as _basics
from bagua_hvd.common import config as _config
from bagua_hvd.common import ops as _ops
from bagua_hvd.common import primitives as _prim
from bagua_hvd.common.primitives import Buffer, Errors, Request

__all__ = [
    "TensorAdapter",
    "bucket_layout",
    "bucket_label",
    "LabelledNames",
    "NumberedNames",
    "GradientPath",
    "PeerAverage",
    "LowPrecisionRing",
    "AsyncAveraging",
    "weight_averaging",
    "Implementation",
]


class TensorAdapter:
    """What the engine needs from a frontend's tensors. Subclasses implement every method."""

    #: how failures are raised (the frontend's exception classes)
    errors: Errors = _prim.PYTHON_ERRORS

    def buffer(self, t: Any) -> Buffer:
        """The descriptor of a contiguous tensor (raises the frontend's dtype error)."""
        raise NotImplementedError

    def numel(self, t: Any) -> int:
        """The number of elements of ``t``."""
        raise NotImplementedError

    def empty_like(self, t: Any) -> Any:
        raise NotImplementedError

    def zeros_like(self, t: Any, numel: int) -> Any:
        """A 1-D tensor of ``numel`` zeros of ``t``'s dtype (and device)."""
        raise NotImplementedError

    def empty_bytes(self, nbytes: int, like: Any = None) -> Any:
        """A 1-D uint8 tensor of ``nbytes`` elements, on ``like``'s device (host memory when
        ``like`` is None)."""
        raise NotImplementedError

    def copy_(self, dst: Any, src: Any) -> None:
        """Copies ``src`` into ``dst`` (same dtype and element count)."""
        raise NotImplementedError


# ---- buckets -------------------------------------------------------------------------------------
def bucket_layout(
    infos: Sequence[Tuple[int, Any, int]], cap: int, order: Optional[Sequence[int]] = None
) -> List[List[int]]:
    """Buckets (lists of indices into ``infos``) for tensors described as ``(numel, dtype key,
    itemsize)``, taken in ``order`` (default: reverse order) and appended to the open bucket of
    their dtype key; a bucket is closed when the next tensor would take it past ``cap`` bytes
    (a bigger tensor gets a bucket of its own); ``cap == 0``: one bucket per tensor. Buckets are
    listed in the order they were opened (BAGUA's and the torch DistributedOptimizer's
    first-guess layout). The plan is the core's (c_api.h ``bhvd_bucket_layout``)."""
    n = len(infos)
    order = list(reversed(range(n))) if order is None else list(order)
    keys: Dict[Any, int] = {}
    native = _ops.native()
    new = native.ffi.new
    out = new("int64_t[]", max(len(order), 1))
    count = new("int64_t *")
    status = native.lib.bhvd_bucket_layout(
        new("int64_t[]", [numel * itemsize for numel, _, itemsize in infos] or [0]),
        new("int32_t[]", [keys.setdefault(key, len(keys)) for _, key, _ in infos] or [0]),
        n,
        new("int64_t[]", order or [0]),
        len(order),
        int(cap),
        out,
        count,
    )
    if status != _ops.OK:
        raise ValueError(_native.last_error() or "bucket layout failed")
    buckets: List[List[int]] = [[] for _ in range(count[0])]
    for k, i in enumerate(order):
        buckets[out[k]].append(i)
    return buckets


def bucket_label(first: Any, count: int) -> str:
    """A bucket's name after its first tensor's: ``"<first>"`` or ``"<first>+<count - 1>"``."""
    return f"{first}" if count == 1 else f"{first}+{count - 1}"


class LabelledNames:
    """Op names after the buckets' labels (the torch frontend: ``"decentralized.<label>"``,
    ``"lpdec.x.<label>"``, ``"async.<first label>.<elastic generation>.<restarts>"``)."""

    _PREFIX = {
        "grad": "allreduce",
        "momentum": "allreduce",
        "peer": "decentralized",
        "lp.init": "lpdec.init",
        "lp.step": "lpdec",
        "lp.x": "lpdec.x",
    }

    def __init__(self, labels: Sequence[str]) -> None:
        self.labels = list(labels)

    def op(self, kind: str, i: int) -> str:
        return f"{self._PREFIX[kind]}.{self.labels[i]}"

    def averager_prefix(self) -> str:
        """The averagers' names without their generations (the core adds them: c_api.h
        ``bhvd_async_impl_step_args``)."""
        return f"async.{self.labels[0]}"


class NumberedNames:
    """Op names after a per-process counter of implementations and the bucket's index (the
    TensorFlow frontend: ``"lp_decentralized.bagua_tf<uid>.x.<i>"``, ...)."""

    _PREFIX = {
        "grad": ("allreduce", "grad"),
        "momentum": ("allreduce", "momentum"),
        "peer": ("decentralized", "w"),
        "lp.init": ("lp_decentralized", "init"),
        "lp.step": ("lp_decentralized", "step"),
        "lp.x": ("lp_decentralized", "x"),
        "steps": ("counter", "steps"),  # an elastic job's agreement on the step counts
    }

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def op(self, kind: str, i: int) -> str:
        op, what = self._PREFIX[kind]
        return f"{op}.bagua_tf{self.uid}.{what}.{i}"

    def averager_prefix(self) -> str:
        """The averagers' names without their generations (the core adds them)."""
        return f"async.bagua_tf{self.uid}"


# ---- gradients -----------------------------------------------------------------------------------
class StepPlan(NamedTuple):
    """What the gradient path does at one step (:meth:`GradientPath.plan`)."""

    step: int  #: the step the declaration was asked about
    communicates: bool  #: the gradients are communicated at all
    momentum: bool  #: the buckets carry the optimizer's new momentum (QAdam after warm-up)
    primitive: bool  #: BAGUA's allreduce (compressed and/or hierarchical), not Horovod's
    compressed: bool  #: the compressed (MinMaxUInt8) allreduce
    residuals: bool  #: with error feedback's residuals


class GradientPath:
    """How an algorithm's gradient buckets travel at a step (GradientAllReduce, ByteGrad,
    QAdam, AsyncModelAverage's warm-up)."""

    def __init__(self, alg: Any, adapter: TensorAdapter, process_set: Any) -> None:
        self.alg = alg
        self.adapter = adapter
        self.process_set = process_set
        self._plan: Optional[StepPlan] = None

    def replan(self) -> None:
        """A new job was formed (an elastic reset): the next step asks the declaration anew."""
        self._plan = None

    def stage_step(self, step: int, optimizer_steps: Callable[[], int]) -> int:
        """The ``step`` the declaration's stage methods take: the distributed steps completed,
        or, for an algorithm staged by its optimizer (QAdam), ``optimizer_steps()``."""
        return optimizer_steps() if self.alg.staged_by_optimizer else step

    def plan(self, step: int) -> StepPlan:
        """The declaration's answers for ``step`` (from :meth:`stage_step`), asked once per
        step."""
        plan = self._plan
        if plan is None or plan.step != step:
            plan = self._plan = self._ask(step)
        return plan

    def stages(self) -> List[Tuple[int, StepPlan]]:
        """Every stage of the gradient path as ``(first step, plan)``, in order of the steps
        (the declaration's ``gradient_stages``): what a frontend that builds its step once, as
        a graph, plans at trace time; the stage of a step is the last whose first step it
        has reached."""
        firsts = sorted({0, *(b for b in self.alg.gradient_stages() if b > 0)})
        return [(first, self._ask(first)) for first in firsts]

    def _ask(self, step: int) -> StepPlan:
        alg = self.alg
        compressed = alg.compresses_gradients(step)
        return StepPlan(
            step,
            alg.communicates_gradients(step),
            alg.sends_momentum(step),
            alg.hierarchical or compressed,
            compressed,
            compressed and alg.error_feedback,
        )

    def residuals(self, current: Optional[Tuple[Any, Any]], buf: Any) -> Tuple[Any, Any]:
        """Error feedback's residuals for bucket ``buf`` (the worker's: the bucket padded to a
        multiple of the compression group; the server's: one chunk), ``current`` when it has
        the right size, else new zeros (a new layout starts from zero residuals)."""
        a = self.adapter
        worker, server = _prim.residual_sizes(
            _ops.process_set_id(self.process_set),
            self.alg.hierarchical,
            a.numel(buf),
            errors=a.errors,
        )
        if current is not None and a.numel(current[1]) == server:
            return current
        return (a.zeros_like(buf, worker), a.zeros_like(buf, server))

    def launch(
        self,
        plan: StepPlan,
        buf: Any,
        name: str,
        *,
        reduce_op: int,
        residuals: Optional[Tuple[Any, Any]] = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> Request:
        """BAGUA's allreduce of one bucket, in place, as ``plan`` says. ``residuals`` (error
        feedback, from :meth:`residuals`) are used when the step compresses."""
        a = self.adapter
        aux = residuals if plan.compressed and residuals is not None else ()
        req = _prim.allreduce(
            a.buffer(buf),
            name,
            _ops.process_set_id(self.process_set),
            reduce_op=reduce_op,
            compressed=plan.compressed,
            residuals=[a.buffer(r) for r in aux],
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            hierarchical=self.alg.hierarchical,
            errors=a.errors,
        )
        req.hold = (buf, aux)
        return req


# ---- weights -------------------------------------------------------------------------------------
class _WeightAveraging:
    """Base of the weight algorithms. ``weights()`` returns the flat weight buckets (called
    only when they are needed: a frontend may build them lazily). ``step`` is this step's index
    (the steps completed before it). ``before_update`` runs when this step's gradients are
    ready, before the optimizer's update; ``after_update`` right after the update; each returns
    the buffers that now hold the weights, or None when the weights did not change."""

    #: before_update does something (a frontend may skip calling it otherwise)
    acts_before_update = True
    #: after_update does something (the frontend must call it after every update)
    acts_after_update = False

    def __init__(
        self,
        alg: Any,
        adapter: TensorAdapter,
        names: Any,
        process_set: Any,
        size: Callable[[], int],
    ) -> None:
        self.alg = alg
        self.adapter = adapter
        self.names = names  # LabelledNames or NumberedNames
        self.process_set = process_set
        self.size = size  # the process set's size now

    @property
    def process_set_id(self) -> int:
        return _ops.process_set_id(self.process_set)

    def replan(self) -> None:
        """A new job was formed (an elastic reset): drops what belonged to the old one (its
        requests died with it: they are forgotten, not released, as the new core numbers its
        handles from 1 again)."""

    def during_backward(self, step: int, weights: Callable[[], List[Any]]) -> None:
        """A gradient of this step is ready (the weights cannot change until the update)."""

    def before_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        return None

    def after_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        return None

    def _bufs(self, ts: Sequence[Any]) -> List[Buffer]:
        return [self.adapter.buffer(t) for t in ts]


class PeerAverage(_WeightAveraging):
    """Decentralized: every ``communication_interval`` steps the weights are replaced by their
    average with the round's peers (before the update, which applies the local gradient)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.requests: Optional[List[Request]] = None
        self.peers: List[Any] = []

    def communicating(self, step: Any) -> Any:
        """Whether ``step`` averages (an int, or a graph's step count: a bool tensor)."""
        return step % self.alg.communication_interval == 0

    def round(self, step: Any) -> Any:
        """The communication round of a communicating ``step`` (shift_one's peers)."""
        return step // self.alg.communication_interval

    def start(self, step: int, flats: List[Any]) -> None:
        """Starts the averages of a communicating step (the weights must not change until
        :meth:`finish`)."""
        a = self.adapter
        if not self.peers:
            self.peers = [a.empty_like(f) for f in flats]
        k = self.round(step)
        self.requests = [
            _prim.peer_average(
                a.buffer(flat),
                a.buffer(peer),
                self.names.op("peer", i),
                self.process_set_id,
                peer_selection_mode=self.alg.peer_selection_mode,
                step=k,
                hierarchical=self.alg.hierarchical,
                errors=a.errors,
            )
            for i, (flat, peer) in enumerate(zip(flats, self.peers))
        ]
        for r, flat, peer in zip(self.requests, flats, self.peers):
            r.hold = (flat, peer)

    def started(self) -> bool:
        return self.requests is not None

    def replan(self) -> None:
        _forget(self.requests or [])
        self.requests = None

    def finish(self) -> List[Any]:
        """Waits for the averages; returns the buffers holding them."""
        requests, self.requests = self.requests or [], None
        _prim.wait_all(requests)
        return self.peers

    def during_backward(self, step: int, weights: Callable[[], List[Any]]) -> None:
        if self.requests is None and self.communicating(step):
            self.start(step, weights())  # overlaps with the rest of backward

    def before_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        if not self.communicating(step):
            return None
        if self.requests is None:
            self.start(step, weights())
        return self.finish()


def _forget(requests: Sequence[Request]) -> None:
    """Requests of a job that is gone: never waited for or released again."""
    for r in requests:
        r.done = True
        r.keep = r.hold = None


def settle_rings_before_shutdown() -> None:
    """At shutdown: the exchanges in flight of every low-precision ring of this process (the
    engine's and the TensorFlow kernels': one registry in the core) complete first, so that a
    rank that ends first does not fail a slower rank's last step; bounded by
    HOROVOD_GLOO_TIMEOUT_SECONDS (a rank that never takes that step must not hold this one's
    exit forever)."""
    limit = _config.gloo_timeout_seconds()
    warn_exchanges_left(_prim.lp_rings_settle(limit), limit)


def warn_exchanges_left(late: int, limit: float) -> None:
    """The warning of a shutdown that stopped waiting for ``late`` exchanges in flight after
    ``limit`` seconds."""
    if late:
        warnings.warn(
            f"bagua_hvd: shutting down with {late} low-precision decentralized exchange(s) still "
            f"in flight after {limit:g} s (HOROVOD_GLOO_TIMEOUT_SECONDS): another rank has not "
            "taken its last step; that step will fail on it",
            RuntimeWarning,
            stacklevel=3,
        )


def _release_ring(ring: int, buffers: Any) -> None:
    """Forgets a dropped ring once its exchanges in flight complete; ``buffers`` (the replicas
    and differences the core writes into) are freed only after this returns."""
    _prim.lp_ring_release(ring)


class LowPrecisionRing(_WeightAveraging):
    """LowPrecisionDecentralized: the core's ring (c_api.h ``bhvd_lp_ring_*``), started before
    the first update with replicas (self, left, right) from the weights; after each update of
    a communicating step, its step. On a flat ring the local half runs on this thread (on a
    CUDA bucket: queued on the device, the current stream waiting for it) and the exchange in
    the background, overlapping the next step (waited for by the next step or :meth:`flush`);
    with the host hierarchy in play the core runs the whole step, blocking. This object
    allocates the replicas and differences and keeps them alive until the core's ring is
    released (:meth:`replan`, or when this object is collected)."""

    acts_after_update = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.replicas: Optional[List[List[Any]]] = None  # per bucket: self, left, right
        self.diffs: List[Any] = []
        self.ring = 0  # the core's ring (0: none)
        self._release: Optional[weakref.finalize] = None
        # A rank that ends first must not stop the job while a slower one's last exchange
        # still needs it: hvd.shutdown() (and exit) waits for the exchanges first.
        _basics.before_shutdown(settle_rings_before_shutdown)

    def replan(self) -> None:
        # New neighbours: the replicas are initialised again before the next update, on every
        # rank (a new worker's are None too). The old job's ring ended with it (its release
        # finds it unknown).
        self._drop()

    def _drop(self) -> None:
        if self._release is not None:
            self._release()  # releases the ring, then lets go of its buffers
        self._release = None
        self.replicas, self.diffs, self.ring = None, [], 0

    @property
    def pending(self) -> List[str]:
        """The names of the exchanges started and not yet waited for."""
        n = _prim.lp_ring_pending(self.ring) if self.ring else 0
        return [self.names.op("lp.x", i) for i in range(n or 0)]

    def before_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        # Before the first update: replicas from the weights as they are on every rank. One
        # rank has no neighbours: nothing to keep.
        if self.replicas is None and self.size() > 1:
            self.init_replicas(weights())
        return None

    def init_replicas(self, flats: List[Any]) -> None:
        """self = x, left/right = the ring neighbours' x, exchanged by the core."""
        self._drop()
        a = self.adapter
        bufs = self._bufs(flats)
        replicas = [[a.empty_like(f) for _ in range(3)] for f in flats]
        # The split step's compressed differences, where the bucket is (a CUDA bucket's local
        # half runs on its device).
        diffs = [a.empty_bytes(_prim.compressed_size(b.dtype, b.numel), like=f) for b, f in
                 zip(bufs, flats)]  # fmt: skip
        self.ring = _prim.lp_ring_start(
            [[b] for b in bufs],
            [self._bufs(reps) for reps in replicas],
            [None if d is None else a.buffer(d) for d in diffs],
            [
                (self.names.op("lp.init", i), self.names.op("lp.step", i), self.names.op("lp.x", i))
                for i in range(len(flats))
            ],
            self.process_set_id,
            hierarchical=self.alg.hierarchical,
            errors=a.errors,
        )
        self.replicas, self.diffs = replicas, diffs
        # Never at exit: the core's shutdown ends the ring's exchanges there.
        self._release = weakref.finalize(self, _release_ring, self.ring, (replicas, diffs))
        self._release.atexit = False

    def communicating(self, step: Any) -> Any:
        """Whether the update of ``step`` is followed by a ring step (an int, or a graph's
        step count: a bool tensor)."""
        return step % self.alg.communication_interval == 0

    def after_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        if self.replicas is None or not self.communicating(step):
            return None
        flats = weights()
        _prim.lp_ring_step(self.ring, [self._bufs([f]) for f in flats], errors=self.adapter.errors)
        return flats

    def flush(self) -> None:
        """Waits for the last exchange (and every other ring's): afterwards the replicas are
        final."""
        _prim.lp_ring_flush(self.ring, errors=self.adapter.errors)


# Implementations whose buffers an averager of the core may be writing into (until abort(), or
# the end of the job): kept alive.
_live_averagers: Dict[int, AsyncAveraging] = {}


class AsyncAveraging(_WeightAveraging):
    """AsyncModelAverage: gradient allreduce during ``warmup_steps``, then the core averages
    the weights in the background; each step boundary (after the update) merges a finished
    round or snapshots the weights. The state machine is the core's (c_api.h
    ``bhvd_async_impl_*``: the averager, its names, ``abort()``/``resume()``, the end of a job);
    this object owns the flat weight buffers an averager runs over."""

    acts_before_update = False
    acts_after_update = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffers: List[Any] = []  # the running averager's (the weights of its first step)
        self._impl = 0  # the core's implementation (0: not made yet)

    @property
    def impl(self) -> int:
        """The core's implementation, made at first use."""
        if not self._impl:
            self._impl = _prim.async_impl_create()
            weakref.finalize(self, _prim.async_impl_release, self._impl).atexit = False
        return self._impl

    def averages(self, step: Any) -> Any:
        """Whether the update of ``step`` is past the warm-up (an int, or a graph's step
        count: a bool tensor)."""
        return step >= self.alg.warmup_steps

    def after_update(self, step: int, weights: Callable[[], List[Any]]) -> Optional[List[Any]]:
        """Returns the buffers holding the weights when a round was merged into them."""
        if not self.averages(step):
            return None
        state = _prim.async_impl_state(self.impl)
        if state.aborted:
            return None
        flats = weights()
        if not state.averager:  # the core starts one over this step's weights
            self.buffers = list(flats)
            _live_averagers[id(self)] = self
        merged = _prim.async_impl_step(
            self.impl,
            self.names.averager_prefix(),
            self._bufs(self.buffers),
            self._bufs(flats),  # staged weights: copied in
            self.process_set_id,
            int(self.alg.sync_interval_ms),
            self.adapter.errors,
        )
        return self.buffers if merged else None  # else a snapshot (or nothing)

    def rounds(self) -> int:
        return _prim.async_impl_state(self._impl).rounds if self._impl else 0

    def replan(self) -> None:
        # The core's shutdown stopped the averager with the old job: a new one starts at the
        # next step past the warm-up, under the new job's names.
        _live_averagers.pop(id(self), None)

    @property
    def id(self) -> Optional[int]:
        """The core's id of the running averager (None: none runs)."""
        return (_prim.async_impl_state(self._impl).averager or None) if self._impl else None

    def abort(self) -> None:
        try:
            _prim.async_impl_abort(self.impl, self.adapter.errors)
        finally:
            _live_averagers.pop(id(self), None)  # the core no longer writes into the buffers

    def resume(self) -> None:
        _prim.async_impl_resume(self.impl)


_WEIGHT_AVERAGING = {
    "peer_average": PeerAverage,
    "low_precision_ring": LowPrecisionRing,
    "async": AsyncAveraging,
}


def weight_averaging(
    alg: Any, adapter: TensorAdapter, names: Any, process_set: Any, size: Callable[[], int]
) -> Optional[_WeightAveraging]:
    """The implementation of ``alg.weight_averaging`` (None: the algorithm communicates
    gradients only), registered with the declaration (``AsyncModelAverage.abort()`` reaches
    it). ``size()``: the process set's size."""
    kind = alg.weight_averaging
    if kind is None:
        return None
    impl = _WEIGHT_AVERAGING[kind](alg, adapter, names, process_set, size)
    alg.register_impl(impl)
    return impl


class Implementation:
    """One algorithm inside one training loop: the engine's gradient path and weight
    averaging. A frontend's subclass runs them at the points of its training step."""

    def __init__(
        self,
        alg: Any,
        adapter: TensorAdapter,
        names: Any,
        process_set: Any,
        size: Callable[[], int],
    ) -> None:
        self.alg = alg
        self.gradients = GradientPath(alg, adapter, process_set)
        self.averaging = weight_averaging(alg, adapter, names, process_set, size)

    def replan(self) -> None:
        """A new job was formed (an elastic reset): the gradient path and the weight averaging
        drop what belonged to the old one (the frontend agrees on the step count anew)."""
        self.gradients.replan()
        if self.averaging is not None:
            self.averaging.replan()

    @property
    def replicas(self) -> Optional[List[List[Any]]]:
        """Low-precision decentralized: per bucket (self, left, right)."""
        return self.averaging.replicas

    def flush(self) -> None:
        """Low-precision decentralized: waits for the exchange still in flight."""
        self.averaging.flush()

    def rounds(self) -> int:
        """Asynchronous averaging: rounds merged so far."""
        return self.averaging.rounds()

    @property
    def id(self) -> Optional[int]:
        """Asynchronous averaging: the core's id of the running averager (None: none)."""
        return self.averaging.id
