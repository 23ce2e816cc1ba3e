"""BAGUA's algorithms for ``hvd.DistributedOptimizer(..., algorithm=...)``.

An algorithm is a declaration: which tensors are communicated (gradients, weights or the
optimizer's momentum), how they are bucketed, and which primitive of the core runs when. The
primitives themselves (compressed allreduce, decentralized averages, asynchronous averaging)
run in the C++ core; Python only decides when to start them. The exact math of each algorithm
is in docs/algorithms.md.

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   algorithm=ByteGrad())

``bagua-run --algorithm NAME`` (``BAGUA_HVD_ALGORITHM=NAME``) picks one for every
``DistributedOptimizer`` built without ``algorithm=``.

The declarations (``ByteGrad``, ...) are the framework-neutral classes of
``bagua_hvd.common.algorithms``, re-exported here; this module holds their torch
implementations (registered for ``Algorithm.reify(torch optimizer)``) and ``QAdamOptimizer``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from bagua_hvd.common import algorithms as _common
from bagua_hvd.common import basics as _basics
from bagua_hvd.common import ops as _ops
from bagua_hvd.common._native import ffi as _ffi
from bagua_hvd.common._native import last_error as _last_error
from bagua_hvd.common._native import lib as _lib

__all__ = [*_common.FRONTEND_EXPORTS, "QAdamOptimizer"]

# The declarations are framework-neutral (bagua_hvd.common.algorithms): the same classes in
# every frontend. This module adds torch's implementations and QAdamOptimizer.
Algorithm = _common.Algorithm
GradientAllReduce = _common.GradientAllReduce
ByteGrad = _common.ByteGrad
Decentralized = _common.Decentralized
LowPrecisionDecentralized = _common.LowPrecisionDecentralized
QAdamAlgorithm = _common.QAdamAlgorithm
AsyncModelAverage = _common.AsyncModelAverage
BY_NAME = _common.BY_NAME
from_name = _common.from_name
from_environment = _common.from_environment
ALGORITHM_ENV = _common.ALGORITHM_ENV


class QAdamOptimizer(torch.optim.Optimizer):
    """BAGUA's QAdam: Adam during ``warmup_steps``, then the second moment is frozen and the
    momentum is averaged through the 8-bit compressed allreduce (with ``QAdamAlgorithm``).

    Unlike BAGUA, weight decay is applied in both stages, and after warm-up the denominator is
    floored by ``|m| / (1 - beta1**s)``, so no coordinate moves by more than ``lr`` per step: a
    tiny frozen v no longer turns the momentum's quantization error into a divergence
    (docs/algorithms.md)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not isinstance(warmup_steps, int) or warmup_steps <= 0:
            raise ValueError(
                f"warmup_steps must be a positive integer, got {warmup_steps!r}: the compression "
                "stage freezes the second moment estimated during warm-up"
            )
        self.warmup_steps = warmup_steps
        self.step_id = 0  # completed steps
        self._momentum_in_grad: set = set()  # compression stage: grads already turned to m
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def in_warmup(self) -> bool:
        """True while the next step is a warm-up (plain Adam) step."""
        return self.step_id < self.warmup_steps

    def momentum_(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Compression stage, before communication: turns ``grad`` (in place) into this rank's
        new momentum, beta1 * m + (1 - beta1) * (g + weight_decay * x)."""
        group = self._group_of(p)
        beta1 = group["betas"][0]
        if group["weight_decay"] != 0:
            grad.add_(p.detach(), alpha=group["weight_decay"])
        # docs/algorithms.md fixes the operation order: m * beta1 + g * (1 - beta1).
        grad.copy_(self.state[p]["exp_avg"].mul(beta1).add_(grad, alpha=1 - beta1))

    def _group_of(self, p: torch.Tensor) -> Dict[str, Any]:
        groups = getattr(self, "_groups_by_param", None)
        if groups is None or p not in groups:
            groups = self._groups_by_param = {q: g for g in self.param_groups for q in g["params"]}
        return groups[p]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warm = self.in_warmup()
        self.step_id += 1
        s = self.step_id
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                bc1 = 1 - beta1**s
                bc2 = 1 - beta2**s
                if warm:
                    # torch.optim.Adam's single-tensor update, operation for operation.
                    grad = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                else:
                    if p not in self._momentum_in_grad:  # not communicated (one rank)
                        self.momentum_(p, p.grad)
                    exp_avg.copy_(p.grad)  # the averaged momentum; v stays frozen
                step_size = lr / bc1
                denom = exp_avg_sq.sqrt() / bc2**0.5
                if not warm:
                    # A coordinate that never had a gradient in warm-up (v == 0, e.g. a dead
                    # ReLU unit) stays put: it has no second-moment estimate at all.
                    exp_avg.masked_fill_(exp_avg_sq == 0, 0.0)
                    # The frozen v may be far below the momentum's square (a tiny warm-up
                    # gradient, then quantization noise or a grown gradient): the denominator
                    # is floored by |m| / bc1, so no coordinate moves by more than lr.
                    denom = torch.maximum(denom, exp_avg.abs() / bc1)
                denom.add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        self._momentum_in_grad.clear()
        return loss


_common.register_qadam_optimizer(QAdamOptimizer)


# ---- implementations ------------------------------------------------------------------------------
class _Impl:
    """What an algorithm does inside one DistributedOptimizer. The base class is the gradient
    path (GradientAllReduce, ByteGrad)."""

    def __init__(self, alg: Algorithm, opt: Any) -> None:
        self.alg = alg
        self.opt_ref = weakref.ref(opt)
        self.step = 0  # completed DistributedOptimizer steps

    def communicates_gradients(self) -> bool:
        return self.alg.communicates_gradients(self.step)

    def compresses_gradients(self) -> bool:
        return self.alg.compresses_gradients(self.step)

    def error_feedback(self) -> bool:
        return bool(getattr(self.alg, "error_feedback", False))

    def hierarchical(self) -> bool:
        """Within each host, then among the hosts (only where the job spans several hosts and
        some host runs several ranks; the core runs the flat algorithm otherwise)."""
        return bool(getattr(self.alg, "hierarchical", False))

    def before_launch(self, params: List[torch.Tensor]) -> None:
        """A gradient bucket is complete and about to be sent."""

    def on_gradient(self, p: torch.Tensor) -> None:
        """A gradient is ready while gradients are not communicated."""

    def synchronize(self) -> None:
        """Before the local update, while gradients are not communicated."""

    def after_step(self) -> None:
        self.step += 1


class _WeightBuckets:
    """The parameters flattened into one contiguous buffer per bucket (``p.data`` become views),
    so the core averages weights in place."""

    def __init__(self, groups: List[List[torch.Tensor]], names: Dict[Any, str]) -> None:
        self.flats: List[torch.Tensor] = []
        self.names: List[str] = []
        with torch.no_grad():
            for g in groups:
                flat = torch.empty(sum(p.numel() for p in g), dtype=g[0].dtype)
                off = 0
                for p in g:
                    n = p.numel()
                    flat[off : off + n].copy_(p.detach().reshape(-1))
                    p.data = flat[off : off + n].view_as(p)
                    off += n
                self.flats.append(flat)
                self.names.append(
                    names.get(g[0], "param") + (f"+{len(g) - 1}" if len(g) > 1 else "")
                )


class _WeightImpl(_Impl):
    def weights(self) -> _WeightBuckets:
        wb = getattr(self, "_wb", None)
        if wb is None:
            opt = self.opt_ref()
            params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            # The gradient buckets' first-guess layout (reverse registration order, per dtype).
            groups = opt._form_buckets(list(reversed(params)), set())
            wb = self._wb = _WeightBuckets(groups, opt._parameter_names)
        return wb

    def _name(self, kind: str, i: int) -> str:
        return f"{kind}.{self.weights().names[i]}"


class _DecentralizedImpl(_WeightImpl):
    """Weights averaged with peers during backward; the local gradient applied to the average."""

    def __init__(self, alg: Decentralized, opt: Any) -> None:
        super().__init__(alg, opt)
        self.handles: Optional[List[int]] = None
        self.peer: List[torch.Tensor] = []

    def communicating(self) -> bool:
        return self.step % self.alg.communication_interval == 0

    def launch(self) -> None:
        from bagua_hvd.torch import mpi_ops

        opt = self.opt_ref()
        wb = self.weights()
        if not self.peer:
            self.peer = [torch.empty_like(f) for f in wb.flats]
        k = self.step // self.alg.communication_interval
        self.handles = [
            mpi_ops._primitive_async(
                _ops.OP_DECENTRALIZED,
                flat,
                self._name("decentralized", i),
                opt.process_set,
                peer_mode=_ops.PEER_MODES[self.alg.peer_selection_mode],
                step=k,
                output=self.peer[i],
                hierarchical=self.hierarchical(),
            )
            for i, flat in enumerate(wb.flats)
        ]

    def on_gradient(self, p: torch.Tensor) -> None:
        if self.handles is None and self.communicating():
            self.launch()  # the weights cannot change until step(): overlap with backward

    def synchronize(self) -> None:
        from bagua_hvd.torch import mpi_ops

        if not self.communicating():
            return
        if self.handles is None:
            self.launch()
        handles, self.handles = self.handles, None
        for h in handles:
            mpi_ops.synchronize(h)
        with torch.no_grad():
            for flat, avg in zip(self.weights().flats, self.peer):
                flat.copy_(avg)


# The exchanges still running in the background, of every low-precision decentralized optimizer
# of this process. A name stays taken until its handle is waited for (docs/design-core.md), so an
# optimizer dropped with its last exchange in flight would block a later one's bucket names: each
# new optimizer first waits for them all, at the same point of the program on every rank.
_lp_pending: List[int] = []


def _flush_lp_pending() -> None:
    """Waits for every exchange still in flight (at shutdown: a faster rank must not stop the
    job while a slower one's last exchange still needs it)."""
    from bagua_hvd.torch import mpi_ops

    pending = list(_lp_pending)
    _lp_pending.clear()
    for h in pending:
        mpi_ops.synchronize(h)


class _LowPrecisionDecentralizedImpl(_WeightImpl):
    """After the local update, the compressed ring step of the core on every weight bucket."""

    def __init__(self, alg: LowPrecisionDecentralized, opt: Any) -> None:
        super().__init__(alg, opt)
        self.replicas: Optional[List[List[torch.Tensor]]] = None  # per bucket: self, left, right
        _basics.before_shutdown(_flush_lp_pending)

    def synchronize(self) -> None:
        # Before the first update: replicas from the weights as they are on every rank. One
        # rank has no neighbours: nothing to keep.
        if self.replicas is None and self.opt_ref().process_set.size() > 1:
            self.replicas = self._init_replicas()

    def _init_replicas(self) -> List[List[torch.Tensor]]:
        """self = x, left/right = the ring neighbours' x, exchanged by the core."""
        from bagua_hvd.torch import mpi_ops

        self.flush()  # an earlier optimizer's last exchange, if it was dropped in flight
        opt = self.opt_ref()
        out = [[torch.empty_like(f) for _ in range(3)] for f in self.weights().flats]
        handles = [
            mpi_ops._primitive_async(
                _ops.OP_LP_DECENTRALIZED,
                flat,
                self._name("lpdec.init", i),
                opt.process_set,
                peer_mode=1,
                aux=out[i],
                hierarchical=self.hierarchical(),
            )
            for i, flat in enumerate(self.weights().flats)
        ]
        for h in handles:
            mpi_ops.synchronize(h)
        return out

    def after_step(self) -> None:
        from bagua_hvd.torch import mpi_ops

        if self.replicas is not None and self.step % self.alg.communication_interval == 0:
            opt = self.opt_ref()
            if self._split():
                self._split_step(opt)
            else:  # hierarchical: the host average needs communication first, one blocking op
                handles = [
                    mpi_ops._primitive_async(
                        _ops.OP_LP_DECENTRALIZED,
                        flat,
                        self._name("lpdec", i),
                        opt.process_set,
                        aux=self.replicas[i],
                        hierarchical=True,
                    )
                    for i, flat in enumerate(self.weights().flats)
                ]
                for h in handles:
                    mpi_ops.synchronize(h)
        super().after_step()

    def _split(self) -> bool:
        """Flat ring (no host hierarchy in play): the step's local half runs here, its exchange
        in the background, overlapping the next forward and backward (BAGUA blocks)."""
        split = getattr(self, "_split_cached", None)
        if split is None:
            ps = self.opt_ref().process_set
            group = _lib().bhvd_compression_group_size(ps.process_set_id, 1)
            split = self._split_cached = not self.hierarchical() or group == ps.size()
        return split

    def _split_step(self, opt: Any) -> None:
        from bagua_hvd.torch import mpi_ops

        self.flush()  # the replicas must have the previous round's differences
        flats = self.weights().flats
        if not hasattr(self, "_diffs"):
            self._diffs = [
                torch.empty(
                    _lib().bhvd_minmax_uint8_size(_torch_dtype_code(f), f.numel(), 1),
                    dtype=torch.uint8,
                )
                for f in flats
            ]
        for flat, (own, left, right), c in zip(flats, self.replicas, self._diffs):
            status = _lib().bhvd_lp_decentralized_local(
                _ffi.cast("void *", flat.data_ptr()),
                _ffi.cast("void *", own.data_ptr()),
                _ffi.cast("void *", left.data_ptr()),
                _ffi.cast("void *", right.data_ptr()),
                _torch_dtype_code(flat),
                flat.numel(),
                _ffi.cast("uint8_t *", c.data_ptr()),
            )
            if status != _ops.OK:
                raise _ops.exception_for_status(status, _last_error())
        _lp_pending.extend(
            mpi_ops._primitive_async(
                _ops.OP_LP_DECENTRALIZED,
                c,
                self._name("lpdec.x", i),
                opt.process_set,
                peer_mode=2,
                aux=self.replicas[i][1:],
            )
            for i, c in enumerate(self._diffs)
        )

    def flush(self) -> None:
        """Waits for the last exchanges (of every such optimizer): afterwards the replicas are
        final."""
        _flush_lp_pending()


class _QAdamImpl(_Impl):
    """The DistributedOptimizer is itself a QAdamOptimizer (a subclass of its class): its own
    step count decides the stage."""

    def before_launch(self, params: List[torch.Tensor]) -> None:
        q = self.opt_ref()
        if q.in_warmup():
            return
        for p in params:
            if p.grad is not None:
                q.momentum_(p, p.grad)
                q._momentum_in_grad.add(p)

    def compresses_gradients(self) -> bool:
        return not self.opt_ref().in_warmup()


class _AsyncImpl(_WeightImpl):
    """Gradient allreduce during warm-up, then background averaging by the core."""

    def __init__(self, alg: AsyncModelAverage, opt: Any) -> None:
        super().__init__(alg, opt)
        self.id: Optional[int] = None
        self.generation = 0
        self.aborted = False
        self._keep: Any = None

    def _start(self) -> None:
        opt = self.opt_ref()
        wb = self.weights()
        descs = []
        keep = []
        tensors = _ffi.new("bhvd_tensor[]", len(wb.flats))
        for i, flat in enumerate(wb.flats):
            shape = _ffi.new("int64_t[]", [flat.numel()])
            keep.append(shape)
            tensors[i].data = _ffi.cast("void *", flat.data_ptr())
            tensors[i].dtype = _torch_dtype_code(flat)
            tensors[i].ndim = 1
            tensors[i].shape = shape
            descs.append(flat)
        out = _ffi.new("int64_t *")
        name = f"async.{wb.names[0]}.{self.generation}"
        status = _lib().bhvd_async_start(
            name.encode(),
            tensors,
            len(wb.flats),
            opt.process_set.process_set_id,
            int(self.alg.sync_interval_ms),
            out,
        )
        if status != _ops.OK:
            raise _ops.exception_for_status(status, _last_error())
        self.id = out[0]
        self._keep = (tensors, keep, descs)
        _live_averagers[self.id] = self

    def after_step(self) -> None:
        super().after_step()
        if self.step <= self.alg.warmup_steps or self.aborted:
            return
        if self.id is None:
            self._start()
        _lib().bhvd_async_step(self.id)

    def rounds(self) -> int:
        return int(_lib().bhvd_async_rounds(self.id)) if self.id is not None else 0

    def abort(self) -> None:
        self.aborted = True
        if self.id is None:
            return
        status = _lib().bhvd_async_abort(self.id, -1)
        _lib().bhvd_async_release(self.id)
        _live_averagers.pop(self.id, None)
        self.id = None
        if status not in (_ops.OK, _ops.ABORTED):
            raise _ops.exception_for_status(status, _last_error())

    def resume(self) -> None:
        if not self.aborted:
            return
        self.aborted = False
        self.generation += 1


_live_averagers: Dict[int, _AsyncImpl] = {}


def _torch_dtype_code(t: torch.Tensor) -> int:
    from bagua_hvd.torch import mpi_ops

    return mpi_ops._check(t, mpi_ops._ALLREDUCE_DTYPES)


# Each declaration's torch implementation (the base _Impl: the gradient path).
_IMPLS: Dict[type, type] = {
    Decentralized: _DecentralizedImpl,
    LowPrecisionDecentralized: _LowPrecisionDecentralizedImpl,
    QAdamAlgorithm: _QAdamImpl,
    AsyncModelAverage: _AsyncImpl,
}


def _reify(alg: Algorithm, opt: torch.optim.Optimizer) -> _Impl:
    """``alg.reify(opt)`` for a torch DistributedOptimizer."""
    impl_cls = next((c for t, c in _IMPLS.items() if isinstance(alg, t)), _Impl)
    impl = impl_cls(alg, opt)
    if isinstance(alg, AsyncModelAverage):
        alg.register_impl(impl)
    return impl


_common.register_frontend(torch.optim.Optimizer, _reify)
