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
``bagua_hvd.common.algorithms``, re-exported here, and their implementation is the engine's
(``bagua_hvd.common.engine``); this module holds ``QAdamOptimizer`` and what the engine needs
from torch: the tensor adapter, the weight buckets, and the points of a DistributedOptimizer's
step where each part runs (:class:`AlgorithmImpl`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from bagua_hvd.common import algorithms as _common
from bagua_hvd.common import config, engine
from bagua_hvd.common.algorithms import *  # noqa: F403  (the declarations, re-exported)
from bagua_hvd.common.primitives import Buffer, Request
from bagua_hvd.torch import mpi_ops
from bagua_hvd.torch.bucketwise import register_partial_step
from bagua_hvd.torch.mpi_ops import core_dtype

__all__ = [*_common.FRONTEND_EXPORTS, "QAdamOptimizer"]

# The declarations are framework-neutral (bagua_hvd.common.algorithms): the same classes in
# every frontend. This module adds torch's implementations and QAdamOptimizer.


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
        _common.check_qadam_arguments(lr, warmup_steps, betas, eps, weight_decay)
        self.warmup_steps = warmup_steps
        self.step_id = 0  # completed steps
        self._momentum_in_grad: set = set()  # compression stage: grads already turned to m
        self._scratch: Dict[torch.dtype, Tuple[torch.Tensor, ...]] = {}  # _pieces()' buffers
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def in_warmup(self) -> bool:
        """True while the next step is a warm-up (plain Adam) step."""
        return self.step_id < self.warmup_steps

    def adopt_stage(self, other: QAdamOptimizer) -> None:
        """Takes over ``other``'s warm-up length and step count (a DistributedOptimizer built
        from ``other``)."""
        self.warmup_steps = other.warmup_steps
        self.step_id = other.step_id
        self._momentum_in_grad = set()

    def momentum_into_grads_(self, params: Iterable[torch.Tensor]) -> None:
        """Compression stage, before communication: each parameter's ``.grad`` becomes its new
        momentum (:meth:`momentum_`); ``step()`` then applies the averaged momentum."""
        for p in params:
            if p.grad is not None:
                self.momentum_(p, p.grad)
                self._momentum_in_grad.add(p)

    def momentum_(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Compression stage, before communication: turns ``grad`` (in place) into this rank's
        new momentum, beta1 * m + (1 - beta1) * (g + weight_decay * x)."""
        group = self._group_of(p)
        beta1 = group["betas"][0]
        if group["weight_decay"] != 0:
            grad.add_(p.detach(), alpha=group["weight_decay"])
        # docs/algorithms.md fixes the operation order: m * beta1 + g * (1 - beta1).
        for g, m, t, _ in self._pieces(grad, self.state[p]["exp_avg"]):
            g.copy_(torch.mul(m, beta1, out=t).add_(g, alpha=1 - beta1))

    def _group_of(self, p: torch.Tensor) -> Dict[str, Any]:
        groups = getattr(self, "_groups_by_param", None)
        if groups is None or p not in groups:
            groups = self._groups_by_param = {q: g for g in self.param_groups for q in g["params"]}
        return groups[p]

    def _pieces(self, *tensors: torch.Tensor, masks: bool = False) -> Iterator[Tuple[Any, ...]]:
        """``tensors`` (of one shape, dtype and device) piece by piece, each piece followed by
        two scratch tensors of its size and, with ``masks``, a bool one. On the CPU a piece is
        at most _PIECE elements of contiguous tensors: the update's element-wise passes then
        run in cache and allocate nothing (bench/qadam_update.py); every element sees the same
        operations, so the same bits.
        Elsewhere, or not contiguous: the whole tensors, with fresh scratch."""
        first = tensors[0]
        n = first.numel()
        if not first.is_cpu or n <= _PIECE or not all(t.is_contiguous() for t in tensors):
            scratch = [torch.empty_like(first), torch.empty_like(first)]
            if masks:
                scratch.append(torch.empty_like(first, dtype=torch.bool))
            yield (*tensors, *scratch)
            return
        key = first.dtype
        scratch = self._scratch.get(key)
        if scratch is None or scratch[0].numel() != _PIECE:
            scratch = self._scratch[key] = (
                torch.empty(_PIECE, dtype=key),
                torch.empty(_PIECE, dtype=key),
                torch.empty(_PIECE, dtype=torch.bool),
            )
        flat = [t.view(-1) for t in tensors]
        for a in range(0, n, _PIECE):
            b = min(n, a + _PIECE)
            yield (*(f[a:b] for f in flat), *(s[: b - a] for s in scratch[: 3 if masks else 2]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.begin_step()(self.param_groups)
        self._momentum_in_grad.clear()
        return loss

    def begin_step(self) -> Callable[[List[Dict[str, Any]]], None]:
        """Starts one step: the stage and the step count are those of the whole step. Returns
        the update of the parameters of the given param groups (a subset of ``param_groups``),
        to be called until every parameter was updated once (``step()`` calls it once with
        all of them; a DistributedOptimizer calls it bucket by bucket, as its reductions
        complete: one parameter's update reads its own gradient and state only)."""
        warm = self.in_warmup()
        self.step_id += 1
        s = self.step_id

        @torch.no_grad()
        def update(groups: List[Dict[str, Any]]) -> None:
            for group in groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group, warm, s)

        return update

    def _update(self, p: torch.Tensor, group: Dict[str, Any], warm: bool, s: int) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        bc1 = 1 - beta1**s
        bc2 = 1 - beta2**s
        step_size = lr / bc1
        if warm:
            # torch.optim.Adam's single-tensor update, operation for operation.
            grad = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
            for x, m, v, d, _ in self._pieces(p, exp_avg, exp_avg_sq):
                torch.sqrt(v, out=d).div_(bc2**0.5).add_(eps)
                x.addcdiv_(m, d, value=-step_size)
            return
        if p in self._momentum_in_grad:
            self._momentum_in_grad.discard(p)
        else:  # not communicated (one rank)
            self.momentum_(p, p.grad)
        # The averaged momentum becomes m; v stays frozen. A coordinate that never had a
        # gradient in warm-up (v == 0, e.g. a dead ReLU unit) stays put: it has no
        # second-moment estimate at all. The frozen v may be far below the momentum's square
        # (a tiny warm-up gradient, then quantization noise or a grown gradient): the
        # denominator is floored by |m| / bc1, so no coordinate moves by more than lr.
        pieces = self._pieces(p, p.grad, exp_avg, exp_avg_sq, masks=True)
        for x, g, m, v, d, t, zero in pieces:
            m.copy_(g)
            m.masked_fill_(torch.eq(v, 0, out=zero), 0.0)
            torch.sqrt(v, out=d).div_(bc2**0.5)
            torch.maximum(d, torch.abs(m, out=t).div_(bc1), out=d).add_(eps)
            x.addcdiv_(m, d, value=-step_size)


# Elements per piece of QAdamOptimizer's CPU update (4 MB of float32 tensors and scratch in
# flight: within a core's share of the L3 cache).
_PIECE = 1 << 18


_common.register_qadam_optimizer(QAdamOptimizer)
register_partial_step(QAdamOptimizer, QAdamOptimizer.begin_step)


# ---- the engine's torch side ----------------------------------------------------------------------
class TorchTensors(engine.TensorAdapter):
    """torch tensors for the engine (contiguous; the dtypes of Horovod's allreduce)."""

    def buffer(self, t: torch.Tensor) -> Buffer:
        # tuple.__new__: a Buffer without NamedTuple's Python-level constructor (hot path)
        if t.is_cpu:
            return _new_buffer(Buffer, (t.data_ptr(), core_dtype(t), t.numel(), -1, 0))
        # CUDA: the core's stream waits for torch's current stream, which produced the data.
        stream = torch.cuda.current_stream(t.device).cuda_stream
        return _new_buffer(Buffer, (t.data_ptr(), core_dtype(t), t.numel(), t.device.index, stream))

    def numel(self, t: torch.Tensor) -> int:
        return t.numel()

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    def zeros_like(self, t: torch.Tensor, numel: int) -> torch.Tensor:
        return t.new_zeros(numel)

    def empty_bytes(self, nbytes: int, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=None if like is None else like.device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src)


TENSORS = TorchTensors()
_new_buffer = tuple.__new__


class WeightBuckets:
    """The parameters flattened into one contiguous buffer per bucket (``p.data`` become views),
    so the core averages weights in place. The layout is the gradient buckets' first guess
    (reverse registration order, per dtype and device); ``labels`` name the buckets after
    their parameters."""

    def __init__(self, params: List[torch.Tensor], names: Dict[Any, str]) -> None:
        infos = [(p.numel(), (p.dtype, p.device), p.element_size()) for p in params]
        groups = [
            [params[i] for i in b] for b in engine.bucket_layout(infos, config.bucket_bytes())
        ]
        self.flats: List[torch.Tensor] = []
        self.labels: List[str] = []
        with torch.no_grad():
            for g in groups:
                flat = torch.empty(sum(p.numel() for p in g), dtype=g[0].dtype, device=g[0].device)
                off = 0
                for p in g:
                    n = p.numel()
                    flat[off : off + n].copy_(p.detach().reshape(-1))
                    p.data = flat[off : off + n].view_as(p)
                    off += n
                self.flats.append(flat)
                self.labels.append(engine.bucket_label(names.get(g[0], "param"), len(g)))


class AlgorithmImpl(engine.Implementation):
    """An algorithm inside one DistributedOptimizer: the engine's gradient path and weight
    averaging, run at the optimizer's points of the step (hooks, synchronize(), step())."""

    def __init__(
        self,
        alg: _common.Algorithm,
        opt: torch.optim.Optimizer,
        names: Dict[Any, str],
    ) -> None:
        ps = opt.process_set
        self._names = engine.LabelledNames([])  # labelled when the weights are flattened
        super().__init__(alg, TENSORS, self._names, ps, ps.size)
        self.opt_ref = weakref.ref(opt)  # the buckets' hooks hold this object: not the optimizer
        self.step = 0  # completed DistributedOptimizer steps
        # In an elastic job the step counts must be rank 0's on every rank (a worker that joins
        # starts from 0): agreed at the first gradient hook, then after each reset.
        self._agree_steps = config.elastic()
        self._param_names = names
        self._wb: Optional[WeightBuckets] = None
        self._plan: Optional[engine.StepPlan] = None

    # -- gradients ---------------------------------------------------------------------------------
    def gradient_hook(self, p: torch.Tensor) -> bool:
        """First in each gradient hook: agrees on the step counts when due; True when this
        step does not communicate gradients (``p``'s hook ends here)."""
        if self._agree_steps:
            self._agree_on_steps()
        if (self._plan or self._new_plan()).communicates:
            return False
        self.on_gradient(p)
        return True

    def _agree_on_steps(self) -> None:
        """Every rank takes rank 0's step counts (the algorithm's distributed steps and, for
        QAdam, its optimizer's updates): the stages and rounds they select must match."""
        self._agree_steps = False
        opt = self.opt_ref()
        qadam = hasattr(opt, "step_id")
        mine = [self.step, opt.step_id if qadam else 0]
        ps = opt.process_set
        counts = torch.tensor(mine if ps.rank() == 0 else [0, 0], dtype=torch.int64)
        counts = mpi_ops.allreduce(
            counts, name="DistributedOptimizer.steps", op=mpi_ops.Max, process_set=ps
        ).tolist()
        self.step = counts[0]
        if qadam:
            opt.step_id = counts[1]

    def communicates_gradients(self) -> bool:
        return (self._plan or self._new_plan()).communicates

    def _new_plan(self) -> engine.StepPlan:
        """This step's plan (kept until after_step(): the stage cannot change before)."""
        path = self.gradients
        self._plan = path.plan(path.stage_step(self.step, self._optimizer_steps))
        return self._plan

    def replan(self) -> None:
        super().replan()
        self._plan = None
        self._agree_steps = True

    def _optimizer_steps(self) -> int:
        return self.opt_ref().step_id  # QAdam: the DistributedOptimizer's own updates

    def launch(
        self,
        params: List[torch.Tensor],
        buf: torch.Tensor,
        name: str,
        slot: Any,
        reduce_op: int,
        prescale_factor: float,
        postscale_factor: float,
    ) -> Optional[Request]:
        """A gradient bucket (``params``, in ``buf``) is complete: BAGUA's allreduce of it,
        or None when Horovod's allreduce sends it. ``slot.residuals`` keeps its residuals."""
        path = self.gradients
        plan = self._plan or self._new_plan()
        if plan.momentum:
            self.opt_ref().momentum_into_grads_(params)
        if not plan.primitive:
            return None
        residuals = None
        if plan.residuals:
            residuals = slot.residuals = path.residuals(slot.residuals, buf)
        return path.launch(
            plan,
            buf,
            name,
            reduce_op=reduce_op,
            residuals=residuals,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )

    # -- weights -----------------------------------------------------------------------------------
    def weights(self) -> WeightBuckets:
        if self._wb is None:
            groups = self.opt_ref().param_groups
            params = [p for g in groups for p in g["params"] if p.requires_grad]
            self._wb = WeightBuckets(params, self._param_names)
            self._names.labels = self._wb.labels
        return self._wb

    def _flats(self) -> List[torch.Tensor]:
        return self.weights().flats

    def _store(self, new: Optional[List[torch.Tensor]]) -> None:
        """The weights are the flat buffers (``p.data`` are views): results elsewhere are
        copied in."""
        if new is not None:
            for flat, x in zip(self.weights().flats, new):
                if x.data_ptr() != flat.data_ptr():
                    TENSORS.copy_(flat, x)

    def on_gradient(self, p: torch.Tensor) -> None:
        """A gradient is ready while gradients are not communicated."""
        if self.averaging is not None:
            self.averaging.during_backward(self.step, self._flats)

    def synchronize(self) -> None:
        """Before the local update, while gradients are not communicated."""
        if self.averaging is not None:
            self._store(self.averaging.before_update(self.step, self._flats))

    def after_step(self) -> None:
        if self.averaging is not None:
            self._store(self.averaging.after_update(self.step, self._flats))
        self.step += 1
        self._plan = None


class AutoImpl:
    """``Auto`` inside one DistributedOptimizer: the schedule (``bagua_hvd.common.
    auto_algorithm``) names each step's candidate at the step's first hook (or its
    synchronize()); the candidate runs through an implementation of its own, made when the
    schedule switches to it (so the chosen one starts fresh, with zero error-feedback
    residuals), or through Horovod's allreduce of the buckets for ``GradientAllReduce()``.
    Has the interface of :class:`AlgorithmImpl` that the optimizer and its buckets call."""

    def __init__(self, alg: _common.Auto, opt: torch.optim.Optimizer, names: Dict[Any, str]):
        self.alg = alg
        self.opt_ref = weakref.ref(opt)
        self._param_names = names
        self.schedule = alg.schedule(opt.process_set)
        self.impl: Optional[AlgorithmImpl] = None  # this step's (None: Horovod's allreduce)
        self._key: Optional[Tuple[int, bool]] = None  # the candidate of self.impl, final
        self._begun = False  # a step began (the schedule was asked)

    @property
    def step(self) -> int:
        """Steps begun."""
        return self.schedule.step

    def _begin(self) -> Optional[AlgorithmImpl]:
        if not self._begun:
            self._begun = True
            key = self.schedule.begin_step()
            if key != self._key:
                self._switch(key)
        return self.impl

    def _switch(self, key: Tuple[int, bool]) -> None:
        """Another candidate from this step on, with state of its own from scratch."""
        old, self.impl, self._key = self.impl, None, key
        if old is not None and old.averaging is not None:
            if old.averaging.acts_after_update:
                old.flush()  # the low-precision ring's last exchange
            old.averaging.replan()
        opt = self.opt_ref()
        for b in opt._buckets:
            b.residuals = None  # error feedback starts from zero
        cand = self.alg.candidates[key[0]]
        if not cand.is_horovod_allreduce():
            self.impl = AlgorithmImpl(cand, opt, self._param_names)

    def gradient_hook(self, p: torch.Tensor) -> bool:
        impl = self._begin()
        return impl is not None and impl.gradient_hook(p)

    def communicates_gradients(self) -> bool:
        impl = self._begin()
        return impl is None or impl.communicates_gradients()

    def launch(self, *args: Any) -> Optional[Request]:
        """:meth:`AlgorithmImpl.launch` of this step's candidate (None: Horovod's allreduce)."""
        impl = self._begin()
        return None if impl is None else impl.launch(*args)

    def synchronize(self) -> None:
        impl = self._begin()
        if impl is not None:
            impl.synchronize()

    def after_step(self) -> None:
        if not self._begun:
            return
        self._begun = False
        if self.impl is not None:
            self.impl.after_step()

    def replan(self) -> None:
        """An elastic reset: the candidate's implementation drops the old job's state; the
        schedule agrees with rank 0 at the next step (a choice made is kept)."""
        if self.impl is not None:
            self.impl.replan()
        self._begun = False
        self.schedule.reset()


def implementation(
    alg: _common.Algorithm, opt: torch.optim.Optimizer, names: Dict[Any, str]
) -> Any:
    """The implementation of ``alg`` inside the DistributedOptimizer ``opt`` (``names``:
    parameter -> name): an :class:`AlgorithmImpl`, or an :class:`AutoImpl` for ``Auto``."""
    if isinstance(alg, _common.Auto):
        return AutoImpl(alg, opt, names)
    return AlgorithmImpl(alg, opt, names)
